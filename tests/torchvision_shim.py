"""Import before ``torchvision`` in tests: makes it importable on CPU-only torch.

The reason and the mechanism are in tools/torchvision_shim.py (shared with the demo and
the benchmarks); this module only applies it on import.
"""

from __future__ import annotations

from tools import torchvision_shim

torchvision_shim.install()
LIBRARY = torchvision_shim._library
