"""The C extensions under AddressSanitizer and UndefinedBehaviorSanitizer: the FUSE session
(fs/_session.c) and the tiers' block index (cache/_index.c).

The extensions are built a second time with ``CUBEFS_FUSE_SANITIZE=1`` into a copy of the
package, and a real daemon runs it (the sanitizer runtimes preloaded, since the Python
interpreter itself is not instrumented) while readers on several threads list, stat,
read, readlink, statfs and try to write through the mount, with the kernel's caches
dropped under them, and the mount's FORGETs, published entries, a handover to a second
daemon (``cubefs-fuse upgrade``), a SIGKILL and the standby's recovery, and the unmount
run their course; and the block index's unit tests (random churn against a reference
model, table growth and deletion, values' references) run against the sanitized index.
Any report of either sanitizer fails the test.
"""

from __future__ import annotations

import errno
import json
import os
import random
import shutil
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path

from tests.helpers import REPO, Mount, cli, kill_daemon, metric, wait_until

READERS = 8
FILES = 60


def _runtime(name: str) -> str:
    path = subprocess.run(["gcc", f"-print-file-name={name}"], capture_output=True, text=True,
                          check=True).stdout.strip()
    assert os.path.isabs(path), f"gcc has no {name} (Debian: libgcc-12-dev ships it): {path!r}"
    return path


def _sanitized_package(tmp: Path) -> Path:
    """A copy of the package whose extensions are built with ASan and UBSan."""
    pkg = tmp / "pkg"
    shutil.copytree(REPO / "cubefs_fuse", pkg / "cubefs_fuse",
                    ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    subprocess.run([sys.executable, "setup.py", "-q", "build_ext", "--build-lib", str(pkg),
                    "--build-temp", str(tmp / "build")], cwd=REPO, check=True, capture_output=True,
                   env={**os.environ, "CUBEFS_FUSE_SANITIZE": "1"})
    assert list((pkg / "cubefs_fuse" / "fs").glob("_session.*.so")), "the sanitized build made no session"
    assert list((pkg / "cubefs_fuse" / "cache").glob("_index.*.so")), "the sanitized build made no index"
    return pkg


def _sanitized_env(pkg: Path, reports: Path) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(pkg),
            "LD_PRELOAD": f"{_runtime('libasan.so')}:{_runtime('libubsan.so')}",
            # CPython frees not everything at exit: leaks are not what this test looks for.
            "ASAN_OPTIONS": f"detect_leaks=0:log_path={reports}/asan",
            "UBSAN_OPTIONS": f"print_stacktrace=1:halt_on_error=1:log_path={reports}/ubsan"}


def _reports(folder: Path) -> str:
    return "\n".join(f"{p.name}:\n{p.read_text(errors='replace')[:4000]}" for p in sorted(folder.iterdir()))


def _drop_caches(what: str) -> None:
    os.sync()
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write(what)


def _workload(m: Mount, names: list[str], contents: dict[str, bytes], seed: int, problems: list[str]) -> None:
    rng = random.Random(seed)
    try:
        for round_ in range(3):
            if seed == 0:
                # Pages (READs reach the daemon), and from the second round the kernel's
                # entries and inodes too (LOOKUPs, some answered from published entries).
                _drop_caches("3" if round_ else "1")
            for dirpath, _dirs, files in os.walk(m.mount_point):
                for name in files:
                    os.stat(os.path.join(dirpath, name))
            for rel in rng.sample(names, len(names) // 2):
                with open(m.path(rel), "rb") as f:  # Python's open(): an IOCTL (isatty) too
                    if f.read() != contents[rel]:
                        problems.append(f"{rel}: wrong bytes")
                fd = os.open(m.path(rel), os.O_RDONLY | (os.O_DIRECT if seed % 2 else 0))
                try:
                    off = rng.randrange(0, len(contents[rel]))
                    if os.pread(fd, 4096, off) != contents[rel][off:off + 4096]:
                        problems.append(f"{rel}: wrong pread at {off}")
                finally:
                    os.close(fd)
            assert os.readlink(m.path("link")) == "d0/f0"
            os.statvfs(m.mount_point)
            try:
                os.open(m.path("d0/new"), os.O_WRONLY | os.O_CREAT, 0o644)
                problems.append("a create succeeded on a read-only mount")
            except OSError as exc:
                if exc.errno != errno.EROFS:
                    problems.append(f"create: {exc}")
    except Exception as exc:  # noqa: BLE001 - reported by the test, with the thread's seed
        problems.append(f"reader {seed}: {exc!r}")


def _readers(m: Mount, contents: dict[str, bytes]) -> None:
    """READERS threads, each its own workload, all at once; none may hang or find a problem."""
    problems: list[str] = []
    threads = [threading.Thread(target=_workload, args=(m, sorted(contents), contents, seed, problems))
               for seed in range(READERS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=240)
    assert not any(t.is_alive() for t in threads), "a reader hung"
    assert not problems, problems[:10]


def test_the_session_runs_clean_under_address_and_undefined_behaviour_sanitizers(
        tmp_path: Path, make_mount: Callable[..., Mount]) -> None:
    # Files of one and two blocks and a RAM tier holding a few of them: READs are served by
    # the session from lent RAM blocks and from NVMe entries (whole blocks of two-block files
    # too), and by Python (cold, and parts of a two-block file's block).
    m = make_mount(blockSize="256KiB", memCacheSize="1MiB", diskCacheSize="64MiB")
    contents: dict[str, bytes] = {}
    rng = random.Random(7)
    for i in range(FILES):
        rel = f"d{i % 4}/f{i}"
        (m.source / rel).parent.mkdir(exist_ok=True)
        contents[rel] = rng.randbytes(rng.randint(1, 300_000))
        (m.source / rel).write_bytes(contents[rel])
    os.symlink("d0/f0", m.source / "link")
    pkg = _sanitized_package(tmp_path)
    reports = tmp_path / "reports"
    reports.mkdir()
    env = _sanitized_env(pkg, reports)
    m.config_path.write_text(json.dumps(m.config()))
    result = subprocess.run([sys.executable, "-m", "cubefs_fuse", "mount", "-c", str(m.config_path)],
                            capture_output=True, text=True, timeout=120, env=env, cwd=REPO)
    assert result.returncode == 0, f"mount failed: {result.stderr}\n{_reports(reports)}\n{m.log()}"
    m.mounted = True
    maps = Path(f"/proc/{m.pid()}/maps").read_text()
    assert "libasan" in maps and str(pkg / "cubefs_fuse" / "fs") in maps, "the daemon does not run the sanitized session"
    assert str(pkg / "cubefs_fuse" / "cache") in maps, "the daemon does not run the sanitized block index"
    _readers(m, contents)
    # The kernel's entries dropped twice under one reader that looks every name up: the
    # second time, each LOOKUP is answered from the entry the first (or the readers) published.
    for _ in range(2):
        _drop_caches("3")
        for rel in sorted(contents):
            assert os.stat(m.path(rel)).st_size == len(contents[rel])
    samples = m.scrape()
    assert metric(samples, "cubefs_fuse_native_reads_total") > 0, "the session served no READ itself"
    assert metric(samples, "cubefs_fuse_native_lookups_total") > 0, "the session answered no LOOKUP itself"
    # A handover under the sanitizers too (pause, detach; the new daemon's adoption, its
    # replayed INIT), then every reader's workload through the daemon that took the mount
    # over, and its unmount of a mount it did not make.
    old = m.pid()
    standbys = m.log().count("standby daemon pid")
    result = subprocess.run([sys.executable, "-m", "cubefs_fuse", "upgrade", str(m.mount_point)],
                            capture_output=True, text=True, timeout=120, env=env, cwd=REPO)
    assert result.returncode == 0, f"upgrade failed: {result.stderr}\n{_reports(reports)}\n{m.log()}"
    assert m.pid() != old and "libasan" in Path(f"/proc/{m.pid()}/maps").read_text()
    _readers(m, contents)
    # A crash under the sanitizers too: the standby adopts the dead daemon's connection and
    # has the kernel resend what it had read; every reader's workload through it.
    old = m.pid()
    wait_until(lambda: m.log().count("standby daemon pid") > standbys, 60, "the standby that follows the upgrade")
    kill_daemon(m)
    assert "libasan" in Path(f"/proc/{m.pid()}/maps").read_text()
    _readers(m, contents)
    assert cli("umount", str(m.mount_point)).returncode == 0, m.log()
    m.mounted = False
    assert not _reports(reports), _reports(reports)
    assert "runtime error" not in m.log() and "AddressSanitizer" not in m.log(), m.log()[-4000:]


def test_the_block_index_runs_clean_under_address_and_undefined_behaviour_sanitizers(tmp_path: Path) -> None:
    pkg = _sanitized_package(tmp_path)
    reports = tmp_path / "reports"
    reports.mkdir()
    env = _sanitized_env(pkg, reports)
    env["PYTHONPATH"] = f"{pkg}{os.pathsep}{REPO}"  # the sanitized package first, the tests from the checkout
    where = subprocess.run([sys.executable, "-c", "import cubefs_fuse.cache._index as i; print(i.__file__)"],
                           capture_output=True, text=True, env=env, cwd=tmp_path, timeout=60)
    assert where.stdout.startswith(str(pkg)), f"not the sanitized index: {where.stdout} {where.stderr}"
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                             str(REPO / "tests" / "unit" / "test_block_index.py")],
                            capture_output=True, text=True, env=env, cwd=tmp_path, timeout=600)
    assert result.returncode == 0, f"{result.stdout[-3000:]}\n{result.stderr[-3000:]}\n{_reports(reports)}"
    assert " passed" in result.stdout and "skipped" not in result.stdout, result.stdout[-500:]
    assert not list(reports.iterdir()), _reports(reports)
