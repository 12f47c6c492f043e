"""``CachedDataset``: a dataset whose samples are computed once and kept in a sample store.
``CachedDataset(base, name, transform=None, store=None)[i]`` is ``transform(base[i])``,
where ``base[i]`` comes from the store under (name, i) once any process has computed it:
cache the deterministic part (decoding, resizing) in ``base`` and put random augmentation in
``transform``. ``__getitems__`` does one store round trip per batch; entries are checked
against the sample's source files when cube_torch knows them (cube_torch/files.py); in
DataLoader workers the fast path serves only the batch's misses' files, and at each epoch's
start the epoch's key order goes to the store (:meth:`CachedDataset.plan`) so that a store
that evicts keeps the entries needed soonest."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import Any

import numpy as np
from torch.utils.data import Dataset

from cube_torch.files import SampleFiles, Unsupported, sample_files
from cube_torch.samples.cache import CacheStatistics, SampleCache
from cube_torch.samples.store import SampleStore


class CachedDataset(Dataset[Any]):
    """``transform(base[i])`` with ``base[i]`` computed once per (name, i) and kept in ``store``.

    ``name``: what identifies ``base``'s samples in the store (the dataset *and* the
    deterministic processing: change the name when either changes, e.g.
    ``"imagenet-train-decoded-224"``).  ``store``: None (the node's cubefs-fuse daemon of
    ``$VOL_NAME``), ``"redis://host:port/db"``, ``"redis+cluster://host:port[,host:port]"``
    or a :class:`~cube_torch.samples.store.SampleStore` object.
    """

    # The fast path's fetcher leaves this dataset's batches to it (see __getitems__).
    cube_torch_own_batches = True
    # cube_torch/files.py: its samples read ``base``'s files (its planned files are the base's).
    cube_torch_cached = True

    def __init__(self, base: Any, name: str, transform: Callable[[Any], Any] | None = None,
                 store: str | SampleStore | None = None) -> None:
        if not hasattr(base, "__getitem__") or not hasattr(base, "__len__"):
            raise TypeError(f"CachedDataset needs a map-style dataset (with __getitem__ and __len__), "
                            f"not a {type(base).__name__}")
        if transform is not None and not callable(transform):
            raise TypeError(f"transform must be callable, not a {type(transform).__name__}")
        self.base = base
        self.transform = transform
        self.cache = SampleCache(name, store)
        self._files: SampleFiles | None = None  # per process
        self._no_files = False  # the base's files are not known

    @property
    def name(self) -> str:
        return self.cache.name

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_files"] = None
        return state

    def __len__(self) -> int:
        return len(self.base)

    def __repr__(self) -> str:
        return f"CachedDataset({type(self.base).__name__}, name={self.name!r}, store={self.cache.store_spec!r})"

    def _index(self, index: Any) -> int:
        i = int(index)
        n = len(self.base)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError(f"index {int(index)} out of range for a dataset of {n} samples")
        return i

    def _files_of(self) -> Callable[[int], Sequence[str]] | None:
        if self._files is None and not self._no_files:
            try:
                self._files = sample_files(self.base)
            except Unsupported:
                self._no_files = True
        return self._files

    def _compute(self, index: int) -> Any:
        return self.base[index]

    def _scope(self, indices: list[int]) -> AbstractContextManager[Any]:
        from cube_torch import fastpath

        return fastpath.own_batch_scope(self.base, indices)

    def __getitem__(self, index: Any) -> Any:
        return self.__getitems__([index])[0]

    def __getitems__(self, indices: Sequence[Any]) -> list[Any]:
        return [self.cube_torch_finish(sample) for sample in self.cube_torch_load_many(indices)]

    def cube_torch_load_many(self, indices: Sequence[Any]) -> list[Any]:
        """``base[i]`` of each index (the store's or computed), before ``transform``: one
        store round trip.  cube_torch's fetcher loads a ConcatDataset's parts with it, then
        finishes the samples in the batch's order (so a random transform draws its random
        numbers sample by sample, as torch's own sample-by-sample loading would)."""
        keys = [self._index(i) for i in indices]
        return self.cache.get_many(keys, self._compute, self._files_of(), self._scope)

    def cube_torch_finish(self, sample: Any) -> Any:
        """``transform(sample)`` (or the sample itself)."""
        return sample if self.transform is None else self.transform(sample)

    def plan(self, keys: Sequence[int] | np.ndarray) -> np.ndarray | None:
        """Send the store the next epoch's key order (cube_torch does, at each epoch start,
        from its background thread); which keys the store holds, when it says (see
        SampleCache.plan)."""
        return self.cache.plan(keys)

    def statistics(self) -> CacheStatistics:
        """This process's hit/miss counters of the cache."""
        return self.cache.statistics()

    def close(self) -> None:
        """Write what is pending (bounded) and close this process's store connection."""
        self.cache.close()
