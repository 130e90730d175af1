"""lightning_bpk.runtime.ranks without a Trainer: one rank with no collective, and two real
processes agreeing over a gloo process group."""

from __future__ import annotations

import multiprocessing
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_bpk.runtime.ranks import Ranks

JOIN_TIMEOUT_S = 240  # two fresh interpreters importing torch; a hang fails instead of waiting


def _no_collective(*args: Any) -> Any:
    raise AssertionError("a single rank needs no collective")


def test_a_single_rank_agrees_with_itself_without_a_collective():
    ranks = Ranks(1, True, _no_collective, torch.device("cpu"), _no_collective)
    assert ranks.agree_all([0, 2, 1]) == [0, 2, 1]
    assert ranks.gather({"batches": 3}) == [{"batches": 3}]
    # agree goes through the strategy's reduce even alone (Lightning's is the identity there)
    assert Ranks(1, True, lambda t: t, torch.device("cpu")).agree(5) == 5


def test_rank_0_decides_and_a_failure_reaches_every_rank():
    """``decide``: rank 0's choice for all; where it raised, every rank gets the failure's
    value and rank 0 raises the error itself after the broadcast (unless told not to)."""
    told: list[Any] = []  # what each broadcast was given (rank 0's value is what all get)

    def broadcast(value: Any) -> Any:
        told.append(value)
        return told[0]

    rank0 = Ranks(2, True, _no_collective, torch.device("cpu"), _no_collective, broadcast)
    other = Ranks(2, False, _no_collective, torch.device("cpu"), _no_collective, broadcast)
    assert rank0.decide(lambda: 7, lambda e: -1) == 7
    assert other.decide(_no_collective, lambda e: -1) == 7  # only rank 0 chooses
    assert told == [7, None]
    told.clear()

    def fails() -> int:
        raise OSError("disk gone")

    with pytest.raises(OSError, match="disk gone"):
        rank0.decide(fails, lambda e: f"failed: {e}")
    assert told == ["failed: disk gone"]  # what the other ranks receive
    assert rank0.decide(fails, lambda e: f"failed: {e}", reraise=False) == "failed: disk gone"


def _rank(rank: int, store: str, out: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    try:

        def reduce_max(tensor: torch.Tensor) -> torch.Tensor:
            dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
            return tensor

        ranks = Ranks(2, rank == 0, reduce_max, torch.device("cpu"))
        results = {
            "agree": ranks.agree(rank),  # only rank 1 saw the signal
            "agree_all": ranks.agree_all([rank, 2 * (1 - rank)]),
            "gather": ranks.gather({"rank": rank, "batches": 10 + rank}),
        }
        torch.save(results, out)
    finally:
        dist.destroy_process_group()


def test_two_ranks_take_the_same_decision(tmp_path: Path):
    context = multiprocessing.get_context("spawn")
    store, outs = tmp_path / "store", [tmp_path / f"rank{r}.pt" for r in range(2)]
    processes = [
        context.Process(target=_rank, args=(r, str(store), str(outs[r]))) for r in range(2)
    ]
    for process in processes:
        process.start()
    for process in processes:
        process.join(JOIN_TIMEOUT_S)
        if process.is_alive():
            process.kill()
            pytest.fail("a rank hung in a collective")
    assert [p.exitcode for p in processes] == [0, 0]
    zero, one = (torch.load(out, weights_only=True) for out in outs)
    assert zero["agree"] == one["agree"] == 1
    assert zero["agree_all"] == one["agree_all"] == [1, 2]
    assert zero["gather"] == [{"rank": 0, "batches": 10}, {"rank": 1, "batches": 11}]
    assert one["gather"] is None  # only rank 0 receives
