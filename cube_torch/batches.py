"""The tensors of a batch, wherever a collate function put them: in tuples (named ones
too), lists, dicts and dataclasses, nested; anything else is left as it is.  The
prefetcher maps a batch's tensors to their device copies and rebuilds the structure
around them with the same types."""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Iterator, Mapping, MutableMapping
from typing import Any

import torch


def map_tensors(batch: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """``batch`` with each tensor ``t`` replaced by ``fn(t)``: containers rebuilt with their
    own types, other values (strings, numbers, arrays, None) the same objects."""
    if isinstance(batch, torch.Tensor):
        return fn(batch)
    if isinstance(batch, tuple):
        items = [map_tensors(item, fn) for item in batch]
        if type(batch) is tuple:
            return tuple(items)
        if hasattr(batch, "_fields"):  # a namedtuple takes its fields as arguments
            return type(batch)(*items)
        return type(batch)(items)
    if isinstance(batch, list):
        mapped = [map_tensors(item, fn) for item in batch]
        if type(batch) is list:
            return mapped
        clone = copy.copy(batch)  # a list subclass keeps its type and attributes
        clone[:] = mapped
        return clone
    if isinstance(batch, Mapping):
        pairs = {key: map_tensors(value, fn) for key, value in batch.items()}
        if type(batch) is dict or not isinstance(batch, MutableMapping):
            return pairs
        copied: MutableMapping[Any, Any] = copy.copy(batch)  # an OrderedDict, a defaultdict with its factory
        copied.update(pairs)
        return copied
    if dataclasses.is_dataclass(batch) and not isinstance(batch, type):
        rebuilt = copy.copy(batch)
        for f in dataclasses.fields(batch):
            # object.__setattr__: a frozen dataclass is rebuilt the same way.
            object.__setattr__(rebuilt, f.name, map_tensors(getattr(batch, f.name), fn))
        return rebuilt
    return batch


def tensors(batch: Any) -> Iterator[torch.Tensor]:
    """Every tensor of ``batch``, in the order :func:`map_tensors` visits them."""
    if isinstance(batch, torch.Tensor):
        yield batch
    elif isinstance(batch, (tuple, list)):
        for item in batch:
            yield from tensors(item)
    elif isinstance(batch, Mapping):
        for value in batch.values():
            yield from tensors(value)
    elif dataclasses.is_dataclass(batch) and not isinstance(batch, type):
        for f in dataclasses.fields(batch):
            yield from tensors(getattr(batch, f.name))
