"""One error family: every error class the package raises derives from LightningBpkError and
keeps the built-in base a user would catch."""

from __future__ import annotations

import pytest

import lightning_bpk
from lightning_bpk import burnpack, state
from lightning_bpk.checkpointer import CheckpointLockedError
from lightning_bpk.errors import LightningBpkError
from lightning_bpk.interop import RemapError
from lightning_bpk.lightning.callback import CheckpointSaveError
from lightning_bpk.records import RecordChecksumError, RecordError

FORMAT_ERRORS = [
    burnpack.HeaderError,
    burnpack.MagicError,
    burnpack.VersionError,
    burnpack.MetadataError,
    burnpack.ValidationError,
    burnpack.TensorNotFoundError,
    burnpack.ChecksumError,
    burnpack.SizeMismatchError,
    burnpack.BurnpackIOError,
]


@pytest.mark.parametrize(
    ("error", "builtin"),
    [
        *((e, Exception) for e in FORMAT_ERRORS),
        (burnpack.BurnpackIOError, OSError),
        (state.StateError, ValueError),
        (RemapError, ValueError),
        (RecordError, Exception),
        (RecordChecksumError, burnpack.ChecksumError),
        (CheckpointLockedError, RuntimeError),
        (CheckpointSaveError, RuntimeError),
    ],
)
def test_every_error_is_in_the_family_and_keeps_its_builtin_base(error, builtin) -> None:
    assert issubclass(error, LightningBpkError) and issubclass(error, builtin)


def test_root_is_exported_from_the_package() -> None:
    assert lightning_bpk.LightningBpkError is LightningBpkError
    assert "LightningBpkError" in lightning_bpk.__all__


def test_a_real_failure_is_caught_by_the_root() -> None:
    with pytest.raises(LightningBpkError, match="magic"):
        burnpack.loads(b"NOPE" + bytes(12))
    with pytest.raises(LightningBpkError, match="cannot store"):
        state.encode({"f": object()})
