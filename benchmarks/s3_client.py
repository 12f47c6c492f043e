"""Client CPU per small GET from a local S3 server, per client library: what chose the S3
backend's library (benchmarks/results/2026-11-29-s3-client.md).

    .venv/bin/python -m benchmarks.s3_client [--objects 100] [--rounds 3] [--threads 8]

Starts SeaweedFS (tests/s3_servers.py) on loopback ports, puts ``--objects`` objects of
110,000 bytes (an ImageNet-like file), then GETs every object ``--rounds`` times from
``--threads`` worker threads, as the daemon's backend would (a blocking call per worker
thread), once per library: boto3 (one shared client) and obstore (one shared store, its
blocking API).  Reported per GET: this process's CPU (user + system of every thread,
``resource.getrusage``) and wall time; the server's own CPU is not counted.  Each library
also does one ranged GET conditional on the ETag (If-Match), checked, so a library that
cannot is seen to fail here.  Then ``--list-keys`` one-byte keys in one prefix are listed
with the delimiter ``/`` twice per library (boto3's paginator, plain and as the S3
backend sets it up, and obstore's ``list_with_delimiter``): CPU and wall time per key.
"""

from __future__ import annotations

import argparse
import datetime
import resource
import subprocess
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from botocore.config import Config

from tests.s3_servers import ACCESS_KEY, REGION, SECRET_KEY, SeaweedS3

SIZE = 110_000  # bytes: the median ImageNet file


def _cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _measure(get: Callable[[str], bytes], keys: list[str], rounds: int, threads: int) -> tuple[float, float]:
    """(CPU seconds per GET, wall seconds per GET) over ``rounds`` passes of ``keys``."""
    work = keys * rounds
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(get, keys[:threads]))  # connections opened, code paths warm
        cpu, wall = _cpu(), time.perf_counter()
        for data in pool.map(get, work):
            assert len(data) == SIZE
        return (_cpu() - cpu) / len(work), (time.perf_counter() - wall) / len(work)


def boto3_get(server: SeaweedS3, bucket: str, threads: int, checksums: str = "when_supported",
              ) -> tuple[Callable[[str], bytes], Callable[[str], bytes]]:
    import boto3

    client: Any = boto3.client("s3", endpoint_url=server.endpoint, aws_access_key_id=ACCESS_KEY,
                               aws_secret_access_key=SECRET_KEY, region_name=REGION,
                               config=Config(max_pool_connections=threads, s3={"addressing_style": "path"},
                                             response_checksum_validation=checksums))

    def get(key: str) -> bytes:
        data: bytes = client.get_object(Bucket=bucket, Key=key)["Body"].read()
        return data

    def ranged(key: str) -> bytes:
        etag = client.head_object(Bucket=bucket, Key=key)["ETag"]
        data: bytes = client.get_object(Bucket=bucket, Key=key, Range="bytes=10-19", IfMatch=etag)["Body"].read()
        return data

    return get, ranged


def obstore_get(server: SeaweedS3, bucket: str, threads: int, boto3_credentials: bool = False,
                ) -> tuple[Callable[[str], bytes], Callable[[str], bytes]]:
    import boto3
    import obstore
    from obstore.auth.boto3 import Boto3CredentialProvider
    from obstore.store import S3Store

    if boto3_credentials:  # the standard chain through boto3, as the backend does
        session = boto3.Session(aws_access_key_id=ACCESS_KEY, aws_secret_access_key=SECRET_KEY, region_name=REGION)
        store = S3Store(bucket, endpoint=server.endpoint, credential_provider=Boto3CredentialProvider(session),
                        virtual_hosted_style_request=False, client_options={"allow_http": True})
    else:
        store = S3Store(bucket, endpoint=server.endpoint, access_key_id=ACCESS_KEY, secret_access_key=SECRET_KEY,
                        region=REGION, virtual_hosted_style_request=False, client_options={"allow_http": True})

    def get(key: str) -> bytes:
        return bytes(obstore.get(store, key).bytes())

    def ranged(key: str) -> bytes:
        etag = obstore.head(store, key)["e_tag"]
        result = obstore.get(store, key, options={"range": (10, 20), "if_match": etag})
        return bytes(result.bytes())

    return get, ranged


def boto3_list(server: SeaweedS3, bucket: str) -> Callable[[], int]:
    client = server.client()

    def count() -> int:
        pages = client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix="listed/", Delimiter="/")
        return sum(len(page.get("Contents", ())) for page in pages)

    return count


def backend_list(server: SeaweedS3, bucket: str) -> Callable[[], int]:
    """boto3 as the S3 backend configures it (its own timestamp parser)."""
    import os

    from cubefs_fuse.backends.s3 import Clients, S3Location

    os.environ.update(server.environment())
    client = Clients(S3Location(bucket, endpoint=server.endpoint), threads=1, timeout=30.0).boto

    def count() -> int:
        pages = client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix="listed/", Delimiter="/")
        return sum(len(page.get("Contents", ())) for page in pages)

    return count


def obstore_list(server: SeaweedS3, bucket: str) -> Callable[[], int]:
    import obstore
    from obstore.store import S3Store

    store = S3Store(bucket, endpoint=server.endpoint, access_key_id=ACCESS_KEY, secret_access_key=SECRET_KEY,
                    region=REGION, virtual_hosted_style_request=False, client_options={"allow_http": True})
    return lambda: len(obstore.list_with_delimiter(store, "listed/")["objects"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--objects", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=8)
    parser.add_argument("--list-keys", type=int, default=3000)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        server = SeaweedS3(Path(tmp)).start()
        try:
            bucket = server.new_bucket()
            client = server.client()
            payload = bytes(range(256)) * (SIZE // 256) + bytes(SIZE % 256)
            keys = [f"train/n{i // 10:04d}/img{i:05d}.jpg" for i in range(args.objects)]
            for key in keys:
                client.put_object(Bucket=bucket, Key=key, Body=payload)
            commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
            print(f"{datetime.date.today()} at {commit}: {args.objects} objects x {args.rounds} rounds, "
                  f"{args.threads} threads, {SIZE} bytes each")
            print("| library | CPU per GET (us) | wall per GET (us) |")
            print("|---|---|---|")
            libraries: list[tuple[str, Callable[[], tuple[Callable[[str], bytes], Callable[[str], bytes]]]]] = [
                ("boto3 (default: response checksums validated)", lambda: boto3_get(server, bucket, args.threads)),
                ("boto3 (checksums only when required)",
                 lambda: boto3_get(server, bucket, args.threads, "when_required")),
                ("obstore (static keys)", lambda: obstore_get(server, bucket, args.threads)),
                ("obstore (boto3's credential chain)", lambda: obstore_get(server, bucket, args.threads, True)),
            ]
            for name, make in libraries:
                get, ranged = make()
                assert ranged(keys[0]) == payload[10:20], f"{name}: ranged conditional GET"
                cpu, wall = _measure(get, keys, args.rounds, args.threads)
                print(f"| {name} | {cpu * 1e6:.0f} | {wall * 1e6:.0f} |")
            list_keys = [f"listed/img{i:06d}.jpg" for i in range(args.list_keys)]
            with ThreadPoolExecutor(16) as pool:
                list(pool.map(lambda key: client.put_object(Bucket=bucket, Key=key, Body=b"x"), list_keys))
            print(f"\nListing {args.list_keys} keys of one prefix, twice per library:")
            print("| library | CPU per key (us) | wall per key (us) |")
            print("|---|---|---|")
            for name, count in (("boto3 (paginator, 1,000 keys a page)", boto3_list(server, bucket)),
                                ("boto3 as backends/s3.py sets it up", backend_list(server, bucket)),
                                ("obstore (list_with_delimiter)", obstore_list(server, bucket))) * 2:
                cpu, wall = _cpu(), time.perf_counter()
                assert count() == args.list_keys, name
                print(f"| {name} | {(_cpu() - cpu) / args.list_keys * 1e6:.1f} | "
                      f"{(time.perf_counter() - wall) / args.list_keys * 1e6:.1f} |")
        finally:
            server.stop()


if __name__ == "__main__":
    main()
