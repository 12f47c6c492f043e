"""The test tiers are declared once (tests/conftest.py) and everything else agrees with it:
the folders, the markers in pyproject.toml (the tiers', then the one other) and the tier
names scripts/test.sh accepts."""

from __future__ import annotations

import re
import tomllib

from tests.conftest import NEEDS_ROOT_AND_FUSE, TESTS, TIERS, tier_of
from tests.helpers import REPO


def test_every_test_file_is_in_a_tier_folder() -> None:
    stray = [str(p.relative_to(REPO)) for p in TESTS.rglob("test_*.py") if tier_of(p) is None]
    assert stray == [], f"test files outside tests/{{{','.join(TIERS)}}}/"
    assert sorted(p.name for p in TESTS.iterdir() if p.is_dir() and not p.name.startswith(("_", "."))) == sorted(TIERS)
    for tier in TIERS:  # packages, so that test modules of the same name in two tiers do not clash
        assert (TESTS / tier / "__init__.py").is_file(), tier
        assert list((TESTS / tier).glob("test_*.py")), f"tests/{tier}/ has no tests"


def test_test_files_share_code_only_through_tests_modules() -> None:
    """A test file imports no other test file: what two share lives in tests/*.py."""
    for path in TESTS.rglob("test_*.py"):
        imports = re.findall(r"^\s*(?:from|import) (tests\.[\w.]+)", path.read_text(), re.MULTILINE)
        assert [i for i in imports if i.count(".") > 1 or i.split(".")[1] in TIERS] == [], path


def test_markers_and_test_sh_name_the_same_tiers() -> None:
    pytest_options = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]
    names = [marker.split(":")[0].split("(")[0] for marker in pytest_options["markers"]]
    assert names[:len(TIERS)] == list(TIERS)
    assert names[len(TIERS):] == ["expected_daemon_errors"]  # the one marker that is not a tier (tests/conftest.py)
    assert pytest_options["testpaths"] == ["tests"]
    script = (REPO / "scripts" / "test.sh").read_text()
    assert re.search(r"^TIERS=\((.*)\)$", script, re.MULTILINE).group(1).split() == list(TIERS)  # type: ignore[union-attr]
    assert re.search(r"^\s*(unit \| .*)\) paths", script, re.MULTILINE).group(1).split(" | ") == list(TIERS)  # type: ignore[union-attr]
    assert set(NEEDS_ROOT_AND_FUSE) <= set(TIERS)
