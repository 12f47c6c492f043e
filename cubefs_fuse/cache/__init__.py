"""The block cache: a RAM tier and an NVMe tier behind one interface (BlockCache)."""
