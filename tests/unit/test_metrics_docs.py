"""The metric table and its documentation agree (a live daemon's /metrics: tests/mounted/test_metrics_live.py)."""

from __future__ import annotations

import re

from cubefs_fuse.metrics import METRICS
from tests.helpers import REPO

DOC = (REPO / "docs" / "metrics.md").read_text()


def documented_rows() -> dict[str, list[str]]:
    """{metric name: [type, labels, meaning]} from the reference tables of docs/metrics.md."""
    rows = {}
    for line in DOC.splitlines():
        match = re.match(r"\|\s*`(cubefs_fuse_\w+)`\s*\|(.*)\|\s*$", line)
        if match:
            rows[match.group(1)] = [cell.strip() for cell in match.group(2).split("|")]
    return rows


def test_every_metric_is_documented_with_its_type_and_labels() -> None:
    rows = documented_rows()
    assert set(rows) == set(METRICS), "docs/metrics.md and METRICS list different names"
    for name, spec in METRICS.items():
        kind, labels, meaning = rows[name]
        assert kind == spec.kind, name
        for label in spec.labels:
            assert f"`{label}`" in labels, f"{name}: label {label} not documented"
        assert meaning, name


def test_metric_names_follow_prometheus_conventions() -> None:
    for name, spec in METRICS.items():
        assert name.startswith("cubefs_fuse_") and spec.name == name
        assert name.endswith("_total") == (spec.kind == "counter"), name
        assert spec.help.strip(), name
