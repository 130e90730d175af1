"""lightning_bpk.runtime.rng: which CUDA devices' states a process captures and restores."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from lightning_bpk.errors import CheckpointResumeError
from lightning_bpk.runtime import rng


def test_a_rank_restores_only_its_own_device_and_only_one_that_exists():
    assert rng._cuda_devices(8, None) == list(range(8))
    assert rng._cuda_devices(8, 5) == [5]
    assert rng._own_cuda_device() is None  # no process group: a single process
    assert rng._cuda_states({"torch": torch.zeros(1)}) == {}
    if not torch.cuda.is_available():
        assert "cuda_devices" not in rng.capture_rng()


def _malformed() -> dict[str, dict]:
    """Valid states, each broken in one field as a damaged or hostile file could have it."""
    good = rng.capture_rng()
    numpy, python = good["numpy"], good["python"]
    return {
        "no torch state": {k: v for k, v in good.items() if k != "torch"},
        "a torch state of the wrong size": {**good, "torch": torch.zeros(3, dtype=torch.uint8)},
        "a torch state that is a string": {**good, "torch": "state"},
        "numpy keys of the wrong length": {**good, "numpy": {**numpy, "keys": numpy["keys"][:5]}},
        "a numpy kind of no generator": {**good, "numpy": {**numpy, "kind": "XYZ"}},
        "a numpy position past the keys": {**good, "numpy": {**numpy, "pos": 2**70}},
        "no numpy gauss": {**good, "numpy": {k: v for k, v in numpy.items() if k != "gauss"}},
        "a python version of no generator": {**good, "python": {**python, "version": 99}},
        "a python state that is not a tensor": {**good, "python": {**python, "state": [1, 2]}},
        "a python state too short": {
            **good,
            "python": {**python, "state": torch.zeros(3, dtype=torch.int64)},
        },
        "a cuda device that is no index": {**good, "cuda_devices": {"x": torch.zeros(3)}},
    }


@pytest.mark.parametrize("case", list(_malformed()))
def test_a_malformed_rng_state_is_a_resume_error_naming_the_field_and_changes_nothing(case):
    """A checkpoint's RNG states come from a file: a malformed one is refused with the package's
    error naming the field (it raised KeyError, ValueError or OverflowError), and no global
    generator is touched: every state is checked on a generator of its own first."""
    before = rng.capture_rng()
    expected = (torch.rand(3), np.random.rand(), random.random())
    rng.restore_rng(before)
    with pytest.raises(CheckpointResumeError, match="RNG state is malformed"):
        rng.restore_rng(_malformed()[case])
    assert torch.equal(torch.rand(3), expected[0])
    assert np.random.rand() == expected[1] and random.random() == expected[2]
