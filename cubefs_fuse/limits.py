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

