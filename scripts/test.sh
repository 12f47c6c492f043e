#!/usr/bin/env bash
# The test command: installs what it needs (scripts/setup.sh), type-checks, runs the suite.
# Extra arguments go to pytest (e.g. scripts/test.sh -k cache).
set -uo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh || exit 1
echo "== mypy" >&2
.venv/bin/mypy || exit 1
echo "== pytest" >&2
.venv/bin/python -m pytest -q -p no:cacheprovider "$@"
rc=$?
if [ "$rc" -eq 5 ]; then
    echo "test.sh: pytest collected no tests: failing" >&2
    exit 1
fi
exit "$rc"
