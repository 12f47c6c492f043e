"""Which backend a config's ``source`` needs, and its check at mount time: a directory
source is served by the directory backend (``config.check_environment`` has checked the
path), an ``s3://`` source by the S3 backend, after one listing of its bucket
(``backends/s3.py``, ``check_location``) has made a missing bucket, refused credentials or
a dead endpoint one ``ConfigError`` line.  Between the config and the backends, so that
neither imports the other; boto3 and obstore are loaded only for an ``s3://`` source."""

from __future__ import annotations

from typing import TYPE_CHECKING

from cubefs_fuse.backends.base import ProbedBackend
from cubefs_fuse.backends.localdir import LocalDirBackend
from cubefs_fuse.config import ClientConfig

if TYPE_CHECKING:
    from cubefs_fuse.backends.s3 import S3Location


def s3_location(config: ClientConfig) -> S3Location:
    """Where an ``s3://`` source is and how to reach it (the ``s3*`` keys)."""
    from cubefs_fuse.backends.s3 import S3Location

    where = config.s3_source
    assert where is not None, "s3_location of a directory source"
    return S3Location(where[0], where[1], endpoint=config.s3_endpoint, region=config.s3_region,
                      path_style=config.s3_path_style, profile=config.s3_profile)


def check_source(config: ClientConfig) -> None:
    """At mount time, after ``check_environment``: an ``s3://`` source's bucket answers a
    listing under its prefix (ConfigError naming the cause otherwise)."""
    if config.s3_source is not None:
        from cubefs_fuse.backends.s3 import check_location

        check_location(s3_location(config), config.backend_timeout)


def source_backend(config: ClientConfig) -> ProbedBackend:
    """The S3 backend for an ``s3://`` source, the directory backend otherwise."""
    if config.s3_source is not None:
        from cubefs_fuse.backends.s3 import S3Backend

        return S3Backend(s3_location(config), config.backend_threads, timeout=config.backend_timeout)
    return LocalDirBackend(config.source, config.backend_threads)
