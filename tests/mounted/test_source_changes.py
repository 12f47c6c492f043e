"""Mounted: a file changed at the source is never served old or mixed to a new open after the TTL.

"Never wrong bytes": for every kind of change (in place keeping the size,
growing, shrinking; a new file renamed over it; content changed with the mtime restored,
in place or as ``cp -p`` would, renamed over it), with or without a handle still open on
the old version, and whichever reads first (the old handle, a new handle, or both
interleaved), every byte a new open reads after the TTL is the new version's, and every
byte an old handle reads is its own version's (or the read fails with ESTALE).  The
kernel page cache is per inode, so this is what goes wrong when both versions share one.

Files span several blocks (``blockSize`` 64 KiB) and every 4 KiB page names its file,
version and page, so a mixed read says which pages came from which version.
"""

from __future__ import annotations

import errno
import os
import re
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.helpers import Mount, metric

KiB = 1024
BS = 64 * KiB  # blockSize: files of several blocks, so a mixed block would show
PAGE = 4 * KiB  # the kernel's page: each one is labelled in the content
TTL = 0.2  # attrValid and lookupValid, seconds
# After a change, the daemon's cached attributes (attrValid) and then the kernel's entry
# (lookupValid, refreshed at most until the daemon's attributes expire) have both expired;
# plus a margin for the kernel's jiffies and a loaded machine.  The contract is stated in
# terms of this TTL, so the test waits it out instead of polling for the new version.
SETTLE = 2 * TTL + 0.3
ROUNDS = 4  # changes per file
CHUNK = 24 * KiB  # read size: not block- or page-aligned in offset after the first
MODES = ("no_old_handle", "old_reads_first", "new_reads_first", "interleaved")
METRIC = "cubefs_fuse_file_version_changes_total"


def content(name: str, version: int, size: int) -> bytes:
    """``size`` bytes whose every page says ``name``, ``version`` and the page number."""
    pages = []
    for page in range(-(-size // PAGE)):
        label = f"<{name} v{version} p{page}>".encode()
        pages.append((label * (PAGE // len(label) + 1))[:PAGE])
    return b"".join(pages)[:size]


def describe(data: bytes, expected: bytes) -> str:
    """Which versions' pages a wrong read holds (for the failure message)."""
    wrong = [p for p in range(0, max(len(data), len(expected)), PAGE) if data[p:p + PAGE] != expected[p:p + PAGE]]
    labels = sorted({m.group(1) for p in wrong[:50] for m in [re.search(rb"<\S+ (v\d+) p\d+>", data[p:p + PAGE])] if m})
    return f"{len(data)} bytes (expected {len(expected)}), {len(wrong)} wrong pages, from {labels or 'no labelled page'}"


def size_of(kind: str, version: int) -> int:
    base = 3 * BS + 1000  # four blocks, the last one partial
    if kind == "in_place_grow":
        return base + version * (BS + 517)
    if kind == "in_place_shrink":
        return base + (ROUNDS - version) * (BS + 517)
    return base


def _write_in_place(path: Path, data: bytes) -> None:
    with open(path, "r+b") as f:
        f.write(data)
        f.truncate(len(data))


def _rename_over(path: Path, data: bytes, *, keep_mtime: bool = False) -> None:
    before = os.stat(path)
    tmp = path.with_name(path.name + ".new")
    tmp.write_bytes(data)
    if keep_mtime:
        os.utime(tmp, ns=(before.st_atime_ns, before.st_mtime_ns))
    os.rename(tmp, path)


def _in_place_mtime_restored(path: Path, data: bytes) -> None:
    before = os.stat(path)
    _write_in_place(path, data)
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))  # ctime still changes


CHANGES: dict[str, Callable[[Path, bytes], None]] = {
    "in_place_same_size": _write_in_place,
    "in_place_grow": _write_in_place,
    "in_place_shrink": _write_in_place,
    "rename_over": _rename_over,
    "in_place_mtime_restored": _in_place_mtime_restored,
    "copy_with_mtime_renamed_over": lambda path, data: _rename_over(path, data, keep_mtime=True),
}


def version_of(path: Path) -> tuple[int, int, int, int]:
    st = os.stat(path)
    return st.st_size, st.st_mtime_ns, st.st_ino, st.st_ctime_ns


class NewOpen:
    """A new open of the file, expected to read exactly ``expected``, chunk by chunk."""

    def __init__(self, path: Path, expected: bytes, what: str) -> None:
        self.fd = os.open(path, os.O_RDONLY)  # ESTALE or any error here fails the test
        self.expected, self.what = expected, what
        self.offset = 0
        self.data = bytearray()
        size = os.fstat(self.fd).st_size
        assert size == len(expected), f"{what}: fstat says {size} bytes, the new version has {len(expected)}"

    def read_chunk(self) -> bool:
        """Read the next chunk; False at EOF."""
        chunk = os.pread(self.fd, CHUNK, self.offset)
        self.data += chunk
        self.offset += len(chunk)
        return bool(chunk)

    def finish(self) -> None:
        while self.read_chunk():
            pass
        os.close(self.fd)
        data = bytes(self.data)
        assert data == self.expected, f"{self.what}: not the new version: {describe(data, self.expected)}"


class OldHandle:
    """A handle opened on the old version: reads its own bytes or ESTALE, never others'."""

    def __init__(self, path: Path, expected: bytes, what: str) -> None:
        self.fd = os.open(path, os.O_RDONLY)
        self.expected, self.what = expected, what
        self.outcomes: list[str] = []

    def read_at(self, offset: int, length: int = CHUNK) -> None:
        try:
            data = os.pread(self.fd, length, offset)
        except OSError as exc:
            assert exc.errno == errno.ESTALE, f"{self.what}: pread({length}, {offset}): {exc}"
            self.outcomes.append("ESTALE")
            return
        want = self.expected[offset:offset + length]
        assert data == want, f"{self.what}: pread({length}, {offset}) is not the old version: {describe(data, want)}"
        self.outcomes.append("old")

    def read_all(self) -> None:
        for offset in range(0, len(self.expected) + 1, CHUNK):
            self.read_at(offset)

    def close(self) -> None:
        size = os.fstat(self.fd).st_size
        assert size == len(self.expected), f"{self.what}: fstat says {size}, its version has {len(self.expected)}"
        os.close(self.fd)


@pytest.mark.parametrize("kind", sorted(CHANGES))
def test_new_opens_after_a_change_and_the_ttl_see_only_the_new_version(
        make_mount: Callable[..., Mount], kind: str) -> None:
    m = make_mount(blockSize="64KiB", attrValid=TTL, lookupValid=TTL)
    (m.source / "d").mkdir()
    names = {mode: f"{mode}.bin" for mode in MODES}
    for mode, name in names.items():
        (m.source / "d" / name).write_bytes(content(name, 0, size_of(kind, 0)))
    m.mount()
    new_opens = 0
    before = m.scrape()
    for version in range(ROUNDS):
        current = {mode: content(name, version, size_of(kind, version)) for mode, name in names.items()}
        following = {mode: content(name, version + 1, size_of(kind, version + 1)) for mode, name in names.items()}
        old: dict[str, OldHandle] = {}
        os.listdir(m.path("d"))  # the daemon caches the listing (with the versions before the change)
        for mode, name in names.items():
            # The version before the change, read whole through a new open: the kernel holds
            # the inode and its pages, the daemon the blocks.
            NewOpen(m.path(f"d/{name}"), current[mode], f"{kind} {mode} round {version} before").finish()
            if mode != "no_old_handle":
                old[mode] = OldHandle(m.path(f"d/{name}"), current[mode], f"{kind} {mode} round {version} old handle")
                old[mode].read_at(0)  # pinned, with a page or two of its own in the kernel
        for mode, name in names.items():
            source = m.source / "d" / name
            was = version_of(source)
            CHANGES[kind](source, following[mode])
            assert version_of(source) != was, f"precondition: {kind} must change the file's version"
        for handle in old.values():
            handle.read_at(BS + 100)  # before the TTL: still its own version (or ESTALE)
        time.sleep(SETTLE)
        if version % 2:
            os.listdir(m.path("d"))  # readdirplus hands the kernel the new entries first
        for mode, name in names.items():
            path, what = m.path(f"d/{name}"), f"{kind} {mode} round {version + 1}"
            if mode == "old_reads_first":
                old[mode].read_all()
                NewOpen(path, following[mode], f"{what} new open 1").finish()
                old[mode].read_all()  # refills the old version's pages after the new open read
            elif mode == "new_reads_first":
                first = NewOpen(path, following[mode], f"{what} new open 1")
                for _ in range(2):
                    first.read_chunk()
                old[mode].read_all()
                first.finish()
            elif mode == "interleaved":
                first = NewOpen(path, following[mode], f"{what} new open 1")
                offset = 0
                while first.read_chunk():
                    old[mode].read_at(offset)
                    offset += CHUNK
                old[mode].read_at(offset)
                first.finish()
            else:
                NewOpen(path, following[mode], f"{what} new open 1").finish()
            for n in (2, 3):  # later opens: whatever the old handle left in the kernel
                NewOpen(path, following[mode], f"{what} new open {n}").finish()
                if mode in old:
                    old[mode].read_at(2 * BS)
            new_opens += 3
        for handle in old.values():
            handle.close()
    after = m.scrape()
    changes = metric(after, METRIC) - metric(before, METRIC)
    # Every change of a file with a handle open on the old version is counted once (the
    # kernel holds its inode); one without (the kernel may have let the old inode go) at
    # most once.
    assert ROUNDS * (len(MODES) - 1) <= changes <= ROUNDS * len(MODES), changes
    assert new_opens == ROUNDS * len(MODES) * 3
    m.umount()


def test_a_long_lookup_valid_keeps_no_entry_past_the_attributes_trust(make_mount: Callable[..., Mount]) -> None:
    # lookupValid is long, attrValid short: each entry the daemon answers carries its own
    # timeout, as long as it trusts the attributes, so after the change and attrValid a new
    # open walks to a LOOKUP, which answers the new version's inode: the application sees
    # the new bytes and no error, the old handle its own version.
    m = make_mount(blockSize="64KiB", attrValid=TTL, lookupValid=3600)
    old, new = content("f", 0, 3 * BS + 5), content("f", 1, 3 * BS + 5)
    (m.source / "f.bin").write_bytes(old)
    m.mount()
    NewOpen(m.path("f.bin"), old, "before").finish()
    handle = OldHandle(m.path("f.bin"), old, "old handle")
    _write_in_place(m.source / "f.bin", new)
    before = m.scrape()
    time.sleep(2 * TTL + 0.1)  # the daemon's attributes expire; the kernel's entry does not
    for n in range(3):
        NewOpen(m.path("f.bin"), new, f"new open {n}").finish()
        handle.read_all()
    handle.close()
    after = m.scrape()
    assert metric(after, "cubefs_fuse_lookups_total") > metric(before, "cubefs_fuse_lookups_total")
    assert metric(after, METRIC) - metric(before, METRIC) == 1
    m.umount()
