"""Every PromQL expression that ships (the Grafana dashboard's targets and template
variables, the alert rules, the ``promql`` blocks of the docs) evaluated by a real
Prometheus (Debian's ``prometheus`` package, which scripts/setup.sh installs) scraping a live
daemon: each must run without error and return data.

The daemon serves the ``ai_prefetch`` profile with a registered job and plan, and a workload
keeps reading through the mount while Prometheus scrapes it every second, so rates and ratios
have something to divide.  The expressions are evaluated twice, at a fixed time each:

1. on a healthy daemon (no error yet): everything returns data except the expressions in
   ``NO_DATA_UNTIL_FIRST_ERROR`` (each with its reason, which the docs must state), and those
   must return nothing (the list stays exact);
2. after one backend error: everything returns data.

"Data" means at least one sample with a value that is not NaN (a ratio of two idle rates is
NaN, which Grafana shows as no value).  An alert expression is evaluated with ``bool`` on its
comparisons against a number (``X > 0.25`` becomes ``X > bool 0.25``): the condition is false
on a healthy daemon, so the expression as written returns nothing, while the ``bool`` form
returns one 0/1 sample for every series the condition looks at, which proves that the
selectors match exported series and that both sides of an ``and``/``/`` join on their labels.
Prometheus also loads the rules themselves, and every rule must evaluate without error.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml  # type: ignore[import-untyped]

from cube_torch.fastpath import Channel
from cube_torch.samples.daemon_store import DaemonStore
from cubefs_fuse import mounts
from cubefs_fuse.control.protocol import ControlClient, read_volume_config
from tests.helpers import REPO, Mount, free_port, wait_until

DASHBOARD = REPO / "deploy" / "grafana" / "cubefs-fuse.json"
RULES = REPO / "deploy" / "prometheus" / "cubefs-fuse-rules.yml"
DOCS = REPO / "docs"
METRICS_DOC = DOCS / "metrics.md"
NODE = "promql-node"
# Grafana's $__rate_interval is max($__interval + scrape interval, 4 × scrape interval); with
# the 1 s scrape below that is 4 s.  15 s keeps several samples in every window even when a
# loaded machine delays or drops some scrapes.
RATE_INTERVAL = "15s"
GRAFANA_VARIABLES = {
    # "All" of a multi-value variable: any value.
    "node": ".*", "instance": ".*", "volume": ".*", "training_job": ".*",
    "__rate_interval": RATE_INTERVAL, "__interval": "1s", "__range": "1m", "__range_s": "60",
}
# Workload rounds while Prometheus scrapes, before each evaluation: enough samples in every
# RATE_INTERVAL window, with activity in it.
ROUND_FILES = 4
FILE_BYTES = 200_000  # several read requests (of 128 KiB at most) per file
# At most two rounds a second: activity in every scrape, and 40 × 0.8 MB written per 20 s.
ROUND_EVERY_S = 0.5
MIN_ACTIVE_SCRAPES = 20
# Bounds of the waits: far above what they take on an idle machine (Prometheus starts in
# about a second; the scrapes take MIN_ACTIVE_SCRAPES seconds), for a loaded 2-core one.
PROMETHEUS_START_S = 120.0
SCRAPES_S = 240.0
HTTP_TIMEOUT_S = 30.0

# Expressions that return nothing on a healthy daemon, with the reason; each reason quotes
# docs/metrics.md's row of the metric, which must say it.  After the first error they must
# return data like every other.
NO_DATA_UNTIL_FIRST_ERROR: dict[str, tuple[str, str]] = {
    "panel 'Backend errors by operation and errno'":
        ("cubefs_fuse_backend_errors_total", "No sample until the first error."),
    "alert CubefsFuseBackendErrors":
        ("cubefs_fuse_backend_errors_total", "No sample until the first error."),
}


# -- the expressions ---------------------------------------------------------------------------


def _panels(panels: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    for panel in panels:
        yield panel
        yield from _panels(panel.get("panels", []))  # rows (collapsed ones nest their panels)


def grafana_to_promql(expr: str) -> str:
    """A dashboard query as Prometheus runs it: ``label_values(SELECTOR, label)`` (Grafana's
    variable syntax) becomes SELECTOR, the variables their "All" values."""
    match = re.fullmatch(r"\s*label_values\((.+),\s*\w+\s*\)\s*", expr, re.S)
    if match:
        expr = match.group(1)
    for name, value in sorted(GRAFANA_VARIABLES.items(), key=lambda item: -len(item[0])):
        expr = expr.replace(f"${{{name}}}", value).replace(f"[[{name}]]", value).replace(f"${name}", value)
    assert "$" not in expr and "[[" not in expr, f"unknown Grafana variable in {expr}"
    return expr


def dashboard_expressions() -> list[tuple[str, str]]:
    dashboard = json.loads(DASHBOARD.read_text())
    found = [(f"panel {p.get('title', '?')!r}", t["expr"]) for p in _panels(dashboard["panels"])
             for t in p.get("targets", []) if t.get("expr")]
    for var in dashboard["templating"]["list"]:
        if var.get("type") == "query":
            query = var["query"]["query"] if isinstance(var["query"], dict) else var["query"]
            found.append((f"variable {var['name']}", query))
    return [(where, grafana_to_promql(expr)) for where, expr in found]


# A comparison with a number on its right: `X > 0.25`, `X == 0` (not a label matcher: those
# are followed by a quoted string).
COMPARISON = re.compile(r"(==|!=|<=|>=|<|>)(\s*)(?=[-+]?(?:\d|\.\d|Inf|NaN))")


def rule_expressions() -> list[tuple[str, str]]:
    rules = yaml.safe_load(RULES.read_text())
    found = []
    for group in rules["groups"]:
        for rule in group["rules"]:
            expr = rule["expr"].strip()
            if "alert" in rule:
                expr = COMPARISON.sub(r"\1 bool\2", expr)
                assert " bool" in expr, f"alert {rule['alert']}: no comparison found in {rule['expr']}"
                found.append((f"alert {rule['alert']}", expr))
            else:
                found.append((f"record {rule['record']}", expr))
    return found


def doc_expressions() -> list[tuple[str, str]]:
    """The expressions of every ```promql block of docs/*.md: one per line, except that a
    line continues the expression above it when it is indented, or when the text so far
    ends with an operator or has an open parenthesis."""
    found = []
    for doc in sorted(DOCS.glob("*.md")):
        for block in re.findall(r"```promql\n(.*?)```", doc.read_text(), re.S):
            current = ""
            for line in block.splitlines():
                if not line.strip() or line.lstrip().startswith("#"):
                    continue
                continues = current and (line[0].isspace() or current.rstrip()[-1] in "/*+-(,"
                                         or current.count("(") > current.count(")"))
                if continues:
                    current += " " + line.strip()
                else:
                    if current:
                        found.append((f"{doc.name}: {current}", current))
                    current = line.strip()
            if current:
                found.append((f"{doc.name}: {current}", current))
    return found


def test_the_expressions_are_all_found() -> None:
    """The extraction itself (a broken one would make the live test vacuous)."""
    dashboard, rules, docs = dashboard_expressions(), rule_expressions(), doc_expressions()
    assert len(dashboard) >= 50 and len(rules) >= 8 and len(docs) >= 8, (len(dashboard), len(rules), len(docs))
    assert ("variable node", "cubefs_fuse_mount_info") in dashboard
    assert any("node=~\".*\"" in expr and "[15s]" in expr for _, expr in dashboard)
    assert ("alert CubefsFuseJobStalling",
            "sum by (node, training_job, rank) (rate(cubefs_fuse_job_stall_seconds_total[10m])) > bool 0.25") in rules
    # The three-line hit-rate query of docs/metrics.md is one expression.
    assert sum("cubefs_fuse_cache_misses_total" in expr and expr.count("(") == expr.count(")")
               for _, expr in docs) == 1
    for where in NO_DATA_UNTIL_FIRST_ERROR:
        assert where in {w for w, _ in dashboard + rules + docs}, f"{where} is no longer there: update the list"


def test_no_data_list_is_documented() -> None:
    text = METRICS_DOC.read_text()
    for where, (metric, reason) in NO_DATA_UNTIL_FIRST_ERROR.items():
        rows = [line for line in text.splitlines() if line.startswith(f"| `{metric}` |")]
        assert len(rows) == 1 and reason in rows[0], f"{where}: docs/metrics.md's row of {metric} must say {reason!r}"


# -- a real Prometheus ---------------------------------------------------------------------------


class Prometheus:
    """A ``prometheus`` server on a free loopback port, scraping one daemon every second."""

    def __init__(self, directory: Path, target_port: int, volume: str) -> None:
        binary = shutil.which("prometheus")
        if binary is None:
            pytest.fail("prometheus not found: scripts/setup.sh installs it (Debian package `prometheus`)")
        self.directory = directory
        self.port = free_port()
        directory.mkdir()
        shutil.copy(RULES, directory / RULES.name)
        config = {
            "global": {"scrape_interval": "1s", "scrape_timeout": "1s", "evaluation_interval": "1s"},
            "rule_files": [RULES.name],
            # The job name of deploy/prometheus/prometheus.yml (the rules select `cubefs-fuse.*`),
            # the node and volume labels that its relabelling gives every target.
            "scrape_configs": [{
                "job_name": "cubefs-fuse", "metrics_path": "/metrics",
                "static_configs": [{"targets": [f"127.0.0.1:{target_port}"],
                                    "labels": {"node": NODE, "volume": volume}}],
            }],
        }
        (directory / "prometheus.yml").write_text(yaml.safe_dump(config))
        self.log_path = directory / "prometheus.log"
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(
                [binary, f"--config.file={directory / 'prometheus.yml'}",
                 f"--storage.tsdb.path={directory / 'data'}", f"--web.listen-address=127.0.0.1:{self.port}",
                 "--log.level=warn"],
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=directory)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-5000:]

    def get(self, path: str, **params: str) -> Any:
        url = f"http://127.0.0.1:{self.port}{path}?{urllib.parse.urlencode(params)}"
        try:
            with urllib.request.urlopen(url, timeout=HTTP_TIMEOUT_S) as response:
                body = json.load(response)
        except urllib.error.HTTPError as e:  # a bad query: 400 with the error in the body
            body = json.load(e)
        return body

    def ready(self) -> bool:
        assert self.process.poll() is None, f"prometheus exited ({self.process.returncode}):\n{self.log()}"
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/-/ready", timeout=HTTP_TIMEOUT_S) as r:
                return bool(r.status == 200)
        except OSError:
            return False

    def query(self, expr: str, at: float) -> dict[str, Any]:
        body = self.get("/api/v1/query", query=expr, time=f"{at:.3f}")
        assert body["status"] == "success", f"{expr}: {body.get('errorType')}: {body.get('error')}"
        result: dict[str, Any] = body["data"]
        return result

    def value(self, expr: str) -> float:
        """The single value of EXPR now (NaN if it returns nothing)."""
        result = self.query(expr, time.time())["result"]
        return float(result[0]["value"][1]) if result else math.nan

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=30)
        shutil.rmtree(self.directory, ignore_errors=True)


def has_data(data: dict[str, Any]) -> bool:
    """At least one sample (instant vector or scalar) whose value is a number, not NaN."""
    if data["resultType"] == "vector":
        values = [sample["value"][1] for sample in data["result"]]
    elif data["resultType"] == "scalar":
        values = [data["result"][1]]
    else:
        raise AssertionError(f"unexpected result type {data['resultType']}")
    return any(not math.isnan(float(v)) for v in values)


# -- the test ----------------------------------------------------------------------------------


def test_every_shipped_promql_expression_returns_data_from_a_live_daemon(
        make_mount: Callable[..., Mount], tmp_path: Path) -> None:
    volume = f"promql-{uuid.uuid4().hex[:8]}"
    m = make_mount(volName=volume, profile="ai_prefetch", memCacheSize="64MiB")
    rng = np.random.default_rng(7)
    names = [f"d/f{i}" for i in range(8)]
    for name in names + ["gone"]:
        (m.source / name).parent.mkdir(exist_ok=True)
        (m.source / name).write_bytes(rng.bytes(FILE_BYTES))
    m.mount()
    client = ControlClient(mounts.registered(str(m.mount_point))["controlSocket"])  # type: ignore[index]
    # This process is the registered job: its opens count for the per-job series.
    client.register_job("promql-job", 0, os.getpid())
    dataset = client.register_dataset(names)
    client.submit_plan("promql-job", 0, 0, dataset, np.arange(len(names), dtype="<u4").tobytes(), "<u4")
    for name in names:
        m.path(name).read_bytes()
    # Listed, then looked up (attributes cached from the listing: a lookup that missed them
    # would bring the small file whole, docs/contracts.md "The lean path"),
    # removed at the source later.
    assert "gone" in os.listdir(m.mount_point)
    os.stat(m.path("gone"))
    # cube_torch's other two paths, as its DataLoader workers use them: the fast path's data
    # socket and the daemon's sample store (the fast-path and sample-cache panels).
    config_dir = m.config().get("configDir", "/tmp")
    channel = Channel(read_volume_config(volume, config_dir).data_socket)
    store = DaemonStore(volume, config_dir=config_dir)

    rounds = 0

    def workload_round() -> None:
        """New files (metadata misses, backend reads, readahead) planned for the job (plan
        prefetch) and read; the first files again after dropping their pages (cache hits)."""
        nonlocal rounds
        rounds += 1
        directory = f"r{rounds}"
        (m.source / directory).mkdir()
        fresh = [f"{directory}/f{i}" for i in range(ROUND_FILES)]
        for name in fresh:
            (m.source / name).write_bytes(rng.bytes(FILE_BYTES))
        os.listdir(m.path(directory))
        round_set = client.register_dataset(fresh)
        client.submit_plan("promql-job", 0, rounds, round_set, np.arange(len(fresh), dtype="<u4").tobytes(), "<u4")
        for name in fresh + names[:2]:
            with open(m.path(name), "rb") as f:
                f.read()
                os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)  # the next open reads through
        # A fast-path batch, each file opened once, and a sample cache's put and get (the
        # round's key a hit, a key never put a miss).
        assert None not in channel.batch(names[2:4])
        channel.release([1, 1])
        store.put_many("promql-samples", [(rounds, rng.bytes(1000))])
        assert store.get_many("promql-samples", [rounds, -1])[1] is None
        # The job's DevicePrefetcher steps, as its cube_torch reports them with each line.
        client.report_reads("promql-job", 0, 0, {"steps": 10 * rounds, "wait_seconds": 0.1 * rounds,
                                                 "step_seconds": 2.0 * rounds, "p50_seconds": 0.001,
                                                 "p99_seconds": 0.05})

    prometheus = Prometheus(tmp_path / "prometheus", m.port, volume)
    try:
        wait_until(prometheus.ready, timeout=PROMETHEUS_START_S, what="prometheus to be ready")
        selector = f'{{job="cubefs-fuse", node="{NODE}"}}'
        last_round = [0.0]

        def scraped_while_active(extra: str = "") -> Callable[[], bool]:
            def check() -> bool:
                if time.monotonic() - last_round[0] >= ROUND_EVERY_S:
                    workload_round()
                    last_round[0] = time.monotonic()
                ok = prometheus.value(f"sum_over_time(up{selector}[{RATE_INTERVAL}])") >= 5 and \
                    prometheus.value(f"sum_over_time(up{selector}[1h])") >= MIN_ACTIVE_SCRAPES
                return ok and (not extra or prometheus.value(extra) >= 2)
            return check

        expressions = dashboard_expressions() + rule_expressions() + doc_expressions()

        def evaluate() -> tuple[set[str], list[str]]:
            """(where of the expressions that returned no data, errors) at one fixed time."""
            at = time.time()
            empty, errors = set(), []
            for where, expr in expressions:
                try:
                    data = prometheus.query(expr, at)
                except AssertionError as e:
                    errors.append(f"{where}: {e}")
                    continue
                if not has_data(data):
                    empty.add(where)
            return empty, errors

        # 1. A healthy daemon.
        wait_until(scraped_while_active(), timeout=SCRAPES_S, what="scrapes of the daemon under load")
        empty, errors = evaluate()
        assert not errors, "\n".join(errors)
        assert empty == set(NO_DATA_UNTIL_FIRST_ERROR), (
            f"no data on a healthy daemon: {sorted(empty - set(NO_DATA_UNTIL_FIRST_ERROR))}; "
            f"listed as empty until the first error but returned data: {sorted(set(NO_DATA_UNTIL_FIRST_ERROR) - empty)}")

        # 2. After one backend error: the file, looked up before, was removed at the source.
        (m.source / "gone").unlink()
        with pytest.raises(OSError):
            m.path("gone").read_bytes()
        wait_until(scraped_while_active(f"count_over_time(cubefs_fuse_backend_errors_total{selector}[{RATE_INTERVAL}])"),
                   timeout=SCRAPES_S, what="scrapes after the backend error")
        empty, errors = evaluate()
        assert not errors, "\n".join(errors)
        assert not empty, f"no data after the first error: {sorted(empty)}"

        # The template variables name their label in the series they select.
        dashboard = json.loads(DASHBOARD.read_text())
        for var in dashboard["templating"]["list"]:
            if var.get("type") == "query":
                query = var["query"]["query"] if isinstance(var["query"], dict) else var["query"]
                label = re.fullmatch(r"label_values\(.+,\s*(\w+)\s*\)", query)
                assert label, f"variable {var['name']}: {query}"
                series = prometheus.query(grafana_to_promql(query), time.time())["result"]
                assert any(s["metric"].get(label.group(1)) for s in series), f"variable {var['name']}: no {label.group(1)}"

        # The rules as Prometheus loads them: every one evaluated, none with an error.
        body = prometheus.get("/api/v1/rules")
        rules = [rule for group in body["data"]["groups"] for rule in group["rules"]]
        assert len(rules) == len(rule_expressions())
        assert all(rule["health"] == "ok" and not rule.get("lastError") for rule in rules), rules
        print(f"prometheus: {len(expressions)} expressions × 2 evaluations after {rounds} workload rounds")
    finally:
        prometheus.stop()
        channel.close()
        store.close()
    m.umount()
