"""lightning_bpk.runtime.rng: which CUDA devices' states a process captures and restores."""

from __future__ import annotations

import torch

from lightning_bpk.runtime import rng


def test_a_rank_restores_only_its_own_device_and_only_one_that_exists():
    assert rng._cuda_devices(8, None) == list(range(8))
    assert rng._cuda_devices(8, 5) == [5]
    assert rng._own_cuda_device() is None  # no process group: a single process
    assert rng._cuda_states({"torch": torch.zeros(1)}) == {}
    if not torch.cuda.is_available():
        assert "cuda_devices" not in rng.capture_rng()
