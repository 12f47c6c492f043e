"""The sample store's location word: per cache, each key maps to one int (in a
``ShardedDict`` by the key's low byte, ``cache/shards.py``) packing the entry's payload
size, the bytes it is charged on NVMe, and its offset and segment id there
(``segments.Fields``), because one object per entry would make every full garbage collection
walk a node-wide cache (~1.28M entries for ImageNet) on the trio thread. The layout is in
docs/on-disk.md, "The sample store's index"."""

from __future__ import annotations

from cubefs_fuse.cache.segments import Fields

# Field widths of the location word: 40 bits hold 1 TiB, ~2^14 times the largest entry,
# charge or segment file this store writes.  Counted in bytes: a charge (a range plus
# files.ENTRY_CHARGE) is no multiple of an allocation unit.
FIELD_BITS = 40
FIELD = (1 << FIELD_BITS) - 1
WORD = Fields((FIELD_BITS, 1), (FIELD_BITS, 1), (FIELD_BITS, 1))

size_of = WORD.field(0)
charge_of = WORD.field(1)  # bytes charged on NVMe (0: not there, and then offset and segment are 0)
offset_of = WORD.field(2)
segment_of = WORD.segment


def located(size: int, charge: int, segment: int, offset: int) -> int:
    """The word of an entry of ``size`` bytes on NVMe (``charge`` > 0) at ``segment``/``offset``."""
    return WORD.pack(segment, size, charge, offset)


def fits(size: int, offset: int) -> bool:
    """Whether a size and an offset found on NVMe fit their fields (a damaged or foreign
    file could claim anything; what the store writes always fits)."""
    return WORD.fits(size, 0, offset)


def resized(word: int, size: int) -> int:
    """The word with a new value's size (its NVMe place, if any, kept: the old value is
    still there until a write replaces or frees it)."""
    return word & ~FIELD | size


def off_disk(word: int) -> int:
    """The word of the entry once it left NVMe: its size alone."""
    return word & FIELD
