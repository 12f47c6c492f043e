"""Let torchvision import next to the CPU-only torch this project installs.

Why: the torchvision wheel on PyPI is built for a CUDA torch, so its C++ extension
(``_C``) does not load here; ``import torchvision`` then still registers fake kernels for
the operators ``torchvision::nms`` and ``torchvision::qnms``, which fails unless they
exist.  Declaring their schemas (as in torchvision's csrc/ops/nms.cpp) is enough: the
tests, the demo and the benchmarks use only torchvision's pure-Python datasets and
transforms, never these operators (calling one would still fail: no kernel is
registered).  Where the extension does load, nothing is declared (it registers the
``torchvision`` namespace itself).

This is development tooling, shared by tests/, demo/ and benchmarks/; the shipped
packages (cubefs_fuse, cube_torch) never import torchvision.  Call ``install()`` before
the first ``import torchvision``.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import sys

import torch

_SCHEMAS = (
    "nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
)
_library: torch.library.Library | None = None  # kept alive: collecting it drops the operators


def install() -> None:
    """Call before the first ``import torchvision``; idempotent."""
    global _library
    if _library is not None or "torchvision" in sys.modules or _extension_loads():
        return
    _library = torch.library.Library("torchvision", "DEF")  # type: ignore[no-untyped-call]
    for schema in _SCHEMAS:
        _library.define(schema)  # type: ignore[no-untyped-call]


def _extension_loads() -> bool:
    spec = importlib.util.find_spec("torchvision")
    for directory in (spec.submodule_search_locations or []) if spec else []:
        for suffix in importlib.machinery.EXTENSION_SUFFIXES:
            path = os.path.join(directory, "_C" + suffix)
            if os.path.exists(path):
                try:
                    torch.ops.load_library(path)  # type: ignore[no-untyped-call]
                    return True
                except OSError:
                    return False
    return False
