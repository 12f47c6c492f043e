"""Which files a dataset sample reads: the index -> paths mapping per dataset type, for
torchvision ``ImageFolder``/``DatasetFolder`` (``samples[i][0]``), ``VOCDetection`` (image
and annotation XML), ``CocoDetection`` (the file of image id ``ids[i]``), any dataset with
``train_data_list()`` (see :data:`ACCEPTED_LISTS`), and ``Subset``/``ConcatDataset`` of
those, nested, and a ``CachedDataset`` of any of them."""

from __future__ import annotations

import bisect
import os
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

SampleFiles = Callable[[int], list[str]]

ACCEPTED_LISTS = ("N paths; a (k, N) array or k lists of N paths (k files per sample, e.g. image and "
                  "annotation); an (N, k) array or N rows of k paths; paths as str, bytes or os.PathLike")


class Unsupported(Exception):
    """The dataset's files cannot be known (a reason for one info line)."""


def sample_files(dataset: Any) -> SampleFiles:
    """A function from a sample index to the paths that sample reads."""
    from torch.utils.data import ConcatDataset, Subset

    if getattr(type(dataset), "cube_torch_cached", False):  # a CachedDataset reads its base's files (of its misses)
        return sample_files(dataset.base)
    if isinstance(dataset, Subset):
        inner = sample_files(dataset.dataset)
        indices = dataset.indices
        return lambda i: inner(int(indices[i]))
    if isinstance(dataset, ConcatDataset):
        parts = [sample_files(d) for d in dataset.datasets]
        cumulative = list(dataset.cumulative_sizes)

        def concat(i: int) -> list[str]:
            part = bisect.bisect_right(cumulative, i)
            return parts[part](i - (cumulative[part - 1] if part else 0))

        return concat
    train_data_list = getattr(dataset, "train_data_list", None)
    if callable(train_data_list):
        return _from_list(train_data_list(), len(dataset))
    name = type(dataset).__name__
    mro = {cls.__name__ for cls in type(dataset).__mro__}
    if "DatasetFolder" in mro and hasattr(dataset, "samples"):  # ImageFolder is a DatasetFolder
        samples = dataset.samples
        return lambda i: [str(samples[i][0])]
    if "VOCDetection" in mro or "VOCSegmentation" in mro:
        images = dataset.images
        targets = getattr(dataset, "annotations", None) or getattr(dataset, "targets", None) or getattr(dataset, "masks", [])
        return lambda i: [str(images[i])] + ([str(targets[i])] if i < len(targets) else [])
    if "CocoDetection" in mro and hasattr(dataset, "coco"):
        root, ids, images = str(dataset.root), dataset.ids, dataset.coco.imgs
        return lambda i: [os.path.join(root, str(images[ids[i]]["file_name"]))]
    raise Unsupported(f"{name} does not say which files it reads (add a train_data_list() method)")


def _path(value: Any) -> str:
    """A path from ``train_data_list()``: str, bytes (file-system encoding) or os.PathLike."""
    if isinstance(value, (str, bytes, os.PathLike)):
        path = os.fsdecode(value)
    elif isinstance(value, np.str_):
        path = str(value)
    elif isinstance(value, np.bytes_):
        path = os.fsdecode(bytes(value))
    else:
        raise Unsupported(f"train_data_list() holds a {type(value).__name__}, not a path ({ACCEPTED_LISTS})")
    return path


def _from_list(listed: Any, samples: int) -> SampleFiles:
    """Sample index -> paths for what ``train_data_list()`` returned (``samples`` = len(dataset))."""
    try:
        array = np.asarray(listed, dtype=object)  # ragged rows mostly stay 1-D: lists are "not a path"
    except ValueError:  # ragged deeper down
        raise Unsupported(f"train_data_list() is ragged ({ACCEPTED_LISTS})") from None
    if array.ndim == 1:
        _check_length(len(array), samples)
        paths = [_path(v) for v in array.tolist()]
        return lambda i: [paths[i]]
    if array.ndim == 2:
        rows, cols = array.shape
        # (k, N) when the columns are the samples; (N, k) when the rows are.  A square
        # array is read as (k, N), the form cube_torch has always accepted.
        if cols == samples:
            columns = [[_path(v) for v in column] for column in array.tolist()]
            return lambda i: [column[i] for column in columns]
        _check_length(rows, samples)
        per_sample = [[_path(v) for v in row] for row in array.tolist()]
        return lambda i: list(per_sample[i])
    raise Unsupported(f"train_data_list() returned a {array.ndim}-D array ({ACCEPTED_LISTS})")


def _check_length(listed: int, samples: int) -> None:
    if listed != samples:
        raise Unsupported(f"train_data_list() lists {listed} samples but the dataset has {samples} "
                          f"({ACCEPTED_LISTS})")


def relative_to_mount(path: str, mount_point: str) -> str | None:
    """``path`` relative to the mount point, or None when it lies outside the mount."""
    absolute = os.path.abspath(path)
    prefix = mount_point.rstrip("/") + "/"
    if not absolute.startswith(prefix):
        return None
    return absolute[len(prefix):]
