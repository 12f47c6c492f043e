"""The alert rules (deploy/prometheus/cubefs-fuse-rules.yml) under ``promtool check rules`` and
their unit tests (cubefs-fuse-rules.test.yml) under ``promtool test rules``: every alert has
a case where it fires, with all its labels and annotations, and one where it must not.

promtool comes from Debian's ``prometheus`` package, which scripts/setup.sh installs.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml  # type: ignore[import-untyped]

from tests.helpers import REPO

PROMETHEUS_DIR = REPO / "deploy" / "prometheus"
RULES = PROMETHEUS_DIR / "cubefs-fuse-rules.yml"
RULE_TESTS = PROMETHEUS_DIR / "cubefs-fuse-rules.test.yml"
# promtool evaluates the cases in memory; 120 s is far above its run time (about a second)
# even on a loaded machine, and only bounds a hung promtool.
PROMTOOL_TIMEOUT_S = 120


def promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        pytest.fail("promtool not found: scripts/setup.sh installs it (Debian package `prometheus`)")
    return path


def run_promtool(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([promtool(), *args], capture_output=True, text=True, cwd=cwd,
                          timeout=PROMTOOL_TIMEOUT_S, check=False)


def alerts() -> dict[str, dict[str, Any]]:
    rules = yaml.safe_load(RULES.read_text())
    return {rule["alert"]: rule for group in rules["groups"] for rule in group["rules"] if "alert" in rule}


def test_rules_pass_promtool_check() -> None:
    result = run_promtool("check", "rules", RULES.name, cwd=PROMETHEUS_DIR)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(alerts())} rules found" in result.stdout, result.stdout


def test_rule_unit_tests_pass() -> None:
    result = run_promtool("test", "rules", RULE_TESTS.name, cwd=PROMETHEUS_DIR)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout and "FAILED" not in result.stdout + result.stderr, result.stdout


def test_every_alert_has_a_firing_and_a_silent_case() -> None:
    cases: dict[str, list[dict[str, Any]]] = {}
    tests = yaml.safe_load(RULE_TESTS.read_text())
    assert tests["rule_files"] == [RULES.name]
    for group in tests["tests"]:
        for case in group.get("alert_rule_test", []):
            cases.setdefault(case["alertname"], []).append(case)
    rules = alerts()
    assert len(rules) >= 8 and set(cases) == set(rules), (sorted(rules), sorted(cases))
    for name, rule in rules.items():
        firing = [alert for case in cases[name] for alert in case["exp_alerts"]]
        assert firing, f"{name}: no case where it fires"
        assert any(not case["exp_alerts"] for case in cases[name]), f"{name}: no case where it stays silent"
        for alert in firing:
            # The alert's own labels and every annotation it carries are checked, not a subset.
            assert rule["labels"].items() <= alert["exp_labels"].items(), name
            assert set(alert["exp_annotations"]) == set(rule["annotations"]), name


@pytest.mark.parametrize("alert", sorted(alerts()))
def test_rule_unit_tests_fail_when_an_alert_never_fires(alert: str, tmp_path: Path) -> None:
    """The cases can fail: with one alert's expression replaced by one that never matches,
    ``promtool test rules`` reports that alert's firing case."""
    rules = yaml.safe_load(RULES.read_text())
    for group in rules["groups"]:
        for rule in group["rules"]:
            if rule.get("alert") == alert:
                rule["expr"] = "vector(1) < 0"
    (tmp_path / RULES.name).write_text(yaml.safe_dump(rules))
    shutil.copy(RULE_TESTS, tmp_path / RULE_TESTS.name)
    result = run_promtool("test", "rules", RULE_TESTS.name, cwd=tmp_path)
    report = result.stdout + result.stderr  # promtool writes its FAILED cases to stderr
    assert result.returncode != 0, report
    failed = {line.strip().removeprefix("alertname: ").split(",")[0]
              for line in report.splitlines() if line.strip().startswith("alertname: ")}
    assert failed == {alert}, report
