"""Which files a dataset sample reads: the index -> paths mapping per dataset type.

Supported: torchvision ``ImageFolder``/``DatasetFolder`` (``samples[i][0]``),
``VOCDetection`` (image and annotation XML), ``CocoDetection`` (the file of image id
``ids[i]``), any dataset with ``train_data_list()`` (a 1-D array of paths, or a 2-D
array of k parallel path lists), and ``Subset``/``ConcatDataset`` of those, nested.
"""

from __future__ import annotations

import bisect
import os
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

SampleFiles = Callable[[int], list[str]]


class Unsupported(Exception):
    """The dataset's files cannot be known (a reason for one info line)."""


def sample_files(dataset: Any) -> SampleFiles:
    """A function from a sample index to the paths that sample reads."""
    from torch.utils.data import ConcatDataset, Subset

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
        return _from_array(np.asarray(train_data_list()))
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


def _from_array(array: np.ndarray) -> SampleFiles:
    if array.ndim == 1:
        paths: Sequence[Any] = array.tolist()
        return lambda i: [str(paths[i])]
    if array.ndim == 2:
        columns = [list(map(str, row)) for row in array.tolist()]
        return lambda i: [column[i] for column in columns]
    raise Unsupported(f"train_data_list() returned a {array.ndim}-D array (1-D or 2-D expected)")


def relative_to_mount(path: str, mount_point: str) -> str | None:
    """``path`` relative to the mount point, or None when it lies outside the mount."""
    absolute = os.path.abspath(path)
    prefix = mount_point.rstrip("/") + "/"
    if not absolute.startswith(prefix):
        return None
    return absolute[len(prefix):]
