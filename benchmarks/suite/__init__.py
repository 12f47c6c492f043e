"""The benchmark suite of docs/benchmarks.md: ``scripts/bench.sh`` or ``python -m benchmarks.suite``.

One run: an ImageNet-like dataset, the emulated remote (tools/slowfs.py, one process per
latency preset, its zero-latency ceiling measured first), our daemon's CPU per file over
the local source (daemon_cpu.py), and every system -- local copy, raw remote, cubefs-fuse
without and with cube_torch, rclone, JuiceFS -- on the same data through four workloads
(raw I/O, training, cache smaller than the dataset, the NVMe regime).  Writes
results.json, results.md and PNG plots; see docs/benchmarks.md.
"""
