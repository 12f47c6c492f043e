"""Make ``import torchvision`` work on the CPU-only torch the tests use.

Why: the torchvision wheels on PyPI are CUDA builds.  Their compiled extension
(``torchvision/_C.so``) does not load against a CPU-only torch, so the operators it would
declare never exist, and torchvision's import then fails in ``_meta_registrations.py``,
which registers fake (meta) kernels for ``torchvision::nms`` and ``torchvision::qnms``
with ``torch.library.register_fake`` -- an error for an operator nobody defined.

Declaring the two schemas (exactly as the extension declares them: ``strings _C.so``, and
the fake kernels' signatures in ``torchvision/_meta_registrations.py``) before the first
import is enough: the datasets and
transforms the tests use are pure Python and never call these operators (calling them
would still fail: no kernel is registered).  This lives only here, for tests; cube_torch
itself never imports torchvision.

Import this module before ``torchvision`` (``import tests.torchvision_shim  # noqa``).
"""

from __future__ import annotations

import torch
import torch.library

SCHEMAS = (
    "nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
)


def _has_operator(name: str) -> bool:
    try:
        getattr(torch.ops.torchvision, name)
    except (AttributeError, RuntimeError):
        return False
    return True


def _declare() -> torch.library.Library | None:
    if all(_has_operator(s.split("(")[0]) for s in SCHEMAS):
        return None  # a matching torchvision build (or an earlier import) declared them
    library = torch.library.Library("torchvision", "DEF")
    for schema in SCHEMAS:
        if not _has_operator(schema.split("(")[0]):
            library.define(schema)
    return library


# Kept referenced for the life of the process: a Library object that is garbage-collected
# removes the schemas it defined.
LIBRARY = _declare()
