"""The JSON client config (docs/configuration.md): :func:`parse_config` is pure, turning a
JSON object into a frozen :class:`ClientConfig` or raising :class:`ConfigError` with one
line naming the key, and :func:`check_environment` then checks what it points at (source,
mount point, cache dir), separately, so that tests and tools can parse configs of other
machines."""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import os
import re
import shutil
import stat
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import Any

from cubefs_fuse.errors import ConfigError
from cubefs_fuse.limits import DIGITS, DIGITS_PATTERN, is_sample_cache_name

KiB = 1024
MiB = 1024 * KiB
GiB = 1024 * MiB

# Keys of CubeFS's own client config that have no meaning here.  They are accepted so
# an existing CubeFS config keeps working, and reported once at start-up as unused.
CUBEFS_UNUSED_KEYS = frozenset(
    {
        "masterAddr", "consulAddr", "accessKey", "secretKey", "rdonly", "writecache",
        "keepcache", "icacheTimeout", "enSyncWrite", "autoInvalData", "maxcpus",
        "enablePosixACL", "subdir", "fsyncOnClose", "followerRead", "authenticate",
        "ticketHost", "enableHTTPS", "token", "readRate", "writeRate", "enableXattr",
        "nearRead", "bcacheDir", "bcacheCheckIntervalS", "bcacheFilterFiles",
        "bcacheBatchCnt", "enableBcache", "maxStreamerLimit", "buffersTotalLimit",
        "enableAudit", "lookupValid_ms", "warnLogDir", "pidFile", "clientKey", "allowOther",
        "readThreads", "writeThreads", "mountOptions", "metaAddr",
    }
)

PROFILES = ("", "default", "ai_prefetch")
LOG_LEVELS = ("debug", "info", "warn", "warning", "error")

# Block size bounds: below 4 KiB a block is smaller than a page and costs more in
# per-block bookkeeping than it saves; above 64 MiB one miss would pin too much RAM.
MIN_BLOCK_SIZE = 4 * KiB
MAX_BLOCK_SIZE = 64 * MiB
# 1 MiB: a ~110 KB image is one block, and a large file is read in units that amortise a
# remote round trip (a 1 MiB read at 1 GB/s costs ~1 ms, comparable to the latency).
DEFAULT_BLOCK_SIZE = 1 * MiB


# Seconds without an open or a plan after which a job the daemon cannot watch (pid 0:
# another pid namespace) or a plan of a job never registered ends.  30 minutes outlast
# what a training job does between epochs without reading (validation on other data,
# checkpointing), and bound what a churn of short container jobs leaves registered.
DEFAULT_JOB_IDLE_TIMEOUT = 1800.0


# The sample store's budgets.  RAM: decoded samples are larger than their files (a
# 224x224x3 uint8 image is 150 KB), 1 GiB holds the hot part of a few thousand of them
# beside the block cache's own 1 GiB default; NVMe: 10 GiB, the block cache's default
# size, holds ~70,000 such samples (an ImageNet-scale run at 224 px needs ~190 GB: size
# it with the dataset).  Memory and disk are only used as entries arrive.
DEFAULT_SAMPLE_CACHE_MEM_SIZE = 1 * GiB
DEFAULT_SAMPLE_CACHE_DISK_SIZE = 10 * GiB


@dataclass(frozen=True, slots=True)
class ClientConfig:
    mount_point: str
    vol_name: str
    source: str
    owner: str = ""
    log_dir: str = ""
    log_level: str = "info"
    exporter_port: int | None = None
    exporter_addr: str = "127.0.0.1"
    prof_port: int | None = None
    profile: str = ""
    mem_cache_size: int = 1 * GiB
    disk_cache_dir: str = ""
    disk_cache_size: int = 10 * GiB
    disk_free_ratio: float = 0.10
    block_size: int = DEFAULT_BLOCK_SIZE
    lookup_valid: float = 30.0
    attr_valid: float = 30.0
    # Fetches prefetch may have in flight, and the backend's worker threads (every fetch's
    # slot).  A plan's files/s is at most its fetches in flight over a file's latency at
    # the source: 48 keep ~2,700 files/s against 9 round trips of 2 ms (an NFS-like remote
    # without attribute caching) and 4,800 against a 10 ms GET, where 16 capped the
    # suite's cold raw-I/O epoch at ~700-800 files/s (2026-11-30); 64 threads leave the
    # application's reads 16 slots of their own.
    prefetch_threads: int = 48
    backend_threads: int = 64
    # Seconds any one backend operation may take before the caller gets EIO and the
    # backend counts as down (docs/concurrency.md, "Never stuck"; backends/deadline.py).  30 s
    # is thousands of times a healthy remote's latency (ms; an NFS soft mount gives up
    # after 60 s) and still short enough that a reader sees an error, not a dead process.
    backend_timeout: float = 30.0
    # While the source counts as down, serve files the cache holds whole at the version
    # last validated instead of failing them with EIO (fs/outage.py, docs/contracts.md,
    # "Outages of the source").  On: a training job reads a dataset that does not change
    # under it, and a remote's failover of seconds must not kill a run of days whose data
    # is all local; the bytes are always those of one version the source gave.
    stale_if_error: bool = True
    meta_cache_entries: int = 1_000_000
    control_socket: str = ""
    control_allow_uids: tuple[int, ...] = ()
    control_allow_gids: tuple[int, ...] = ()
    # The per-volume file's directory: the key, else $CUBE_TORCH_CONFIG_DIR (what cube_torch
    # reads too), else /tmp, CubeFS's place.
    config_dir: str = dataclasses.field(default_factory=lambda: os.environ.get("CUBE_TORCH_CONFIG_DIR") or "/tmp")
    job_idle_timeout: float = DEFAULT_JOB_IDLE_TIMEOUT
    # The processed-sample cache's daemon store (cubefs_fuse/samples/; 0 turns a tier off).
    sample_cache_mem_size: int = DEFAULT_SAMPLE_CACHE_MEM_SIZE
    sample_cache_disk_size: int = DEFAULT_SAMPLE_CACHE_DISK_SIZE
    sample_cache_shared: tuple[tuple[int, str], ...] = ()  # (owner uid, name) every allowed uid may read
    # An s3:// source's client settings (docs/configuration.md, "An S3 bucket as the source");
    # empty / None: what the AWS credential chain says.  Never credentials.
    s3_endpoint: str = ""
    s3_region: str = ""
    s3_path_style: bool | None = None
    s3_profile: str = ""
    unused_keys: tuple[str, ...] = ()

    @property
    def s3_source(self) -> tuple[str, str] | None:
        """(bucket, prefix) of an ``s3://`` source, the prefix "" or ending in "/"; None
        for a directory source."""
        return split_s3_url(self.source) if self.source.startswith(S3_SCHEME) else None

    @property
    def cache_dir(self) -> str:
        """The NVMe tier directory; defaults to a per-volume directory."""
        return self.disk_cache_dir or f"/var/cache/cubefs-fuse/{self.vol_name}"


# -- value parsers: each takes (key, raw value) and returns the typed value ------------


def _type_name(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def _string(key: str, value: Any) -> str:
    if not isinstance(value, str):
        raise ConfigError(f"key {key!r}: expected a string, got {_type_name(value)} {value!r}")
    return value


def _nonempty_string(key: str, value: Any) -> str:
    text = _string(key, value)
    if not text.strip():
        raise ConfigError(f"key {key!r}: must not be empty")
    return text


# Volume names as CubeFS allows them (letters, digits, '_', '.', '-'; starting with a
# letter or digit; at most 63).  The name goes into file names and the fsname= mount
# option, so '/', ',' and whitespace must never get through.
_VOL_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,62}")


def _vol_name(key: str, value: Any) -> str:
    text = _string(key, value)
    if not _VOL_NAME.fullmatch(text):
        raise ConfigError(f"key {key!r}: {text!r} is not a volume name (1-63 letters, digits, '_', '.', '-')")
    return text


def _port(key: str, value: Any) -> int | None:
    if value is None:
        return None
    number = _integer(key, value)
    if not 0 < number < 65536:
        raise ConfigError(f"key {key!r}: port {number} is outside 1..65535")
    return number


# The largest number any key takes: sizes and counts end up in int64 fields (the kernel's,
# numpy's), so anything beyond is a mistake, and refusing it before int() or float() keeps
# Python's 4300-digit int-str limit and float overflow from ever being reached.
MAX_NUMBER = (1 << 63) - 1
# Seconds, quoted: ASCII decimal notation, at most 19 digits before and 9 after the point.
_DECIMAL = re.compile(DIGITS_PATTERN + r"(\.[0-9]{1,9})?")


def _shown(value: Any) -> str:
    """``value`` for an error line: its repr, cut to 60 characters (a 5,000-digit number)."""
    text = repr(value)
    return text if len(text) <= 60 else f"{text[:40]}...({len(text)} characters)"


def _integer(key: str, value: Any) -> int:
    # CubeFS configs often quote numbers ("exporterPort": "9500"); accept digit strings.
    if isinstance(value, str) and DIGITS.fullmatch(value.strip()):
        value = int(value.strip())
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"key {key!r}: expected an integer, got {_type_name(value)} {_shown(value)}")
    if not -MAX_NUMBER <= value <= MAX_NUMBER:
        raise ConfigError(f"key {key!r}: {_shown(value)} is out of range")
    return value


def _positive_int(key: str, value: Any) -> int:
    number = _integer(key, value)
    if number < 1:
        raise ConfigError(f"key {key!r}: must be at least 1, got {number}")
    return number


def _seconds(key: str, value: Any) -> float:
    if isinstance(value, str):
        if not _DECIMAL.fullmatch(value.strip()):
            raise ConfigError(f"key {key!r}: expected a number of seconds, got {_shown(value)}")
        value = float(value)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"key {key!r}: expected a number of seconds, got {_type_name(value)} {_shown(value)}")
    if isinstance(value, int) and abs(value) > MAX_NUMBER:  # float() of it would overflow
        raise ConfigError(f"key {key!r}: {_shown(value)} is out of range")
    if not math.isfinite(value):
        raise ConfigError(f"key {key!r}: expected a number of seconds, got {_type_name(value)} {value!r}")
    if value < 0:
        raise ConfigError(f"key {key!r}: must not be negative, got {value}")
    return float(value)


def _positive_seconds(key: str, value: Any) -> float:
    seconds = _seconds(key, value)
    if seconds <= 0:
        raise ConfigError(f"key {key!r}: must be more than 0 seconds, got {value!r}")
    return seconds


def _ratio(key: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < 1:
        raise ConfigError(f"key {key!r}: expected a fraction in [0, 1), got {_shown(value)}")
    return float(value)


# Size units, all powers of 1024: the IEC spelling (KiB ... TiB) and Kubernetes' quantity
# suffixes (Ki ... Ti), so a value copied from a manifest means the same here.  "B" is bytes.
SIZE_UNITS = {"B": 1, "KiB": KiB, "MiB": MiB, "GiB": GiB, "TiB": 1024 * GiB,
              "Ki": KiB, "Mi": MiB, "Gi": GiB, "Ti": 1024 * GiB}
# Units refused because readers disagree on them: Kubernetes and SI read K/M/G/T (and KB,
# MB, ...) as powers of 1000, systemd, the JVM and many tools as powers of 1024.  Each
# maps to the binary unit the error suggests.
_AMBIGUOUS_UNITS = {"K": "KiB", "M": "MiB", "G": "GiB", "T": "TiB", "k": "KiB",
                    "KB": "KiB", "MB": "MiB", "GB": "GiB", "TB": "TiB", "kB": "KiB"}
# A size string: ASCII digits, an optional fraction of the unit ("1.5GiB"; at most 9
# digits, as for seconds: a size that needs finer is written in a smaller unit), an
# optional space, then letters (the unit, checked against SIZE_UNITS).  A leading "-" is
# matched only to say "negative" rather than "cannot parse".
_SIZE = re.compile(r"(?P<number>-?" + DIGITS_PATTERN + r")(?:\.(?P<fraction>[0-9]{1,9}))? ?(?P<unit>[A-Za-z]*)")
_SIZE_EXAMPLES = 'examples: 1073741824, "512MiB", "8GiB", "8Gi"'


def parse_size(key: str, value: Any) -> int:
    """Bytes from an integer or a ``"512MiB"``/``"8GiB"``/``"8Gi"`` string (docs/configuration.md,
    "Sizes"): units are powers of 1024; anything else is a ConfigError naming the key."""
    if isinstance(value, bool):
        raise ConfigError(f"key {key!r}: expected a size like 1073741824 or \"1GiB\", got {value!r}")
    if isinstance(value, int):
        size = value
    elif isinstance(value, str):
        size = _size_string(key, value)
    else:
        raise ConfigError(f"key {key!r}: expected a size like 1073741824 or \"1GiB\", got {_type_name(value)} {_shown(value)}")
    if size < 0:
        raise ConfigError(f"key {key!r}: size must not be negative, got {_shown(value)}")
    if size > MAX_NUMBER:
        raise ConfigError(f"key {key!r}: {_shown(value)} is out of range")
    return size


def _size_string(key: str, value: str) -> int:
    # At most 40 characters: "1099511627776 B" has 15; a longer string is no size.
    text = value.strip()
    match = _SIZE.fullmatch(text) if text.isascii() and len(text) <= 40 else None
    if match is None:
        raise ConfigError(f"key {key!r}: cannot parse {_shown(value)} as a size ({_SIZE_EXAMPLES})")
    number, fraction, unit = match.group("number", "fraction", "unit")
    if number.startswith("-"):
        raise ConfigError(f"key {key!r}: size must not be negative, got {value!r}")
    if unit in _AMBIGUOUS_UNITS:
        binary = _AMBIGUOUS_UNITS[unit]
        raise ConfigError(f"key {key!r}: {value!r}: the unit {unit!r} means 1000 or 1024 depending on the tool; "
                          f"write {number}{'.' + fraction if fraction else ''}{binary} (powers of 1024) or a byte count")
    factor = SIZE_UNITS.get(unit or "B")
    if factor is None:
        close = [u for u in SIZE_UNITS if u.lower() == unit.lower()]
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ConfigError(f"key {key!r}: {value!r} has an unknown unit {unit!r}{hint}; sizes are bytes or a "
                          f"number with KiB, MiB, GiB, TiB (or Ki, Mi, Gi, Ti), all powers of 1024")
    exact = Fraction(int(number + (fraction or "")), 10 ** len(fraction or "")) * factor
    if exact.denominator != 1:
        raise ConfigError(f"key {key!r}: {value!r} is not a whole number of bytes ({float(exact):.1f})")
    return int(exact)


# uids and gids are 32-bit; (uid_t)-1 means "no change" to the kernel, never a real id.
_MAX_ID = (1 << 32) - 2


def _id_list(key: str, value: Any) -> tuple[int, ...]:
    if not isinstance(value, list) or not all(isinstance(v, int) and not isinstance(v, bool)
                                              and 0 <= v <= _MAX_ID for v in value):
        raise ConfigError(f"key {key!r}: expected a list of non-negative integer ids (at most {_MAX_ID}), got {_shown(value)}")
    return tuple(value)


def _shared_samples(key: str, value: Any) -> tuple[tuple[int, str], ...]:
    """``["<owner uid>:<name>", ...]``: sample caches every allowed uid may read."""
    out: list[tuple[int, str]] = []
    if isinstance(value, list):
        for item in value:
            uid, _, name = item.partition(":") if isinstance(item, str) else ("", "", "")
            if not (uid.isascii() and uid.isdigit() and len(uid) <= 10 and int(uid) <= _MAX_ID
                    and is_sample_cache_name(name)):
                break
            out.append((int(uid), name))
        else:
            return tuple(out)
    raise ConfigError(f"key {key!r}: expected a list of \"<owner uid>:<sample cache name>\" strings, got {_shown(value)}")


S3_SCHEME = "s3://"
# Bucket names as S3 allows them: 3-63 lowercase letters, digits, '.' and '-', starting
# and ending with a letter or digit.
_BUCKET = re.compile(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]")


def split_s3_url(url: str) -> tuple[str, str]:
    """``s3://bucket/some/prefix`` -> ("bucket", "some/prefix/"); ConfigError naming
    ``source`` if the bucket name is not one or a prefix component is empty, ``.`` or ``..``
    (no key path could reach it through a directory tree)."""
    bucket, _, prefix = url[len(S3_SCHEME):].partition("/")
    if not _BUCKET.fullmatch(bucket):
        raise ConfigError(f"key 'source': {bucket!r} in {url!r} is not a bucket name "
                          "(3-63 lowercase letters, digits, '.', '-')")
    prefix = prefix.rstrip("/")
    if prefix and any(part in ("", ".", "..") for part in prefix.split("/")):
        raise ConfigError(f"key 'source': the prefix {prefix!r} of {url!r} has an empty, '.' or '..' component")
    return bucket, f"{prefix}/" if prefix else ""


def _source(key: str, value: Any) -> str:
    """A directory (an absolute path, checked with the others below) or an ``s3://`` URL."""
    text = _nonempty_string(key, value)
    if text.startswith(S3_SCHEME):
        split_s3_url(text)
    return text


def _endpoint_url(key: str, value: Any) -> str:
    text = _string(key, value)
    if text and re.fullmatch(r"https?://[^/\s?#]+/?", text) is None:
        raise ConfigError(f"key {key!r}: {_shown(text)} is not an endpoint URL (http[s]://host[:port])")
    return text.rstrip("/")


def _bool(key: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(f"key {key!r}: expected true or false, got {_type_name(value)} {_shown(value)}")
    return value


def _bool_or_null(key: str, value: Any) -> bool | None:
    if value is not None and not isinstance(value, bool):
        raise ConfigError(f"key {key!r}: expected true, false or null, got {_type_name(value)} {_shown(value)}")
    return value


def _choice(choices: tuple[str, ...]) -> Callable[[str, Any], str]:
    def parse(key: str, value: Any) -> str:
        text = _string(key, value)
        if text not in choices:
            raise ConfigError(f"key {key!r}: {text!r} is not one of {', '.join(repr(c) for c in choices if c)}")
        return text

    return parse


# JSON key -> (ClientConfig field, parser).  The key names are the contract (docs/configuration.md).
_KEYS: dict[str, tuple[str, Callable[[str, Any], Any]]] = {
    "mountPoint": ("mount_point", _nonempty_string),
    "volName": ("vol_name", _vol_name),
    "source": ("source", _source),
    "owner": ("owner", _string),
    "logDir": ("log_dir", _string),
    "logLevel": ("log_level", _choice(LOG_LEVELS)),
    "exporterPort": ("exporter_port", _port),
    "exporterAddr": ("exporter_addr", _nonempty_string),
    "profPort": ("prof_port", _port),
    "profile": ("profile", _choice(PROFILES)),
    "memCacheSize": ("mem_cache_size", parse_size),
    "diskCacheDir": ("disk_cache_dir", _string),
    "diskCacheSize": ("disk_cache_size", parse_size),
    "diskFreeRatio": ("disk_free_ratio", _ratio),
    "blockSize": ("block_size", parse_size),
    "lookupValid": ("lookup_valid", _seconds),
    "attrValid": ("attr_valid", _seconds),
    "prefetchThreads": ("prefetch_threads", _positive_int),
    "backendThreads": ("backend_threads", _positive_int),
    "backendTimeout": ("backend_timeout", _positive_seconds),
    "staleIfError": ("stale_if_error", _bool),
    "metaCacheEntries": ("meta_cache_entries", _positive_int),
    "controlSocket": ("control_socket", _string),
    "controlAllowUids": ("control_allow_uids", _id_list),
    "controlAllowGids": ("control_allow_gids", _id_list),
    "configDir": ("config_dir", _nonempty_string),
    "jobIdleTimeout": ("job_idle_timeout", _positive_seconds),
    "sampleCacheMemSize": ("sample_cache_mem_size", parse_size),
    "sampleCacheDiskSize": ("sample_cache_disk_size", parse_size),
    "sampleCacheShared": ("sample_cache_shared", _shared_samples),
    "s3Endpoint": ("s3_endpoint", _endpoint_url),
    "s3Region": ("s3_region", _string),
    "s3PathStyle": ("s3_path_style", _bool_or_null),
    "s3Profile": ("s3_profile", _string),
}
S3_KEYS = ("s3Endpoint", "s3Region", "s3PathStyle", "s3Profile")
# CubeFS's credential keys: ignored with a directory source, refused with an s3:// one
# (a secret in the config would be a secret in a world-readable file; the credential chain
# has the credentials).
_SECRET_KEYS = ("accessKey", "secretKey")
REQUIRED_KEYS = ("mountPoint", "volName", "source")
KNOWN_KEYS = frozenset(_KEYS)


def parse_config(raw: Mapping[str, Any]) -> ClientConfig:
    """Validate a decoded JSON object and build the config; raises ConfigError."""
    if not isinstance(raw, Mapping):
        raise ConfigError(f"the config must be a JSON object, got {_type_name(raw)}")
    values: dict[str, Any] = {}
    unused: list[str] = []
    for key, value in raw.items():
        if key in _KEYS:
            field, parser = _KEYS[key]
            values[field] = parser(key, value)
        elif key in CUBEFS_UNUSED_KEYS:
            unused.append(key)
        else:
            close = difflib.get_close_matches(key, sorted(KNOWN_KEYS | CUBEFS_UNUSED_KEYS), n=1, cutoff=0.6)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ConfigError(f"unknown key {key!r}{hint}")
    for key in REQUIRED_KEYS:
        if _KEYS[key][0] not in values:
            raise ConfigError(f"missing required key {key!r}")
    block = values.get("block_size", DEFAULT_BLOCK_SIZE)
    if not MIN_BLOCK_SIZE <= block <= MAX_BLOCK_SIZE or block % MIN_BLOCK_SIZE:
        raise ConfigError(
            f"key 'blockSize': {block} bytes is not a multiple of 4KiB between 4KiB and 64MiB"
        )
    s3 = values["source"].startswith(S3_SCHEME)
    for key in S3_KEYS if not s3 else ():
        if values.get(_KEYS[key][0]) not in (None, ""):
            raise ConfigError(f"key {key!r}: only for an s3:// source (the source is a directory)")
    for key in _SECRET_KEYS if s3 else ():
        if key in raw:
            raise ConfigError(f"key {key!r}: credentials are never read from the config: give them as the AWS CLI "
                              "takes them (AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, AWS_PROFILE or 's3Profile', "
                              "the shared credentials file, web identity)")
    # The daemon runs with cwd "/", so a relative path would mean something else there.
    for key in ("mountPoint", "source", "diskCacheDir", "logDir", "controlSocket", "configDir"):
        path = values.get(_KEYS[key][0], "")
        if path and not (key == "source" and s3) and not os.path.isabs(path):
            raise ConfigError(f"key {key!r}: {path!r} is not an absolute path")
    values["unused_keys"] = tuple(sorted(unused))
    return ClientConfig(**values)


def load_config(path: str) -> ClientConfig:
    """Read and parse a config file; every failure is a one-line ConfigError."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path!r}: {exc.strerror}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"config file {path!r} is not UTF-8 text") from None
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"config file {path!r} is not valid JSON: {exc.msg} at line {exc.lineno} column {exc.colno}") from None
    except RecursionError:
        raise ConfigError(f"config file {path!r} is not valid JSON: nested too deeply") from None
    except ValueError as exc:  # an integer literal beyond Python's int-str limit (4300 digits)
        raise ConfigError(f"config file {path!r} is not valid JSON: {exc}") from None
    try:
        return parse_config(raw)
    except ConfigError as exc:
        raise ConfigError(f"config file {path!r}: {exc}") from None


def check_environment(config: ClientConfig, *, mounted: bool = False) -> None:
    """Check that source, mount point and cache dir are usable; raises ConfigError.  An
    ``s3://`` source is checked by ``sources.check_source`` (its bucket is listed once).
    ``mounted``: the mount point is a live mount of this volume (an upgrade takes it over)."""
    source = config.source
    if config.s3_source is None:
        if not os.path.exists(source):
            raise ConfigError(f"key 'source': {source!r} does not exist")
        if not os.path.isdir(source):
            raise ConfigError(f"key 'source': {source!r} is not a directory")
        if not os.access(source, os.R_OK | os.X_OK):
            raise ConfigError(f"key 'source': {source!r} is not readable")
        if _resolved_mount_point(config, mounted) == os.path.realpath(source):
            raise ConfigError("key 'mountPoint': must differ from 'source'")
    mount_point = config.mount_point
    _check_overlaps(config, mounted)
    if not mounted:
        if not os.path.isdir(mount_point):
            raise ConfigError(f"key 'mountPoint': {mount_point!r} does not exist or is not a directory")
        try:
            with os.scandir(mount_point) as entries:
                if any(entries):
                    raise ConfigError(f"key 'mountPoint': {mount_point!r} is not empty")
        except PermissionError:
            raise ConfigError(f"key 'mountPoint': {mount_point!r} is not readable") from None
    if config.control_socket:
        _check_control_socket(config.control_socket)
    if config.profile == "ai_prefetch":
        if not os.path.isdir(config.config_dir):
            raise ConfigError(f"key 'configDir': {config.config_dir!r} does not exist or is not a directory")
        _check_writable("configDir", config.config_dir)
    cache_dir = config.cache_dir
    try:
        os.makedirs(cache_dir, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"key 'diskCacheDir': cannot create {cache_dir!r}: {exc.strerror}") from None
    _check_writable("diskCacheDir", cache_dir)
    _check_block_size(config)
    if config.log_dir:
        try:
            os.makedirs(config.log_dir, exist_ok=True)
        except OSError as exc:
            raise ConfigError(f"key 'logDir': cannot create {config.log_dir!r}: {exc.strerror}") from None
        _check_writable("logDir", config.log_dir)


FUSE_DEVICE = "/dev/fuse"
FUSE_CONF = "/etc/fuse.conf"


def user_allow_other(fuse_conf: str = FUSE_CONF) -> bool:
    """True if ``user_allow_other`` is set in /etc/fuse.conf: a user other than root may then
    mount with allow_other, which the training jobs of other users need to read the mount."""
    try:
        with open(fuse_conf) as f:
            return any(line.strip() == "user_allow_other" for line in f)
    except OSError:
        return False


def check_fuse_access(device: str = FUSE_DEVICE, fuse_conf: str = FUSE_CONF) -> None:
    """Check that this user can mount a FUSE filesystem at all; a ConfigError says, in one
    line, what is missing: the device, access to it, fusermount3 (which mounts for a user
    other than root), and ``user_allow_other`` where that is missing too.

    Opening the device and closing it again has no effect: a connection exists only once
    a mount names the descriptor.  Kept apart from :func:`check_environment`, whose
    checks need no FUSE at all.
    """
    uid = os.geteuid()
    also = "" if uid == 0 or user_allow_other(fuse_conf) else (
        f"; and add user_allow_other to {fuse_conf}, or only uid {uid} can read the mount")
    try:
        os.close(os.open(device, os.O_RDWR | os.O_CLOEXEC))
    except FileNotFoundError:
        raise ConfigError(f"cannot mount: {device} does not exist: load the fuse kernel module (modprobe fuse); "
                          f"a container needs the device passed in (--device {device})") from None
    except PermissionError as exc:
        if uid == 0:  # root is refused by a device cgroup or a security module: a container
            raise ConfigError(f"cannot mount: {device}: {exc.strerror}: a container needs the device "
                              f"(--device {device}) and CAP_SYS_ADMIN") from None
        try:
            st = os.stat(device)
            how = f" is {stat.filemode(st.st_mode)} uid {st.st_uid} gid {st.st_gid},"
        except OSError:
            how = ""
        raise ConfigError(f"cannot mount as uid {uid} (not root): {device}{how} not readable and writable "
                          f"by this user: run the daemon as root, or give its user access to {device} "
                          f"(mode 0666 is the usual default){also}") from None
    except OSError as exc:
        raise ConfigError(f"cannot mount: {device}: {exc.strerror}") from None
    # libfuse runs fusermount3 from its build's directory (/usr/bin on Debian) or from PATH.
    if uid != 0 and shutil.which("fusermount3", path=os.pathsep.join([os.environ.get("PATH", ""), "/usr/bin", "/bin"])) is None:
        raise ConfigError(f"cannot mount as uid {uid} (not root): fusermount3, which mounts for other users than "
                          f"root, is not installed (Debian: apt-get install fuse3){also}")


def _inside(inner: str, outer: str) -> bool:
    """True if ``inner`` is ``outer`` or below it (both resolved)."""
    return inner == outer or inner.startswith(outer.rstrip("/") + "/")


def _resolved_mount_point(config: ClientConfig, mounted: bool) -> str:
    """The mount point, symlinks resolved.  A live mount's own root is never looked at: the
    daemon that serves it may be the one starting (a recovery), or paused (a handover), and
    the kernel would wait for its answer; a mount point is a directory, not a symlink."""
    path = os.path.abspath(config.mount_point)
    if mounted:
        return os.path.join(os.path.realpath(os.path.dirname(path)), os.path.basename(path))
    return os.path.realpath(path)


def _check_overlaps(config: ClientConfig, mounted: bool) -> None:
    """No two of source, mount point and cache dir may be one inside the other (after
    resolving symlinks), nor the log dir inside the source or the mount point: the cache
    would write into the dataset, the mount would show itself inside itself, and so on."""
    # The key named first is the one blamed: the cache dir is the likeliest to be changed.
    paths = {"diskCacheDir": os.path.realpath(config.cache_dir), "mountPoint": _resolved_mount_point(config, mounted)}
    if config.s3_source is None:
        paths["source"] = os.path.realpath(config.source)
    for key, path in paths.items():
        for other, other_path in paths.items():
            if key != other and _inside(path, other_path):
                where = "is" if path == other_path else "is inside"
                raise ConfigError(f"key {key!r}: {path!r} {where} {other!r} ({other_path!r}); they must not overlap")
    if config.log_dir:
        log_dir = os.path.realpath(config.log_dir)
        for other in ("source", "mountPoint"):
            if other in paths and _inside(log_dir, paths[other]):
                raise ConfigError(f"key 'logDir': {log_dir!r} is inside {other!r} ({paths[other]!r})")


def _check_control_socket(path: str) -> None:
    """The daemon replaces a stale socket at ``controlSocket``; anything else there is not its own."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    except OSError as exc:
        raise ConfigError(f"key 'controlSocket': cannot check {path!r}: {exc.strerror}") from None
    if not stat.S_ISSOCK(st.st_mode):
        raise ConfigError(f"key 'controlSocket': {path!r} exists and is not a socket: refusing to replace it")


# Records the block size the NVMe cache was filled with.  Cache keys name a block by its
# index, so after a blockSize change block i of a file would be other bytes: refuse.
BLOCK_SIZE_FILE = "block_size"


def _check_block_size(config: ClientConfig) -> None:
    try:
        with open(os.path.join(config.cache_dir, BLOCK_SIZE_FILE), encoding="ascii") as f:
            recorded = int(f.read().strip())
    except (OSError, ValueError):
        return  # a new cache directory (or one from before the marker existed)
    if recorded != config.block_size:
        raise ConfigError(
            f"key 'blockSize': {config.block_size} differs from the {recorded} bytes the cache in "
            f"{config.cache_dir!r} was filled with; restore it or use an empty 'diskCacheDir'"
        )


def record_block_size(config: ClientConfig) -> None:
    """Remember the cache's block size (call while holding the cache directory lock)."""
    path = os.path.join(config.cache_dir, BLOCK_SIZE_FILE)
    with open(f"{path}.tmp", "w", encoding="ascii") as f:
        f.write(f"{config.block_size}\n")
    os.replace(f"{path}.tmp", path)


def _check_writable(key: str, directory: str) -> None:
    # os.access() says yes to root even on a read-only filesystem: try a real write.
    try:
        with tempfile.TemporaryFile(dir=directory):
            pass
    except OSError as exc:
        raise ConfigError(f"key {key!r}: {directory!r} is not writable: {exc.strerror}") from None


def to_json_dict(config: ClientConfig) -> dict[str, Any]:
    """The config back in its JSON key names (for status output and tests)."""
    fields = {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}
    return {key: fields[field] for key, (field, _) in _KEYS.items()}
