#!/usr/bin/env bash
# The test command: installs what it needs (scripts/setup.sh), type-checks, runs the suite.
#
#   scripts/test.sh                     everything (what CI runs, via .ci/run)
#   scripts/test.sh TIER... [ARGS]      only those tiers: unit, component, mounted, torch
#   scripts/test.sh [TIER...] ARGS      ARGS go to pytest, e.g. scripts/test.sh mounted -k cache
#
# The tiers are the folders under tests/ (tests/conftest.py says what each needs).  The
# mounted and torch tiers need root and /dev/fuse: without them their tests fail, unless
# CUBEFS_FUSE_SKIP_MOUNTED=1 is set, which skips them with a one-line reason instead.
# Leading words are tier names; one that is neither a tier, nor an option, nor an existing
# path is an error.  A run that collects no test fails.
set -uo pipefail
cd "$(dirname "$0")/.."
TIERS=(unit component mounted torch)
paths=()
while [ $# -gt 0 ]; do
    case "$1" in
        unit | component | mounted | torch) paths+=("tests/$1"); shift ;;
        -* | */* | *::* | *.py) break ;;
        *)
            [ -e "$1" ] && break
            echo "test.sh: '$1' is not a tier (${TIERS[*]}), an option or a path" >&2
            exit 2
            ;;
    esac
done
scripts/setup.sh || exit 1
echo "== mypy" >&2
.venv/bin/mypy || exit 1
echo "== pytest${paths[*]:+ ${paths[*]}}" >&2
.venv/bin/python -m pytest -q -p no:cacheprovider ${paths[@]+"${paths[@]}"} "$@"
rc=$?
if [ "$rc" -eq 5 ]; then
    echo "test.sh: pytest collected no tests: failing" >&2
    exit 1
fi
exit "$rc"
