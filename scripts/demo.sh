#!/usr/bin/env bash
# The demo command: installs what it needs (scripts/setup.sh), then generates 400 JPEGs,
# serves them as a slow remote volume (tools/slowfs.py, 2 ms per operation), mounts that
# with cubefs-fuse ("profile": "ai_prefetch"), trains a tiny CNN on CPU over the mount with
# cube_torch for 3 epochs and prints samples/s, loss, hit-rate lines and what the daemon
# counted.  Extra arguments go to the demo (scripts/demo.sh --help; --no-train is a quick
# read-only mode).  Needs root (or a user allowed to FUSE-mount) and /dev/fuse.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
exec .venv/bin/python -m demo "$@"
