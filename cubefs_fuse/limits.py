"""Bounds on what a client may ask of the daemon, shared by the control API and ai_prefetch.

Standard library only and importing nothing of the package: the wire protocol
(``control/protocol.py``, imported inside training processes) re-exports these, and
the prefetch core validates against them without reaching up into the control API.
"""

from __future__ import annotations

MAX_JSON_BODY = 1024 * 1024  # JSON requests are small control messages
# A file list of 10 million ImageNet-style relative paths (~40 bytes each) is ~400 MB.
MAX_DATASET_BODY = 1024 * 1024 * 1024
MAX_DATASET_FILES = 100_000_000  # plans scale to 1e8 samples (docs/architecture.md)
MAX_PATH_BYTES = 4096  # PATH_MAX on Linux
MAX_PLAN_BODY = MAX_DATASET_FILES * 8  # one uint64 index per sample at most
MAX_NAME = 128  # job names and other identifiers
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
