"""Epoch 0 from a cold daemon: hit rates of real DataLoaders over a slow remote.

    sudo .venv/bin/python -m benchmarks.cold_epoch [--cases coco,voc,imagefolder] [--files 1024]
        [--latency-ms 1] [--workers 4] [--batch 16] [--step-ms 50] [--epochs 2] [--ram both|big|small]

For each case (a torchvision ``CocoDetection``, ``VOCDetection`` or ``ImageFolder``
built over the mount) and each RAM tier (``big``: twice the epoch's bytes; ``small``:
half of them), a fresh remote (tools/slowfs_c, every operation delayed by
``--latency-ms``, nothing cached by the kernel), a fresh daemon (``ai_prefetch``, an
empty cache directory, a fresh mount) and a fresh training process (``import
cube_torch``, ``VOL_NAME`` set, ``--workers`` DataLoader workers, a shuffled order)
read the dataset for ``--epochs`` epochs, decoding every image and then sleeping
``--step-ms`` per batch (the model's step).  It prints, per case
and epoch, what the daemon counted for the job (``cube_torch.stats()``): requests (one
per open of a file), hits, misses and the hit rate, plus the epoch's wall time and what
the remote served during it.

Hit rates are count ratios, not timings: they do not depend on the machine's speed as
long as the prefetch keeps ahead of the readers.  The bar this measures (docs/cube_torch.md,
"Epoch 0 from a cold daemon"): epoch 0 at >= 95 % hits for all three cases at 1 ms.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

CASES = ("coco", "voc", "imagefolder")
# Mean size of the generated JPEGs: ~64 KB, between VOC's (~100 KB) and a thumbnail's; the
# file count, not the bytes, is what a cold epoch pays for at 1 ms per operation.
MEAN_FILE_BYTES = 64 * 1024
# Classes of the ImageFolder case (one directory each).
CLASSES = 8
# How long the training process waits, after an epoch, for the daemon to have counted the
# epoch's last opens (released by workers shutting down): well above a release's latency.
COUNT_WAIT_S = 10.0
# The model's step per batch (a sleep, as an accelerator takes it: the CPU stays free for
# the loader and the daemon): 50 ms per batch of 16 is 320 samples/s, which the daemon on
# this 2-core machine keeps ahead of, VOC's two files per sample included (at 20 ms it
# does not for VOC: docs/benchmarks.md).
STEP_MS = 50.0
# The whole run of one training process (a few seconds per epoch on 2 cores).
CHILD_TIMEOUT_S = 600.0
# Emulator threads: as the benchmark suite (benchmarks/suite/remote.py EMULATOR_THREADS).
EMULATOR_THREADS = 128


# -- the datasets ----------------------------------------------------------------------------


def _jpeg(rng: random.Random, target: int) -> bytes:
    """A noise JPEG of about ``target`` bytes (noise at quality 85: ~0.77 bytes per pixel)."""
    import numpy as np
    from PIL import Image

    pixels = max(64, int(target / 0.77))
    side = max(8, int(pixels**0.5))
    noise = np.random.default_rng(rng.randrange(2**32)).integers(0, 256, (side, side, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(noise).save(out, "JPEG", quality=85)
    return out.getvalue()


def build(root: Path, case: str, files: int, *, mean_bytes: int = MEAN_FILE_BYTES, seed: int = 0) -> int:
    """Write ``case``'s tree of ``files`` samples under ``root/case``; the files one epoch opens."""
    rng = random.Random(seed)
    base = root / case

    def image() -> bytes:
        return _jpeg(rng, int(mean_bytes * rng.uniform(0.7, 1.3)))

    if case == "imagefolder":
        for i in range(files):
            path = base / f"class_{i % CLASSES:02d}" / f"img_{i:06d}.jpg"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(image())
        return files
    if case == "coco":
        (base / "train2017").mkdir(parents=True)
        (base / "annotations").mkdir()
        ids = rng.sample(range(1, 10 * files + 1), files)  # neither contiguous nor in name order
        images, annotations = [], []
        for k, image_id in enumerate(ids):
            name = f"{image_id:012d}.jpg"
            (base / "train2017" / name).write_bytes(image())
            images.append({"id": image_id, "file_name": name, "width": 64, "height": 64})
            annotations.append({"id": k + 1, "image_id": image_id, "category_id": 1 + k % 3,
                                "bbox": [1, 1, 8, 8], "area": 64, "iscrowd": 0})
        (base / "annotations" / "instances_train2017.json").write_text(json.dumps(
            {"images": images, "annotations": annotations,
             "categories": [{"id": c, "name": f"thing{c}"} for c in (1, 2, 3)]}))
        return files
    if case == "voc":
        voc = base / "VOCdevkit" / "VOC2012"
        for sub in ("JPEGImages", "Annotations", "ImageSets/Main"):
            (voc / sub).mkdir(parents=True)
        names = [f"2012_{i:06d}" for i in range(files)]
        for i, name in enumerate(names):
            (voc / "JPEGImages" / f"{name}.jpg").write_bytes(image())
            (voc / "Annotations" / f"{name}.xml").write_text(
                f"<annotation><filename>{name}.jpg</filename><size><width>64</width><height>64</height>"
                f"<depth>3</depth></size><object><name>obj{i % 3}</name><bndbox><xmin>1</xmin><ymin>1</ymin>"
                f"<xmax>9</xmax><ymax>9</ymax></bndbox></object></annotation>")
        (voc / "ImageSets" / "Main" / "train.txt").write_text("\n".join(names) + "\n")
        return 2 * files  # an image and its annotation XML per sample
    raise ValueError(f"unknown case {case!r}; choose from {', '.join(CASES)}")


def dataset_bytes(root: Path, case: str) -> int:
    return sum(p.stat().st_size for p in (root / case).rglob("*") if p.is_file())


# -- the training process ----------------------------------------------------------------------


def make_torch_dataset(case: str, root: Path) -> Any:
    """The torchvision dataset of ``case`` over ``root`` (the mount)."""
    from tools import torchvision_shim

    torchvision_shim.install()  # before the first torchvision import (see its docstring)
    from torchvision import datasets, transforms  # type: ignore[import-untyped]

    to_tensor = transforms.PILToTensor()
    if case == "imagefolder":
        return datasets.ImageFolder(str(root / "imagefolder"), transform=to_tensor)
    if case == "coco":
        return datasets.CocoDetection(str(root / "coco" / "train2017"),
                                      str(root / "coco" / "annotations" / "instances_train2017.json"),
                                      transform=to_tensor)
    if case == "voc":
        return datasets.VOCDetection(str(root / "voc"), year="2012", image_set="train", transform=to_tensor)
    raise ValueError(case)


def keep(batch: Any) -> Any:
    """collate_fn: the samples as they are (detection targets do not collate)."""
    return batch


def process_cpu_seconds(pid: int) -> float:
    """User + system CPU time of process ``pid`` (all its threads) so far."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def remote_counts(remote: Path) -> tuple[int, int]:
    """(operations, reads) the emulated remote has served so far (its statistics file,
    read at no latency and not counted)."""
    raw = json.loads((remote / ".slowfs_stats").read_bytes())
    ops = raw.get("ops", {})
    return sum(int(v) for k, v in ops.items() if k != "release"), int(ops.get("read", 0))


def child(case: str, root: Path, *, workers: int, batch: int, epochs: int, opens_per_epoch: int,
          step_s: float, remote: Path) -> None:
    """Train-like loop (decode every sample); one JSON line per epoch on stdout."""
    import torch
    from torch.utils.data import DataLoader

    import cube_torch
    from cubefs_fuse.control.protocol import read_volume_config

    dataset = make_torch_dataset(case, root)
    loader = DataLoader(dataset, batch_size=batch, shuffle=True, num_workers=workers, collate_fn=keep,
                        generator=torch.Generator().manual_seed(7))
    counted = 0
    daemon_pid = read_volume_config(os.environ["VOL_NAME"]).pid
    for epoch in range(epochs):
        cpu = process_cpu_seconds(daemon_pid)
        remote_before = remote_counts(remote)
        start = time.perf_counter()
        samples = 0
        for b in loader:
            samples += len(b)
            time.sleep(step_s)  # the model's step, as an accelerator takes it: the CPU stays free
        seconds = time.perf_counter() - start
        cpu = process_cpu_seconds(daemon_pid) - cpu
        # The last files are counted when released (workers shutting down): wait for them.
        deadline = time.monotonic() + COUNT_WAIT_S
        stats = cube_torch.stats()
        while (stats is None or stats["cumulative"]["requests"] < counted + opens_per_epoch) \
                and time.monotonic() < deadline:
            time.sleep(0.05)
            stats = cube_torch.stats()
        total = stats["cumulative"] if stats is not None else {"requests": 0, "hits": 0, "misses": 0}
        remote_after = remote_counts(remote)
        print(json.dumps({"epoch": epoch, "samples": samples, "seconds": seconds, "daemon_cpu": cpu, "cumulative": total,
                          "remote_ops": remote_after[0] - remote_before[0],
                          "remote_reads": remote_after[1] - remote_before[1]}), flush=True)
        counted = int(total["requests"])


# -- one run: fresh remote, fresh daemon, fresh training process --------------------------------


@dataclass
class EpochResult:
    epoch: int
    samples: int
    seconds: float
    daemon_cpu: float
    requests: int
    hits: int
    remote_ops: int
    remote_reads: int

    @property
    def hit_rate(self) -> float:
        return 100.0 * self.hits / self.requests if self.requests else 0.0


def run_case(case: str, data: Path, workdir: Path, *, ram_bytes: int, latency_us: int, workers: int, batch: int,
             epochs: int, opens_per_epoch: int, vol_name: str, step_ms: float) -> list[EpochResult]:
    """One cold run of ``case``; the per-epoch counters."""
    from benchmarks.suite.remote import SlowFSCProcess, slowfs_c_binary
    from tools.harness import DaemonMount, HarnessError

    binary = slowfs_c_binary()
    if binary is None:
        raise HarnessError("tools/slowfs_c cannot be built (run scripts/setup.sh)")
    remote_mount = workdir / "remote"
    remote_mount.mkdir(parents=True)
    remote = SlowFSCProcess(binary, data, remote_mount, latency_us=latency_us, threads=EMULATOR_THREADS,
                            cache_timeout=0.0, bandwidth_mb_s=0.0)
    daemon = DaemonMount(workdir, remote_mount, workdir / "cache", vol_name=vol_name, mem_cache_size=ram_bytes,
                         disk_cache_size="1GiB", profile="ai_prefetch")
    remote.start()
    try:
        daemon.mount()
        try:
            env = {**os.environ, "VOL_NAME": vol_name, "CUBE_TORCH_METRICS_INTERVAL": "3600",
                   "CUBE_TORCH_JOB": f"cold-{case}", "PYTHONPATH": _pythonpath()}
            command = [sys.executable, "-m", "benchmarks.cold_epoch", "--child", case, str(daemon.mount_point),
                       f"--workers={workers}", f"--batch={batch}", f"--epochs={epochs}",
                       f"--opens-per-epoch={opens_per_epoch}", f"--step-ms={step_ms}", f"--remote={remote_mount}"]
            done = subprocess.run(command, capture_output=True, text=True, timeout=CHILD_TIMEOUT_S, env=env,
                                  cwd=Path(__file__).resolve().parent.parent)
            if done.returncode != 0:
                raise HarnessError(f"the training process failed (exit {done.returncode}): "
                                   f"{done.stderr.strip()[-2000:]}")
            lines = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
        finally:
            daemon.cleanup()
    finally:
        remote.stop()
    results: list[EpochResult] = []
    previous = {"requests": 0, "hits": 0}
    for line in lines:
        total = line["cumulative"]
        results.append(EpochResult(line["epoch"], line["samples"], line["seconds"], line["daemon_cpu"],
                                   int(total["requests"]) - previous["requests"],
                                   int(total["hits"]) - previous["hits"],
                                   line["remote_ops"], line["remote_reads"]))
        previous = {"requests": int(total["requests"]), "hits": int(total["hits"])}
    return results


def _pythonpath() -> str:
    repo = str(Path(__file__).resolve().parent.parent)
    rest = os.environ.get("PYTHONPATH", "")
    return repo + (os.pathsep + rest if rest else "")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.cold_epoch", description=__doc__.split("\n\n")[0])
    p.add_argument("--cases", default=",".join(CASES), help="comma-separated, from: " + ", ".join(CASES))
    p.add_argument("--files", type=int, default=1024, help="samples per dataset (default 1024)")
    p.add_argument("--latency-ms", type=float, default=1.0, help="remote latency per operation (default 1)")
    p.add_argument("--workers", type=int, default=4, help="DataLoader workers (default 4)")
    p.add_argument("--batch", type=int, default=16, help="batch size (default 16)")
    p.add_argument("--epochs", type=int, default=2, help="epochs per run (default 2)")
    p.add_argument("--step-ms", type=float, default=STEP_MS,
                   help=f"the model's step per batch, a sleep as on an accelerator (default {STEP_MS:g})")
    p.add_argument("--ram", choices=("both", "big", "small"), default="both",
                   help="RAM tier: big (twice the epoch's bytes), small (half of them), or both")
    p.add_argument("--child", metavar="CASE", help=argparse.SUPPRESS)
    p.add_argument("root", nargs="?", help=argparse.SUPPRESS)
    p.add_argument("--opens-per-epoch", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--remote", default="", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        child(args.child, Path(args.root), workers=args.workers, batch=args.batch, epochs=args.epochs,
              opens_per_epoch=args.opens_per_epoch, step_s=args.step_ms / 1000, remote=Path(args.remote))
        return 0
    cases = [c.strip() for c in args.cases.split(",") if c.strip()]
    unknown = [c for c in cases if c not in CASES]
    if unknown:
        p.error(f"unknown case {unknown[0]!r}; choose from {', '.join(CASES)}")
    if os.geteuid() != 0 or not os.path.exists("/dev/fuse"):
        print("cold_epoch: needs root and /dev/fuse (FUSE mounts)", file=sys.stderr)
        return 2
    from tools.harness import HarnessError, remove_workdir

    base = Path(tempfile.mkdtemp(prefix="cubefs-cold-epoch-"))
    rows: list[tuple[str, str, list[EpochResult]]] = []
    try:
        data = base / "remote-disk"
        for case in cases:
            opens = build(data, case, args.files)
            epoch_bytes = dataset_bytes(data, case)
            rams = {"big": 2 * epoch_bytes, "small": epoch_bytes // 2}
            for ram in ("big", "small") if args.ram == "both" else (args.ram,):
                run_dir = base / f"{case}-{ram}"
                run_dir.mkdir()
                results = run_case(case, data, run_dir, ram_bytes=rams[ram], latency_us=int(args.latency_ms * 1000),
                                   workers=args.workers, batch=args.batch, epochs=args.epochs,
                                   opens_per_epoch=opens, step_ms=args.step_ms, vol_name=f"cold{os.getpid()}{case[:4]}{ram}")
                rows.append((case, f"{ram} ({rams[ram] >> 20} MiB)", results))
                for r in results:
                    print(f"{case:12s} RAM {ram:5s} epoch {r.epoch}: {r.requests:5d} opens, {r.hits:5d} hits = "
                          f"{r.hit_rate:5.1f} %  ({r.samples} samples in {r.seconds:.2f} s, daemon CPU {r.daemon_cpu:.2f} s, "
                          f"remote: {r.remote_reads} reads, {r.remote_ops} operations)",
                          flush=True)
    except HarnessError as exc:
        print(f"cold_epoch failed: {exc}", file=sys.stderr)
        return 1
    finally:
        remove_workdir(base, *(base / f"{c}-{r}" / m for c in CASES for r in ("big", "small")
                               for m in ("mnt", "remote")))
    print()
    print(f"epoch hit rates, cold daemon, {args.workers} workers, batch {args.batch}, "
          f"{args.files} samples, remote latency {args.latency_ms:g} ms:")
    for case, ram, results in rows:
        rates = "  ".join(f"epoch {r.epoch}: {r.hit_rate:5.1f} % ({r.hits}/{r.requests})" for r in results)
        print(f"  {case:12s} RAM {ram:16s} {rates}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
