"""A sample cache's name has one rule (control/protocol.py), kept by the daemon's store and
by cube_torch alike: a name one side takes the other takes too, and cube_torch refuses a
bad name where the cache is made, with one line that states the rule."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from cube_torch.samples.cache import SampleCache
from cubefs_fuse.control.protocol import SAMPLE_NAME_RULE
from cubefs_fuse.errors import BadRequest
from cubefs_fuse.samples.store import SampleStore
from tests.fakes import MemoryStore

GOOD = ["imagenet-train-decoded-224", "a", "x" * 128, "v1.2:rank@0_x-y", "...", "~1000/shared-cache"]
BAD: list[Any] = ["", ".", "..", "a b", "a/b", "x" * 129, "x" * 300, "tab\there", "é", "line\nbreak",
                  "~1000/..", "~1000/", "~x/name", "~1000/a/b", None, 7]


@pytest.mark.parametrize("name", GOOD)
def test_a_good_name_is_taken_by_both_sides(name: str, tmp_path: Path) -> None:
    assert SampleCache(name, MemoryStore()).name == name
    store = SampleStore(str(tmp_path), 1 << 20, 0, 0.0)
    owner, resolved = store.resolve(0, name)  # root: may read another user's cache
    assert resolved == name.rpartition("/")[2] and owner == (1000 if name.startswith("~") else 0)


@pytest.mark.parametrize("name", BAD, ids=repr)
def test_a_bad_name_is_refused_by_both_sides(name: Any, tmp_path: Path) -> None:
    with pytest.raises(ValueError) as refused:
        SampleCache(name, MemoryStore())
    message = str(refused.value)
    # One line stating the rule, nothing chained to it (no second traceback under it).
    assert message.startswith(SAMPLE_NAME_RULE) and "\n" not in message
    assert refused.value.__cause__ is None and refused.value.__suppress_context__
    store = SampleStore(str(tmp_path), 1 << 20, 0, 0.0)
    with pytest.raises(BadRequest, match="sample cache name is"):
        store.resolve(0, name)
