"""What a cold lookup costs over S3, per way of asking: what chose the S3 backend's
``stat_read`` (one ranged GET; benchmarks/results/2026-11-29-s3-lookup.md).

    .venv/bin/python -m benchmarks.s3_lookup [--delay-ms 10] [--rounds 20]

Starts SeaweedFS (tests/s3_servers.py) behind the delaying proxy (tools/s3_proxy.py), puts
a small object (110,000 bytes, an ImageNet-like file) and a large one (``--large-mib``),
then makes each way of looking an object up ``--rounds`` times, one at a time, with
obstore as the backend does (blocking calls): a HEAD then a GET of the whole small object
(the lookup before), one ranged GET of the first ``--block-kib`` (the lookup now), and for
the large object a HEAD, that ranged GET read and dropped, and that ranged GET dropped
after its headers (each also followed by a small GET, which shows what a dropped answer's
closed connection costs the next request).  Reported per lookup: wall time and this
process's CPU (user + system, ``resource.getrusage``); the server's and proxy's CPU are
not counted.
"""

from __future__ import annotations

import argparse
import datetime
import resource
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import obstore
from obstore.store import S3Store

from tests.s3_servers import ACCESS_KEY, REGION, SECRET_KEY, SeaweedS3
from tools.s3_proxy import S3Proxy

SMALL = 110_000  # bytes: the median ImageNet file


def _cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _measure(fn: Callable[[], object], rounds: int) -> tuple[float, float]:
    """(wall seconds, CPU seconds) per call of ``fn`` over ``rounds`` calls after a warm one."""
    fn()
    cpu, wall = _cpu(), time.perf_counter()
    for _ in range(rounds):
        fn()
    return (time.perf_counter() - wall) / rounds, (_cpu() - cpu) / rounds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--delay-ms", type=float, default=10.0, help="the proxy's delay per request")
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--block-kib", type=int, default=1024, help="max_size of the lookup: blockSize")
    parser.add_argument("--large-mib", type=int, default=8)
    args = parser.parse_args()
    block = args.block_kib * 1024
    with tempfile.TemporaryDirectory() as tmp:
        server = SeaweedS3(Path(tmp)).start()
        try:
            bucket = server.new_bucket()
            client = server.client()
            client.put_object(Bucket=bucket, Key="small", Body=b"s" * SMALL)
            client.put_object(Bucket=bucket, Key="large", Body=b"l" * (args.large_mib << 20))
            with S3Proxy(server.s3_port, delay=args.delay_ms / 1000) as proxy:
                store = S3Store(bucket, endpoint=proxy.endpoint, access_key_id=ACCESS_KEY,
                                secret_access_key=SECRET_KEY, region=REGION, client_options={"allow_http": True},
                                virtual_hosted_style_request=False)

                def ranged(key: str) -> bytes:
                    return bytes(obstore.get(store, key, options={"range": (0, block)}).bytes())

                def dropped() -> int:
                    result = obstore.get(store, "large", options={"range": (0, block)})
                    return result.meta["size"]  # the headers only: the answer is let go unread

                ways: list[tuple[str, Callable[[], object]]] = [
                    ("small: HEAD, then GET of the whole object",
                     lambda: (obstore.head(store, "small"),
                              bytes(obstore.get(store, "small", options={"range": (0, SMALL)}).bytes()))),
                    ("small: one ranged GET", lambda: ranged("small")),
                    ("large: HEAD", lambda: obstore.head(store, "large")),
                    ("large: ranged GET, read and dropped", lambda: ranged("large")),
                    ("large: ranged GET, dropped after its headers", dropped),
                    ("large: ranged GET read and dropped, then a small GET", lambda: (ranged("large"), ranged("small"))),
                    ("large: ranged GET dropped after headers, then a small GET", lambda: (dropped(), ranged("small"))),
                ]
                commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                        text=True).stdout.strip()
                print(f"{datetime.date.today()} at {commit}: proxy delay {args.delay_ms:g} ms, {args.rounds} rounds, "
                      f"max_size {block} bytes, small {SMALL} bytes, large {args.large_mib} MiB")
                print("| lookup | wall (ms) | CPU (ms) |")
                print("|---|---|---|")
                for name, fn in ways:
                    wall, cpu = _measure(fn, args.rounds)
                    print(f"| {name} | {wall * 1e3:.1f} | {cpu * 1e3:.2f} |")
        finally:
            server.stop()


if __name__ == "__main__":
    main()
