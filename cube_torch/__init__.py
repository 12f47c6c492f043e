"""cube_torch: ``import cube_torch`` and set ``VOL_NAME`` to prefetch each epoch's files.
Importing installs one small patch on torch's DataLoader (``cube_torch.patch``): at the
start of every epoch the loader's exact index order is mapped to the files it reads and sent
to the cubefs-fuse daemon of volume ``$VOL_NAME`` from a background thread (``VOL_NAME`` is
read when an epoch starts, so it may be set after the import); ``CachedDataset`` keeps
decoded samples in a sample store (``cube_torch.samples``); ``uninstall()`` removes the
patch, ``stats()`` returns the job's hit counters, and a hit-rate line is printed every
``CUBE_TORCH_METRICS_INTERVAL`` seconds (default 30); ``DevicePrefetcher`` hands out a
loader's batches already on the GPU (``cube_torch.prefetch``). A missing or misbehaving daemon costs
one warning; training proceeds as usual."""

from __future__ import annotations

import importlib.util
from typing import TYPE_CHECKING

if importlib.util.find_spec("torch") is None:  # before anything imports it: one clear line
    raise ImportError("cube_torch needs PyTorch, which is not installed: install it, e.g. "
                      "pip install 'cubefs-fuse[torch]' (or your own torch build)") from None

from cube_torch.patch import install, installed, uninstall
from cube_torch.reporter import report_once, stats

if TYPE_CHECKING:
    from cube_torch.prefetch import DataStalled, DevicePrefetcher
    from cube_torch.samples.cache import SampleCache
    from cube_torch.samples.dataset import CachedDataset

__all__ = ["install", "installed", "uninstall", "stats", "report_once", "CachedDataset", "SampleCache",
           "DevicePrefetcher", "DataStalled"]


def __getattr__(name: str) -> object:
    """``cube_torch.CachedDataset``, ``SampleCache``, ``DevicePrefetcher`` and ``DataStalled``,
    imported on first use."""
    if name == "CachedDataset":
        from cube_torch.samples.dataset import CachedDataset

        return CachedDataset
    if name == "SampleCache":
        from cube_torch.samples.cache import SampleCache

        return SampleCache
    if name in ("DevicePrefetcher", "DataStalled"):
        from cube_torch import prefetch

        return getattr(prefetch, name)
    raise AttributeError(f"module 'cube_torch' has no attribute {name!r}")

install()
