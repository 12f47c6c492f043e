"""`cubefs-fuse example-config [NAME]`: the example client configs shipped in the package
(cubefs_fuse/examples/, linked from configs/), printed as real subprocesses run them."""

from __future__ import annotations

import json

import pytest

from cubefs_fuse.cli import EXAMPLES
from cubefs_fuse.config import parse_config
from tests.helpers import REPO, cli


def test_every_example_in_configs_is_shipped() -> None:
    assert {p.stem for p in (REPO / "configs").glob("*.json")} == set(EXAMPLES)
    for name in EXAMPLES:
        assert (REPO / "configs" / f"{name}.json").resolve() == REPO / "cubefs_fuse" / "examples" / f"{name}.json"


@pytest.mark.parametrize("name", EXAMPLES)
def test_prints_the_example(name: str) -> None:
    result = cli("example-config", name)
    assert result.returncode == 0 and result.stderr == ""
    printed = json.loads(result.stdout)
    assert printed == json.loads((REPO / "configs" / f"{name}.json").read_text())
    parse_config(printed)  # valid for the daemon's own parser


def test_default_is_minimal() -> None:
    assert cli("example-config").stdout == (REPO / "configs" / "minimal.json").read_text()


def test_unknown_name_is_one_line_and_exit_2() -> None:
    result = cli("example-config", "imagenet")
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr == ("cubefs-fuse: error: no example config 'imagenet'; "
                             "choose one of: minimal, nfs-dataset, cubefs-compatible, s3-dataset\n")


def test_mount_help_points_at_it() -> None:
    assert "cubefs-fuse example-config" in " ".join(cli("mount", "--help").stdout.split())
