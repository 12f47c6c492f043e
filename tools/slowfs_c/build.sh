#!/usr/bin/env bash
# Builds slowfs-c (the C emulated remote, see README.md beside this file) into
# tools/slowfs_c/build/slowfs-c and prints the binary's path (tools/build_c.sh:
# idempotent, exit status 1 with the reason on stderr).  Needs gcc, pkg-config and
# libfuse3-dev (scripts/setup.sh installs them).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
command -v pkg-config >/dev/null 2>&1 || { echo "slowfs-c: pkg-config is missing (scripts/setup.sh installs it)" >&2; exit 1; }
if ! flags="$(pkg-config --cflags --libs fuse3 2>/dev/null)"; then
    echo "slowfs-c: libfuse3-dev is missing (pkg-config fuse3 failed; scripts/setup.sh installs it)" >&2
    exit 1
fi
# shellcheck disable=SC2086  # $flags is a list of compiler flags
exec "$here/../build_c.sh" slowfs-c "$here/slowfs.c" "$here/build/slowfs-c" "$0" $flags -lm
