"""The overlapped snapshot: parameters and optimizer state copied beside the next forward and
backward, the next optimizer step waiting for the copy, never a torn snapshot."""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest
import torch
import xxhash

from lightning_bpk import burnpack
from lightning_bpk.burnpack import writer as burnpack_writer
from lightning_bpk.checkpointer import Checkpointer
from lightning_bpk.records import ModuleRecord, OptimizerRecord
from lightning_bpk.runtime._staging import LateCopy
from lightning_bpk.runtime.async_save import AsyncCheckpointSaver
from lightning_bpk.runtime.overlap import StepGate

pytestmark = pytest.mark.timeout(120)

WAIT = 30.0  # seconds; generous for a loaded 2-core machine, never reached when things work


def _net() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(256, 1024), torch.nn.BatchNorm1d(1024), torch.nn.Linear(1024, 256)
    )


def _loss(net: torch.nn.Module) -> torch.Tensor:
    return net(torch.randn(8, 256)).pow(2).mean()


def _state_bytes(net: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, bytes]:
    """Every tensor of the module and the optimizer state, as bytes, by name."""
    out = {f"model/{k}": v.numpy().tobytes() for k, v in net.state_dict().items()}
    for i, state in enumerate(optimizer.state.values()):
        for k, v in state.items():
            out[f"optim/{i}/{k}"] = v.numpy().tobytes()
    return out


def _saved_bytes(directory, net: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """What checkpoint 1 holds, loaded into fresh copies, in :func:`_state_bytes`' form."""
    data = Checkpointer(directory).load_checkpoint(1)
    other = _net()
    data["model"].apply(other)
    fresh = type(optimizer)(other.parameters(), **optimizer.defaults)
    data["optim"].apply(fresh, other)
    return _state_bytes(other, fresh)


def _stalled_writer(saver: AsyncCheckpointSaver, optimizer: torch.optim.Optimizer) -> None:
    """Keep the saver's writer thread (the copy thread) from starting the next snapshot's late
    copies until the optimizer's step has begun: a pre-hook registered before the saver's
    releases it. So the step provably starts before the copy, and only the gate keeps it
    from changing the parameters first."""
    step_began = threading.Event()
    optimizer.register_step_pre_hook(lambda *_: step_began.set())  # before the saver's hook
    saver.reserve({})  # starts the writer thread, then:
    saver.wait()
    assert saver._executor is not None
    saver._executor.submit(lambda: step_began.wait(WAIT))


def _step(net: torch.nn.Module, optimizer: torch.optim.Optimizer, closure: bool) -> None:
    if closure:

        def run() -> torch.Tensor:
            optimizer.zero_grad()
            loss = _loss(net)
            loss.backward()
            return loss

        optimizer.step(run)
        return
    optimizer.zero_grad()
    _loss(net).backward()
    optimizer.step()


@pytest.mark.parametrize("closure", [False, True], ids=["plain-step", "closure-step"])
def test_a_step_taken_right_after_the_save_never_tears_the_snapshot(tmp_path, closure):
    net = _net()
    optimizer = torch.optim.Adam(net.parameters(), lr=0.1)
    _step(net, optimizer, closure=False)  # Adam's state exists now
    with AsyncCheckpointSaver() as saver:
        _stalled_writer(saver, optimizer)  # its hook runs before the gate's
        saver.watch([optimizer])
        expected = _state_bytes(net, optimizer)
        data = {
            "model": ModuleRecord.from_module(net),
            "optim": OptimizerRecord.from_optimizer(optimizer, net),
        }
        saver.save_checkpoint(Checkpointer(tmp_path), 1, data)
        assert saver._gate.held  # returned before the parameters and Adam's state were copied
        _step(net, optimizer, closure)  # forward changes BatchNorm's statistics, step the rest
        assert not saver._gate.held
        changed = _state_bytes(net, optimizer)
    assert all(changed[k] != expected[k] for k in expected if "num_batches" not in k)
    assert _saved_bytes(tmp_path, net, optimizer) == expected


def test_a_copy_spans_the_micro_batches_of_gradient_accumulation(tmp_path):
    net = _net()
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    _step(net, optimizer, closure=False)
    with AsyncCheckpointSaver() as saver:
        _stalled_writer(saver, optimizer)  # its hook runs before the gate's
        saver.watch([optimizer])
        expected = _state_bytes(net, optimizer)
        data = {
            "model": ModuleRecord.from_module(net),
            "optim": OptimizerRecord.from_optimizer(optimizer, net),
        }
        saver.save_checkpoint(Checkpointer(tmp_path), 1, data)
        for _ in range(3):  # accumulate: no step, so nothing waits
            _loss(net).backward()
            assert saver._gate.held
        optimizer.step()
    assert _saved_bytes(tmp_path, net, optimizer) == expected


def test_without_watched_optimizers_everything_is_copied_before_the_save_returns(tmp_path):
    net = _net()
    with AsyncCheckpointSaver() as saver:
        saver.save_checkpoint(Checkpointer(tmp_path), 0, {"model": ModuleRecord.from_module(net)})
        assert not saver._gate.held and saver.staging.late == {}
        expected = net[0].weight.clone()
        with torch.no_grad():
            net[0].weight.add_(1.0)
    saved = Checkpointer(tmp_path).load_checkpoint(0)["model"].tensors["0.weight"]
    assert torch.equal(saved, expected)


def test_a_failed_late_copy_releases_the_step_and_fails_the_next_save(tmp_path):
    net = _net()
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    with AsyncCheckpointSaver() as saver:
        saver.watch([optimizer])
        data = {"model": ModuleRecord.from_module(net)}
        saver.staging.late["x", "y"] = LateCopy(torch.zeros(2), torch.zeros(3))  # must fail
        saver.save_checkpoint(Checkpointer(tmp_path), 0, data)
        _step(net, optimizer, closure=False)  # released, not hung
        with pytest.raises(RuntimeError, match="size"):
            saver.wait()


@pytest.mark.parametrize(
    "source",
    [
        torch.arange(3 * 2**18 + 5, dtype=torch.float32),  # pieces of 1 MiB and a tail
        torch.arange(7, dtype=torch.bfloat16),
        torch.ones(3, 2, dtype=torch.complex64),
        torch.tensor(True),
        torch.empty(0, 4),
        torch.arange(12.0).reshape(3, 4).t(),  # not contiguous: copied whole, then hashed
    ],
    ids=["pieces", "bf16", "complex", "0-d bool", "empty", "strided"],
)
def test_a_late_copy_is_hashed_as_it_is_copied(source):
    late = LateCopy(torch.empty(source.shape, dtype=source.dtype), source)
    late.run()
    assert torch.equal(late.dst, source)
    assert late.result() == xxhash.xxh3_64_hexdigest(burnpack.tensor_bytes(late.dst))


def test_an_overlapped_save_records_the_checksums_taken_while_copying(tmp_path, monkeypatch):
    # the parameters and the optimizer's state are copied late, hashed as they are copied: the
    # writer records those digests and hashes only what was copied at once (BatchNorm's
    # buffers, which the next forward changes); every tensor verifies
    hashed: list[int] = []

    class Counted:
        xxh3_64_hexdigest = staticmethod(
            lambda view: hashed.append(len(view)) or xxhash.xxh3_64_hexdigest(view)
        )

    monkeypatch.setattr(burnpack_writer, "xxhash", Counted)
    net = _net()
    optimizer = torch.optim.Adam(net.parameters())
    _step(net, optimizer, closure=False)
    checkpointer = Checkpointer(tmp_path)
    with AsyncCheckpointSaver() as saver:
        saver.watch([optimizer])
        records = {
            "model": ModuleRecord.from_module(net),
            "optim": OptimizerRecord.from_optimizer(optimizer, net),
        }
        saver.save_checkpoint(checkpointer, 0, records)
        saver.wait()
    assert sorted(hashed) == sorted(b.nbytes for b in net.buffers())
    assert checkpointer.verify_checkpoint(0) == []
    loaded = checkpointer.load_checkpoint(0)["model"].tensors
    assert all(torch.equal(loaded[k], v) for k, v in net.state_dict().items())


def test_the_gate_watches_a_wrapped_optimizer_once_and_only_its_storages():
    net = _net()
    optimizer = torch.optim.Adam(net.parameters())

    class Wrapper:  # Fabric's and Lightning's wrappers keep the optimizer as .optimizer
        def __init__(self, inner: torch.optim.Optimizer) -> None:
            self.optimizer = inner

    gate = StepGate()
    calls: list[str] = []
    gate.watch([Wrapper(optimizer), optimizer])
    optimizer.register_step_pre_hook(lambda *_: calls.append("step"))
    _step(net, optimizer, closure=False)
    stable = gate.stable()
    weight = net[0].weight
    assert weight.untyped_storage().data_ptr() in stable
    assert optimizer.state[weight]["exp_avg"].untyped_storage().data_ptr() in stable
    assert net[1].running_mean.untyped_storage().data_ptr() not in stable
    assert torch.zeros(3).untyped_storage().data_ptr() not in stable
    assert len(gate._watched) == 1 and calls == ["step"]
    gate.close()
    with pytest.raises(TypeError, match="not a torch optimizer"):
        gate.watch([object()])


def _fabric_loop(directory, steps: int, record: Callable[[int, dict], None]) -> None:
    from lightning.fabric import Fabric

    from lightning_bpk.fabric import CheckpointManager

    fabric = Fabric(accelerator="cpu", devices=1)
    net = _net()
    optimizer = torch.optim.Adam(net.parameters(), lr=0.1)
    net, optimizer = fabric.setup(net, optimizer)
    state = {"model": net, "optimizer": optimizer}
    with CheckpointManager(fabric, directory, every_n_train_steps=2, async_save=True) as manager:
        for step in range(1, steps + 1):
            optimizer.zero_grad()
            fabric.backward(_loss(net))
            optimizer.step()
            if manager.save_if_due(step, state):
                record(step, _state_bytes(net.module, optimizer.optimizer))
        assert manager._saver is not None and manager._saver._gate._watched


def test_fabric_async_saves_overlap_and_match_the_state_at_each_save(tmp_path):
    recorded: dict[int, dict] = {}
    _fabric_loop(tmp_path, 6, recorded.__setitem__)
    assert sorted(recorded) == [2, 4, 6]
    for step, expected in recorded.items():
        data = Checkpointer(tmp_path).load_checkpoint(step)
        net = _net()
        data["model"].apply(net)
        optimizer = torch.optim.Adam(net.parameters(), lr=0.1)
        data["optimizer"].apply(optimizer, net)
        assert _state_bytes(net, optimizer) == expected, step


# --- Lightning: BurnpackCheckpoint(async_save=True) overlaps, bytes equal a synchronous run ----


def _lightning_fit(root, async_save: bool | str, mode: str) -> None:
    import lightning as L

    from lightning_bpk.lightning.callback import BurnpackCheckpoint

    from lightning_tiny import TinyModel, make_trainer

    class Model(TinyModel):
        """TinyModel with BatchNorm (a buffer the next forward changes); ``manual``: manual
        optimization stepping through ``opt.step()`` as users write it."""

        def __init__(self) -> None:
            super().__init__(hidden=64)
            self.net.insert(1, torch.nn.BatchNorm1d(64))
            self.automatic_optimization = mode != "manual"

        def training_step(self, batch, batch_idx):
            loss = super().training_step(batch, batch_idx)
            if self.automatic_optimization:
                return loss
            opt = self.optimizers()
            opt.zero_grad()
            self.manual_backward(loss)
            opt.step()
            return loss

    L.seed_everything(0)
    callback = BurnpackCheckpoint(dirpath=root, every_n_train_steps=1, async_save=async_save)
    options = {"accumulate_grad_batches": 2} if mode == "accumulate" else {}
    make_trainer(str(root), 2, [callback], **options).fit(Model())
    if async_save:
        assert callback._saver is not None and callback._saver._gate._watched


@pytest.mark.parametrize(
    ("mode", "writer"),
    [("automatic", True), ("accumulate", True), ("manual", True), ("automatic", "process")],
)
def test_lightning_overlapped_saves_hold_the_bytes_of_synchronous_ones(tmp_path, mode, writer):
    """Overlapped saves, written by the writer thread or (``"process"``) a writer process."""
    _lightning_fit(tmp_path / "sync", False, mode)
    _lightning_fit(tmp_path / "async", writer, mode)
    sync = sorted(p.name for p in (tmp_path / "sync").glob("ckpt.*"))
    assert sync and sync == sorted(p.name for p in (tmp_path / "async").glob("ckpt.*"))
    for name in sync:
        for record in ("model.bpk", "optim.bpk"):
            expected = (tmp_path / "sync" / name / record).read_bytes()
            assert (tmp_path / "async" / name / record).read_bytes() == expected, (name, record)
