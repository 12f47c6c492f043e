#!/usr/bin/env bash
# Builds s3-proxy-c (the delaying proxy in front of the benchmark suite's S3 server; see
# the comment at the top of proxy.c) into tools/s3_proxy_c/build/s3-proxy-c and prints the
# binary's path.  Idempotent: does nothing when the binary is newer than its source and
# this script.  Needs gcc (scripts/setup.sh installs it).  Exit status 1 with the reason
# on stderr if it cannot build.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
src="$here/proxy.c"
out_dir="$here/build"
binary="$out_dir/s3-proxy-c"

if [ -x "$binary" ] && [ "$binary" -nt "$src" ] && [ "$binary" -nt "$0" ]; then
    echo "$binary"
    exit 0
fi
command -v gcc >/dev/null 2>&1 || { echo "s3-proxy-c: gcc is missing (scripts/setup.sh installs it)" >&2; exit 1; }
mkdir -p "$out_dir"
# A private temporary name, then an atomic rename: concurrent builds never run a half-written binary.
tmp="$(mktemp "$out_dir/.s3-proxy-c.XXXXXX")"
trap 'rm -f "$tmp"' EXIT
gcc -std=gnu11 -O2 -g -Wall -Wextra -Werror -pthread -o "$tmp" "$src"
chmod 755 "$tmp"
mv -f "$tmp" "$binary"
trap - EXIT
echo "$binary"
