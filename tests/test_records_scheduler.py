"""LrSchedulerRecord: Burn's check (step k, save, load, step n more: same LRs), every scheduler."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.optim import lr_scheduler as L
from torch.optim.swa_utils import SWALR

from lightning_bpk import burnpack
from lightning_bpk.records import (
    LrSchedulerRecord,
    ModuleRecord,
    OptimizerRecord,
    RecordError,
    load_record,
)
from lightning_bpk.records import scheduler as scheduler_mod


def decay(epoch: int) -> float:
    return 0.9**epoch


class Warmup:
    """A callable object: torch saves its __dict__."""

    def __init__(self, steps: int) -> None:
        self.steps = steps
        self.calls = 0

    def __call__(self, epoch: int) -> float:
        self.calls += 1
        return min(1.0, (epoch + 1) / self.steps)


Make = Callable[[torch.optim.Optimizer], object]
CASES: dict[str, Make] = {
    "lambda-fn": lambda o: L.LambdaLR(o, decay),
    "lambda-object": lambda o: L.LambdaLR(o, Warmup(10)),
    "multiplicative": lambda o: L.MultiplicativeLR(o, lambda e: 0.95),
    "step": lambda o: L.StepLR(o, step_size=2, gamma=0.5),
    "multistep": lambda o: L.MultiStepLR(o, milestones=[2, 4, 4, 7], gamma=0.5),
    "constant": lambda o: L.ConstantLR(o, factor=0.5, total_iters=4),
    "linear": lambda o: L.LinearLR(o, start_factor=0.2, total_iters=10),
    "exponential": lambda o: L.ExponentialLR(o, gamma=0.9),
    "polynomial": lambda o: L.PolynomialLR(o, total_iters=8, power=2.0),
    "cosine": lambda o: L.CosineAnnealingLR(o, T_max=6, eta_min=0.01),
    "cosine-restarts": lambda o: L.CosineAnnealingWarmRestarts(o, T_0=3, T_mult=2),
    "cyclic": lambda o: L.CyclicLR(o, 0.01, 0.5, step_size_up=3, mode="exp_range", gamma=0.9),
    "one-cycle": lambda o: L.OneCycleLR(o, max_lr=1.0, total_steps=20),
    "swa": lambda o: SWALR(o, swa_lr=0.05, anneal_epochs=10),
    "sequential": lambda o: L.SequentialLR(
        o,
        [L.LinearLR(o, start_factor=0.1, total_iters=3), L.ExponentialLR(o, gamma=0.8)],
        milestones=[3],
    ),
    "chained": lambda o: L.ChainedScheduler(
        [L.ConstantLR(o, factor=0.5, total_iters=3), L.ExponentialLR(o, gamma=0.9)]
    ),
    "nested": lambda o: L.ChainedScheduler(
        [
            L.SequentialLR(
                o, [L.ConstantLR(o, factor=0.5, total_iters=2), L.StepLR(o, 2)], milestones=[2]
            ),
            L.ExponentialLR(o, gamma=0.95),
        ],
        optimizer=o,
    ),
    "plateau": lambda o: L.ReduceLROnPlateau(o, mode="max", patience=1, factor=0.5),
}


def metric(i: int) -> float:
    return [1.0, 0.5, 0.5, 0.4, 0.4, 0.4, 0.3, 0.2, 0.2, 0.2][i % 10]


def step(model: nn.Module, opt: torch.optim.Optimizer, sched: object, i: int) -> float:
    opt.zero_grad()
    model(torch.full((1, 2), float(i))).sum().backward()
    opt.step()
    if isinstance(sched, L.ReduceLROnPlateau):
        sched.step(metric(i))
    else:
        sched.step()
    return opt.param_groups[0]["lr"]


@pytest.mark.parametrize("name", list(CASES))
def test_resume_gives_the_same_lr_sequence(name: str) -> None:
    make = CASES[name]
    torch.manual_seed(0)
    model = nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sched = make(opt)
    for i in range(5):
        step(model, opt, sched, i)
    blobs = (
        ModuleRecord.from_module(model).to_bytes(),
        OptimizerRecord.from_optimizer(opt, model).to_bytes(),
        LrSchedulerRecord.from_scheduler(sched).to_bytes(),
    )

    clone = ModuleRecord.from_bytes(blobs[0]).apply(nn.Linear(2, 1))
    opt2 = torch.optim.SGD(clone.parameters(), lr=0.1, momentum=0.9)
    sched2 = make(opt2)
    LrSchedulerRecord.from_bytes(blobs[2]).apply(sched2)
    OptimizerRecord.from_bytes(blobs[1]).apply(opt2, clone)

    assert sched2.state_dict().keys() == sched.state_dict().keys()
    original = [step(model, opt, sched, i) for i in range(5, 12)]
    resumed = [step(clone, opt2, sched2, i) for i in range(5, 12)]
    assert original == resumed
    assert sched.get_last_lr() == sched2.get_last_lr()
    assert len(set(original)) > 1 or name in ("constant", "plateau")


def test_layout_scalars_strings_and_indexed_lists() -> None:
    opt = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1)
    sched = L.ReduceLROnPlateau(opt, mode="min")
    with burnpack.loads(LrSchedulerRecord.from_scheduler(sched).to_bytes()) as pack:
        assert pack.names == []
        assert pack.scalars["best"] == burnpack.Scalar.Float(math.inf)
        assert pack.scalars["last_epoch"] == burnpack.Scalar.Int(0)
        assert pack.scalars["min_lrs.0"] == burnpack.Scalar.Int(0)
        assert pack.scalars["_last_lr.0"] == burnpack.Scalar.Float(0.1)
        assert pack.metadata["mode"] == "min"
        assert pack.metadata[scheduler_mod._SCHEDULER_CLASS_KEY].endswith("ReduceLROnPlateau")


def test_a_record_holds_the_scheduler_as_it_was_when_taken() -> None:
    # state_dict() shares the scheduler's own lists: one changed in place after the record was
    # taken (before an asynchronous save writes it) must not reach the file
    opt = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1)
    sched = L.StepLR(opt, step_size=2)
    record = LrSchedulerRecord.from_scheduler(sched)
    sched.base_lrs[0] = 99.0
    sched.step()
    with burnpack.loads(record.to_bytes()) as pack:
        assert pack.scalars["base_lrs.0"] == burnpack.Scalar.Float(0.1)
        assert pack.scalars["last_epoch"] == burnpack.Scalar.Int(0)


def test_composed_children_use_index_prefixes() -> None:
    opt = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1)
    sched = CASES["nested"](opt)
    with burnpack.loads(LrSchedulerRecord.from_scheduler(sched).to_bytes()) as pack:
        assert "0.0.total_iters" in pack.scalars and "0.1.step_size" in pack.scalars
        assert "0._milestones.0" in pack.scalars and "1.gamma" in pack.scalars
        assert not any(k.startswith("_schedulers") for k in [*pack.scalars, *pack.metadata])


def test_lambda_objects_state_and_milestone_counter_keep_their_types() -> None:
    opt = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1)
    lam = L.LambdaLR(opt, [Warmup(3)])
    for _ in range(2):
        opt.step()
        lam.step()
    record = LrSchedulerRecord.from_bytes(LrSchedulerRecord.from_scheduler(lam).to_bytes())
    assert record.state["lr_lambdas"] == [{"steps": 3, "calls": 3}]
    fresh = L.LambdaLR(opt, [Warmup(9)])
    record.apply(fresh)
    assert fresh.lr_lambdas[0].steps == 3 and fresh.lr_lambdas[0].calls == 3
    function = LrSchedulerRecord.from_scheduler(L.LambdaLR(opt, decay))
    assert function.state["lr_lambdas"] == [None]  # functions cannot be saved, as in torch
    multi = L.MultiStepLR(opt, milestones=[2, 2, 5])
    milestones = LrSchedulerRecord.from_bytes(
        LrSchedulerRecord.from_scheduler(multi).to_bytes()
    ).state["milestones"]
    assert type(milestones) is Counter and milestones == Counter({2: 2, 5: 1})


def test_tensor_state_is_refused_with_its_key() -> None:
    opt = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=torch.tensor(0.1))
    sched = L.StepLR(opt, step_size=1)
    with pytest.raises(RecordError, match=r"'_last_lr\.0' is a tensor") as info:
        LrSchedulerRecord.from_scheduler(sched)
    assert info.value.kind == "validation"
    with pytest.raises(RecordError, match="scalars only"):
        LrSchedulerRecord.from_bytes(burnpack.dumps({"x": torch.zeros(1)}))


def test_unstorable_state_names_its_path() -> None:
    opt = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1)
    sched = L.StepLR(opt, step_size=1)
    sched.callback = lambda: None  # a user attribute torch would pickle
    with pytest.raises(RecordError, match=r"\$\['callback'\]: cannot store a builtins.function"):
        LrSchedulerRecord.from_scheduler(sched)


def test_other_class_is_refused() -> None:
    opt = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1)
    record = LrSchedulerRecord.from_scheduler(L.StepLR(opt, step_size=1))
    with pytest.raises(RecordError, match=r"record holds .*StepLR state, the scheduler is"):
        record.apply(L.ExponentialLR(opt, gamma=0.5))


def test_file_round_trip_and_burn_empty_pack(tmp_path: Path) -> None:
    opt = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1)
    sched = L.CosineAnnealingLR(opt, T_max=4)
    path = LrSchedulerRecord.from_scheduler(sched).save(tmp_path / "scheduler")
    assert path.name == "scheduler.bpk"
    loaded = load_record(path)
    assert isinstance(loaded, LrSchedulerRecord)
    assert loaded.state == LrSchedulerRecord.from_scheduler(sched).state
    # Burn's scheduler files carry no structure: a clear validation error, not a crash
    with pytest.raises(RecordError) as info:
        LrSchedulerRecord.from_bytes(burnpack.dumps({}, scalars={"0.current_iter": 3}))
    assert info.value.kind == "validation"


def test_state_dict_is_torchs_form() -> None:
    opt = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1)
    sched = CASES["nested"](opt)
    record = LrSchedulerRecord.from_bytes(LrSchedulerRecord.from_scheduler(sched).to_bytes())
    expected = sched.state_dict()
    assert record.state_dict() == expected
    assert len(record.state_dict()["_schedulers"][0]["_schedulers"]) == 2
