#!/usr/bin/env bash
# Builds one C program of tools/ and prints the binary's path: the shared half of
# tools/slowfs_c/build.sh and tools/s3_proxy_c/build.sh.
#
#   tools/build_c.sh NAME SOURCE BINARY CALLER [GCC ARGS...]
#
# Idempotent: does nothing when BINARY is newer than SOURCE, CALLER (the tool's own
# build.sh, whose flags it passes) and this script.  Compiles with gcc -std=gnu11 -O2 -g
# -Wall -Wextra -Werror -pthread plus GCC ARGS into a private temporary name, then renames
# it into place, so concurrent builds never run a half-written binary.  Exit status 1 with
# the reason on stderr (prefixed with NAME) if gcc is missing or the build fails.
set -euo pipefail
name="$1" src="$2" binary="$3" caller="$4"
shift 4
if [ -x "$binary" ] && [ "$binary" -nt "$src" ] && [ "$binary" -nt "$caller" ] && [ "$binary" -nt "$0" ]; then
    echo "$binary"
    exit 0
fi
command -v gcc >/dev/null 2>&1 || { echo "$name: gcc is missing (scripts/setup.sh installs it)" >&2; exit 1; }
out_dir="$(dirname "$binary")"
mkdir -p "$out_dir"
tmp="$(mktemp "$out_dir/.$name.XXXXXX")"
trap 'rm -f "$tmp"' EXIT
gcc -std=gnu11 -O2 -g -Wall -Wextra -Werror -pthread -o "$tmp" "$src" "$@"
chmod 755 "$tmp"
mv -f "$tmp" "$binary"
trap - EXIT
echo "$binary"
