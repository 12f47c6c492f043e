"""The C extension's build; everything else about the package is in pyproject.toml.

``cubefs_fuse.fs._session`` (the daemon's FUSE session) compiles against libfuse 3 as
pkg-config describes it and xxHash's header (libxxhash-dev; compiled in, no library);
``cubefs_fuse.cache._index`` (a cache tier's block index and eviction order) against
xxHash's header alone.  Every warning is an error: native code is held to the bar of
docs/architecture.md ("Never wrong bytes", "Never stuck").  ``CUBEFS_FUSE_SANITIZE=1``
builds both with AddressSanitizer and UndefinedBehaviorSanitizer for the sanitizer tests.
"""

from __future__ import annotations

import os
import shlex
import subprocess

from setuptools import Extension, setup


def pkg_config(*args: str) -> list[str]:
    try:
        out = subprocess.run(["pkg-config", *args, "fuse3"], check=True, capture_output=True, text=True).stdout
    except (OSError, subprocess.CalledProcessError) as exc:
        raise SystemExit(f"cubefs-fuse needs libfuse 3's headers and pkg-config "
                         f"(Debian: apt-get install libfuse3-dev libxxhash-dev pkg-config): {exc}") from None
    return shlex.split(out)


cflags = ["-std=gnu11", "-Wall", "-Wextra", "-Werror", "-O2"]
ldflags: list[str] = []
if os.environ.get("CUBEFS_FUSE_SANITIZE") == "1":
    cflags += ["-fsanitize=address,undefined", "-fno-omit-frame-pointer", "-fno-sanitize-recover=all", "-O1"]
    ldflags += ["-fsanitize=address,undefined"]

setup(ext_modules=[
    Extension(
        "cubefs_fuse.fs._session",
        sources=["cubefs_fuse/fs/_session.c"],
        extra_compile_args=pkg_config("--cflags") + cflags,
        extra_link_args=pkg_config("--libs") + ldflags,
    ),
    Extension(
        "cubefs_fuse.cache._index",
        sources=["cubefs_fuse/cache/_index.c"],
        extra_compile_args=cflags,
        extra_link_args=ldflags,
    ),
])
