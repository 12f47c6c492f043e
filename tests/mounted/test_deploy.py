"""The deployment files in deploy/: the Grafana dashboard and Prometheus rules against what a
real daemon exports, the Prometheus scrape config, the systemd unit (run for real, and
``systemd-analyze verify`` where systemd is installed) and the Kubernetes manifests
(schema validation with kubernetes-validate, plus cross-checks against the client config).
"""

from __future__ import annotations

import json
import os
import re
import select
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import kubernetes_validate  # type: ignore[import-untyped]
import numpy as np
import pytest
import yaml  # type: ignore[import-untyped]
from prometheus_client.parser import text_string_to_metric_families

from cube_torch.fastpath import Channel
from cube_torch.samples.daemon_store import DaemonStore
from cubefs_fuse import mounts
from cubefs_fuse.config import parse_config, parse_size
from cubefs_fuse.metrics import METRICS
from cubefs_fuse.control.protocol import ControlClient, read_volume_config
from tests.helpers import REPO, Mount, cli, kill_for_good, wait_until
from tests.systemd_units import next_notification, notify_socket, parse_unit, unit_command

DEPLOY = REPO / "deploy"
DASHBOARD = DEPLOY / "grafana" / "cubefs-fuse.json"
RULES = DEPLOY / "prometheus" / "cubefs-fuse-rules.yml"
UNIT = DEPLOY / "systemd" / "cubefs-fuse@.service"
K8S = DEPLOY / "k8s"
METRIC_NAME = re.compile(r"\bcubefs_fuse_[A-Za-z0-9_:]*")
# Kubernetes version the manifests are validated against: the newest schema the
# installed kubernetes-validate ships.
K8S_VERSION = kubernetes_validate.utils.latest_version()
# kubelet's default hard eviction threshold: nodefs.available<10%.
KUBELET_NODEFS_EVICTION = 0.10


# -- Grafana dashboard and Prometheus rules vs. the daemon's /metrics --------------------------


def _panels(panels: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    for panel in panels:
        yield panel
        yield from _panels(panel.get("panels", []))  # rows (collapsed ones nest their panels)


def dashboard_queries(dashboard: dict[str, Any]) -> list[tuple[str, str]]:
    """(where, PromQL) of every panel target and every templating query."""
    queries = [(p.get("title", "?"), t["expr"]) for p in _panels(dashboard["panels"])
               for t in p.get("targets", []) if t.get("expr")]
    for var in dashboard.get("templating", {}).get("list", []):
        query = var.get("query")
        if var.get("type") == "query":
            queries.append((f"variable {var['name']}", query["query"] if isinstance(query, dict) else query))
    return queries


def rule_queries() -> list[tuple[str, str]]:
    rules = yaml.safe_load(RULES.read_text())
    return [(rule.get("alert") or rule.get("record"), rule["expr"]) for group in rules["groups"]
            for rule in group["rules"]]


def _base_name(name: str) -> str:
    for suffix in ("_bucket", "_sum", "_count"):
        if name.endswith(suffix) and METRICS.get(name.removesuffix(suffix), None) is not None \
                and METRICS[name.removesuffix(suffix)].kind == "histogram":
            return name.removesuffix(suffix)
    return name


def _exported_names(port: int) -> set[str]:
    """Every sample name on /metrics (counters with _total, histograms as _bucket/_sum/_count)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    return {sample.name for family in text_string_to_metric_families(text) for sample in family.samples}


def test_dashboard_and_alerts_query_only_exported_metrics(make_mount: Callable[..., Mount]) -> None:
    m = make_mount(volName=f"deploy-{uuid.uuid4().hex[:8]}", profile="ai_prefetch", memCacheSize="64MiB")
    rng = np.random.default_rng(3)
    names = [f"d/f{i}" for i in range(8)]
    for name in names + ["gone"]:
        (m.source / name).parent.mkdir(exist_ok=True)
        (m.source / name).write_bytes(rng.bytes(20_000))
    m.mount()
    # Per-job and per-plan series exist once a job registered and a plan arrived.
    client = ControlClient(mounts.registered(str(m.mount_point))["controlSocket"])  # type: ignore[index]
    client.register_job("dash-job", 0, os.getpid())
    dataset = client.register_dataset(names)
    client.submit_plan("dash-job", 0, 0, dataset, np.arange(len(names), dtype="<u4").tobytes(), "<u4")
    for name in names:
        m.path(name).read_bytes()
    # The job's DevicePrefetcher steps, as its cube_torch reports them (the data-wait series).
    client.report_reads("dash-job", 0, len(names), {"steps": 4, "wait_seconds": 0.01, "step_seconds": 0.5,
                                                    "p50_seconds": 0.001, "p99_seconds": 0.008})
    # A backend error (so that cubefs_fuse_backend_errors_total has a sample): the file is
    # listed (attributes cached; a lookup would bring the small file whole, see
    # docs/contracts.md "The lean path"), then removed at the source before it is read.
    assert "gone" in os.listdir(m.mount_point)
    os.stat(m.path("gone"))
    (m.source / "gone").unlink()
    with pytest.raises(OSError):
        m.path("gone").read_bytes()

    # A sample cache (its per-cache series) and a fast-path batch, as cube_torch's workers make them.
    config_dir = m.config().get("configDir", "/tmp")
    channel = Channel(read_volume_config(m.config()["volName"], config_dir).data_socket)
    assert channel.batch(names[:2]) == [m.path(n).read_bytes() for n in names[:2]]
    channel.release([1, 1])
    channel.close()
    store = DaemonStore(m.config()["volName"], config_dir=config_dir)
    store.put_many("dash-samples", [(1, b"x" * 100)])
    assert store.get_many("dash-samples", [1, 2]) == [b"x" * 100, None]
    store.close()

    exported = _exported_names(m.port)
    queries = dashboard_queries(json.loads(DASHBOARD.read_text())) + rule_queries()
    referenced: dict[str, list[str]] = {}
    for where, query in queries:
        for name in METRIC_NAME.findall(query):
            referenced.setdefault(name, []).append(where)
    # The extraction itself works (a broken regex must not make this test vacuous).
    assert len(queries) >= 40 and len(referenced) >= 30, (len(queries), sorted(referenced))
    missing = {name: where for name, where in referenced.items() if name not in exported}
    assert not missing, f"queried but not exported by the daemon: {missing}"
    assert all(_base_name(name) in METRICS for name in referenced)

    # The dashboard covers what operators need (hit rate per job and global, stall,
    # cache use vs limit per tier, backend latency quantiles, lookahead, waste, evictions, errors).
    text = DASHBOARD.read_text()
    for needle in ("cubefs_fuse_job_hits_total", "cubefs_fuse_file_hits_total", "cubefs_fuse_stall_seconds_total",
                   "cubefs_fuse_job_stall_seconds_total", "cubefs_fuse_cache_used_bytes",
                   "cubefs_fuse_cache_limit_bytes", "histogram_quantile(0.99",
                   "cubefs_fuse_backend_latency_seconds_bucket", "cubefs_fuse_plan_lookahead_bytes",
                   "cubefs_fuse_prefetch_wasted_total", "cubefs_fuse_cache_evictions_total",
                   "cubefs_fuse_backend_errors_total", "cubefs_fuse_checksum_failures_total",
                   # what applications read by every path, the fast path and the sample caches
                   "cubefs_fuse_app_requests_total", "cubefs_fuse_app_bytes_total", "cubefs_fuse_fastpath_files_total",
                   "cubefs_fuse_sample_cache_hits_total", "cubefs_fuse_sample_store_used_bytes"):
        assert needle in text, needle
    m.umount()


def test_dashboard_json_structure() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    panels = [p for p in _panels(dashboard["panels"]) if p["type"] != "row"]
    assert len({p["id"] for p in _panels(dashboard["panels"])}) == len(list(_panels(dashboard["panels"])))
    variables = {v["name"] for v in dashboard["templating"]["list"]}
    assert {"datasource", "node", "training_job"} <= variables
    for p in panels:
        assert p["targets"] and p["datasource"]["uid"] == "${datasource}", p["title"]
        assert len({t["refId"] for t in p["targets"]}) == len(p["targets"]), p["title"]
        grid = p["gridPos"]
        assert grid["x"] + grid["w"] <= 24, p["title"]
        for t in p["targets"]:
            # The daemon's per-job label is training_job; Prometheus's own job label is the scrape job.
            assert "exported_job" not in t["expr"] and ' job=~"$training_job"' not in t["expr"], t["expr"]
            assert t["expr"].count("(") == t["expr"].count(")"), t["expr"]


def test_prometheus_scrape_config() -> None:
    config = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    [job] = config["scrape_configs"]
    assert job["job_name"] == "cubefs-fuse" and job["metrics_path"] == "/metrics"
    assert not job.get("honor_labels"), "honor_labels would let the training job replace the scrape job"
    assert config["rule_files"] == [RULES.name]
    assert any(r.get("target_label") == "node" for r in job["relabel_configs"])
    # The node relabelling: a target without a node label is named after its host.
    host_rule, node_rule = job["relabel_configs"][:2]
    host = re.fullmatch(host_rule["regex"], "10.0.0.11:9500")
    assert host is not None and host.group(1) == "10.0.0.11"
    assert re.fullmatch(node_rule["regex"], ";10.0.0.11") and not re.fullmatch(node_rule["regex"], "gpu-01;10.0.0.11")
    # The example target file is valid file_sd JSON, and not picked up as real targets.
    example = DEPLOY / "prometheus" / "targets" / "cubefs-fuse.json.example"
    [pattern] = job["file_sd_configs"][0]["files"]
    assert not list((DEPLOY / "prometheus").glob(pattern))
    for group in json.loads(example.read_text()):
        assert group["targets"] and all(re.fullmatch(r"[\w.-]+:\d+", t) for t in group["targets"])
        assert set(group["labels"]) == {"node", "volume"}
    k8s = yaml.safe_load((DEPLOY / "prometheus" / "kubernetes-scrape.yml").read_text())
    [k8s_job] = k8s["scrape_configs"]
    assert k8s_job["kubernetes_sd_configs"] == [{"role": "pod"}]
    keep = {r["source_labels"][0]: r["regex"] for r in k8s_job["relabel_configs"] if r.get("action") == "keep"}
    daemonset = yaml.safe_load((K8S / "daemonset.yaml").read_text())
    labels = daemonset["spec"]["template"]["metadata"]["labels"]
    assert keep["__meta_kubernetes_pod_label_app_kubernetes_io_name"] == labels["app.kubernetes.io/name"]
    ports = daemonset["spec"]["template"]["spec"]["containers"][0]["ports"]
    assert keep["__meta_kubernetes_pod_container_port_name"] in {p["name"] for p in ports}
    promtool = shutil.which("promtool")
    if promtool:  # present where the prometheus package is installed
        for args in (["check", "config", "prometheus.yml"], ["check", "rules", RULES.name]):
            result = subprocess.run([promtool, *args], capture_output=True, text=True, cwd=DEPLOY / "prometheus")
            assert result.returncode == 0, result.stdout + result.stderr
    print(f"promtool: {'checked' if promtool else 'not installed, YAML checks only'}")


# -- systemd ---------------------------------------------------------------------------------


# File-system namespace options: each gives the service a mount namespace whose mounts do
# not propagate to the host (systemd.exec(5), MountFlags=), so the FUSE mount would be
# invisible outside the daemon.  The unit must use none of them.
NAMESPACE_OPTIONS = ("PrivateTmp", "PrivateDevices", "PrivateMounts", "ProtectSystem", "ProtectHome",
                     "ReadWritePaths", "ReadOnlyPaths", "InaccessiblePaths", "TemporaryFileSystem",
                     "BindPaths", "BindReadOnlyPaths", "ProtectKernelTunables", "ProtectKernelModules",
                     "ProtectKernelLogs", "ProtectControlGroups", "ProtectProc", "ProcSubset", "MountAPIVFS",
                     "RootDirectory", "RootImage", "DynamicUser", "PrivateNetwork", "PrivateUsers", "MountFlags",
                     "LogsDirectory", "CacheDirectory", "RuntimeDirectory", "StateDirectory", "ConfigurationDirectory")
BINARY = "/opt/cubefs-fuse/bin/cubefs-fuse"  # the venv of the walkthrough in docs/operations.md


def test_systemd_unit_keys() -> None:
    unit = parse_unit(UNIT.read_text())
    assert set(unit) == {"Unit", "Service", "Install"}
    after = " ".join(unit["Unit"]["After"]).split()
    assert {"network-online.target", "remote-fs.target"} <= set(after)
    assert "network-online.target" in " ".join(unit["Unit"].get("Wants", []))
    service = {k: v[-1] for k, v in unit["Service"].items()}
    start = unit_command(service["ExecStart"], {})
    assert start[1:] == ["mount", "-c", "/etc/cubefs-fuse/%i.json", "--foreground"]
    stop = unit_command(service["ExecStop"], {})
    assert stop[1:3] == ["umount", "-c"] and stop[3] == "/etc/cubefs-fuse/%i.json"
    assert start[0] == stop[0] == BINARY
    assert service["Restart"] == "on-failure" and service["KillSignal"] == "SIGTERM"
    # Readiness: the daemon notifies systemd once the mount is live (sdnotify.py).
    assert service["Type"] == "notify"
    # Reload: a new daemon takes the mount over and names itself the main process.
    assert unit_command(service["ExecReload"], {})[1:] == ["upgrade", "-c", "/etc/cubefs-fuse/%i.json"]
    assert service["NotifyAccess"] == "all"
    assert service["OOMPolicy"] == "continue"  # the keeper recovers an OOM-killed daemon: the unit must not stop
    assert "2" in service["RestartPreventExitStatus"].split()  # config errors do not loop
    assert int(service["TimeoutStopSec"]) > 60  # above umount's --timeout 60
    assert unit["Install"]["WantedBy"] == ["multi-user.target"]
    # Hardening that keeps the mount visible and FUSE working.
    assert not set(NAMESPACE_OPTIONS) & set(service), set(NAMESPACE_OPTIONS) & set(service)
    assert service.get("User", "root") == "root"  # mount(2) and /run/cubefs-fuse
    assert set(service["CapabilityBoundingSet"].split()) == {"CAP_SYS_ADMIN", "CAP_DAC_READ_SEARCH"}
    assert service["NoNewPrivileges"] == "yes"
    assert service["DevicePolicy"] == "closed" and service["DeviceAllow"] == "/dev/fuse rw"
    allowed = " ".join(unit["Service"]["SystemCallFilter"])
    assert "@mount" in allowed and "@system-service" in allowed
    assert service["SystemCallErrorNumber"] == "EPERM"  # a missed call fails, it does not kill
    assert service["UMask"] == "0022"  # /run/cubefs-fuse and the per-volume file stay readable
    # Memory sized from the default RAM tiers, the block cache's and the sample store's, plus
    # 2 GiB for the rest (drop-ins for others: docs/operations.md).
    defaults = parse_config({"mountPoint": "/m", "volName": "v", "source": "/s"})
    tiers = defaults.mem_cache_size + defaults.sample_cache_mem_size
    high, limit = _systemd_size(service["MemoryHigh"]), _systemd_size(service["MemoryMax"])
    assert limit == tiers + 2 * 2**30 and tiers < high < limit, (tiers, high, limit)
    # The arithmetic in the unit's comment names what it adds up.
    assert "sampleCacheMemSize" in UNIT.read_text()
    assert -1000 < int(service["OOMScoreAdjust"]) <= -500  # training (0) is killed first
    assert service["SyslogIdentifier"] == "cubefs-fuse-%i"


def _systemd_size(value: str) -> int:
    """A systemd size (K, M, G, T: powers of 1024) in bytes."""
    units = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
    match = re.fullmatch(r"(\d+)([KMGT]?)", value)
    assert match, value
    return int(match.group(1)) * units[match.group(2)]


def test_systemd_analyze_security(tmp_path: Path) -> None:
    """The hardening is rated "OK" or better: exposure <= 6.9 ("MEDIUM" ends there)."""
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze not installed (apt install systemd)")

    def exposure(text: str, tmp: Path) -> float:
        path = tmp / "cubefs-fuse@imagenet.service"
        path.write_text(text)
        result = subprocess.run([analyze, "security", "--offline=true", "--no-pager", str(path)],
                                capture_output=True, text=True, timeout=60)
        found = re.search(r"Overall exposure level for \S+: (\d+\.\d)", result.stdout + result.stderr)
        assert found, result.stdout + result.stderr
        return float(found.group(1))

    text = UNIT.read_text()
    rated = exposure(text, tmp_path)
    # The check can fail: the unit without its hardening section rates UNSAFE.
    bare = exposure(text[:text.index("# -- Hardening")] + "\n[Install]\nWantedBy=multi-user.target\n", tmp_path)
    assert rated <= 6.9 and bare > 9.0, (rated, bare)
    print(f"systemd-analyze security: {rated} (without hardening {bare})")


def test_systemd_analyze_verify(tmp_path: Path) -> None:
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        print("systemd-analyze: not installed; test_systemd_unit_keys and the ExecStart/ExecStop run cover the unit")
        return
    binary = shutil.which("cubefs-fuse", path=str(Path(sys.executable).parent))
    assert binary, "cubefs-fuse console script not installed in the venv"
    text = UNIT.read_text().replace(BINARY, binary)
    for name in ("cubefs-fuse@.service", "cubefs-fuse@imagenet.service"):
        (tmp_path / name).write_text(text)
        result = subprocess.run([analyze, "verify", "--man=no", str(tmp_path / name)], capture_output=True,
                                text=True, timeout=60)
        # verify only warns about unknown keys or bad values: any output is a failure.
        assert result.returncode == 0 and not result.stderr.strip() and not result.stdout.strip(), result.stderr
    broken = tmp_path / "broken@x.service"
    broken.write_text(text.replace("KillSignal=SIGTERM", "KillSignal=SIGTERM\nRestartt=always"))
    result = subprocess.run([analyze, "verify", "--man=no", str(broken)], capture_output=True, text=True, timeout=60)
    assert "Restartt" in result.stderr  # the check above can fail
    print("systemd-analyze verify: ran")


def test_systemd_exec_start_reload_and_stop_commands(make_mount: Callable[..., Mount], tmp_path: Path) -> None:
    """Runs the unit's ExecStart as systemd would (instance 'vol', $NOTIFY_SOCKET set): READY=1
    arrives only once the mount is live; then ExecReload: the keeper (the main process)
    starts a new daemon, which says READY=1 once the old one has handed it the mount (never
    STOPPING=1; the main process stays); then ExecStop, or the KillSignal: both unmount
    cleanly, STOPPING=1 arrives and the keeper exits."""
    m = make_mount(volName=f"unit-{uuid.uuid4().hex[:8]}")
    (m.source / "file").write_bytes(b"x" * 1000)
    etc = tmp_path / "etc"
    etc.mkdir()
    (etc / "vol.json").write_text(json.dumps(m.config()))
    binary = str(Path(sys.executable).parent / "cubefs-fuse")
    service = {k: v[-1] for k, v in parse_unit(UNIT.read_text())["Service"].items()}
    subs = {"%i": "vol", "/etc/cubefs-fuse/": f"{etc}/", BINARY: binary}
    start, stop = unit_command(service["ExecStart"], subs), unit_command(service["ExecStop"], subs)
    reload = unit_command(service["ExecReload"], subs)
    for how, kind in (("ExecStop", "path"), ("KillSignal", "abstract")):
        sock, address = notify_socket(kind, tmp_path)
        daemon = subprocess.Popen(start, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                  env={**os.environ, "NOTIFY_SOCKET": address})
        try:
            ready = next_notification(sock, daemon, timeout=60)
            # READY=1 means live: the mount is in the kernel's table and serves reads now.
            assert ready["READY"] == "1" and str(m.mount_point) in ready["STATUS"], ready
            assert mounts.find_mount(str(m.mount_point)) is not None
            assert m.path("file").read_bytes() == b"x" * 1000
            if how == "ExecStop":
                first = m.pid()
                result = subprocess.run(reload, capture_output=True, text=True, timeout=120,
                                        env={**os.environ, "NOTIFY_SOCKET": address})
                assert result.returncode == 0 and "upgraded" in result.stdout, result.stderr
                notes = _notifications_until(sock, "READY", timeout=60)
                # The main process is the keeper, before and after: no MAINPID= to send.
                assert not any("MAINPID" in n for n in notes), notes
                assert not any("STOPPING" in n for n in notes), notes  # the service never stopped
                assert mounts.wait_for_exit(first, timeout=30)  # the old daemon exits once the new one serves
                new = m.pid()
                assert new != first and daemon.poll() is None
                assert mounts.registered(str(m.mount_point))["keeper"] == daemon.pid  # type: ignore[index]
                assert m.path("file").read_bytes() == b"x" * 1000
                result = subprocess.run(stop, capture_output=True, text=True, timeout=120)
                assert result.returncode == 0, result.stderr
                assert f"unmounted {m.mount_point}" in result.stdout
                assert _notifications_until(sock, "STOPPING", timeout=60)[-1]["STOPPING"] == "1"
                assert mounts.wait_for_exit(new, timeout=90)
                assert daemon.wait(timeout=30) == 0  # the keeper ends with the mount
            else:
                daemon.send_signal(getattr(signal, service["KillSignal"]))
                stopping = next_notification(sock, daemon, timeout=60)
                assert stopping["STOPPING"] == "1", stopping
                assert daemon.wait(timeout=90) == 0
            assert mounts.find_mount(str(m.mount_point)) is None
            assert mounts.registered(str(m.mount_point)) is None
        finally:
            sock.close()
            if daemon.poll() is None:
                subprocess.run(["fusermount3", "-u", "-z", str(m.mount_point)], capture_output=True)
                daemon.kill()
                daemon.wait()
            if daemon.stderr is not None:
                daemon.stderr.close()  # read by next_notification only if the daemon died


def _notifications_until(sock: socket.socket, key: str, timeout: float) -> list[dict[str, str]]:
    """sd_notify datagrams, whichever process sent them, up to the first carrying ``key``."""
    deadline = time.monotonic() + timeout
    notes: list[dict[str, str]] = []
    while time.monotonic() < deadline:
        if select.select([sock], [], [], 0.2)[0]:
            notes.append(dict(line.partition("=")[::2] for line in sock.recv(4096).decode().splitlines()))
            if key in notes[-1]:
                return notes
    raise AssertionError(f"no {key}= within {timeout} s: {notes}")


def _syscall_group(analyze: str, name: str, seen: dict[str, set[str]]) -> set[str]:
    """Every system call of a systemd syscall-filter group, nested groups expanded."""
    if name not in seen:
        seen[name] = set()
        out = subprocess.run([analyze, "syscall-filter", "--no-pager", name], capture_output=True, text=True,
                             timeout=60, check=True).stdout
        for line in out.splitlines()[1:]:
            item = line.strip()
            if not item or item.startswith("#"):
                continue
            seen[name] |= _syscall_group(analyze, item, seen) if item.startswith("@") else {item}
    return seen[name]


def test_systemd_syscall_filter_allows_what_the_daemon_calls(make_mount: Callable[..., Mount],
                                                              tmp_path: Path) -> None:
    """The daemon under strace, through a whole life (mount, reads, listing, metrics, the
    control API, SIGTERM, unmount, index write): every system call it made is one the
    unit's SystemCallFilter allows.  (A missed one would fail with EPERM under systemd.)"""
    analyze, strace = shutil.which("systemd-analyze"), shutil.which("strace")
    if analyze is None or strace is None:
        pytest.skip("needs systemd-analyze and strace (scripts/setup.sh installs strace)")
    seen: dict[str, set[str]] = {}
    allowed: set[str] = set()
    denied: set[str] = set()
    for value in parse_unit(UNIT.read_text())["Service"]["SystemCallFilter"]:
        deny = value.startswith("~")
        names = set().union(*(_syscall_group(analyze, n, seen) if n.startswith("@") else {n}
                              for n in value.lstrip("~").split()))
        (denied if deny else allowed).update(names)
    allowed -= denied
    assert {"mount", "umount2", "read", "openat"} <= allowed and "reboot" not in allowed

    m = make_mount(volName=f"sc-{uuid.uuid4().hex[:8]}", profile="ai_prefetch")
    for i in range(4):
        (m.source / f"f{i}").write_bytes(bytes([i]) * 300_000)
    (etc := tmp_path / "etc").mkdir()
    (etc / "vol.json").write_text(json.dumps(m.config()))
    trace = tmp_path / "strace.out"
    sock, address = notify_socket("path", tmp_path)
    daemon = subprocess.Popen([strace, "-f", "-qq", "-c", "-U", "name", "-o", str(trace),
                               str(Path(sys.executable).parent / "cubefs-fuse"), "mount", "-c", str(etc / "vol.json"),
                               "--foreground"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                              env={**os.environ, "NOTIFY_SOCKET": address})
    try:
        assert next_notification(sock, daemon, timeout=120)["READY"] == "1"
        assert sorted(os.listdir(m.mount_point)) == [f"f{i}" for i in range(4)]
        for i in range(4):
            assert m.path(f"f{i}").read_bytes() == bytes([i]) * 300_000
        assert _exported_names(m.port)
        client = ControlClient(mounts.registered(str(m.mount_point))["controlSocket"])  # type: ignore[index]
        client.register_job("sc-job", 0, os.getpid())
        # The unit's ExecStop (cubefs-fuse umount, which runs fusermount3) runs under the
        # same filter: traced too.
        service = {k: v[-1] for k, v in parse_unit(UNIT.read_text())["Service"].items()}
        stop = unit_command(service["ExecStop"], {"%i": "vol", "/etc/cubefs-fuse/": f"{etc}/",
                                                  BINARY: str(Path(sys.executable).parent / "cubefs-fuse")})
        result = subprocess.run([strace, "-f", "-qq", "-c", "-U", "name", "-o", str(tmp_path / "stop.out"), *stop],
                                capture_output=True, text=True, timeout=120)
        assert result.returncode == 0, result.stderr
        assert daemon.wait(timeout=90) == 0
    finally:
        sock.close()
        if daemon.poll() is None:
            subprocess.run(["fusermount3", "-u", "-z", str(m.mount_point)], capture_output=True)
            daemon.kill()
            daemon.wait()
        if daemon.stderr is not None:
            daemon.stderr.close()  # read by next_notification only if the daemon died

    def traced(path: Path) -> set[str]:
        return {line.split()[-1] for line in path.read_text().splitlines()
                if line.strip() and not line.startswith(("-", "syscall")) and line.split()[-1] != "total"}

    called, stopping = traced(trace), traced(tmp_path / "stop.out")
    # The traces themselves worked (this test cannot pass on an empty trace).
    assert {"mount", "read", "openat"} <= called and len(called) > 30, sorted(called)
    assert {"umount2", "execve"} <= stopping, sorted(stopping)  # fusermount3 unmounted
    called |= stopping
    assert called - allowed == set(), f"called but not allowed by SystemCallFilter: {sorted(called - allowed)}"
    print(f"syscall filter: {len(called)} distinct calls made, all allowed")


def test_logrotate_rotates_a_live_daemons_log(make_mount: Callable[..., Mount], tmp_path: Path) -> None:
    """deploy/logrotate/cubefs-fuse, run by the real logrotate on a live daemon's log: the
    file is moved away and the daemon's next lines go to a fresh <volName>.log."""
    logrotate = shutil.which("logrotate") or shutil.which("logrotate", path="/usr/sbin:/sbin")
    if logrotate is None:
        pytest.skip("logrotate not installed (scripts/setup.sh installs it)")
    text = (DEPLOY / "logrotate" / "cubefs-fuse").read_text()
    assert "/var/log/cubefs-fuse/*.log {" in text and "\n    copytruncate" not in text
    m = make_mount(volName=f"rot-{uuid.uuid4().hex[:8]}")
    (m.source / "file").write_bytes(b"y" * 100)
    m.mount()
    log_dir = m.base / "log"
    live = log_dir / f"{m.config()['volName']}.log"
    assert "mounted" in live.read_text()
    config = tmp_path / "cubefs-fuse"
    config.write_text(text.replace("/var/log/cubefs-fuse/*.log", f"{log_dir}/*.log"))
    config.chmod(0o644)  # logrotate ignores group/world-writable configs
    result = subprocess.run([logrotate, "--force", "--state", str(tmp_path / "state"), str(config)],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    rotated = log_dir / f"{live.name}.1"
    assert "mounted" in rotated.read_text() and live.read_text() == ""  # "create": a fresh file
    m.umount()  # the daemon logs "unmounted ..." after the rotation
    assert f"unmounted {m.mount_point}" in live.read_text(), live.read_text()
    assert "unmounted" not in rotated.read_text()


# -- Kubernetes ------------------------------------------------------------------------------


def _manifests() -> dict[str, dict[str, Any]]:
    docs: dict[str, dict[str, Any]] = {}
    for path in sorted(K8S.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc:
                docs[f"{doc['kind']}/{doc['metadata']['name']}"] = doc
    return docs


def test_k8s_manifests_pass_schema_validation() -> None:
    docs = _manifests()
    assert {"Namespace", "ConfigMap", "DaemonSet", "Pod"} <= {d["kind"] for d in docs.values()}
    for name, doc in docs.items():
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
    # The validator rejects what a cluster would (so passing above means something).
    daemonset = next(d for d in docs.values() if d["kind"] == "DaemonSet")
    broken = json.loads(json.dumps(daemonset))
    broken["spec"]["template"]["spec"]["containers"][0]["volumeMount"] = []  # typo of volumeMounts
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, K8S_VERSION, strict=True)
    print(f"kubernetes-validate: {len(docs)} manifests valid for Kubernetes {K8S_VERSION}")


def _mount_of(container: dict[str, Any], path: str) -> dict[str, Any]:
    """The volumeMount of ``container`` under which ``path`` lies (the deepest one)."""
    found = [vm for vm in container["volumeMounts"]
             if path == vm["mountPath"] or path.startswith(vm["mountPath"].rstrip("/") + "/")]
    assert found, f"{path} is on no volume of {container['name']}"
    return max(found, key=lambda vm: len(vm["mountPath"]))


def test_k8s_daemonset_matches_the_client_config() -> None:
    docs = _manifests()
    configmap = next(d for d in docs.values() if d["kind"] == "ConfigMap")
    daemonset = next(d for d in docs.values() if d["kind"] == "DaemonSet")
    pod = next(d for d in docs.values() if d["kind"] == "Pod")
    [(file_name, raw)] = configmap["data"].items()
    config = parse_config(json.loads(raw))  # the daemon's own parser: valid keys, types and sizes
    assert config.profile == "ai_prefetch" and not config.unused_keys

    spec = daemonset["spec"]["template"]["spec"]
    [container] = spec["containers"]
    volumes = {v["name"]: v for v in spec["volumes"]}
    assert container["securityContext"]["privileged"] is True
    assert spec["hostPID"] is True  # FUSE request pids must be comparable with /proc (per-job stats)
    # The config file is the ConfigMap's key, mounted where the command reads it.
    command = " ".join(container["command"])
    config_mount = _mount_of(container, "/etc/cubefs-fuse")
    assert volumes[config_mount["name"]]["configMap"]["name"] == configmap["metadata"]["name"]
    assert f"cubefs-fuse mount -c {config_mount['mountPath']}/{file_name} --foreground" in command
    assert f"mkdir -p {config.mount_point};" in command and "exec cubefs-fuse" in command
    assert volumes[_mount_of(container, "/dev/fuse")["name"]]["hostPath"]["path"] == "/dev/fuse"
    # Every path of the config lies on the right kind of hostPath.
    mnt = _mount_of(container, config.mount_point)
    assert mnt["mountPropagation"] == "Bidirectional" and "hostPath" in volumes[mnt["name"]]
    assert _mount_of(container, config.source).get("mountPropagation") == "HostToContainer"
    cache = volumes[_mount_of(container, config.cache_dir)["name"]]
    assert "hostPath" in cache and "nvme" in cache["hostPath"]["path"]
    socket_dir = _mount_of(container, config.control_socket)
    assert volumes[socket_dir["name"]]["hostPath"]["path"] == "/run/cubefs-fuse"
    volconfig = _mount_of(container, config.config_dir)
    assert volconfig is socket_dir or volconfig["name"] == socket_dir["name"]  # one shared runtime directory
    assert not any(m["mountPath"] == "/tmp" for m in container["volumeMounts"])
    assert {"name": "metrics", "containerPort": config.exporter_port, "protocol": "TCP"} in container["ports"]
    assert config.exporter_addr == "0.0.0.0"  # reachable by Prometheus on the pod IP
    # Resources: the memory limit is both RAM tiers (the block cache's and the sample
    # store's) plus the documented overhead; Kubernetes' Gi is the config's Gi.
    overhead = parse_size("overhead", daemonset["spec"]["template"]["metadata"]["annotations"]
                          ["cubefs-fuse/memory-overhead"])
    limit = parse_size("limit", container["resources"]["limits"]["memory"])
    assert limit == config.mem_cache_size + config.sample_cache_mem_size + overhead, (
        limit, config.mem_cache_size, config.sample_cache_mem_size, overhead)
    assert overhead >= 512 * 2**20
    assert container["resources"]["requests"]["memory"] == container["resources"]["limits"]["memory"]
    # Probes check the mount (test_k8s_probe_checks_the_mount runs them), a clean unmount
    # before the pod stops.
    for probe in ("livenessProbe", "startupProbe"):
        command = container[probe]["exec"]["command"]
        assert command[:2] == ["sh", "-c"] and config.mount_point in command[2] and "cubefs-fuse" not in command[2]
    assert container["startupProbe"]["periodSeconds"] * container["startupProbe"]["failureThreshold"] >= 300
    # Updates wait for a deliberate pod deletion (the drain procedure in deploy/README.md).
    assert daemonset["spec"]["updateStrategy"] == {"type": "OnDelete"}
    assert "OnDelete" in (DEPLOY / "README.md").read_text()
    # The cache directory must already exist: a missing NVMe mount fails the pod instead
    # of filling the root disk; the free-space floor stays above kubelet's eviction line.
    assert cache["hostPath"]["type"] == "Directory"
    assert round(config.disk_free_ratio - KUBELET_NODEFS_EVICTION, 6) >= 0.05, config.disk_free_ratio  # a margin
    pre_stop = " ".join(container["lifecycle"]["preStop"]["exec"]["command"])
    assert f"cubefs-fuse umount {config.mount_point}" in pre_stop
    assert daemonset["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] > 60

    # The training pod sees the same paths, with the mount propagated from the host.
    [train] = pod["spec"]["containers"]
    pod_volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    data = _mount_of(train, config.mount_point)
    assert data["mountPropagation"] == "HostToContainer" and data["mountPath"] == mnt["mountPath"]
    assert pod_volumes[data["name"]]["hostPath"]["path"] == volumes[mnt["name"]]["hostPath"]["path"]
    for path, daemon_mount in ((config.control_socket, socket_dir), (config.config_dir, volconfig)):
        pod_mount = _mount_of(train, path)
        assert pod_mount["mountPath"] == daemon_mount["mountPath"]
        assert pod_volumes[pod_mount["name"]]["hostPath"]["path"] == volumes[daemon_mount["name"]]["hostPath"]["path"]
    env = {e["name"]: e.get("value") for e in train["env"]}
    assert env["VOL_NAME"] == config.vol_name
    # cube_torch looks where the daemon writes the per-volume file, and the pod keeps its
    # own writable /tmp (a hostPath owned by root would not be writable for uid 1000).
    assert env["CUBE_TORCH_CONFIG_DIR"] == config.config_dir
    assert not any(m["mountPath"] == "/tmp" for m in train["volumeMounts"])
    assert pod["spec"]["securityContext"]["runAsNonRoot"] is True
    run_as = pod["spec"].get("securityContext", {}).get("runAsUser", 0)
    assert run_as == 0 or run_as in config.control_allow_uids  # else the control API refuses it
    assert pod["spec"]["nodeSelector"] == spec["nodeSelector"]


# A size as the manifests write it: Kubernetes quantities only (the client config reads them too).
K8S_SIZE = re.compile(r"[0-9]+(?:\.[0-9]+)?(?:Ki|Mi|Gi|Ti)")
# Any size-like token, to catch a second notation in values and comments alike ("8GiB", "10G").
ANY_SIZE = re.compile(r"\b[0-9.]+ ?(?:[KMGT]i?B?|[KMGT]i)\b")


def test_k8s_manifests_write_sizes_in_one_notation() -> None:
    docs = _manifests()
    configmap = next(d for d in docs.values() if d["kind"] == "ConfigMap")
    raw = json.loads(next(iter(configmap["data"].values())))
    sizes = {key: value for key, value in raw.items() if key.endswith("Size")}
    assert sizes and all(isinstance(v, str) and K8S_SIZE.fullmatch(v) for v in sizes.values()), sizes
    daemonset = next(d for d in docs.values() if d["kind"] == "DaemonSet")
    [container] = daemonset["spec"]["template"]["spec"]["containers"]
    for kind in ("requests", "limits"):
        assert K8S_SIZE.fullmatch(container["resources"][kind]["memory"]), container["resources"]
    for path in sorted(K8S.glob("*.yaml")):
        for token in ANY_SIZE.findall(path.read_text()):
            assert K8S_SIZE.fullmatch(token.replace(" ", "")), f"{path.name}: {token!r} is not a Kubernetes quantity"


# A reference to a section of a document in a deploy/ comment: FILE, "Section" (the
# comment may wrap between the two, or inside the section's name).
SECTION_REFERENCE = re.compile(r"((?:docs|deploy)/[A-Za-z0-9_./-]+\.md),\s+\"([^\"]+)\"")


def _comments(path: Path) -> str:
    """The comment text of a YAML, unit or Containerfile, joined into one line."""
    lines = [line.split("#", 1)[1].strip() for line in path.read_text().splitlines() if "#" in line]
    return " ".join(lines)


def test_deploy_comments_point_to_what_exists() -> None:
    """Every "FILE, "Section"" a deploy/ comment names is a heading of that file, and the
    per-volume file's path named in the manifests is where the config's configDir puts it."""
    references = []
    for path in sorted(p for p in DEPLOY.rglob("*") if p.is_file() and p.suffix not in (".json", ".md")):
        for document, section in SECTION_REFERENCE.findall(_comments(path)):
            references.append((path.name, document, section))
            headings = [line.lstrip("#").strip() for line in (REPO / document).read_text().splitlines()
                        if line.startswith("#")]
            assert section in headings, f"{path.name} names {document}, {section!r}, which has no such heading"
    assert len(references) >= 3, references
    docs = _manifests()
    config = parse_config(json.loads(next(iter(docs["ConfigMap/cubefs-fuse-imagenet"]["data"].values()))))
    named = set()
    for path in sorted(K8S.glob("*.yaml")):
        named |= set(re.findall(r"/[A-Za-z0-9_/.-]*cube_torch\.config\.[A-Za-z0-9_.-]+", _comments(path)))
    assert named == {os.path.join(config.config_dir, f"cube_torch.config.{config.vol_name}")}, named


def _probe(name: str, mount_point: Path) -> list[str]:
    """The DaemonSet's probe command, for ``mount_point`` instead of the config's."""
    docs = _manifests()
    config = parse_config(json.loads(next(iter(docs["ConfigMap/cubefs-fuse-imagenet"]["data"].values()))))
    [container] = docs["DaemonSet/cubefs-fuse-imagenet"]["spec"]["template"]["spec"]["containers"]
    return [arg.replace(config.mount_point, str(mount_point)) for arg in container[name]["exec"]["command"]]


def test_k8s_probe_checks_the_mount(make_mount: Callable[..., Mount]) -> None:
    """The probes pass on a live mount and fail on a dead daemon's (ENOTCONN) and on a
    lazily detached one (a plain directory is left); without the control API at all."""
    m = make_mount(volName=f"probe-{uuid.uuid4().hex[:8]}")  # no ai_prefetch: no control API
    (m.source / "file").write_bytes(b"z")
    for name in ("startupProbe", "livenessProbe"):
        probe = _probe(name, m.mount_point)

        def run() -> int:
            return subprocess.run(probe, capture_output=True, timeout=30).returncode

        assert run() != 0  # not mounted yet: a plain directory
        m.mount()
        assert run() == 0
        kill_for_good(mounts.registered(str(m.mount_point)) or {})
        wait_until(lambda: mounts.is_stale(str(m.mount_point)), timeout=30, what="a stale mount")
        assert run() != 0
        # Detached as an operator would (docs/operations.md, "Stale mount"), which also
        # removes the files the killed daemon left.
        assert cli("umount", "--lazy", str(m.mount_point)).returncode == 0
        m.mounted = False
        assert run() != 0
