"""The one place where failures become errno values, and the error kinds of the core: layers
below the FUSE adapter raise ``OSError`` from the backend, :class:`FsError` for conditions
the core detects, :class:`StaleVersion` when the source changed under a read, and the
adapter calls :func:`errno_of`, which alone decides the errno an application sees; the
control API's :class:`RequestError` kinds live here too."""

from __future__ import annotations

import errno


class FsError(Exception):
    """A filesystem-level failure with a definite errno (e.g. EROFS for writes)."""

    def __init__(self, err: int, message: str = "") -> None:
        super().__init__(err, message or errno.errorcode.get(err, str(err)))
        self.errno = err


class StaleVersion(FsError):
    """The source file no longer has the version a block was requested for.

    Serving the bytes would mix two versions of the file in one handle, so the read
    fails with ESTALE; the next lookup of the path (an open once the kernel's entry has
    expired, at most attrValid) sees the new version.
    """

    def __init__(self, path: str) -> None:
        super().__init__(errno.ESTALE, f"{path!r} changed at the source during the read")
        self.path = path


class RequestError(Exception):
    """A control request the daemon cannot serve; the message says why, for the caller.

    Raised by the FUSE-free core (prefetch/); the control API maps each kind to its
    HTTP status in one table (``control/server.py``), so the core knows nothing of HTTP.
    """


class BadRequest(RequestError):
    """Malformed or out-of-range input."""


class Forbidden(RequestError):
    """The caller may not do this (e.g. register a job for another user's process)."""


class NotFound(RequestError):
    """The request names something that does not exist (a dataset id, a warmup)."""


class TooLarge(RequestError):
    """The request alone exceeds a bound."""


class NoRoom(RequestError):
    """The request fits the bounds but what is held already leaves no room for it."""


class ConfigError(Exception):
    """A user mistake in the client config or the mount environment.

    The CLI prints ``str(error)`` as one line and exits with status 2.
    """


# An object store's HTTP answers, as errno values (backends/s3.py raises OSError with them):
# no such key is a missing file, a refused signature or permission is EACCES, a range
# beyond the object is EINVAL (no read asks for one).  Anything else, and no answer at
# all (connection refused or reset, a timeout, 5xx and throttling after the retries),
# is EIO, which also asks backends/deadline.py for a probe of the bucket.
_HTTP_ERRNO = {401: errno.EACCES, 403: errno.EACCES, 404: errno.ENOENT, 416: errno.EINVAL}


def errno_of_http(status: int | None) -> int:
    """The errno of an object store's failed request whose HTTP status was ``status``
    (None: no answer)."""
    return _HTTP_ERRNO.get(status, errno.EIO) if status is not None else errno.EIO


def errno_of(exc: BaseException) -> int:
    """Map any exception raised below the FUSE adapter to the errno the kernel gets."""
    if isinstance(exc, FsError):
        return exc.errno
    if isinstance(exc, OSError) and exc.errno:
        return exc.errno
    # Anything else is a bug or an unexpected failure: the application sees EIO and the
    # adapter logs the traceback.
    return errno.EIO


def sole_exception(exc: BaseException) -> BaseException:
    """The one exception inside (nested) exception groups, else ``exc`` itself: what a
    nursery raised, as the user should read it."""
    while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
        exc = exc.exceptions[0]
    return exc
