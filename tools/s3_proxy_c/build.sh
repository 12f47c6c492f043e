#!/usr/bin/env bash
# Builds s3-proxy-c (the delaying proxy in front of the benchmark suite's S3 server; see
# the comment at the top of proxy.c) into tools/s3_proxy_c/build/s3-proxy-c and prints the
# binary's path (tools/build_c.sh: idempotent, exit status 1 with the reason on stderr).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
exec "$here/../build_c.sh" s3-proxy-c "$here/proxy.c" "$here/build/s3-proxy-c" "$0"
