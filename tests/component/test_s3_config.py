"""An s3:// source at mount time, against a real S3 server (tests/s3_servers.py): the
check passes for a reachable bucket, and a missing bucket, refused credentials, an
endpoint that does not answer, an unknown profile or an empty prefix each make
``check_environment`` + ``check_source`` and ``cubefs-fuse mount`` fail with one line
saying which."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from cubefs_fuse.config import ClientConfig, check_environment, parse_config
from cubefs_fuse.errors import ConfigError
from cubefs_fuse.sources import check_source, source_backend
from tests.cli_checks import Env
from tests.redis_servers import free_port
from tests.s3_servers import SeaweedS3, s3_env, s3_server  # noqa: F401 -- the fixtures


def s3_config(tmp_path: Path, server: SeaweedS3, source: str, **extra: Any) -> ClientConfig:
    mnt = tmp_path / "mnt"
    mnt.mkdir(exist_ok=True)
    return parse_config({"mountPoint": str(mnt), "volName": "s3", "source": source, "s3Endpoint": server.endpoint,
                         "diskCacheDir": str(tmp_path / "cache"), **extra})


def check(cfg: ClientConfig) -> None:
    """What `mount` checks of the config against the machine and the bucket."""
    check_environment(cfg)
    check_source(cfg)


def env_error(cfg: ClientConfig) -> str:
    with pytest.raises(ConfigError) as info:
        check(cfg)
    message = str(info.value)
    assert "\n" not in message, "config errors are one line"
    return message


def test_a_reachable_bucket_passes(tmp_path: Path, s3_env: SeaweedS3) -> None:  # noqa: F811
    bucket = s3_env.new_bucket()
    s3_env.client().put_object(Bucket=bucket, Key="train/a.jpg", Body=b"a")
    check(s3_config(tmp_path, s3_env, f"s3://{bucket}/train"))
    check(s3_config(tmp_path, s3_env, f"s3://{bucket}"))
    assert (tmp_path / "cache").is_dir()


def test_each_mistake_is_one_line_saying_which(tmp_path: Path, s3_env: SeaweedS3,  # noqa: F811
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    bucket = s3_env.new_bucket()
    s3_env.client().put_object(Bucket=bucket, Key="train/a.jpg", Body=b"a")
    assert env_error(s3_config(tmp_path, s3_env, "s3://no-such-bucket-here")) == (
        f"key 'source': bucket 'no-such-bucket-here' does not exist at {s3_env.endpoint}")
    assert env_error(s3_config(tmp_path, s3_env, f"s3://{bucket}/trian")) == f"key 'source': no object under s3://{bucket}/trian/"
    dead = f"http://127.0.0.1:{free_port()}"
    assert env_error(s3_config(tmp_path, s3_env, f"s3://{bucket}", s3Endpoint=dead)).startswith(
        f"key 's3Endpoint': {dead} does not answer: Could not connect to the endpoint URL")
    assert env_error(s3_config(tmp_path, s3_env, f"s3://{bucket}", s3Profile="training")) == (
        "key 's3Profile': no profile 'training' in the AWS config files")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong")
    assert env_error(s3_config(tmp_path, s3_env, f"s3://{bucket}")) == (
        f"key 'source': {s3_env.endpoint} refused the credentials for bucket {bucket!r} (SignatureDoesNotMatch): "
        "check AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, AWS_PROFILE or 's3Profile'")


def test_a_profile_of_the_shared_files_is_used(tmp_path: Path, s3_env: SeaweedS3,  # noqa: F811
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """The standard chain: credentials and region from a profile of the shared files, none
    in the environment."""
    bucket = s3_env.new_bucket()
    s3_env.client().put_object(Bucket=bucket, Key="k", Body=b"k")
    environment = s3_env.environment()
    for name in environment:
        monkeypatch.delenv(name)
    credentials = tmp_path / "credentials"
    credentials.write_text(f"[training]\naws_access_key_id = {environment['AWS_ACCESS_KEY_ID']}\n"
                           f"aws_secret_access_key = {environment['AWS_SECRET_ACCESS_KEY']}\n"
                           "[other]\naws_access_key_id = nobody\naws_secret_access_key = nothing\n")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(credentials))
    check(s3_config(tmp_path, s3_env, f"s3://{bucket}", s3Profile="training"))
    monkeypatch.setenv("AWS_PROFILE", "training")
    check(s3_config(tmp_path, s3_env, f"s3://{bucket}"))
    assert "refused the credentials" in env_error(s3_config(tmp_path, s3_env, f"s3://{bucket}", s3Profile="other"))


def test_mount_of_a_missing_bucket_fails_with_one_line(env: Env, s3_env: SeaweedS3) -> None:  # noqa: F811
    env.write(source="s3://no-such-bucket-here/train", s3Endpoint=s3_env.endpoint)
    assert env.fails() == f"key 'source': bucket 'no-such-bucket-here' does not exist at {s3_env.endpoint}"


async def test_the_endpoint_and_region_from_the_environment(tmp_path: Path, s3_env: SeaweedS3,  # noqa: F811
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """No s3Endpoint: AWS_ENDPOINT_URL, as the AWS CLI reads it, and path style because it
    is not AWS's."""
    bucket = s3_env.new_bucket()
    s3_env.client().put_object(Bucket=bucket, Key="k", Body=b"value")
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_env.endpoint)
    cfg = s3_config(tmp_path, s3_env, f"s3://{bucket}", s3Endpoint="")
    check(cfg)
    backend = source_backend(cfg)
    try:
        attr = await backend.stat("k")
        assert await backend.read_block("k", attr.version, 0, 5) == b"value"
    finally:
        backend.close()
    monkeypatch.delenv("AWS_ENDPOINT_URL")
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", f"http://127.0.0.1:{free_port()}")  # the S3 one wins
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_env.endpoint)
    assert "does not answer" in env_error(s3_config(tmp_path, s3_env, f"s3://{bucket}", s3Endpoint=""))


def test_no_credentials_at_all_is_anonymous_access_refused(tmp_path: Path, s3_env: SeaweedS3,  # noqa: F811
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    bucket = s3_env.new_bucket()
    s3_env.client().put_object(Bucket=bucket, Key="k", Body=b"k")
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    assert env_error(s3_config(tmp_path, s3_env, f"s3://{bucket}")).startswith(
        f"key 'source': {s3_env.endpoint} refused anonymous access (no credentials found) for bucket {bucket!r}")
