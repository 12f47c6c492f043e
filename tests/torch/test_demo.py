"""The demo (scripts/demo.sh = python -m demo), small, end to end: it must keep working as
the README promises (a mount, a training run with hit-rate lines, a clean unmount)."""

from __future__ import annotations

import re
import subprocess
import sys

from cubefs_fuse import mounts
from tests.helpers import REPO


def test_the_demo_trains_with_hit_rate_lines_and_cleans_up() -> None:
    result = subprocess.run([sys.executable, "-m", "demo", "--files", "80", "--epochs", "2"], cwd=REPO,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    out = result.stdout
    assert "demo finished" in out
    assert re.search(r"user memory last_cycle_metrics:\(\[request_count:\d+ hit_count:\d+", out), out[-3000:]
    # The per-epoch table: epoch 1 read nothing from the remote (every file was cached).
    [epoch1] = [line for line in out.splitlines() if re.match(r"\|\s+1 \|", line)]
    cells = [c.strip() for c in epoch1.strip("|").split("|")]
    assert cells[3] == "80 / 80" and cells[4] == "80" and cells[-1] == "0 bytes", epoch1
    # Nothing of the demo is left mounted (its remote and its mount live in a cubefs-demo-* workdir).
    assert not [e.mount_point for e in mounts.mount_table() if "/cubefs-demo-" in e.mount_point]
