#!/usr/bin/env bash
# Builds slowfs-c (the C emulated remote, see README.md beside this file) into
# tools/slowfs_c/build/slowfs-c and prints the binary's path.  Idempotent: does nothing
# when the binary is newer than its source and this script.  Needs gcc, pkg-config and
# libfuse3-dev (scripts/setup.sh installs them).  Exit status 1 with the reason on stderr
# if it cannot build.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
src="$here/slowfs.c"
out_dir="$here/build"
binary="$out_dir/slowfs-c"

if [ -x "$binary" ] && [ "$binary" -nt "$src" ] && [ "$binary" -nt "$0" ]; then
    echo "$binary"
    exit 0
fi
for tool in gcc pkg-config; do
    command -v "$tool" >/dev/null 2>&1 || { echo "slowfs-c: $tool is missing (scripts/setup.sh installs it)" >&2; exit 1; }
done
if ! flags="$(pkg-config --cflags --libs fuse3 2>/dev/null)"; then
    echo "slowfs-c: libfuse3-dev is missing (pkg-config fuse3 failed; scripts/setup.sh installs it)" >&2
    exit 1
fi
mkdir -p "$out_dir"
# A private temporary name, then an atomic rename: concurrent builds never run a half-written binary.
tmp="$(mktemp "$out_dir/.slowfs-c.XXXXXX")"
trap 'rm -f "$tmp"' EXIT
# shellcheck disable=SC2086  # $flags is a list of compiler flags
gcc -std=gnu11 -O2 -g -Wall -Wextra -Werror -pthread -o "$tmp" "$src" $flags -lm
chmod 755 "$tmp"
mv -f "$tmp" "$binary"
trap - EXIT
echo "$binary"
