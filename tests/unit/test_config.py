"""Unit tests of the client config: parse_config, load_config, check_environment."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from cubefs_fuse import config
from cubefs_fuse.config import (
    CUBEFS_UNUSED_KEYS,
    KNOWN_KEYS,
    ClientConfig,
    check_environment,
    load_config,
    parse_config,
    parse_size,
    to_json_dict,
)
from cubefs_fuse.errors import ConfigError
from tests.helpers import REPO

BASE: dict[str, Any] = {"mountPoint": "/mnt/data", "volName": "ltptest", "source": "/nfs/data"}
KiB, MiB, GiB = 1024, 1024**2, 1024**3


def parse(**extra: Any) -> ClientConfig:
    return parse_config({**BASE, **extra})


def error_of(raw: Any) -> str:
    with pytest.raises(ConfigError) as info:
        parse_config(raw)
    message = str(info.value)
    assert "\n" not in message, "config errors are one line"
    return message


# -- every key -------------------------------------------------------------------------

# One valid, non-default JSON value per key and the field value it must become.
EVERY_KEY: dict[str, tuple[Any, str, Any]] = {
    "mountPoint": ("/cfs/mnt", "mount_point", "/cfs/mnt"),
    "volName": ("imagenet-1k_v2.0", "vol_name", "imagenet-1k_v2.0"),
    "source": ("s3://imagenet/train", "source", "s3://imagenet/train"),
    "owner": ("ltptest", "owner", "ltptest"),
    "logDir": ("/var/log/x", "log_dir", "/var/log/x"),
    "logLevel": ("debug", "log_level", "debug"),
    "exporterPort": (9500, "exporter_port", 9500),
    "exporterAddr": ("0.0.0.0", "exporter_addr", "0.0.0.0"),
    "profPort": ("27510", "prof_port", 27510),  # CubeFS writes ports as strings
    "profile": ("ai_prefetch", "profile", "ai_prefetch"),
    "memCacheSize": ("8GiB", "mem_cache_size", 8 * GiB),
    "diskCacheDir": ("/nvme/cache", "disk_cache_dir", "/nvme/cache"),
    "diskCacheSize": ("800Gi", "disk_cache_size", 800 * GiB),
    "diskFreeRatio": (0.25, "disk_free_ratio", 0.25),
    "blockSize": ("512KiB", "block_size", 512 * KiB),
    "lookupValid": (12, "lookup_valid", 12.0),
    "attrValid": ("2.5", "attr_valid", 2.5),
    "prefetchThreads": (4, "prefetch_threads", 4),
    "backendThreads": (64, "backend_threads", 64),
    "backendTimeout": (7.5, "backend_timeout", 7.5),
    "staleIfError": (False, "stale_if_error", False),
    "metaCacheEntries": (5000, "meta_cache_entries", 5000),
    "controlSocket": ("/run/cubefs-fuse/x.sock", "control_socket", "/run/cubefs-fuse/x.sock"),
    "configDir": ("/run/cubefs-fuse", "config_dir", "/run/cubefs-fuse"),
    "jobIdleTimeout": ("600", "job_idle_timeout", 600.0),
    "controlAllowUids": ([1000, 1001], "control_allow_uids", (1000, 1001)),
    "controlAllowGids": ([100], "control_allow_gids", (100,)),
    "sampleCacheMemSize": ("256MiB", "sample_cache_mem_size", 256 * MiB),
    "sampleCacheDiskSize": (0, "sample_cache_disk_size", 0),
    "sampleCacheShared": (["1000:imagenet-224"], "sample_cache_shared", ((1000, "imagenet-224"),)),
    "s3Endpoint": ("https://s3.example.com:9000/", "s3_endpoint", "https://s3.example.com:9000"),
    "s3Region": ("eu-west-1", "s3_region", "eu-west-1"),
    "s3PathStyle": (True, "s3_path_style", True),
    "s3Profile": ("training", "s3_profile", "training"),
}


def test_every_known_key_is_covered_here() -> None:
    assert set(EVERY_KEY) == set(KNOWN_KEYS)


def test_every_key_parses_to_its_field() -> None:
    cfg = parse_config({key: raw for key, (raw, _, _) in EVERY_KEY.items()})
    for key, (_, field, expected) in EVERY_KEY.items():
        assert getattr(cfg, field) == expected, key
        assert type(getattr(cfg, field)) is type(expected), key
    assert cfg.unused_keys == ()
    assert cfg.cache_dir == "/nvme/cache"
    # to_json_dict gives every key back under its JSON name.
    assert to_json_dict(cfg) == {key: expected for key, (_, _, expected) in EVERY_KEY.items()}


def test_defaults() -> None:
    cfg = parse()
    assert (cfg.mem_cache_size, cfg.disk_cache_size, cfg.block_size) == (1 * GiB, 10 * GiB, 1 * MiB)
    assert (cfg.lookup_valid, cfg.attr_valid, cfg.disk_free_ratio) == (30.0, 30.0, 0.10)
    assert cfg.exporter_port is None and cfg.prof_port is None
    assert cfg.exporter_addr == "127.0.0.1"  # loopback unless asked otherwise
    assert cfg.cache_dir == "/var/cache/cubefs-fuse/ltptest"
    assert cfg.profile == "" and cfg.log_level == "info"
    assert cfg.backend_timeout == 30.0
    assert cfg.stale_if_error is True  # cached files stay readable through an outage of the source


def test_exporter_port_null_means_off() -> None:
    assert parse(exporterPort=None).exporter_port is None


# -- sizes -----------------------------------------------------------------------------


TiB = 1024 * GiB
# Every size string a config may hold, good and bad: (raw, bytes) or (raw, what the error says).
# Units are powers of 1024 in both spellings (KiB and Kubernetes' Ki); K/M/G/T and KB/MB/GB/TB
# are refused (1000 or 1024 depending on the tool); bare integers are bytes.
SIZES: list[tuple[Any, int | str]] = [
    (0, 0),
    (4096, 4096),
    (1073741824, GiB),
    ("100", 100),
    ("0", 0),
    ("512B", 512),
    ("512 B", 512),
    ("64KiB", 64 * KiB),
    ("512MiB", 512 * MiB),
    ("8GiB", 8 * GiB),
    ("8 GiB", 8 * GiB),
    (" 8GiB ", 8 * GiB),
    ("2TiB", 2 * TiB),
    ("1.5GiB", 3 * GiB // 2),
    ("0.5KiB", 512),
    ("1.0", 1),
    ("64Ki", 64 * KiB),
    ("512Mi", 512 * MiB),
    ("10Gi", 10 * GiB),  # Kubernetes' Gi is binary, never decimal
    ("1Ti", TiB),
    ("1.5Gi", 3 * GiB // 2),
    ("64bananas", "has an unknown unit 'bananas'"),
    ("10Gibberish", "has an unknown unit 'Gibberish'"),
    ("10 Gbit", "has an unknown unit 'Gbit'"),
    ("8XiB", "has an unknown unit 'XiB'"),
    ("1PiB", "has an unknown unit 'PiB'"),
    ("8gib", "has an unknown unit 'gib' (did you mean 'GiB'?)"),
    ("8gi", "has an unknown unit 'gi' (did you mean 'Gi'?)"),
    ("8bytes", "has an unknown unit 'bytes'"),
    ("10G", "the unit 'G' means 1000 or 1024 depending on the tool; write 10GiB"),
    ("10K", "the unit 'K' means 1000 or 1024 depending on the tool; write 10KiB"),
    ("1.5GB", "the unit 'GB' means 1000 or 1024 depending on the tool; write 1.5GiB"),
    ("100MB", "write 100MiB"),
    ("1kB", "write 1KiB"),
    ("2T", "write 2TiB"),
    ("0.5", "is not a whole number of bytes (0.5)"),
    ("1.5", "is not a whole number of bytes"),
    ("0.3KiB", "is not a whole number of bytes (307.2)"),
    ("-5", "must not be negative"),
    ("-4KiB", "must not be negative"),
    (-1, "must not be negative"),
    ("lots", "cannot parse 'lots' as a size"),
    ("", "cannot parse '' as a size"),
    ("GiB", "cannot parse 'GiB' as a size"),
    ("1e9", "cannot parse '1e9' as a size"),
    ("0x10", "cannot parse '0x10' as a size"),
    ("+5", "cannot parse '+5' as a size"),
    ("8  GiB", "cannot parse '8  GiB' as a size"),
    ("8GiB8", "cannot parse '8GiB8' as a size"),
    ("1,5GiB", "cannot parse '1,5GiB' as a size"),
    (".5GiB", "cannot parse '.5GiB' as a size"),
    ("10\u00a0GiB", "cannot parse"),  # a no-break space
    ("\u0661\u0662GiB", "cannot parse"),  # Arabic-Indic digits
    ("9" * 41, "cannot parse"),
    ("99999999999TiB", "is out of range"),
    (True, "expected a size"),
    (1.5, "expected a size"),
    (None, "expected a size"),
]


def test_the_size_table_is_large() -> None:
    assert len(SIZES) >= 40 and sum(isinstance(e, int) for _, e in SIZES) >= 15


@pytest.mark.parametrize(("raw", "expected"), SIZES, ids=[repr(raw) for raw, _ in SIZES])
def test_sizes(raw: Any, expected: int | str) -> None:
    if isinstance(expected, int):
        assert parse_size("memCacheSize", raw) == expected
        assert parse(memCacheSize=raw).mem_cache_size == expected
        assert isinstance(parse(memCacheSize=raw).mem_cache_size, int)
        return
    message = error_of({**BASE, "diskCacheSize": raw})
    assert message.startswith("key 'diskCacheSize': ") and expected in message, message
    assert len(message) < 300, message


def test_the_size_units_are_documented_once() -> None:
    """docs/configuration.md says, in its Sizes section, which units mean what."""
    doc = (REPO / "docs" / "configuration.md").read_text()
    section = doc.split("## Sizes", 1)[1].split("\n## ", 1)[0]
    for unit in config.SIZE_UNITS:
        assert f"`{unit}`" in section, unit
    assert "powers of 1024" in section and "`G`" in section and "`GB`" in section
    assert "humanfriendly" not in doc


@pytest.mark.parametrize("raw", [True, 1.5, [1], {"GiB": 1}, None])
def test_sizes_of_the_wrong_type(raw: Any) -> None:
    message = error_of({**BASE, "memCacheSize": raw})
    assert message.startswith("key 'memCacheSize': expected a size")


def test_negative_size() -> None:
    assert "must not be negative" in error_of({**BASE, "memCacheSize": -1})


# -- wrong types and values ------------------------------------------------------------


@pytest.mark.parametrize(
    ("key", "raw", "expected"),
    [
        ("mountPoint", 5, "expected a string"),
        ("mountPoint", "", "must not be empty"),
        ("source", None, "expected a string"),
        ("volName", ["a"], "expected a string"),
        ("volName", "a/b", "is not a volume name"),
        ("volName", "x,allow_other", "is not a volume name"),  # would inject a mount option
        ("volName", "..", "is not a volume name"),
        ("volName", "", "is not a volume name"),
        ("logLevel", "loud", "is not one of"),
        ("logLevel", 3, "expected a string"),
        ("profile", "fast", "is not one of"),
        ("exporterPort", "http", "expected an integer"),
        ("exporterPort", 9500.0, "expected an integer"),
        ("exporterPort", True, "expected an integer"),
        ("exporterPort", 0, "outside 1..65535"),
        ("exporterPort", 65536, "outside 1..65535"),
        ("profPort", -1, "outside 1..65535"),
        ("diskFreeRatio", 1, "fraction in [0, 1)"),
        ("diskFreeRatio", -0.1, "fraction in [0, 1)"),
        ("diskFreeRatio", "0.1", "fraction in [0, 1)"),
        ("lookupValid", "soon", "expected a number of seconds"),
        ("attrValid", -1, "must not be negative"),
        ("attrValid", False, "expected a number of seconds"),
        ("attrValid", "inf", "expected a number of seconds"),
        ("prefetchThreads", 0, "must be at least 1"),
        ("backendThreads", 2.5, "expected an integer"),
        ("backendTimeout", 0, "must be more than 0 seconds"),
        ("backendTimeout", -3, "must not be negative"),
        ("backendTimeout", "never", "expected a number of seconds"),
        ("backendTimeout", "inf", "expected a number of seconds"),
        ("backendTimeout", None, "expected a number of seconds"),
        ("metaCacheEntries", "many", "expected an integer"),
        ("staleIfError", "false", "expected true or false"),
        ("staleIfError", 0, "expected true or false"),
        ("staleIfError", None, "expected true or false"),
        ("owner", 7, "expected a string"),
        ("configDir", "", "must not be empty"),
        ("jobIdleTimeout", 0, "more than 0 seconds"),
        ("jobIdleTimeout", -5, "must not be negative"),
        ("controlAllowUids", 1000, "expected a list of non-negative integer ids"),
        ("controlAllowUids", [-1], "expected a list of non-negative integer ids"),
        ("controlAllowGids", ["wheel"], "expected a list of non-negative integer ids"),
    ],
)
def test_wrong_types_and_values_name_the_key(key: str, raw: Any, expected: str) -> None:
    message = error_of({**BASE, key: raw})
    assert message.startswith(f"key {key!r}: "), message
    assert expected in message


def test_config_must_be_an_object() -> None:
    assert "must be a JSON object" in error_of([BASE])


# -- unknown, CubeFS and missing keys --------------------------------------------------


@pytest.mark.parametrize(
    ("typo", "suggestion"),
    [
        ("memCachSize", "memCacheSize"),
        ("diskcachedir", "diskCacheDir"),
        ("mountpoint", "mountPoint"),
        ("blocksize", "blockSize"),
        ("exporterport", "exporterPort"),
        ("lookupValidd", "lookupValid"),
    ],
)
def test_unknown_key_suggests_the_closest(typo: str, suggestion: str) -> None:
    assert error_of({**BASE, typo: 1}) == f"unknown key {typo!r} (did you mean {suggestion!r}?)"


def test_unknown_key_without_a_close_match() -> None:
    assert error_of({**BASE, "zzzzzz": 1}) == "unknown key 'zzzzzz'"


def test_cubefs_keys_are_accepted_and_reported_as_unused() -> None:
    cfg = parse(masterAddr="10.0.0.1:17010", consulAddr="http://c:8500", rdonly="true", icacheTimeout="10")
    assert cfg.unused_keys == ("consulAddr", "icacheTimeout", "masterAddr", "rdonly")
    # Any value is accepted for them: they are never interpreted.
    assert parse(**{key: {"any": [1]} for key in CUBEFS_UNUSED_KEYS}).unused_keys == tuple(sorted(CUBEFS_UNUSED_KEYS))


def test_cubefs_and_own_keys_do_not_overlap() -> None:
    assert not CUBEFS_UNUSED_KEYS & KNOWN_KEYS


@pytest.mark.parametrize("key", ["mountPoint", "volName", "source"])
def test_missing_required_key(key: str) -> None:
    raw = dict(BASE)
    del raw[key]
    assert error_of(raw) == f"missing required key {key!r}"


def test_a_pure_cubefs_config_asks_for_source() -> None:
    raw = {"mountPoint": "/cfs/mnt", "volName": "ltptest", "owner": "ltptest",
           "masterAddr": "10.196.59.198:17010", "logDir": "/cfs/log", "logLevel": "info", "profPort": "27510"}
    assert error_of(raw) == "missing required key 'source'"


# -- block size bounds and paths -------------------------------------------------------


@pytest.mark.parametrize("ok", [4 * KiB, 8 * KiB, "1MiB", "64MiB", 4 * MiB + 4 * KiB])
def test_block_size_in_bounds(ok: Any) -> None:
    assert parse(blockSize=ok).block_size == parse_size("blockSize", ok)


@pytest.mark.parametrize("bad", [0, 2 * KiB, 4 * KiB - 1, 4 * KiB + 1, "65MiB", "128MiB", "1GiB"])
def test_block_size_out_of_bounds(bad: Any) -> None:
    message = error_of({**BASE, "blockSize": bad})
    assert message.startswith("key 'blockSize': ")
    assert "between 4KiB and 64MiB" in message


@pytest.mark.parametrize("key", ["mountPoint", "source", "diskCacheDir", "logDir", "controlSocket", "configDir"])
def test_relative_paths_are_rejected(key: str) -> None:
    assert error_of({**BASE, key: "relative/dir"}) == f"key {key!r}: 'relative/dir' is not an absolute path"


# -- load_config -----------------------------------------------------------------------


def test_load_config(tmp_path: Path) -> None:
    path = tmp_path / "client.json"
    path.write_text(json.dumps({**BASE, "memCacheSize": "2GiB"}))
    assert load_config(str(path)).mem_cache_size == 2 * GiB


def load_error(path: Path) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(str(path))
    message = str(info.value)
    assert "\n" not in message
    return message


def test_load_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "nope.json"
    assert load_error(path) == f"cannot read config file {str(path)!r}: No such file or directory"


def test_load_directory(tmp_path: Path) -> None:
    assert "cannot read config file" in load_error(tmp_path)


def test_load_invalid_json(tmp_path: Path) -> None:
    path = tmp_path / "client.json"
    path.write_text('{"mountPoint": "/mnt",\n "volName": }')
    message = load_error(path)
    assert message.startswith(f"config file {str(path)!r} is not valid JSON: ")
    assert "line 2" in message


def test_load_not_utf8(tmp_path: Path) -> None:
    path = tmp_path / "client.json"
    path.write_bytes(b'{"volName": "\xff"}')
    assert "is not UTF-8" in load_error(path)


def test_load_names_file_and_key(tmp_path: Path) -> None:
    path = tmp_path / "client.json"
    path.write_text(json.dumps({**BASE, "memCachSize": "1GiB"}))
    assert load_error(path) == f"config file {str(path)!r}: unknown key 'memCachSize' (did you mean 'memCacheSize'?)"


# -- the shipped example configs -------------------------------------------------------


EXAMPLES = sorted((REPO / "configs").glob("*.json"))


def test_examples_exist() -> None:
    assert {"minimal.json", "nfs-dataset.json", "cubefs-compatible.json"} <= {p.name for p in EXAMPLES}


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_example_configs_parse(path: Path) -> None:
    cfg = load_config(str(path))
    assert cfg.profile != "ai_prefetch", "ai_prefetch is not built yet; no example may rely on it"
    if path.name == "cubefs-compatible.json":
        assert "masterAddr" in cfg.unused_keys
    else:
        assert cfg.unused_keys == ()


def test_production_example() -> None:
    cfg = load_config(str(REPO / "configs" / "nfs-dataset.json"))
    assert cfg.mem_cache_size == 8 * GiB
    assert cfg.disk_cache_dir and cfg.exporter_port is not None


def test_examples_keys_are_documented_in_configs_readme() -> None:
    readme = (REPO / "configs" / "README.md").read_text()
    for path in EXAMPLES:
        assert path.name in readme
        for key in json.loads(path.read_text()):
            assert f"`{key}`" in readme, f"{path.name}: key {key} not explained in configs/README.md"


def test_every_key_is_documented() -> None:
    doc = (REPO / "docs" / "configuration.md").read_text()
    for key in sorted(KNOWN_KEYS | CUBEFS_UNUSED_KEYS):
        assert f"`{key}`" in doc, f"{key} missing from docs/configuration.md"


# -- check_environment -----------------------------------------------------------------


def env_config(tmp_path: Path, **extra: Any) -> ClientConfig:
    source, mnt = tmp_path / "source", tmp_path / "mnt"
    source.mkdir(exist_ok=True)
    mnt.mkdir(exist_ok=True)
    return parse_config({"mountPoint": str(mnt), "volName": "t", "source": str(source),
                         "diskCacheDir": str(tmp_path / "cache"), **extra})


def env_error(cfg: ClientConfig) -> str:
    with pytest.raises(ConfigError) as info:
        check_environment(cfg)
    message = str(info.value)
    assert "\n" not in message
    return message


def test_environment_ok_creates_cache_dir(tmp_path: Path) -> None:
    cfg = env_config(tmp_path, logDir=str(tmp_path / "log" / "deep"))
    check_environment(cfg)
    assert (tmp_path / "cache").is_dir() and (tmp_path / "log" / "deep").is_dir()
    assert os.listdir(tmp_path / "cache") == []  # the write probe leaves nothing behind


def test_environment_source_missing(tmp_path: Path) -> None:
    cfg = env_config(tmp_path, source=str(tmp_path / "gone"))
    assert env_error(cfg) == f"key 'source': {str(tmp_path / 'gone')!r} does not exist"


def test_environment_source_is_a_file(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    cfg = env_config(tmp_path, source=str(tmp_path / "file"))
    assert env_error(cfg) == f"key 'source': {str(tmp_path / 'file')!r} is not a directory"


def test_environment_mount_point_missing(tmp_path: Path) -> None:
    cfg = env_config(tmp_path, mountPoint=str(tmp_path / "nomnt"))
    assert env_error(cfg).startswith("key 'mountPoint': ")
    assert "does not exist" in env_error(cfg)


def test_environment_mount_point_not_empty(tmp_path: Path) -> None:
    cfg = env_config(tmp_path)
    (tmp_path / "mnt" / "leftover").write_text("x")
    assert env_error(cfg) == f"key 'mountPoint': {str(tmp_path / 'mnt')!r} is not empty"


def test_environment_mount_point_is_source(tmp_path: Path) -> None:
    cfg = env_config(tmp_path, mountPoint=str(tmp_path / "source"))
    assert env_error(cfg) == "key 'mountPoint': must differ from 'source'"


def test_environment_cache_dir_under_a_file(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    cfg = env_config(tmp_path, diskCacheDir=str(tmp_path / "file" / "cache"))
    message = env_error(cfg)
    assert message.startswith("key 'diskCacheDir': cannot create ")
    assert "Not a directory" in message


def test_environment_cache_dir_is_a_file(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    cfg = env_config(tmp_path, diskCacheDir=str(tmp_path / "file"))
    assert env_error(cfg).startswith("key 'diskCacheDir': ")


def test_environment_log_dir_unusable(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    cfg = env_config(tmp_path, logDir=str(tmp_path / "file" / "log"))
    assert env_error(cfg).startswith("key 'logDir': cannot create ")


def test_environment_of_a_mount_taken_over_skips_mount_point_checks(tmp_path: Path) -> None:
    # An upgrade's mount point is the live mount it takes over: its checks are skipped ...
    missing = env_config(tmp_path, mountPoint=str(tmp_path / "nomnt"))
    assert "does not exist" in env_error(missing)
    assert not (tmp_path / "cache").exists()  # the failed check stopped before the cache dir
    check_environment(missing, mounted=True)
    assert (tmp_path / "cache").is_dir()  # ... and goes on to the checks after them
    (tmp_path / "mnt" / "leftover").write_text("x")
    not_empty = env_config(tmp_path)
    assert "is not empty" in env_error(not_empty)
    check_environment(not_empty, mounted=True)
    # ... but not the other checks.
    for changes, expected in (({"source": str(tmp_path / "gone")}, "key 'source': "),
                              ({"mountPoint": str(tmp_path / "source")}, "must differ from 'source'"),
                              ({"logDir": str(tmp_path / "mnt" / "leftover" / "log")}, "key 'logDir': ")):
        with pytest.raises(ConfigError, match=expected):
            check_environment(env_config(tmp_path, **changes), mounted=True)


def test_defaults_module_constants_are_consistent() -> None:
    assert config.MIN_BLOCK_SIZE <= config.DEFAULT_BLOCK_SIZE <= config.MAX_BLOCK_SIZE
    assert set(config.REQUIRED_KEYS) <= KNOWN_KEYS


# -- numbers that do not parse, nesting, overlapping paths, controlSocket, configDir ----------

HUGE = int("9" * 4000)  # under Python's int-str limit, so json can produce it


@pytest.mark.parametrize(("key", "raw"), [
    (key, raw)
    for key in ("exporterPort", "prefetchThreads", "backendThreads", "metaCacheEntries")
    for raw in ("١٢٣", "²", "٩٥٠٠", "9" * 5000, "9" * 20, HUGE, -HUGE, 1.5, "1.5", float("nan"), float("inf"),
                "nan", "inf", -1, "-1", True, False)
] + [
    (key, raw)
    for key in ("memCacheSize", "diskCacheSize", "blockSize")
    for raw in ("١٢٣", "²", "9" * 5000, HUGE, -HUGE, 1.5, float("nan"), float("inf"), "nan", "inf", "-1",
                True, "1e400")
] + [
    (key, raw)
    for key in ("lookupValid", "attrValid")
    for raw in ("١٢٣", "²", "9" * 5000, HUGE, -HUGE, float("nan"), float("inf"), "nan", "inf", "1e400", "-1",
                -1, True)
] + [("diskFreeRatio", raw) for raw in (HUGE, float("nan"), float("inf"), -1, True, "0.1")]
  + [("controlAllowUids", raw) for raw in ([HUGE], [1 << 32], [-1], [1.0], [True])])
def test_numbers_that_do_not_parse_are_one_line(key: str, raw: Any) -> None:
    message = error_of({**BASE, key: raw})
    assert message.startswith(f"key {key!r}: ") and len(message) < 300, message


@pytest.mark.parametrize("text", [
    '{"volName": "v", "memCacheSize": ' + "9" * 5000 + "}",  # past Python's int-str limit
    "[" * 100_000 + "]" * 100_000,  # RecursionError in json.loads
    '{"volName": ' + "[" * 100_000 + "]" * 100_000 + "}",
])
def test_load_unparsable_json_is_one_line(tmp_path: Path, text: str) -> None:
    path = tmp_path / "client.json"
    path.write_text(text)
    message = load_error(path)
    assert message.startswith(f"config file {str(path)!r} is not valid JSON: ") and len(message) < 300, message


def overlap_tree(tmp_path: Path) -> dict[str, Path]:
    dirs = {name: tmp_path / name for name in ("source", "mnt", "cache", "data")}
    for d in dirs.values():
        d.mkdir(exist_ok=True)
    (tmp_path / "link-to-source").symlink_to(dirs["source"])
    return dirs


@pytest.mark.parametrize(("changes", "key"), [
    ({"diskCacheDir": "{source}"}, "diskCacheDir"),
    ({"diskCacheDir": "{source}/cache"}, "diskCacheDir"),
    ({"diskCacheDir": "{link}/cache"}, "diskCacheDir"),  # through a symlink
    ({"source": "{cache}/data", "diskCacheDir": "{cache}"}, "source"),
    ({"mountPoint": "{source}/mnt"}, "mountPoint"),
    ({"mountPoint": "{link}/mnt"}, "mountPoint"),
    ({"source": "{mnt}/src"}, "source"),
    ({"diskCacheDir": "{mnt}"}, "diskCacheDir"),
    ({"diskCacheDir": "{mnt}/cache"}, "diskCacheDir"),
    ({"mountPoint": "{cache}/mnt"}, "mountPoint"),
    ({"logDir": "{source}/log"}, "logDir"),
    ({"logDir": "{mnt}/log"}, "logDir"),
])
def test_environment_overlapping_paths_are_refused_before_anything_is_created(
        tmp_path: Path, changes: dict[str, str], key: str) -> None:
    dirs = overlap_tree(tmp_path)
    names = {"source": dirs["source"], "mnt": dirs["mnt"], "cache": dirs["cache"], "link": tmp_path / "link-to-source"}
    for sub in ("source/mnt", "cache/data", "cache/mnt", "mnt/src"):  # what the cases name as existing dirs
        (tmp_path / sub).mkdir()
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    resolved = {k: v.format(**names) for k, v in changes.items()}
    cfg = parse_config({"mountPoint": str(dirs["mnt"]), "volName": "t", "source": str(dirs["source"]),
                        "diskCacheDir": str(dirs["cache"]), **resolved})
    message = env_error(cfg)
    assert message.startswith(f"key {key!r}: ") and ("must not overlap" in message or "is inside" in message), message
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before  # nothing created


def test_environment_control_socket_that_is_not_a_socket_is_refused(tmp_path: Path) -> None:
    victim = tmp_path / "precious.txt"
    victim.write_text("data")
    (tmp_path / "link").symlink_to(victim)
    for path in (victim, tmp_path / "link", tmp_path / "source"):
        message = env_error(env_config(tmp_path, controlSocket=str(path)))
        assert message == f"key 'controlSocket': {str(path)!r} exists and is not a socket: refusing to replace it"
    assert victim.read_text() == "data"
    check_environment(env_config(tmp_path, controlSocket=str(tmp_path / "new.sock")))  # absent: fine


def test_environment_config_dir_must_exist_for_ai_prefetch(tmp_path: Path) -> None:
    missing = tmp_path / "nocfg"
    cfg = env_config(tmp_path, profile="ai_prefetch", configDir=str(missing))
    assert env_error(cfg) == f"key 'configDir': {str(missing)!r} does not exist or is not a directory"
    assert not missing.exists()
    check_environment(env_config(tmp_path, configDir=str(missing)))  # unused without ai_prefetch


@pytest.mark.parametrize("value", [["imagenet"], ["x:imagenet"], ["1000:"], ["1000:.."], ["1000:a/b"], "1000:a",
                                   [1000], ["99999999999:a"]])
def test_sample_cache_shared_names_an_owner_uid_and_a_cache(value: Any) -> None:
    assert "sampleCacheShared" in error_of({**BASE, "sampleCacheShared": value})


# -- check_fuse_access: what a user who cannot mount is missing ---------------------------


def fuse_error(device: Path, fuse_conf: Path) -> str:
    with pytest.raises(ConfigError) as info:
        config.check_fuse_access(str(device), str(fuse_conf))
    assert "\n" not in str(info.value)
    return str(info.value)


def refuse_open(monkeypatch: pytest.MonkeyPatch, device: Path) -> None:
    """The device as a user without access sees it (root opens any file)."""
    real_open = os.open

    def opener(path: Any, flags: int, *args: Any, **kwargs: Any) -> int:
        if str(path) == str(device):
            raise PermissionError(13, "Permission denied")
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", opener)


@pytest.mark.parametrize("allow_other", [False, True])
def test_fuse_access_of_a_user_names_the_device_and_user_allow_other(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, allow_other: bool) -> None:
    device, conf = tmp_path / "fuse", tmp_path / "fuse.conf"
    device.write_text("")
    os.chmod(device, 0o600)
    conf.write_text("# comment\nuser_allow_other\n" if allow_other else "#user_allow_other\n")
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    config.check_fuse_access(str(device), str(conf))  # openable: nothing missing
    refuse_open(monkeypatch, device)
    st = device.stat()
    expected = (f"cannot mount as uid 1000 (not root): {device} is -rw------- uid {st.st_uid} gid {st.st_gid}, not "
                f"readable and writable by this user: run the daemon as root, or give its user access to {device} "
                "(mode 0666 is the usual default)")
    if not allow_other:
        expected += f"; and add user_allow_other to {conf}, or only uid 1000 can read the mount"
    assert fuse_error(device, conf) == expected


def test_fuse_access_without_the_device_or_as_root_in_a_container(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    device, conf = tmp_path / "fuse", tmp_path / "fuse.conf"
    assert fuse_error(device, conf) == (f"cannot mount: {device} does not exist: load the fuse kernel module "
                                        f"(modprobe fuse); a container needs the device passed in (--device {device})")
    device.write_text("")
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    refuse_open(monkeypatch, device)
    assert fuse_error(device, conf) == (f"cannot mount: {device}: Permission denied: a container needs the device "
                                        f"(--device {device}) and CAP_SYS_ADMIN")


# -- an s3:// source -------------------------------------------------------------------


@pytest.mark.parametrize(("url", "expected"), [
    ("s3://imagenet", ("imagenet", "")),
    ("s3://imagenet/", ("imagenet", "")),
    ("s3://my.bucket-1/train", ("my.bucket-1", "train/")),
    ("s3://abc/a/b/c//", ("abc", "a/b/c/")),
])
def test_s3_source_is_bucket_and_prefix(url: str, expected: tuple[str, str]) -> None:
    cfg = parse(source=url)
    assert cfg.s3_source == expected and cfg.source == url
    assert (cfg.s3_endpoint, cfg.s3_region, cfg.s3_path_style, cfg.s3_profile) == ("", "", None, "")
    assert parse().s3_source is None  # a directory


@pytest.mark.parametrize(("changes", "expected"), [
    ({"source": "s3://ab/x"}, "key 'source': 'ab' in 's3://ab/x' is not a bucket name (3-63 lowercase letters, digits, '.', '-')"),
    ({"source": "s3://Bucket"}, "key 'source': 'Bucket' in 's3://Bucket' is not a bucket name"),
    ({"source": "s3://"}, "key 'source': '' in 's3://' is not a bucket name"),
    ({"source": "s3://bkt/a/../b"}, "key 'source': the prefix 'a/../b' of 's3://bkt/a/../b' has an empty, '.' or '..' component"),
    ({"source": "s3://bkt/a//b"}, "key 'source': the prefix 'a//b' of 's3://bkt/a//b' has an empty"),
    ({"source": "s3:/bkt"}, "key 'source': 's3:/bkt' is not an absolute path"),
    ({"s3Endpoint": "http://minio:9000"}, "key 's3Endpoint': only for an s3:// source (the source is a directory)"),
    ({"s3PathStyle": False}, "key 's3PathStyle': only for an s3:// source"),
    ({"source": "s3://bkt", "s3Endpoint": "minio:9000"}, "key 's3Endpoint': 'minio:9000' is not an endpoint URL (http[s]://host[:port])"),
    ({"source": "s3://bkt", "s3Endpoint": "http://minio:9000/path"}, "key 's3Endpoint': 'http://minio:9000/path' is not an endpoint URL"),
    ({"source": "s3://bkt", "s3PathStyle": "yes"}, "key 's3PathStyle': expected true, false or null, got str 'yes'"),
    ({"source": "s3://bkt", "s3Region": 1}, "key 's3Region': expected a string, got int 1"),
    ({"source": "s3://bkt", "secretKey": "hunter2"}, "key 'secretKey': credentials are never read from the config"),
])
def test_s3_source_mistakes_are_one_line_naming_the_key(changes: dict[str, Any], expected: str) -> None:
    assert error_of({**BASE, **changes}).startswith(expected)


def test_cubefs_credential_keys_stay_ignored_with_a_directory_source() -> None:
    assert parse(accessKey="AK", secretKey="SK").unused_keys == ("accessKey", "secretKey")
    assert parse(s3Endpoint="", s3PathStyle=None).s3_source is None  # empty values are no setting
