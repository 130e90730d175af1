"""OptimizerRecord: every torch optimizer resumes bit-identically from a record, by parameter id."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from test_state import assert_exact  # exact nested equality, shared with the codec tests
from torch import nn

from lightning_bpk import burnpack
from lightning_bpk.records import (
    ModuleRecord,
    OptimizerRecord,
    RecordError,
    load_record,
    param_ids,
)

optim = torch.optim


class MLP(nn.Module):
    def __init__(self, bias: bool = True) -> None:
        super().__init__()
        self.fc1 = nn.Linear(4, 6, bias=bias)
        self.fc2 = nn.Linear(6, 3, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.fc1(x)))


class Bag(nn.Module):
    """Sparse gradients, for SparseAdam."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 3, sparse=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.embed((x.abs() * 10).long().clamp(max=9)).sum(1)[:, :3]


@dataclass
class Case:
    id: str
    make: Callable[[list], optim.Optimizer]
    model: Callable[[], nn.Module] = MLP
    shuffle: bool = True  # LBFGS's flat state is tied to the parameter order
    extra: dict = field(default_factory=dict)


CASES = [
    Case("sgd", lambda p: optim.SGD(p, lr=0.1)),
    Case("sgd-nesterov", lambda p: optim.SGD(p, lr=0.1, momentum=0.9, nesterov=True)),
    Case(
        "sgd-dampening-loop",
        lambda p: optim.SGD(
            p, lr=0.1, momentum=0.5, dampening=0.1, weight_decay=0.01, foreach=False
        ),
    ),
    Case("adam", lambda p: optim.Adam(p, lr=0.01)),
    Case("adam-amsgrad-loop", lambda p: optim.Adam(p, lr=0.01, amsgrad=True, foreach=False)),
    Case("adam-fused", lambda p: optim.Adam(p, lr=0.01, fused=True)),
    Case("adam-maximize", lambda p: optim.Adam(p, lr=0.01, maximize=True, weight_decay=0.1)),
    Case("adam-tensor-lr", lambda p: optim.Adam(p, lr=torch.tensor(0.01), foreach=False)),
    Case("adamw-amsgrad", lambda p: optim.AdamW(p, lr=0.01, amsgrad=True, weight_decay=0.1)),
    Case("adadelta", lambda p: optim.Adadelta(p, lr=0.5)),
    Case("adafactor", lambda p: optim.Adafactor(p, lr=0.01)),
    Case("adagrad", lambda p: optim.Adagrad(p, lr=0.1, lr_decay=0.01)),
    Case("adamax", lambda p: optim.Adamax(p, lr=0.01)),
    Case("asgd", lambda p: optim.ASGD(p, lr=0.01, t0=1)),
    Case("nadam", lambda p: optim.NAdam(p, lr=0.01, decoupled_weight_decay=True, weight_decay=0.1)),
    Case("radam", lambda p: optim.RAdam(p, lr=0.01, decoupled_weight_decay=True)),
    Case("rmsprop", lambda p: optim.RMSprop(p, lr=0.01, centered=True, momentum=0.9)),
    Case("rprop", lambda p: optim.Rprop(p, lr=0.01)),
    Case("muon", lambda p: optim.Muon(p, lr=0.01), model=lambda: MLP(bias=False)),
    Case("sparse-adam", lambda p: optim.SparseAdam(p, lr=0.01), model=Bag),
    Case("lbfgs", lambda p: optim.LBFGS(p, lr=0.5, history_size=3, max_iter=4), shuffle=False),
]


def batch(i: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + i)
    return torch.randn(5, 4, generator=gen), torch.randn(5, 3, generator=gen)


def train(model: nn.Module, opt: optim.Optimizer, steps: range) -> None:
    for i in steps:
        x, y = batch(i)

        def closure(x: torch.Tensor = x, y: torch.Tensor = y) -> torch.Tensor:
            opt.zero_grad()
            loss = ((model(x) - y) ** 2).mean()
            loss.backward()
            return loss

        opt.step(closure)


def by_name(model: nn.Module, opt: optim.Optimizer) -> dict[str, dict]:
    names = {id(p): n for n, p in model.named_parameters()}
    return dict(sorted((names[id(p)], s) for p, s in opt.state.items()))


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_resume_is_bit_identical(case: Case) -> None:
    torch.manual_seed(0)
    model = case.model()
    opt = case.make(list(model.parameters()))
    train(model, opt, range(3))
    module_bytes = ModuleRecord.from_module(model).to_bytes()
    opt_bytes = OptimizerRecord.from_optimizer(opt, model).to_bytes()

    torch.manual_seed(1)  # another init, overwritten by the record
    clone = ModuleRecord.from_bytes(module_bytes).apply(case.model())
    params = list(clone.parameters())
    opt2 = case.make(params[::-1] if case.shuffle else params)
    for group in opt2.param_groups:  # hyperparameters must come from the record
        group["weight_decay"] = 0.5
    OptimizerRecord.from_bytes(opt_bytes).apply(opt2, clone)

    for a, b in zip(opt.param_groups, opt2.param_groups, strict=True):
        assert_exact(
            {k: v for k, v in a.items() if k != "params"},
            {k: v for k, v in b.items() if k != "params"},
        )
    assert_exact(by_name(model, opt), by_name(clone, opt2))

    train(model, opt, range(3, 6))
    train(clone, opt2, range(3, 6))
    for (name, p), (_, q) in zip(model.named_parameters(), clone.named_parameters(), strict=True):
        assert torch.equal(p, q), name
    assert_exact(by_name(model, opt), by_name(clone, opt2))


def adam_after_steps() -> tuple[MLP, optim.Adam]:
    torch.manual_seed(0)
    model = MLP()
    opt = optim.Adam(model.parameters(), lr=0.01, amsgrad=True)
    train(model, opt, range(2))
    return model, opt


def test_adam_uses_burn_layout() -> None:
    model, opt = adam_after_steps()
    ids = param_ids(model)
    with burnpack.loads(OptimizerRecord.from_optimizer(opt, model).to_bytes()) as pack:
        pid = ids["fc1.weight"]
        for field_name in ("moment_1", "moment_2", "max_moment_2"):
            entry = pack.entries[f"{pid}.momentum.{field_name}"]
            assert entry.param_id == pid and entry.shape == (6, 4) and entry.dtype == "F32"
        assert pack.scalars[f"{pid}.momentum.time"] == burnpack.Scalar.UInt(2)
        assert pack.scalars[f"{pid}.__rank"] == burnpack.Scalar.UInt(2)
        assert pack.scalars[f"{ids['fc1.bias']}.__rank"] == burnpack.Scalar.UInt(1)
        assert pack.metadata[str(pid)] == "fc1.weight"
        assert {n.split(".", 1)[1] for n in pack.names} == {
            "momentum.moment_1",
            "momentum.moment_2",
            "momentum.max_moment_2",
        }
        assert pack.scalars["param_groups.0.lr"] == burnpack.Scalar.Float(0.01)
        assert pack.scalars["param_groups.0.amsgrad"] == burnpack.Scalar.Bool(True)


def test_sgd_velocity_name_and_stateless_sgd() -> None:
    torch.manual_seed(0)
    model = MLP()
    opt = optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    train(model, opt, range(1))
    pid = param_ids(model)["fc2.bias"]
    with burnpack.loads(OptimizerRecord.from_optimizer(opt, model).to_bytes()) as pack:
        assert pack.entries[f"{pid}.momentum.velocity"].param_id == pid
    plain = optim.SGD(model.parameters(), lr=0.1)
    train(model, plain, range(1))
    with burnpack.loads(OptimizerRecord.from_optimizer(plain, model).to_bytes()) as pack:
        assert pack.names == [] and not any(k.endswith("__rank") for k in pack.scalars)


def test_step_keeps_its_torch_dtype() -> None:
    model, opt = adam_after_steps()
    record = OptimizerRecord.from_bytes(OptimizerRecord.from_optimizer(opt, model).to_bytes())
    step = record.state[param_ids(model)["fc1.weight"]]["step"]
    assert step.dtype == torch.float32 and step.dim() == 0 and step.item() == 2.0


def test_group_hyperparameters_keep_exact_types() -> None:
    model = MLP()
    opt = optim.Adam(model.parameters(), lr=0.01, betas=(0.8, 0.9))
    optim.lr_scheduler.StepLR(opt, step_size=1)  # adds initial_lr
    record = OptimizerRecord.from_bytes(OptimizerRecord.from_optimizer(opt, model).to_bytes())
    group = record.param_groups[0]
    assert group["betas"] == (0.8, 0.9) and type(group["betas"]) is tuple
    assert group["foreach"] is None and group["fused"] is None
    assert group["initial_lr"] == 0.01 and group["weight_decay"] == 0
    assert type(group["weight_decay"]) is int
    assert group["params"] == [param_ids(model)[n] for n, _ in model.named_parameters()]


def test_regrouped_target_restores_each_groups_hyperparameters() -> None:
    torch.manual_seed(0)
    model = MLP()
    opt = optim.Adam(
        [
            {"params": [model.fc1.weight, model.fc1.bias], "lr": 0.01},
            {"params": [model.fc2.weight, model.fc2.bias], "lr": 0.02, "betas": (0.5, 0.6)},
        ]
    )
    train(model, opt, range(2))
    blob = OptimizerRecord.from_optimizer(opt, model).to_bytes()
    clone = ModuleRecord.from_module(model).apply(MLP())
    target = optim.Adam(
        [
            {"params": [clone.fc2.bias]},
            {"params": [clone.fc1.bias, clone.fc1.weight]},
            {"params": [clone.fc2.weight]},
        ],
        lr=1.0,
    )
    OptimizerRecord.from_bytes(blob).apply(target, clone)
    assert [g["lr"] for g in target.param_groups] == [0.02, 0.01, 0.02]
    assert target.param_groups[0]["betas"] == (0.5, 0.6)
    train(model, opt, range(2, 4))
    train(clone, target, range(2, 4))
    for (name, p), (_, q) in zip(model.named_parameters(), clone.named_parameters(), strict=True):
        assert torch.equal(p, q), name

    mixed = optim.Adam([clone.fc1.weight, clone.fc2.weight, clone.fc1.bias, clone.fc2.bias])
    with pytest.raises(RecordError, match=r"mixes recorded groups \[0, 1\]"):
        OptimizerRecord.from_bytes(blob).apply(mixed, clone)


def test_mismatches_are_listed_before_anything_changes() -> None:
    model, opt = adam_after_steps()
    record = OptimizerRecord.from_bytes(OptimizerRecord.from_optimizer(opt, model).to_bytes())
    clone = ModuleRecord.from_module(model).apply(MLP())
    stranger = nn.Parameter(torch.zeros(2))
    target = optim.Adam([clone.fc1.weight, clone.fc1.bias, clone.fc2.weight, stranger])
    with pytest.raises(RecordError) as info:
        record.apply(target, clone)
    assert info.value.kind == "validation"
    assert info.value.problems == [
        "param_groups[0] parameter 3 (shape [2]) is not a parameter of the module",
        f"recorded parameter 'fc2.bias' (id {param_ids(clone)['fc2.bias']}) is not in the "
        "optimizer",
    ]
    assert target.state == {}
    other = nn.Sequential(MLP())  # never loaded, other names: other ids
    with pytest.raises(RecordError, match=r"'0\.fc1\.weight' \(id \d+\) is not in the record"):
        record.apply(optim.Adam(other.parameters()), other)
    with pytest.raises(RecordError, match=r"record holds torch\.optim\.adam\.Adam state"):
        record.apply(optim.AdamW(clone.parameters()), clone)


def test_optimizer_parameter_outside_the_module_is_named() -> None:
    model = MLP()
    opt = optim.SGD([*model.parameters(), nn.Parameter(torch.ones(3))], lr=0.1)
    with pytest.raises(RecordError, match=r"parameter 4 \(shape \[3\]\) is not a parameter"):
        OptimizerRecord.from_optimizer(opt, model)


def test_lbfgs_refuses_another_parameter_order() -> None:
    torch.manual_seed(0)
    model = MLP()
    opt = optim.LBFGS(model.parameters(), max_iter=2)
    train(model, opt, range(1))
    record = OptimizerRecord.from_optimizer(opt, model)
    with pytest.raises(RecordError, match="LBFGS keeps one flat state"):
        record.apply(optim.LBFGS(list(model.parameters())[::-1]), model)


def test_file_round_trip_and_load_record(tmp_path: Path) -> None:
    model, opt = adam_after_steps()
    path = OptimizerRecord.from_optimizer(opt, model).save(tmp_path / "optim")
    assert path.name == "optim.bpk"
    loaded = load_record(path)
    assert isinstance(loaded, OptimizerRecord)
    target = optim.Adam(model.parameters())
    loaded.apply(target, model)
    assert_exact(by_name(model, opt), by_name(model, target))
    with pytest.raises(RecordError, match="'optimizer' record, not 'module'"):
        ModuleRecord.load(path)


def test_tensors_after_apply_do_not_alias_the_record() -> None:
    model, opt = adam_after_steps()
    data = bytearray(OptimizerRecord.from_optimizer(opt, model).to_bytes())
    record = OptimizerRecord.from_bytes(data)
    target = optim.Adam(model.parameters())
    record.apply(target, model)
    pid = param_ids(model)["fc1.weight"]
    assert (
        target.state[model.fc1.weight]["exp_avg"].data_ptr()
        != record.state[pid]["exp_avg"].data_ptr()
    )


def test_pack_without_optimizer_structure_is_a_validation_error() -> None:
    with pytest.raises(RecordError) as info:
        OptimizerRecord.from_bytes(burnpack.dumps({"1.momentum.moment_1": torch.zeros(2)}))
    assert info.value.kind == "validation" and "lightning_bpk/state" in str(info.value)


def test_positional_state_dict_loads_into_a_same_order_optimizer() -> None:
    model, opt = adam_after_steps()
    record = OptimizerRecord.from_bytes(OptimizerRecord.from_optimizer(opt, model).to_bytes())
    target = optim.Adam(model.parameters(), amsgrad=True)
    target.load_state_dict(record.state_dict())
    assert_exact(by_name(model, opt), by_name(model, target))
    assert record.state_dict()["param_groups"][0]["params"] == [0, 1, 2, 3]
