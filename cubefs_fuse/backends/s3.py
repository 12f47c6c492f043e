"""The S3 backend: a bucket (or a prefix of one) of an S3-compatible object store as the
remote volume, read only. Keys are files and ``/``-separated prefixes directories
(ListObjectsV2 with the delimiter ``/``, one page at a time); a key's version is its ETag
with its size and last-modified second (:func:`object_attr`), and every read is a ranged
GET conditional on that ETag (If-Match), its answer checked again, so a block is never of
another version (:class:`~cubefs_fuse.errors.StaleVersion`). Per-file requests (HEAD, GET)
go through obstore, listings and probes through boto3, whose session also resolves the
credentials and endpoint as the AWS CLI does (benchmarks/results/2026-11-29-s3-client.md
says why two libraries); both retry throttling and 5xx answers with one schedule
(exponential backoff with jitter, within backendTimeout), and every call runs in a worker thread of :class:`~cubefs_fuse.backends.
operations.Operations`. Nothing is ever written to the bucket."""

from __future__ import annotations

import errno
import os
import random
import stat
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any, TypeVar
from urllib.parse import urlsplit

import obstore
import xxhash
from obstore.exceptions import BaseError as ObstoreError
from obstore.exceptions import GenericError
from obstore.exceptions import PermissionDeniedError, PreconditionError, UnauthenticatedError

from cubefs_fuse.attrs import Attr, FileVersion, FsStats
from cubefs_fuse.backends.base import BackendStatistics, too_many_entries
from cubefs_fuse.backends.operations import Operations
from cubefs_fuse.errors import StaleVersion, errno_of_http

if TYPE_CHECKING:
    from obstore import GetOptions, ObjectMeta
    from obstore.store import ClientConfig, RetryConfig, S3Store

T = TypeVar("T")

# Keys per ListObjectsV2 page: 1,000 is S3's own maximum.  A listing holds one page of
# the answer at a time besides the entries made from it (~200 bytes each), so a prefix
# with millions of keys costs its entries, never its pages' XML.
LIST_PAGE_SIZE = 1000
# Retries of one request after a 5xx, a throttling answer (503 SlowDown) or a dropped
# connection, with exponential backoff and jitter: the first after 50 ms, each next one
# after a random time between 50 ms and twice the last, at most 2 s, and none once the
# request's time (backendTimeout) would be spent.  Ten cover a throttled bucket's usual
# few seconds.  obstore retries its requests so itself (retry_config); boto3's requests
# are retried by retrying() on the same schedule, not by boto3's standard mode, which
# waits up to 20 s between tries and knows no deadline: a listing given up at
# backendTimeout (backends/deadline.py) kept its worker thread, and a probe the probe's
# one token, for a minute of retries, so a bucket answering again went unnoticed as long.
MAX_RETRIES = 10
INITIAL_BACKOFF = timedelta(milliseconds=50)
MAX_BACKOFF = timedelta(seconds=2)
BACKOFF_BASE = 2
# The error codes of 4xx answers that say "try again" (a 5xx or 429 always does).
RETRIED_CODES = frozenset({"SlowDown", "Throttling", "ThrottlingException", "RequestTimeout",
                           "RequestLimitExceeded", "TooManyRequestsException"})
# A connection that does not open within 5 s will not (a healthy endpoint answers in ms):
# the retries then try again rather than wait out backendTimeout on one attempt.
CONNECT_TIMEOUT = 5.0
# Versions whose ETag is remembered for If-Match (~150 bytes each: 15 MB): a read of a
# version seen longer ago is checked by its answer's ETag alone, which guarantees the same
# (one answer's headers and body are of one object version), only after the transfer.
MAX_ETAGS = 100_000
# How long obstore keeps credentials boto3 handed it before asking again: botocore renews
# temporary ones (web identity, SSO, a role) when less than 10-15 minutes are left, so
# asking every 5 minutes never signs with credentials about to expire.
CREDENTIALS_TTL = timedelta(minutes=5)
# What stat reports as the preferred I/O size: the default blockSize, the unit the cache
# reads in, so stdio and Python's buffered files read a small file in one request.
BLKSIZE = 1 << 20
# Longest name a FUSE directory entry can carry (Linux NAME_MAX); longer key components
# are left out of listings.
NAME_MAX = 255
# Bit mask of the version's "inode" (the ETag's hash): FileVersion packs it as a signed
# 64-bit field (cache/keys.py).
INO_MASK = (1 << 63) - 1


# The owner of every file and directory: the daemon's user (objects have none), read once
# rather than per key listed.
_UID, _GID = os.geteuid(), os.getegid()


@dataclass(frozen=True, slots=True)
class S3Location:
    """Where the volume is and how to reach it (the config's ``source`` and ``s3*`` keys)."""

    bucket: str
    prefix: str = ""  # "" or ending with "/"
    endpoint: str = ""  # "": the standard chain's (AWS_ENDPOINT_URL, the profile), else AWS's
    region: str = ""  # "": the standard chain's (AWS_REGION, the profile)
    path_style: bool | None = None  # None: path style for an endpoint other than AWS's
    profile: str = ""  # "": AWS_PROFILE, else the default profile

    @property
    def url(self) -> str:
        return f"s3://{self.bucket}/{self.prefix}"


def etag_ino(etag: str) -> int:
    """The version's ``ino`` field for an ETag (quoted or not): its 63-bit xxh64 hash."""
    return xxhash.xxh64_intdigest(etag.strip('"').encode()) & INO_MASK


def _seconds_ns(when: datetime) -> int:
    # Whole seconds: HEAD and GET answers carry Last-Modified as an HTTP date (seconds),
    # ListObjectsV2 as ISO 8601 (milliseconds on AWS); one object must have one version.
    return int(when.timestamp()) * 1_000_000_000


def object_attr(size: int, last_modified: datetime, etag: str) -> Attr:
    """A key's attributes: a read-only regular file owned by the daemon's user.  Its
    version (size, mtime, ino, ctime) is (size, last-modified second, the ETag's hash,
    the same second): an overwrite changes the ETag (and mostly the others), so the cache
    sees a new version exactly as for a changed file of a directory source."""
    mtime = _seconds_ns(last_modified)
    return Attr(stat.S_IFREG | 0o444, 1, _UID, _GID, 0, size, (size + 511) // 512,
                BLKSIZE, mtime, mtime, mtime, etag_ino(etag))


def prefix_attr(prefix: str, mtime_ns: int) -> Attr:
    """A prefix's attributes: a read-only directory; prefixes have no time of their own,
    so every one shows the time the backend started.  Its link count is 1, "not counted"
    (as btrfs reports it): 2 would tell find(1) that it has no subdirectories."""
    return Attr(stat.S_IFDIR | 0o555, 1, _UID, _GID, 0, 0, 0, BLKSIZE,
                mtime_ns, mtime_ns, mtime_ns, xxhash.xxh64_intdigest(prefix.encode()) & INO_MASK)


def _usable_name(name: str) -> bool:
    """A key component a directory entry can show: not empty ("a//b"), ``.``/``..``, nor
    longer than NAME_MAX bytes or with a NUL."""
    return name not in ("", ".", "..") and "\0" not in name and len(name.encode()) <= NAME_MAX


def _status_of(exc: Exception) -> int | None:
    """The HTTP status of a failed request of either library, None if there was no answer."""
    if isinstance(exc, FileNotFoundError):  # obstore raises the builtin for a 404
        return 404
    if isinstance(exc, PermissionDeniedError):
        return 403
    if isinstance(exc, UnauthenticatedError):
        return 401
    response = getattr(exc, "response", None)  # botocore's ClientError
    if isinstance(response, dict):
        status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        return status if isinstance(status, int) else None
    return None


def os_error(exc: Exception, what: str) -> OSError:
    """The OSError for a failed request (the errno from cubefs_fuse.errors' table)."""
    code = errno_of_http(_status_of(exc))
    # The libraries' messages run to many lines (a debug dump): the first says it all, cut
    # at 300 characters (a URL and an S3 error message fit) so that a log line stays one.
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return OSError(code, f"{os.strerror(code)}: {what}: {first[:300]}")


def _is_library_error(exc: Exception) -> bool:
    from botocore.exceptions import BotoCoreError, ClientError

    return isinstance(exc, (ObstoreError, FileNotFoundError, BotoCoreError, ClientError))


def worth_retrying(exc: Exception) -> bool:
    """Whether a boto3 request's failure is worth another try: no answer (connection
    refused or dropped, a timeout), a 5xx or 429, or a throttling code."""
    from botocore.exceptions import ClientError, HTTPClientError
    from botocore.exceptions import ConnectionError as BotoConnectionError

    if isinstance(exc, (BotoConnectionError, HTTPClientError)):
        return True
    if isinstance(exc, ClientError):
        status = _status_of(exc)
        return (status is not None and (status >= 500 or status == 429)) or \
            exc.response.get("Error", {}).get("Code") in RETRIED_CODES
    return False


def retrying(fn: Callable[[], T], retries: int, timeout: float, sleep: Callable[[float], None] = time.sleep) -> T:
    """``fn()``, a boto3 request, tried again after a failure :func:`worth_retrying` accepts, at
    most ``retries`` times and never past ``timeout`` seconds from the first try (the
    schedule of MAX_RETRIES' comment).  Runs in a worker thread: it sleeps."""
    deadline = time.monotonic() + timeout
    wait = initial = INITIAL_BACKOFF.total_seconds()
    for attempt in range(retries + 1):
        try:
            return fn()
        except Exception as exc:
            if attempt == retries or not worth_retrying(exc) or time.monotonic() + wait > deadline:
                raise
        sleep(wait)
        wait = min(MAX_BACKOFF.total_seconds(), random.uniform(initial, wait * BACKOFF_BASE))
    raise AssertionError("unreachable")


def _timestamp(value: str) -> datetime:
    """A time in an answer boto3 parses: ListObjectsV2's ISO 8601 by the standard library,
    anything else by botocore's general parser (dateutil's, which took half of a listing's
    CPU; a listing costs 30-40 us per key with this one against 150-200 with plain boto3,
    benchmarks/results/2026-11-29-s3-client.md)."""
    from botocore.utils import parse_timestamp

    try:
        return datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        parsed: datetime = parse_timestamp(value)
        return parsed


class Clients:
    """The two clients of one location: boto3's (listings, probes; its session resolves
    credentials, region and endpoint as the AWS CLI does) and an obstore S3Store (HEAD,
    GET) signing with the credentials boto3 found.  Creating them reads the AWS config
    files: blocking, done once at start."""

    def __init__(self, location: S3Location, *, threads: int, timeout: float, retries: int = MAX_RETRIES) -> None:
        import boto3
        import botocore.session
        from botocore import UNSIGNED
        from botocore.config import Config
        from obstore.auth.boto3 import Boto3CredentialProvider
        from obstore.store import S3Store

        core = botocore.session.Session()
        core.get_component("response_parser_factory").set_parser_defaults(timestamp_parser=_timestamp)
        session = boto3.Session(botocore_session=core, profile_name=location.profile or None,
                                region_name=location.region or None)
        credentials = session.get_credentials()
        region = session.region_name or "us-east-1"  # the AWS CLI's fallback too
        # Where the chain says (endpoint_url of the profile, AWS_ENDPOINT_URL[_S3]) unless
        # the config names one: boto3 resolves it, obstore is given the result.
        resolver = session.client("s3", endpoint_url=location.endpoint or None, region_name=region)
        endpoint: str = resolver.meta.endpoint_url
        resolver.close()
        on_aws = (urlsplit(endpoint).hostname or "").endswith(".amazonaws.com")
        path_style = location.path_style if location.path_style is not None else not on_aws
        self.endpoint = endpoint
        self.anonymous = credentials is None  # a public bucket: requests go unsigned
        self.retries, self.timeout = retries, timeout
        config = Config(
            signature_version=UNSIGNED if self.anonymous else None,
            s3={"addressing_style": "path" if path_style else "virtual"},
            retries={"total_max_attempts": 1},  # retrying() retries (see MAX_RETRIES)
            connect_timeout=CONNECT_TIMEOUT, read_timeout=timeout, max_pool_connections=threads,
            # A listing's answer has no checksum to check; a GET goes through obstore.
            response_checksum_validation="when_required")
        self.boto: Any = session.client("s3", endpoint_url=endpoint, region_name=region, config=config)
        retry: RetryConfig = {"max_retries": retries, "retry_timeout": timedelta(seconds=timeout),
                              "backoff": {"init_backoff": INITIAL_BACKOFF, "max_backoff": MAX_BACKOFF, "base": 2}}
        options: ClientConfig = {"allow_http": endpoint.startswith("http://"), "timeout": timedelta(seconds=timeout),
                                   "connect_timeout": timedelta(seconds=CONNECT_TIMEOUT)}
        kwargs: dict[str, Any] = {"region": region, "virtual_hosted_style_request": not path_style}
        if not on_aws:
            # obstore takes a virtual-hosted endpoint with the bucket in its host name.
            parts = urlsplit(endpoint)
            kwargs["endpoint"] = endpoint if path_style else f"{parts.scheme}://{location.bucket}.{parts.netloc}"
        if self.anonymous:
            kwargs["skip_signature"] = True
            self.store: S3Store = S3Store(location.bucket, client_options=options, retry_config=retry, **kwargs)
        else:
            self.store = S3Store(location.bucket, client_options=options, retry_config=retry,
                                 credential_provider=Boto3CredentialProvider(session, ttl=CREDENTIALS_TTL),
                                 **kwargs)


    def list_objects(self, retries: int | None = None, **args: Any) -> dict[str, Any]:
        """One ListObjectsV2 page through boto3, retried (``retries``: the client's unless
        given).  Blocking: a worker thread's call."""
        page: dict[str, Any] = retrying(lambda: self.boto.list_objects_v2(**args),
                                         self.retries if retries is None else retries, self.timeout)
        return page


class S3Backend:
    """A bucket prefix as the remote volume (see module doc); implements ProbedBackend."""

    def __init__(self, location: S3Location, threads: int, *, timeout: float = 30.0,
                 page_size: int = LIST_PAGE_SIZE, retries: int = MAX_RETRIES) -> None:
        if location.prefix and not location.prefix.endswith("/"):
            location = replace(location, prefix=location.prefix + "/")  # "a" is the directory "a/"
        self.location = location
        self._clients = Clients(location, threads=threads, timeout=timeout, retries=retries)
        self._page_size = page_size
        self._ops = Operations(threads)
        self._started_ns = time.time_ns() // 1_000_000_000 * 1_000_000_000
        self._root = prefix_attr(location.prefix, self._started_ns)
        self._etags: dict[int, str] = {}  # version ino -> quoted ETag, oldest first (MAX_ETAGS)
        self._etags_lock = threading.Lock()

    def close(self) -> None:
        self._clients.boto.close()

    # -- helpers (worker threads) ---------------------------------------------------------

    def _key(self, path: str) -> str:
        return self.location.prefix + path

    def _remember(self, attr: Attr, etag: str) -> Attr:
        if not etag:
            return attr  # a server that sends none: reads are checked by size and time alone
        quoted = etag if etag.startswith('"') else f'"{etag}"'
        with self._etags_lock:
            etags = self._etags
            etags.pop(attr.ino, None)
            etags[attr.ino] = quoted
            if len(etags) > MAX_ETAGS:
                del etags[next(iter(etags))]
        return attr

    def _etag(self, version: FileVersion) -> str | None:
        with self._etags_lock:
            return self._etags.get(version.ino)

    def _call(self, what: str, fn: Callable[[], Any]) -> Any:
        """``fn()``, a request; a library's failure becomes an OSError (errors.errno_of_http)."""
        try:
            return fn()
        except PreconditionError:
            raise
        except Exception as exc:
            if _is_library_error(exc):
                raise os_error(exc, what) from None
            raise

    def _attr_of(self, meta: ObjectMeta) -> Attr:
        """The attributes of a HEAD's or a GET's answer (the object's total size, also for a
        ranged GET), its ETag remembered for If-Match."""
        etag = meta["e_tag"] or ""
        return self._remember(object_attr(meta["size"], meta["last_modified"], etag), etag)

    def _head(self, path: str) -> Attr:
        key = self._key(path)
        return self._attr_of(self._call(f"HEAD {key}", lambda: obstore.head(self._clients.store, key)))

    def _pages(self, prefix: str, *, max_keys: int | None = None,
               retries: int | None = None) -> Iterator[dict[str, Any]]:
        """ListObjectsV2 pages of ``prefix`` with the delimiter ``/``, one at a time; each
        request retried ``retries`` times (the client's unless given)."""
        token: str | None = None
        while True:
            args: dict[str, Any] = {"Bucket": self.location.bucket, "Prefix": prefix, "Delimiter": "/",
                                    "MaxKeys": max_keys or self._page_size}
            if token:
                args["ContinuationToken"] = token
            page = self._call(f"LIST {prefix!r}", lambda: self._clients.list_objects(retries, **args))
            yield page
            token = page.get("NextContinuationToken")
            if max_keys is not None or not page.get("IsTruncated") or not token:
                return

    def _is_prefix(self, path: str) -> bool:
        page = next(self._pages(self._key(path) + "/", max_keys=1))
        return bool(page.get("Contents") or page.get("CommonPrefixes"))

    # -- the Backend protocol -------------------------------------------------------------

    async def stat(self, path: str) -> Attr:
        if not path:
            return self._root

        def head_or_prefix() -> Attr:
            try:
                return self._head(path)
            except FileNotFoundError:
                pass
            # No such key: a directory if keys start with "path/" (a key and a prefix of
            # one name: the key wins, here and in listings).
            if self._is_prefix(path):
                return prefix_attr(self._key(path) + "/", self._started_ns)
            raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), path)

        return await self._ops.run("stat", path, head_or_prefix, expected=(errno.ENOENT,))

    async def listdir(self, path: str, limit: int | None = None) -> list[tuple[str, Attr]]:
        """The prefix's keys (files) and sub-prefixes (directories), page by page (past
        ``limit`` names, E2BIG without the next page asked for); a key
        equal to the prefix itself (a "directory marker" a console made) is left out, as
        are names no directory entry can carry.  A prefix without keys other than the
        root is no directory (ENOENT)."""
        prefix = self._key(path) + "/" if path else self.location.prefix

        def scan() -> list[tuple[str, Attr]]:
            entries: dict[str, Attr] = {}
            seen_any = False
            for page in self._pages(prefix):
                for item in page.get("Contents") or ():
                    seen_any = True
                    name = item["Key"][len(prefix):]
                    if _usable_name(name):
                        entries[name] = self._remember(object_attr(item["Size"], item["LastModified"], item["ETag"]),
                                                       item["ETag"])
                for common in page.get("CommonPrefixes") or ():
                    seen_any = True
                    name = common["Prefix"][len(prefix):-1]
                    if _usable_name(name) and name not in entries:  # the key of that name wins
                        entries[name] = prefix_attr(common["Prefix"], self._started_ns)
                if limit is not None and len(entries) > limit:
                    raise too_many_entries(path, limit)
            if path and not seen_any:
                raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), path)
            return list(entries.items())

        return await self._ops.run("listdir", path, scan, expected=(errno.E2BIG,))

    def _get(self, path: str, version: FileVersion, start: int, end: int) -> bytes:
        """Bytes [start, end) of exactly ``version`` (worker thread), else StaleVersion."""
        key = self._key(path)
        options: GetOptions = {"range": (start, end)}
        etag = self._etag(version)
        if etag is not None:
            options["if_match"] = etag
        try:
            result = self._call(f"GET {key}", lambda: obstore.get(self._clients.store, key, options=options))
            data = bytes(result.bytes())
        except PreconditionError:
            raise StaleVersion(path) from None  # 412: the key has another ETag now
        if len(data) != end - start or self._attr_of(result.meta).version != version:
            raise StaleVersion(path)
        return data

    async def read_block(self, path: str, version: FileVersion, offset: int, size: int) -> bytes:
        if size <= 0:
            return b""
        if offset + size > version.size:
            raise StaleVersion(path)  # a block past the end of this version: the file changed
        data: bytes = await self._ops.run("read", path, lambda: self._get(path, version, offset, offset + size))
        self._ops.counters.bytes_read += len(data)
        return data

    async def stat_read(self, path: str, max_size: int, want: Callable[[Attr], bool]) -> tuple[Attr, bytes | None]:
        """Backend.stat_read: one ranged GET of the object's first ``max_size`` bytes, whose
        answer gives both the attributes (the total size from its Content-Range, the ETag,
        Last-Modified) and, for an object of 1 to ``max_size`` bytes that ``want``, the
        bytes: one answer's headers and body are of one version, so never bytes of another
        version than ``attr``.  No key: a directory if it is a prefix (a LIST); an empty
        object (a range of it is 416 Not Satisfiable): a HEAD.

        The body is read whole even when it is not kept (an object larger than
        ``max_size``, or one ``want`` declines): the Range header bounds it to ``max_size``
        bytes.  No size is known before the request, and the alternatives cost more
        (benchmarks/results/2026-11-29-s3-lookup.md, 10 ms per request, 1 MiB max_size): a
        HEAD first keeps every small object at two requests (27-29 ms against 14.2 for
        110 KB), while a large object's lookup is one request either way (this GET read and
        dropped 18.7-20.5 ms, a HEAD 13.3-13.5) and is followed by block reads that cost far
        more; dropping the answer after its headers was no faster (the server had sent the
        range anyway), cost more CPU and closed the pooled connection, so the next request
        opened a new one (a TLS handshake on a real endpoint)."""
        if not path:
            return self._root, None
        key = self._key(path)

        # (attributes, bytes, seconds the read part took or None if none was kept, its error)
        Result = tuple[Attr, bytes | None, float | None, OSError | None]

        def ranged_get() -> Any:
            try:
                return obstore.get(self._clients.store, key, options={"range": (0, max_size)})
            except GenericError as exc:
                # 416 Range Not Satisfiable: every range of an empty object is (obstore has no
                # exception class for it; its message carries the status).
                if "status code: 416" in str(exc):
                    return None
                raise

        def job() -> Result:
            try:
                result = self._call(f"GET {key}", ranged_get)
            except FileNotFoundError:
                if self._is_prefix(path):
                    return prefix_attr(key + "/", self._started_ns), None, None, None
                raise
            if result is None:
                return self._head(path), None, None, None  # an empty object: nothing to read
            attr = self._attr_of(result.meta)
            # The read part is the body's transfer after the headers (the request is the stat's).
            start = time.perf_counter()
            try:
                data = bytes(result.bytes())
            except ObstoreError as exc:  # the body broke off: the read path meets it again and reports it
                return attr, None, time.perf_counter() - start, os_error(exc, f"GET {key}")
            elapsed = time.perf_counter() - start
            if not (0 < attr.size <= max_size) or not want(attr):
                return attr, None, None, None  # not kept: no read part
            if len(data) != attr.size:
                return attr, None, elapsed, None  # a short body: the read path reads it again
            return attr, data, elapsed, None

        attr, data, elapsed, error = await self._ops.run("stat", path, job, expected=(errno.ENOENT,))
        if elapsed is not None:
            self._ops.count_read_part(path, elapsed, error, data)
        return attr, data

    async def readlink(self, path: str) -> str:
        raise OSError(errno.EINVAL, os.strerror(errno.EINVAL), path)  # an object store has no symlinks

    async def statfs(self) -> FsStats:
        # An object store has no capacity to report: no blocks, none free (the mount is
        # read-only), no inode counts; 4 KiB blocks and NAME_MAX as any Linux filesystem.
        return FsStats(4096, 4096, 0, 0, 0, 0, 0, NAME_MAX)

    async def probe(self) -> bool:
        """Check the bucket (ProbedBackend.probe): one ListObjectsV2 of one key under the
        prefix, not retried (the probe loop tries again).  Never "reopened": a bucket has no
        descriptor to renew."""
        await self._ops.thread(lambda: next(self._pages(self.location.prefix, max_keys=1, retries=0)),
                               self._ops.probe_limiter)
        return False

    def statistics(self) -> BackendStatistics:
        return self._ops.statistics()


# Attempts of the mount-time check: one retry, so that a wrong endpoint fails the mount
# within seconds (CONNECT_TIMEOUT each) rather than after the daemon's MAX_RETRIES.
CHECK_RETRIES = 1
# S3 error codes that say the credentials were refused (a wrong key, a wrong secret, an
# expired token, or a key without the right to list the bucket).
_CREDENTIAL_CODES = frozenset({"InvalidAccessKeyId", "SignatureDoesNotMatch", "AccessDenied", "ExpiredToken",
                               "InvalidToken", "InvalidClientTokenId", "AllAccessDisabled"})


def check_location(location: S3Location, timeout: float) -> None:
    """At mount time: list one key under the location's prefix; ConfigError with one line
    naming the cause (no such profile, an endpoint that does not answer, no such bucket,
    refused credentials, nothing under the prefix)."""
    from botocore.exceptions import BotoCoreError, ClientError, ProfileNotFound

    from cubefs_fuse.errors import ConfigError

    endpoint_key = "key 's3Endpoint'" if location.endpoint else "the S3 endpoint"
    try:
        clients = Clients(location, threads=1, timeout=min(timeout, CONNECT_TIMEOUT), retries=CHECK_RETRIES)
    except ProfileNotFound:
        raise ConfigError(f"key 's3Profile': no profile {location.profile!r} in the AWS config files") from None
    except BotoCoreError as exc:
        raise ConfigError(f"key 'source': cannot set up an S3 client for {location.url}: {exc}") from None
    try:
        answer = clients.list_objects(Bucket=location.bucket, Prefix=location.prefix, MaxKeys=1)
    except ClientError as exc:
        error = exc.response.get("Error", {})
        code = str(error.get("Code", ""))
        status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        if code == "NoSuchBucket":
            raise ConfigError(f"key 'source': bucket {location.bucket!r} does not exist at {clients.endpoint}") from None
        if code in _CREDENTIAL_CODES or status in (401, 403):
            who = "anonymous access (no credentials found)" if clients.anonymous else "the credentials"
            raise ConfigError(f"key 'source': {clients.endpoint} refused {who} for bucket {location.bucket!r} "
                              f"({code or status}): check AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, AWS_PROFILE "
                              "or 's3Profile'") from None
        raise ConfigError(f"key 'source': cannot list {location.url} at {clients.endpoint}: "
                          f"{code or status} {error.get('Message', '')}".rstrip()) from None
    except BotoCoreError as exc:  # no answer: connection refused, unknown host, timeout
        raise ConfigError(f"{endpoint_key}: {clients.endpoint} does not answer: {exc}") from None
    finally:
        clients.boto.close()
    if location.prefix and not answer.get("KeyCount"):
        raise ConfigError(f"key 'source': no object under {location.url}")
