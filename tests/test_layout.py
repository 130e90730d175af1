"""The on-disk vocabulary: one definition, and every writer and reader of names uses it."""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest

from lightning_bpk import checkpointer, cli, layout
from lightning_bpk.interop import formats
from lightning_bpk.lightning import callback, trainer_state


def test_dopamine_defaults_and_record_files() -> None:
    assert (layout.DEFAULT_PREFIX, layout.DEFAULT_IDENTIFIER) == ("ckpt", "checkpoint")
    assert layout.sentinel_name("checkpoint", 3) == "sentinel_checkpoint_complete.3"
    assert (layout.MODEL_FILE, layout.TRAINER_FILE) == ("model.bpk", "trainer.bpk")


@pytest.mark.parametrize(
    ("name", "parsed"),
    [
        ("sentinel_checkpoint_complete.0", ("checkpoint", 0)),
        ("sentinel_my_run_complete.42", ("my_run", 42)),
        ("sentinel_checkpoint_complete.007", None),
        ("sentinel_checkpoint_complete.-1", None),
        ("sentinel_checkpoint_complete.3.12-0.tmp", None),
        ("sentinel__complete.3", None),
        ("ckpt.3", None),
    ],
)
def test_parse_sentinel_name_accepts_only_canonical_names(name: str, parsed) -> None:
    assert layout.parse_sentinel_name(name) == parsed


def test_every_default_comes_from_the_layout(tmp_path: Path) -> None:
    for fn in (
        checkpointer.Checkpointer.__init__,
        checkpointer.list_checkpoints,
        callback.BurnpackCheckpoint.__init__,
    ):
        params = inspect.signature(fn).parameters
        assert params["checkpoint_file_prefix"].default is layout.DEFAULT_PREFIX
        assert params["sentinel_file_identifier"].default is layout.DEFAULT_IDENTIFIER
    c = checkpointer.Checkpointer(tmp_path, "run", "mine")
    assert c.sentinel_path(5).name == layout.sentinel_name("mine", 5)
    assert trainer_state.MODEL_KEY + layout.RECORD_SUFFIX == formats.CHECKPOINT_MODEL_FILE
    args = cli._build_parser().parse_args(["ls", str(tmp_path)])
    assert (args.prefix, args.identifier) == (layout.DEFAULT_PREFIX, layout.DEFAULT_IDENTIFIER)


@pytest.mark.parametrize(
    ("name", "why"),
    [
        ("__0_0.bpk", None),
        ("sub/dir/file.bpk", None),
        ("../../../x/evil.bpk", "component '..'"),
        ("a/../b", "component '..'"),
        ("/etc/passwd", "an absolute path"),
        ("a//b", "component ''"),
        ("./a", "component '.'"),
        ("a/", "component ''"),
        ("a\\..\\b", "a backslash or NUL"),
        ("a\x00b", "a backslash or NUL"),
        ("", "is not a file name"),
        (7, "is not a file name"),
        (None, "is not a file name"),
    ],
)
def test_member_name_problem_refuses_every_name_that_leaves_its_checkpoint(
    name: object, why: str | None
) -> None:
    problem = layout.member_name_problem(name)
    if why is None:
        assert problem is None
    else:
        assert problem is not None and why in problem and repr(name) in problem
