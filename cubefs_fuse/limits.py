"""Bounds on what a client may ask of the daemon (sizes, counts, the rule of a sample cache's
name), shared by the control API, the sample store and ai_prefetch;
standard library only and importing nothing of the package, so that the wire protocol
(``control/protocol.py``, imported inside training processes) can re-export them and the
prefetch core can validate against them without reaching up into the control API."""

from __future__ import annotations

import re
from typing import Any

# A decimal integer as a config value, a query string or a JSON string carries it: ASCII
# digits only (str.isdigit() also says yes to "²" and "١٢٣", which int() refuses or reads
# as other digits), at most 19 of them: 2^63 - 1, the largest number any key or parameter
# takes, has 19, and int() then never meets Python's 4300-digit int-str limit.
DIGITS_PATTERN = r"[0-9]{1,19}"
DIGITS = re.compile(DIGITS_PATTERN)

MAX_JSON_BODY = 1024 * 1024  # JSON requests are small control messages
# A file list of 10 million ImageNet-style relative paths (~40 bytes each) is ~400 MB.
MAX_DATASET_BODY = 1024 * 1024 * 1024
MAX_DATASET_FILES = 100_000_000  # plans scale to 1e8 samples (docs/ai_prefetch.md)
MAX_PATH_BYTES = 4096  # PATH_MAX on Linux
MAX_PLAN_BODY = MAX_DATASET_FILES * 8  # one uint64 index per sample at most
MAX_NAME = 128  # job names and other identifiers
# Paths per warmup request (a subtree counts as one path; the request's body is bounded by
# MAX_JSON_BODY too); `cubefs-fuse warmup` checks the count before it asks the daemon.
MAX_WARMUP_PATHS = 100_000
PLAN_DTYPES = {"<u4": 4, "<u8": 8, "<i4": 4, "<i8": 8}
# DataLoaders of one (job, rank) with a plan each (train and val, domains zipped together).
# Every open of the job is matched against each of its loaders' plans, and the lookahead
# budget (half the RAM tier) is split among the loaders being read: at 16 a share is
# already 1/32 of the RAM tier.  A 17th loader's plan replaces the least recently read one.
MAX_LOADERS = 16


# The fast path (cube_torch's FUSE-free hits, control/dataplane.py): one message per batch
# on the data socket.  A batch of 1024 files of ~100-byte paths is ~110 KiB of JSON; an
# AF_UNIX SOCK_SEQPACKET message must fit the socket's send buffer (net.core.wmem_default,
# 208 KiB by default), so 160 KiB is the largest request either side sends or accepts.
MAX_BATCH_FILES = 1024  # far above workers' batch sizes (32-256 samples x a few files)
MAX_BATCH_MESSAGE = 160 * 1024
# Each data connection's shared-memory ring (a sealed memfd): a batch's bytes up to this
# size are served from it, anything beyond goes through the mount.  32 MiB holds a batch
# of 256 ImageNet JPEGs (~110 KB each); at most MAX_CONNECTIONS (64) rings exist at once,
# and a ring's pages are only allocated as batches fill them.
FAST_RING_BYTES = 32 * 1024 * 1024


# The processed-sample cache's daemon store (cubefs_fuse/samples/, over the data socket).
# One entry must fit a data connection's ring, which carries it in both directions: 32 MiB
# holds a 2048x2048x3 float32 image (48 MiB would not), far above decoded training samples
# (a 224x224x3 uint8 image is 150 KB).  A larger entry is dropped: the cache is optional.
MAX_SAMPLE_ENTRY_BYTES = FAST_RING_BYTES
# Keys of one sample_get / sample_put message: a batch's samples.  A put's item
# ``[key, offset, length]`` is at most ~50 bytes of JSON, so 2048 of them stay within
# MAX_BATCH_MESSAGE (160 KiB); batch sizes are 32-1024.
MAX_SAMPLE_KEYS = 2048
# A plan (the next epoch's key order) travels through the ring as little-endian int64s: one
# ring holds 4 Mi keys.  Longer plans are cut there: eviction only needs the order of what
# can be resident, and 4 Mi entries of a typical 150 KB sample are 600 GB, beyond a node's
# NVMe budget; what comes later is treated as unplanned (LRU).
MAX_SAMPLE_PLAN_KEYS = FAST_RING_BYTES // 8
# Sample caches a daemon keeps (one per (owner uid, name)): each is a label value of the
# per-cache metrics, so this bounds their cardinality; a sweep reuses one name per
# preprocessing, and a node runs a few jobs.  A user may hold at most a quarter of them,
# so one user's churn cannot lock the others out.
MAX_SAMPLE_CACHES = 256
MAX_SAMPLE_CACHES_PER_UID = 64
# Plan keys the sample store holds over all its caches: a plan costs 13 bytes per distinct
# key (the sorted key, its position, a consumed flag), so 16 Mi keys bound plans to ~220 MB
# whatever users send; past it, the least recently planned caches lose their plans (LRU).
MAX_SAMPLE_PLANNED_KEYS = 4 * MAX_SAMPLE_PLAN_KEYS
# Processes whose plans of one sample cache are kept side by side (a node's ranks each plan
# their share of the epoch: 8-16 GPUs a node, several loaders each); a merge re-sorts all
# of them, and each new plan checks each source is still alive (one kill(pid, 0) each).
# Past it, the least recently planned source's plan is dropped.
MAX_SAMPLE_PLAN_SOURCES = 64


# A sample cache's name, the one rule of the daemon and cube_torch (which takes it from
# control/protocol.py): the characters of job names, at most MAX_NAME of them, since the
# daemon's NVMe store keeps a cache's entries in a directory of that name (one safe path
# component: "." and ".." are refused); or ~UID/NAME for another user's cache (the daemon
# decides whether the caller may read it).
SAMPLE_NAME_RULE = (f"a sample cache name is 1-{MAX_NAME} of [A-Za-z0-9_.:@-] (not '.' or '..'), "
                    "or ~UID/NAME for another user's shared cache")
_SAMPLE_NAME = re.compile(r"[A-Za-z0-9_.:@-]{1,%d}" % MAX_NAME)
_FOREIGN = re.compile(r"~([0-9]{1,10})/(.*)", re.S)


def is_sample_cache_name(name: Any) -> bool:
    """Whether ``name`` is a sample cache's own name (not a ``~UID/NAME`` reference)."""
    return isinstance(name, str) and _SAMPLE_NAME.fullmatch(name) is not None and name not in (".", "..")


def sample_cache_reference(reference: Any) -> tuple[int | None, str]:
    """(owner uid, None for the caller's own cache; name) of a sample cache reference, NAME
    or ~UID/NAME; ValueError (:data:`SAMPLE_NAME_RULE`) for anything else."""
    owner, name = None, reference
    if isinstance(reference, str) and (m := _FOREIGN.fullmatch(reference)):
        owner, name = int(m.group(1)), m.group(2)
    if not is_sample_cache_name(name):
        raise ValueError(SAMPLE_NAME_RULE)
    return owner, name
