"""Mounted: the read path through a real daemon -- content, metadata, symlinks, permissions, EROFS."""

from __future__ import annotations

import errno
import multiprocessing
import os
import random
import stat
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.helpers import Mount, metric, stat_tree

BS = 64 * 1024  # the mount's blockSize: small, so boundaries and multi-block files stay cheap
READERS = 4  # reader processes (several at once; 4 on 2 cores still overlap)
RANDOM_READS = 300  # random preads per reader process
NOBODY = 65534
OWNER = 1000

# relative path -> size: empty, one byte, every block boundary +-1, multi-block, odd names.
FILES = {
    "empty": 0,
    "one": 1,
    "a/bs-1": BS - 1,
    "a/bs": BS,
    "a/bs+1": BS + 1,
    "a/b/2bs-1": 2 * BS - 1,
    "a/b/2bs": 2 * BS,
    "a/b/2bs+1": 2 * BS + 1,
    "a/b/c/multi.bin": 7 * BS + 12_345,
    "image 110k.jpg": 110_000,  # the ImageNet-like size, and a space in the name
    "ünïcödé ñame.dat": BS + 7,
    "a/b/c/d/e/deep.txt": 10,
}
SYMLINKS = {  # link -> target (relative to the link's directory)
    "link_multi": "a/b/c/multi.bin",
    "a/b/up": "../bs+1",
    "dirlink": "a/b",
    "dangling": "nowhere",
}


def build_tree(root: Path) -> dict[str, bytes]:
    rng = random.Random(20240611)
    contents = {}
    for rel, size in FILES.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        contents[rel] = rng.randbytes(size)
        path.write_bytes(contents[rel])
    (root / "a" / "emptydir").mkdir()
    for link, target in SYMLINKS.items():
        os.symlink(target, root / link)
    return contents


@pytest.fixture
def tree_mount(make_mount: Callable[..., Mount]) -> Iterator[tuple[Mount, dict[str, bytes]]]:
    m = make_mount(blockSize="64KiB", memCacheSize="4MiB", diskCacheSize="16MiB")
    contents = build_tree(m.source)
    m.mount()
    yield m, contents
    m.umount()  # a clean unmount is part of every test


def _read_to_end(fd: int) -> bytes:
    chunks = []
    while chunk := os.read(fd, 3 * BS // 2):  # 1.5 blocks: reads straddle block boundaries
        chunks.append(chunk)
    return b"".join(chunks)


def _random_reader(job: tuple[str, dict[str, bytes], int, bool]) -> tuple[int, int, list[str]]:
    """Whole-file reads, then random preads; returns (reads, O_DIRECT preads inside a file, mismatches)."""
    mount, contents, seed, direct = job
    rng = random.Random(seed)
    flags = os.O_RDONLY | (os.O_DIRECT if direct else 0)
    bad: list[str] = []
    reads = inside = 0
    names = sorted(contents)
    rng.shuffle(names)
    fds = {rel: os.open(os.path.join(mount, rel), flags) for rel in names}
    try:
        for rel in names:
            data = _read_to_end(fds[rel])
            reads += 1
            if data != contents[rel]:
                bad.append(f"{rel}: whole-file read of {len(data)} bytes differs")
        for _ in range(RANDOM_READS):
            rel = rng.choice(names)
            size = len(contents[rel])
            # Offsets near block boundaries are the interesting ones: half of them land there.
            if rng.random() < 0.5 and size > BS:
                offset = rng.randrange(1, size // BS + 1) * BS + rng.randint(-2, 2)
            else:
                offset = rng.randint(0, size + 10)
            offset = max(0, offset)
            length = rng.randint(1, 3 * BS)
            got = os.pread(fds[rel], length, offset)
            reads += 1
            if direct and offset < size:  # the kernel answers reads past EOF itself
                inside += 1
            if got != contents[rel][offset : offset + length]:
                bad.append(f"{rel}: pread({length}, {offset}) returned {len(got)} wrong bytes")
    finally:
        for fd in fds.values():
            os.close(fd)
    return reads, inside, bad[:10]


def test_random_reads_from_several_processes(tree_mount: tuple[Mount, dict[str, bytes]]) -> None:
    m, contents = tree_mount
    # Half the readers use O_DIRECT, so their random offsets and lengths reach the daemon
    # as they are; the others go through the kernel page cache (page-aligned readahead).
    jobs = [(str(m.mount_point), contents, seed, seed % 2 == 0) for seed in range(READERS)]
    with multiprocessing.get_context("fork").Pool(READERS) as pool:
        results = pool.map(_random_reader, jobs)
    problems = [problem for _, _, bad in results for problem in bad]
    assert not problems, problems
    assert sum(reads for reads, _, _ in results) == READERS * (len(contents) + RANDOM_READS)
    samples = m.scrape()
    assert metric(samples, "cubefs_fuse_lookups_total") >= len(contents)  # the kernel shares its entries
    # Each O_DIRECT pread inside a file reached the daemon (as one or more FUSE reads).
    assert metric(samples, "cubefs_fuse_reads_total") >= sum(inside for _, inside, _ in results) > 0
    blocks = sum(-(-len(c) // BS) for c in contents.values())
    # Every block was fetched from the backend at least once, and then served from cache.
    assert metric(samples, "cubefs_fuse_backend_operations_total", op="read") >= blocks
    assert metric(samples, "cubefs_fuse_cache_hits_total", tier="ram") > 0
    assert metric(samples, "cubefs_fuse_backend_errors_total", op="read", errno="EIO") == 0


def test_readdir_and_stat_match_source(tree_mount: tuple[Mount, dict[str, bytes]]) -> None:
    m, _ = tree_mount
    source, mounted = stat_tree(m.source), stat_tree(m.mount_point)
    assert sorted(mounted) == sorted(source)
    for rel, want in source.items():
        got = mounted[rel]
        assert (stat.S_IFMT(got.st_mode), stat.S_IMODE(got.st_mode)) == \
            (stat.S_IFMT(want.st_mode), stat.S_IMODE(want.st_mode)), rel
        assert (got.st_uid, got.st_gid, got.st_mtime_ns) == (want.st_uid, want.st_gid, want.st_mtime_ns), rel
        if not stat.S_ISDIR(want.st_mode):
            assert got.st_size == want.st_size, rel
    for directory in ("", "a", "a/b", "a/emptydir"):
        assert sorted(os.listdir(m.path(directory))) == sorted(os.listdir(m.source / directory))
    assert sorted(os.listdir(m.path("dirlink"))) == sorted(os.listdir(m.source / "a" / "b"))
    assert os.statvfs(m.mount_point).f_blocks == os.statvfs(m.source).f_blocks


def test_symlinks_readlink_and_resolve(tree_mount: tuple[Mount, dict[str, bytes]]) -> None:
    m, contents = tree_mount
    for link, target in SYMLINKS.items():
        assert os.readlink(m.path(link)) == target
        assert stat.S_ISLNK(os.lstat(m.path(link)).st_mode)
    assert m.path("link_multi").read_bytes() == contents["a/b/c/multi.bin"]
    assert m.path("a/b/up").read_bytes() == contents["a/bs+1"]
    assert m.path("dirlink/c/multi.bin").read_bytes() == contents["a/b/c/multi.bin"]
    assert os.path.realpath(m.path("dirlink/2bs")) == str(m.path("a/b/2bs"))
    with pytest.raises(FileNotFoundError):
        m.path("dangling").read_bytes()
    with pytest.raises(OSError) as info:
        os.readlink(m.path("one"))
    assert info.value.errno == errno.EINVAL


def _access_as(user: int, mount: str, rel: str, action: str, answer: multiprocessing.Queue[str]) -> None:
    """In a child: drop to ``user`` and report what ``action`` on ``rel`` gives."""
    try:
        # The mount's ancestors (pytest's tmp dirs) are root-only; resolve from the mount's fd.
        root = os.open(mount, os.O_RDONLY | os.O_DIRECTORY)
        os.setgroups([])
        os.setgid(user)
        os.setuid(user)
        if action == "read":
            fd = os.open(rel, os.O_RDONLY, dir_fd=root)
            data = os.read(fd, 100)
            os.close(fd)
            answer.put(f"ok {len(data)}")
        else:
            fd = os.open(rel, os.O_RDONLY | os.O_DIRECTORY, dir_fd=root)
            answer.put(f"ok {len(os.listdir(fd))}")
    except OSError as exc:
        answer.put(errno.errorcode.get(exc.errno or 0, "?"))


def _as_user(user: int, m: Mount, rel: str, action: str = "read") -> str:
    context = multiprocessing.get_context("fork")
    answer: multiprocessing.Queue[str] = context.Queue()
    child = context.Process(target=_access_as, args=(user, str(m.mount_point), rel, action, answer))
    child.start()
    result = answer.get(timeout=30)
    child.join(30)
    return result


def test_permissions_and_ownership(make_mount: Callable[..., Mount]) -> None:
    m = make_mount()
    private = m.source / "private"
    private.mkdir()
    (private / "secret.bin").write_bytes(b"s" * 10)
    (private / "shared.bin").write_bytes(b"p" * 20)
    (private / "locked").mkdir()
    (private / "locked" / "inside.txt").write_bytes(b"i")
    for path, mode in ((private / "secret.bin", 0o600), (private / "shared.bin", 0o644), (private / "locked", 0o700)):
        os.chown(path, OWNER, OWNER)
        os.chmod(path, mode)
    m.mount()
    st = os.stat(m.path("private/secret.bin"))
    assert (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)) == (OWNER, OWNER, 0o600)
    assert _as_user(NOBODY, m, "private/secret.bin") == "EACCES"
    assert _as_user(NOBODY, m, "private/locked", "list") == "EACCES"
    assert _as_user(NOBODY, m, "private/shared.bin") == "ok 20"  # others may read 0644
    assert _as_user(OWNER, m, "private/secret.bin") == "ok 10"  # the owner may read 0600
    assert _as_user(OWNER, m, "private/locked", "list") == "ok 1"
    assert m.path("private/secret.bin").read_bytes() == b"s" * 10  # root reads it
    m.umount()


def test_every_write_operation_fails_with_erofs(tree_mount: tuple[Mount, dict[str, bytes]]) -> None:
    m, contents = tree_mount
    p = m.path
    attempts: dict[str, Callable[[], object]] = {
        "create": lambda: os.open(p("new.txt"), os.O_WRONLY | os.O_CREAT, 0o644),
        "open for write": lambda: os.open(p("one"), os.O_WRONLY),
        "open read-write": lambda: os.open(p("one"), os.O_RDWR),
        "open append": lambda: os.open(p("one"), os.O_WRONLY | os.O_APPEND),
        "open truncate": lambda: os.open(p("a/bs"), os.O_RDONLY | os.O_TRUNC),
        "truncate": lambda: os.truncate(p("a/bs"), 0),
        "mkdir": lambda: os.mkdir(p("newdir")),
        "rmdir": lambda: os.rmdir(p("a/emptydir")),
        "unlink": lambda: os.unlink(p("one")),
        "rename": lambda: os.rename(p("one"), p("two")),
        "chmod": lambda: os.chmod(p("one"), 0o777),
        "chown": lambda: os.chown(p("one"), NOBODY, NOBODY),
        "utime": lambda: os.utime(p("one"), (0, 0)),
        "symlink": lambda: os.symlink("one", p("newlink")),
        "link": lambda: os.link(p("one"), p("hardlink")),
        "mkfifo": lambda: os.mkfifo(p("fifo")),
        "setxattr": lambda: os.setxattr(p("one"), "user.test", b"x"),
    }
    for name, attempt in attempts.items():
        with pytest.raises(OSError) as info:
            attempt()
        assert info.value.errno == errno.EROFS, f"{name}: {info.value}"
    for rel, data in contents.items():  # the source is untouched
        assert (m.source / rel).read_bytes() == data
    assert not (m.source / "new.txt").exists()
