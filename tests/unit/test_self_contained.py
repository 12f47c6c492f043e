"""The repository refers only to what it contains: no design document, shared folder or
issue number that a reader of the repository cannot open."""

from __future__ import annotations

import re
from pathlib import Path

from tests.helpers import REPO

OUTSIDE = re.compile(r"DESIGN\.md|\.\./shared|/work/shared|\b[Ii]ssues? #?\d+\b|\bissue's\b|later issues")
TEXT = {".py", ".md", ".sh", ".toml", ".yaml", ".yml", ".json", ".service", ".txt", ".c", ".h", ""}
SKIP_DIRS = {".git", ".venv", "__pycache__", "bench-results", "build", ".mypy_cache", ".pytest_cache",
             "cubefs_fuse.egg-info"}  # the egg-info is pip's copy of an older README


def _files() -> list[Path]:
    return [p for p in REPO.rglob("*") if p.is_file() and not p.is_symlink() and p.suffix in TEXT
            and not SKIP_DIRS & set(p.relative_to(REPO).parts)]


def test_no_reference_to_documents_outside_the_repository() -> None:
    me = Path(__file__).resolve()
    found = []
    for path in _files():
        rel = str(path.relative_to(REPO))
        if path.resolve() == me:
            continue
        for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            if OUTSIDE.search(line):
                found.append(f"{rel}:{n}: {line.strip()[:100]}")
    assert found == [], "\n".join(found)


def test_the_pattern_sees_each_kind() -> None:
    for line in ("see DESIGN.md 2.1", "(../shared/notes)", "asked in issue 5", "Issue 3 asks", "issue #14",
                 "The issue's target", "Planned (later issues):"):
        assert OUTSIDE.search(line), line
    for line in ("prefetch_issued", "blocks issued ahead", "an issue with the disk"):
        assert not OUTSIDE.search(line), line
