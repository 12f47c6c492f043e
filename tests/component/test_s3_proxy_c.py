"""tools/s3_proxy_c, the benchmark suite's delaying proxy, in front of a real S3 server
(SeaweedFS, tests/s3_servers.py): bytes pass unchanged both ways (signatures hold), each
request on a kept-alive connection is delayed once, a request body sent in many writes is
not delayed per write, bad options are one line and exit status 2, SIGTERM ends it."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import boto3
import pytest
from botocore.config import Config

from benchmarks.suite.s3 import PROXY_BUILD
from tests.s3_servers import ACCESS_KEY, REGION, SECRET_KEY, SeaweedS3, s3_env, s3_server  # noqa: F401 -- the fixtures
from tools.harness import build_tool

DELAY_MS = 100  # far above a loopback GET (~2 ms): a request that was not delayed shows


@pytest.fixture(scope="module")
def binary() -> Path:
    """The built proxy.  A missing compiler fails (scripts/setup.sh installs it)."""
    path = build_tool(PROXY_BUILD)
    assert os.access(path, os.X_OK), path
    return path


@pytest.fixture
def proxy(binary: Path, s3_env: SeaweedS3) -> Iterator[tuple[subprocess.Popen[bytes], int]]:
    process = subprocess.Popen([str(binary), "--target-port", str(s3_env.s3_port), "--delay-ms", str(DELAY_MS)],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        assert process.stdout is not None
        line = process.stdout.readline().strip()
        assert line.isdigit(), (line, process.stderr.read() if process.stderr else b"")
        yield process, int(line)
    finally:
        process.terminate()
        process.communicate(timeout=10)  # reaps it and closes its pipes


def client(port: int) -> Any:
    return boto3.client("s3", endpoint_url=f"http://127.0.0.1:{port}", aws_access_key_id=ACCESS_KEY,
                        aws_secret_access_key=SECRET_KEY, region_name=REGION,
                        config=Config(s3={"addressing_style": "path"}, retries={"max_attempts": 1}))


def test_requests_are_delayed_once_each_and_bytes_pass_unchanged(s3_env: SeaweedS3,
                                                                  proxy: tuple[subprocess.Popen[bytes], int]) -> None:
    bucket = s3_env.new_bucket()
    objects = {f"k{i}": os.urandom(110_000 + i) for i in range(3)}
    direct = s3_env.client()
    for key, data in objects.items():
        direct.put_object(Bucket=bucket, Key=key, Body=data)
    delayed = client(proxy[1])
    delayed.head_bucket(Bucket=bucket)  # the connection, kept alive for the GETs below
    for key, data in objects.items():
        started = time.monotonic()
        got = delayed.get_object(Bucket=bucket, Key=key)["Body"].read()
        took = time.monotonic() - started
        assert got == data
        assert took >= DELAY_MS / 1000, f"a request on a kept-alive connection was not delayed ({took:.3f} s)"
    ranged = delayed.get_object(Bucket=bucket, Key="k1", Range="bytes=100-199")["Body"].read()
    assert ranged == objects["k1"][100:200]


def test_a_body_sent_in_many_writes_is_delayed_once(s3_env: SeaweedS3,
                                                    proxy: tuple[subprocess.Popen[bytes], int]) -> None:
    """An 8 MiB PUT reaches the proxy in ~64 reads of 128 KiB: delayed per read it would take
    over 6 s; delayed once (twice with a "100 Continue"), a fraction of a second more than
    direct."""
    bucket = s3_env.new_bucket()
    body = os.urandom(8 << 20)
    delayed = client(proxy[1])
    started = time.monotonic()
    delayed.put_object(Bucket=bucket, Key="big", Body=body)
    took = time.monotonic() - started
    assert took < 64 * DELAY_MS / 1000 / 2, f"the body was delayed per write ({took:.1f} s)"
    assert s3_env.client().get_object(Bucket=bucket, Key="big")["Body"].read() == body


@pytest.mark.parametrize("args, says", [
    ([], "--target-port is required"),
    (["--target-port", "0"], "--target-port must be a whole number from 1 to 65535, not 0"),
    (["--target-port", "9000", "--delay-ms", "ten"], "--delay-ms must be a whole number from 0 to 60000, not ten"),
    (["--target-port"], "every option takes a value"),
    (["--target-port", "9000", "--verbose", "1"], "unknown option"),
])
def test_bad_options_are_one_line_and_status_2(binary: Path, args: list[str], says: str) -> None:
    done = subprocess.run([str(binary), *args], capture_output=True, text=True, timeout=10)
    assert done.returncode == 2
    assert done.stderr.splitlines()[0] == f"s3-proxy-c: {says}"
    assert done.stdout == ""


def test_sigterm_ends_it(proxy: tuple[subprocess.Popen[bytes], int]) -> None:
    process, _ = proxy
    process.send_signal(signal.SIGTERM)
    assert process.wait(10) == -signal.SIGTERM
