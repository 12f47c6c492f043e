"""The one patch: ``DataLoader._index_sampler`` returns a sampler that plans the epoch.
Every DataLoader iterator draws its indices from ``iter(loader._index_sampler)`` once per
epoch in the main process; the patched property wraps that sampler in
:class:`PlannedSampler`, whose iterator, on its first ``next()``, materialises the whole
epoch from the real sampler (the same RNG draws at the same moment), hands the order to the
background submitter and then yields exactly that order. Nothing else of torch is replaced:
``isinstance(loader, DataLoader)`` stays true and the worker loop is torch's."""

from __future__ import annotations

import itertools
import logging
import os
import weakref
from collections.abc import Iterator
from typing import Any

import numpy as np

from cube_torch import fastpath, progress, reporter
from cube_torch.client import PLAN_SUBMIT_WAIT, PlanRequest, default_job, info_once, rank, submitter, world_size

log = logging.getLogger("cube_torch")

# Epochs longer than this are not planned: materialising 50 M indices as Python objects
# would cost GBs in the training process.
MAX_PLANNED_SAMPLES = 50_000_000

_epochs: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()
_original: property | None = None
# Each DataLoader's id in this process, sent with its plans: the daemon keeps one plan per
# (job, rank, loader), so two loaders iterated together (train and val, two domains
# zipped) do not replace each other's plans.  Assigned when a loader first builds an
# iterator, from a process-wide counter; held weakly (the loader's own lifetime).
_loader_ids: weakref.WeakKeyDictionary[Any, str] = weakref.WeakKeyDictionary()
_next_loader_id = itertools.count()
_ids_by_object: dict[int, str] = {}  # loaders that cannot be weakly referenced (none in torch)


def loader_id(loader: Any) -> str:
    """The id this process gives ``loader``'s plans ("0", "1", ... in order of first use)."""
    try:
        known = _loader_ids.get(loader)
    except TypeError:
        known = _ids_by_object.get(id(loader))
    if known is None:
        known = str(next(_next_loader_id))
        try:
            _loader_ids[loader] = known
        except TypeError:
            _ids_by_object[id(loader)] = known
    return known


class PlannedSampler:
    """Wraps a loader's index sampler; iterating it plans the epoch, then replays it."""

    def __init__(self, inner: Any, loader: Any) -> None:
        self.inner = inner
        self._loader = weakref.ref(loader)
        # Held strongly: in ``for batch in DataLoader(...)`` the loader itself is dropped
        # while its iterator runs, and that epoch must be planned all the same.
        self._dataset = loader.dataset
        self._sampler = getattr(loader, "sampler", None)
        self._loader_id = loader_id(loader)  # now: the loader may be gone by the first next()

    def __len__(self) -> int:
        return len(self.inner)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name in ("inner", "_loader", "_dataset", "_sampler", "_loader_id"):
            raise AttributeError(name)  # not yet set (copy, pickle): never recurse
        return getattr(self.inner, name)

    def __iter__(self) -> Iterator[Any]:
        # A generator: nothing runs (and no RNG is drawn) until the loader asks for the
        # first index, exactly as with the inner sampler's own generator.
        fastpath.publish(os.environ.get("VOL_NAME"))  # for workers forked before it was set
        items = list(self.inner) if self._plannable() else None
        if items is None:
            yield from self.inner
            return
        reads = None
        try:
            reads = self._submit(items)
        except Exception as exc:  # planning must never break the epoch
            info_once("plan-failed", "could not plan this epoch: %r", exc)
        if reads is None:
            yield from items
        else:
            complete = False
            try:
                batched = bool(items) and isinstance(items[0], (list, tuple))
                for item in items:
                    reads.hand(len(item) if batched else 1)
                    yield item
                complete = True
            finally:  # also when the loop leaves early (the generator is closed)
                progress.finish(reads, complete)
        reporter.epoch_ended()

    def _plannable(self) -> bool:
        if not os.environ.get("VOL_NAME"):
            return False
        from torch.utils.data import IterableDataset

        if isinstance(self._dataset, IterableDataset):
            info_once("iterable", "IterableDataset has no index order to plan: not prefetching it")
            return False
        try:
            length = len(self.inner)
        except TypeError:
            info_once("infinite", "the sampler has no length (infinite?): not prefetching this loader")
            return False
        if length > MAX_PLANNED_SAMPLES:
            info_once("huge", "epochs of over %d samples are not planned", MAX_PLANNED_SAMPLES)
            return False
        return True

    def _submit(self, items: list[Any]) -> progress.EpochReads:
        if items and isinstance(items[0], (list, tuple)):
            flat = [int(i) for batch in items for i in batch]
        else:
            flat = [int(i) for i in items]
        order = np.asarray(flat, dtype=np.int64)
        epoch = _epoch_of(self._loader(), self._sampler)
        vol_name, this_rank, job = os.environ["VOL_NAME"], rank(), default_job()
        submitter.register_job_now(vol_name, job, this_rank)  # bounded; once per process and daemon
        loader = self._loader()
        first = _first_samples(loader, items)
        reads = progress.start((vol_name, job, this_rank), _ahead(loader))
        # The plan reaches the daemon before the loader hands out the epoch's first index
        # (workers open nothing before that), waiting at most PLAN_SUBMIT_WAIT; a slower
        # submission (a first, large file list) finishes in the background.
        submitter.submit_and_wait(PlanRequest(vol_name, self._dataset, order, epoch, this_rank, job, world_size(),
                                              loader=self._loader_id, first=first, reads=reads),
                                  PLAN_SUBMIT_WAIT)
        reporter.ensure_running(planning_loaders)
        return reads


def _ahead(loader: Any) -> int:
    """Batches a loader with workers keeps requested ahead of the loop: each worker's
    ``prefetch_factor`` (0 without workers: it asks for a batch when the loop does)."""
    workers = int(getattr(loader, "num_workers", 0) or 0)
    return workers * int(getattr(loader, "prefetch_factor", None) or 2) if workers > 0 else 0


def _first_samples(loader: Any, items: list[Any]) -> int:
    """How many samples the loader asks for as soon as it starts: each worker's first
    ``prefetch_factor`` batches (one batch without workers)."""
    return sum(len(b) if isinstance(b, (list, tuple)) else 1 for b in items[:_ahead(loader) or 1])


def _epoch_of(loader: Any, sampler: Any) -> int:
    epoch = getattr(sampler, "epoch", None)  # DistributedSampler.set_epoch
    counted = 0  # a loader already dropped (``for b in DataLoader(...)``) lives one epoch
    if loader is not None:
        counted = _epochs.get(loader, -1) + 1
        _epochs[loader] = counted
    return int(epoch) if isinstance(epoch, int) else counted


def planning_loaders() -> int:
    """How many live DataLoaders have planned an epoch (the reporter stops at 0)."""
    return len(_epochs)


def install() -> bool:
    """Patch DataLoader (idempotent); True if this call installed it."""
    global _original
    from torch.utils.data import DataLoader

    if _original is not None:
        return False
    original = DataLoader.__dict__["_index_sampler"]
    assert isinstance(original, property)

    def planned_index_sampler(loader: Any) -> Any:
        inner = original.fget(loader)  # type: ignore[misc]
        if inner is None or isinstance(inner, PlannedSampler):
            return inner
        return PlannedSampler(inner, loader)

    DataLoader._index_sampler = property(planned_index_sampler)  # type: ignore[method-assign,assignment]
    _original = original
    fastpath.install()
    return True


def uninstall() -> bool:
    """Remove the patch; True if it was installed."""
    global _original
    from torch.utils.data import DataLoader

    if _original is None:
        return False
    DataLoader._index_sampler = _original  # type: ignore[method-assign,assignment]
    _original = None
    fastpath.uninstall()
    return True


def installed() -> bool:
    return _original is not None
