"""lightning_bpk.fabric in one process, with a real single-device Fabric and real files: the
loader's position, what a restore puts back and returns, the choice of checkpoint (damage,
override, newer ones), retention, cadence, the lease, object storage, gin, adapters, export,
and BurnpackCheckpointIO as Fabric's plugin. (Killed processes, DDP and FSDP2:
test_fabric_e2e.py; the examples: test_fabric_examples.py.)"""

from __future__ import annotations

import re
import signal
import uuid
from datetime import timedelta

import gin
import lightning as L
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler

from lightning_bpk import BurnpackCheckpointIO, burnpack
from lightning_bpk.checkpointer import Checkpointer, CheckpointWarning, list_checkpoints
from lightning_bpk.errors import CheckpointResumeError, CheckpointSaveError
from lightning_bpk.fabric import (
    CheckpointManager,
    ResumableLoader,
    load_raw,
    trainable,
    trainable_parameters,
)
from lightning_bpk.interop import save_module_record
from lightning_bpk.lightning import trainer_state
from lightning_bpk.records import ModuleRecord, OptimizerRecord, files

pytestmark = pytest.mark.filterwarnings("ignore:The `srun` command")


@pytest.fixture(autouse=True)
def _signal_handlers():
    """Every manager handles SIGTERM and SIGUSR1 from its construction until ``close()``; put
    back what the test process had, whatever a test left."""
    signums = (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2)
    before = {s: signal.getsignal(s) for s in signums}
    yield
    for signum, handler in before.items():
        signal.signal(signum, handler)


def make_fabric() -> L.Fabric:
    return L.Fabric(accelerator="cpu", devices=1)


def numbers(n: int = 20) -> list[torch.Tensor]:
    return [torch.tensor([float(i)]) for i in range(n)]


def model_and_optimizer(fabric: L.Fabric, seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(1, 4), nn.Dropout(0.3), nn.Linear(4, 1))
    return fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=0.05))


def train_steps(fabric, state, manager, until: int, filter=None) -> list[list[float]]:
    """Train until ``state["step"] == until``, saving when due; the batches seen."""
    seen = []
    while state["step"] < until:
        for batch in state["data"]:
            loss = state["model"](batch).square().mean()
            fabric.backward(loss)
            state["optimizer"].step()
            state["optimizer"].zero_grad()
            state["step"] += 1
            seen.append(batch.flatten().tolist())
            manager.save_if_due(state["step"], state, filter=filter)
            if state["step"] == until:
                break
    return seen


def run(root, until: int, seed: int = 0, **options) -> tuple[dict, list, CheckpointManager]:
    fabric = make_fabric()
    model, optimizer = model_and_optimizer(fabric, seed)
    loader = DataLoader(numbers(), batch_size=3, shuffle=True)
    data = ResumableLoader(fabric.setup_dataloaders(loader))
    options.setdefault("every_n_train_steps", 4)
    manager = CheckpointManager(fabric, root, **options)
    state = {"model": model, "optimizer": optimizer, "data": data, "step": 0, "tag": "run"}
    manager.restore(state)
    seen = train_steps(fabric, state, manager, until)
    manager.close()
    return state, seen, manager


def weights(state) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in state["model"].state_dict().items()}


# --- ResumableLoader ------------------------------------------------------------------------------


def _order(loader: ResumableLoader, passes: int) -> list[list[float]]:
    out = []
    for _ in range(passes):
        out += [b.flatten().tolist() for b in loader]
    return out


@pytest.mark.parametrize(
    "make",
    [
        pytest.param(lambda: DataLoader(numbers(), batch_size=3, shuffle=True), id="random"),
        pytest.param(
            lambda: DataLoader(
                numbers(), batch_size=3, shuffle=True, generator=torch.Generator().manual_seed(3)
            ),
            id="generator",
        ),
        pytest.param(
            lambda: make_fabric().setup_dataloaders(
                DataLoader(numbers(), batch_size=2, sampler=DistributedSampler(numbers(), 2, 1))
            ),
            id="fabric-distributed",
        ),
        pytest.param(
            lambda: __import__(
                "torchdata.stateful_dataloader"
            ).stateful_dataloader.StatefulDataLoader(numbers(), batch_size=3, shuffle=True),
            id="stateful",
        ),
        pytest.param(
            lambda: DataLoader(numbers(), batch_size=3, shuffle=True, num_workers=2),
            id="workers",
        ),
    ],
)
@pytest.mark.parametrize("where", [0, 2, 7], ids=["start", "mid-pass", "second-pass"])
def test_a_restored_loader_continues_with_the_next_batch_of_the_same_order(make, where):
    _continues(make, where)


def _litdata_item(i: int) -> torch.Tensor:
    return torch.tensor([float(i)])


@pytest.fixture(scope="module")
def litdata_chunks(tmp_path_factory: pytest.TempPathFactory) -> str:
    """20 numbers written by litdata's ``optimize`` as small chunks (a streaming dataset)."""
    litdata = pytest.importorskip("litdata")
    out = str(tmp_path_factory.mktemp("litdata") / "chunks")
    litdata.optimize(
        fn=_litdata_item, inputs=list(range(20)), output_dir=out, chunk_bytes="256B", num_workers=1
    )
    return out


@pytest.mark.parametrize("where", [0, 2, 7], ids=["start", "mid-pass", "second-pass"])
def test_a_restored_litdata_loader_continues_with_the_next_batch(litdata_chunks, where):
    """litdata's ``StreamingDataLoader`` is positioned through its own state (shuffled chunks,
    the epoch, the samples consumed), as ``torchdata``'s is."""
    litdata = pytest.importorskip("litdata")

    def make() -> object:
        dataset = litdata.StreamingDataset(litdata_chunks, shuffle=True, seed=3)
        return litdata.StreamingDataLoader(dataset, batch_size=3)

    _continues(make, where)


def _continues(make, where: int) -> None:
    """Take ``where`` batches, save, and check a new loader restored from the state hands out
    exactly the batches the first one goes on with (the rest of its pass, then two more)."""
    torch.manual_seed(11)
    loader = ResumableLoader(make())
    length = len(loader)
    iterator, taken = iter(loader), 0
    while taken < where:
        try:
            next(iterator)
        except StopIteration:
            iterator = iter(loader)
            continue
        taken += 1
    state = loader.state_dict()
    rest = [b.flatten().tolist() for b in iterator] if where % length else []
    expected = rest + _order(loader, 2)
    torch.manual_seed(999)  # a new process: the global RNGs are anywhere
    again = ResumableLoader(make())
    again.load_state_dict(state)
    assert _order(again, 3 if where % length else 2)[: len(expected)] == expected
    assert again.epoch == loader.epoch


def test_a_loader_state_goes_through_plain_fabric_save_and_weights_only_load(tmp_path):
    """The docs promise plain ``fabric.save``/``fabric.load``: Lightning's default checkpoint
    I/O loads with ``weights_only=True``, which refuses numpy arrays in the state."""
    fabric = make_fabric()
    loader = ResumableLoader(DataLoader(numbers(), batch_size=3, shuffle=True))
    batches = iter(loader)
    next(batches)
    fabric.save(tmp_path / "plain.ckpt", {"loader": loader})
    expected = [b.tolist() for b in batches]
    again = ResumableLoader(DataLoader(numbers(), batch_size=3, shuffle=True))
    fabric.load(tmp_path / "plain.ckpt", {"loader": again})
    assert [b.tolist() for b in again] == expected
    state = torch.load(tmp_path / "plain.ckpt", weights_only=True)
    assert isinstance(state["loader"]["rng"]["numpy"]["keys"], torch.Tensor)


def test_a_loader_without_state_is_refused_and_a_kind_mismatch_is_named():
    with pytest.raises(TypeError, match="cannot position a list"):
        ResumableLoader([1, 2, 3])
    stateful = __import__("torchdata.stateful_dataloader").stateful_dataloader
    saved = ResumableLoader(DataLoader(numbers(), batch_size=3)).state_dict()
    other = ResumableLoader(stateful.StatefulDataLoader(numbers(), batch_size=3))
    with pytest.raises(
        ValueError, match="'sampler' loader, this loader is positioned as 'stateful'"
    ):
        other.load_state_dict(saved)


# --- the manager: restore -------------------------------------------------------------------------


def test_restore_continues_bit_identically_and_returns_the_remainder(tmp_path):
    reference, seen_reference, _ = run(tmp_path / "ref", 14)
    _, _, manager = run(tmp_path / "run", 9)  # saved 4 and 8; "dies" after step 9
    assert manager.last_saved_step == 8
    resumed, seen, manager = run(tmp_path / "run", 14)
    assert manager.restored_step == 8
    assert seen == seen_reference[8:]
    assert all(
        torch.equal(a, b)
        for a, b in zip(weights(reference).values(), weights(resumed).values(), strict=True)
    )
    ours = OptimizerRecord.from_optimizer(resumed["optimizer"].optimizer, resumed["model"].module)
    theirs = OptimizerRecord.from_optimizer(
        reference["optimizer"].optimizer, reference["model"].module
    )
    assert all(
        torch.equal(ours.state[p][k], theirs.state[p][k])
        for p in theirs.state
        for k in theirs.state[p]
    )
    # what the state did not ask for comes back; plain values are written into the state
    fabric = make_fabric()
    model, _ = model_and_optimizer(fabric)
    state = {"model": model, "step": -1}
    restored = CheckpointManager(fabric, tmp_path / "run", verify=False).restore(state)
    assert restored.step == 12 and state["step"] == 12  # the newest: run() saves every 4
    assert set(restored.remainder) == {"optimizer", "data", "tag"}
    assert restored.remainder["tag"] == "run"
    assert set(restored.remainder["optimizer"]) == {"state", "param_groups"}
    assert trainer_state.RNG_KEY not in restored.remainder


def test_strict_restore_names_what_the_checkpoint_lacks(tmp_path):
    run(tmp_path, 4)
    fabric = make_fabric()
    model, _ = model_and_optimizer(fabric)
    manager = CheckpointManager(fabric, tmp_path)
    with pytest.raises(KeyError, match=r"has no \['extra'\]"):
        manager.restore({"model": model, "extra": 1})
    state = {"model": model, "extra": 1}
    assert manager.restore(state, strict=False).step == 4 and state["extra"] == 1
    with pytest.raises(Exception, match="'tag' is a module here but was saved as a value"):
        manager.restore({"tag": nn.Linear(1, 1)})


def test_a_damaged_newest_checkpoint_is_skipped_with_a_warning_naming_the_file(tmp_path):
    run(tmp_path, 8)
    model_file = tmp_path / "ckpt.8" / "model.bpk"
    data = bytearray(model_file.read_bytes())
    data[-3] ^= 0xFF  # a tensor byte: its checksum no longer matches
    model_file.write_bytes(bytes(data))
    fabric = make_fabric()
    model, optimizer = model_and_optimizer(fabric)
    with pytest.warns(CheckpointWarning, match=r"checkpoint 8 .* skipped: .*ckpt\.8/model\.bpk"):
        restored = CheckpointManager(fabric, tmp_path).restore(
            {"model": model, "optimizer": optimizer}, strict=False
        )
    assert restored.step == 4


def test_override_number_and_the_checkpoints_a_run_would_save_over(tmp_path):
    run(tmp_path, 12)  # 4, 8, 12
    fabric = make_fabric()
    model, optimizer = model_and_optimizer(fabric)
    state = {"model": model, "optimizer": optimizer, "step": 0}
    manager = CheckpointManager(fabric, tmp_path, override_number=4)
    assert manager.restore(state, strict=False).step == 4
    with pytest.raises(
        CheckpointResumeError, match=r"complete checkpoints \[8, 12\], newer than step 5"
    ):
        manager.save(5, state)
    with gin.unlock_config():
        gin.bind_parameter(
            "lightning_bpk.checkpointer.get_latest_checkpoint_number.override_number", 8
        )
    try:
        assert CheckpointManager(fabric, tmp_path).restore(state, strict=False).step == 8
    finally:
        gin.clear_config()
    with pytest.raises(CheckpointResumeError, match="cannot restore checkpoint 7"):
        CheckpointManager(fabric, tmp_path, override_number=7).restore(state, strict=False)
    manager = CheckpointManager(fabric, tmp_path, override_number=4, overwrite=True)
    manager.restore(state, strict=False)
    manager.save(5, state)
    assert Checkpointer(tmp_path).latest_checkpoint_number() == 5


def test_the_first_save_never_replaces_another_runs_checkpoint_of_its_step(tmp_path):
    """The run layer's one bound (as the Lightning callback's): a complete checkpoint numbered
    from the first save on, other than the one restored, stops the save, also the one at the
    very step saved now (which the manager used to replace without a word); the restored one
    itself may be saved again, and older ones stay."""
    run(tmp_path, 8)  # 4, 8
    fabric = make_fabric()
    state = {"step": 0}
    with pytest.raises(CheckpointResumeError, match=r"complete checkpoints \[4, 8\]"):
        CheckpointManager(fabric, tmp_path).save(4, state)  # started over, not restored
    manager = CheckpointManager(fabric, tmp_path, override_number=4)
    model, optimizer = model_and_optimizer(fabric)
    assert manager.restore({"model": model, "optimizer": optimizer}, strict=False).step == 4
    with pytest.raises(CheckpointResumeError, match=r"complete checkpoints \[8\]"):
        manager.save(4, {"model": model, "optimizer": optimizer, "step": 4})
    manager = CheckpointManager(fabric, tmp_path)  # the newest: 8; saving 8 again is fine
    assert manager.restore({"model": model, "optimizer": optimizer}, strict=False).step == 8
    manager.save(8, {"model": model, "optimizer": optimizer, "step": 8})
    assert [e.number for e in list_checkpoints(tmp_path) if e.complete] == [8, 4]


def test_a_checkpoint_of_the_lightning_callback_is_refused_by_name(tmp_path):
    Checkpointer(tmp_path).save_checkpoint(
        3, {"model": {"w": torch.ones(1)}, "trainer": {"epoch": 3}}
    )
    with pytest.raises(CheckpointResumeError, match="not written by a CheckpointManager"):
        CheckpointManager(make_fabric(), tmp_path).restore({})


# --- the manager: saving --------------------------------------------------------------------------


def test_retention_keeps_the_newest_and_every_keep_every_th_save(tmp_path):
    run(tmp_path, 26, every_n_train_steps=2, checkpoint_duration=2, keep_every=3)
    complete = [e.number for e in list_checkpoints(tmp_path) if e.complete]
    assert complete == [26, 24, 18, 12, 6]  # the newest 2, and every 3rd save (steps 6k)


def test_time_and_auto_cadence(tmp_path):
    _, _, manager = run(
        tmp_path / "time",
        3,
        every_n_train_steps=None,
        train_time_interval=timedelta(microseconds=1),
    )
    assert Checkpointer(tmp_path / "time").latest_checkpoint_number() == 3
    _, _, manager = run(tmp_path / "auto", 12, every_n_train_steps="auto", checkpoint_duration=10)
    assert manager.last_saved_step == 10  # "auto" measures a save 10 steps in
    with pytest.raises(ValueError, match="every_n_train_steps must be a positive int"):
        CheckpointManager(make_fabric(), tmp_path, every_n_train_steps=0)


def test_filters_follow_fabric_and_refuse_what_cannot_be_filtered(tmp_path):
    fabric = make_fabric()
    model, optimizer = model_and_optimizer(fabric)
    manager = CheckpointManager(fabric, tmp_path)
    state = {"model": model, "optimizer": optimizer, "meta": {"a": 1, "b": 2}}
    manager.save(
        1,
        state,
        filter={"model": lambda name, _: name.startswith("2."), "meta": lambda k, _: k == "a"},
    )
    saved = Checkpointer(tmp_path).load_checkpoint(1)
    assert sorted(saved["model"].tensors) == ["2.bias", "2.weight"]
    assert saved["trainer"]["values"]["meta"] == {"a": 1}
    with pytest.raises(ValueError, match="filter keys \\['nope'\\] are not present"):
        manager.save(2, state, filter={"nope": lambda *_: True})
    with pytest.raises(ValueError, match="an optimizer's state follows the parameters"):
        manager.save(2, state, filter={"optimizer": lambda *_: True})
    with pytest.raises(TypeError, match=r"wrap it in lightning_bpk\.fabric\.ResumableLoader"):
        manager.save(2, {"data": DataLoader(numbers())})
    with pytest.raises(ValueError, match="'trainer' is reserved"):
        manager.save(2, {"trainer": 1})


def test_a_failed_save_raises_and_keeps_the_earlier_checkpoints(tmp_path):
    fabric = make_fabric()
    manager = CheckpointManager(fabric, tmp_path)
    manager.save(1, {"x": 1})
    with pytest.raises(
        CheckpointSaveError,
        match=r"checkpoint 2 .* failed \(RecordError: .*'x'\]: cannot store a builtins\.object",
    ):
        manager.save(2, {"x": object()})
    assert Checkpointer(tmp_path).latest_checkpoint_number() == 1


def test_a_newer_run_takes_the_directory_over(tmp_path):
    fabric = make_fabric()
    older = CheckpointManager(fabric, tmp_path)
    older.save(1, {"x": 1})
    newer = CheckpointManager(fabric, tmp_path)
    with pytest.raises(CheckpointSaveError, match="CheckpointSupersededError"):
        older.save(2, {"x": 2})
    newer.save(2, {"x": 2})


def test_async_saves_on_object_storage_restore_there(tmp_path):
    url = f"memory://fabric-{uuid.uuid4().hex[:8]}/run"
    reference, _, _ = run(tmp_path, 10)
    run(url, 6, async_save=True)
    resumed, _, manager = run(url, 10, async_save=True)
    assert manager.restored_step == 4
    assert all(
        torch.equal(a, b)
        for a, b in zip(weights(reference).values(), weights(resumed).values(), strict=True)
    )


def test_gin_configures_the_manager(tmp_path):
    with gin.unlock_config():
        gin.parse_config("lightning_bpk.fabric.CheckpointManager.checkpoint_duration = 2")
    try:
        manager = CheckpointManager(make_fabric(), tmp_path)
    finally:
        gin.clear_config()
    assert manager.checkpointer.checkpoint_duration == 2


@pytest.mark.parametrize(
    ("config", "named"),
    [
        (
            "Checkpointer.checkpoint_duration = 2",
            "Checkpointer.checkpoint_duration = 2 (bind CheckpointManager.checkpoint_duration)",
        ),
        (
            "Checkpointer.checkpoint_frequency = 5",
            "Checkpointer.checkpoint_frequency = 5 (bind CheckpointManager.every_n_train_steps)",
        ),
        ("get_latest_checkpoint_number.verify = False", "(bind CheckpointManager.verify)"),
    ],
)
def test_a_gin_binding_the_manager_cannot_apply_is_an_error(tmp_path, config, named):
    # the manager builds its Checkpointer with its own settings: the binding would change nothing
    with gin.unlock_config():
        gin.parse_config(f"lightning_bpk.checkpointer.{config}")
    try:
        with pytest.raises(CheckpointResumeError, match="does not read: .*" + re.escape(named)):
            CheckpointManager(make_fabric(), tmp_path / "run")
    finally:
        gin.clear_config()
    assert not (tmp_path / "run").exists()


# --- adapters and export --------------------------------------------------------------------------


def test_an_adapter_checkpoint_holds_only_what_trains_and_loads_over_the_base(tmp_path):
    fabric = make_fabric()
    base, _ = model_and_optimizer(fabric, seed=5)
    save_module_record(ModuleRecord.from_module(base.module), tmp_path / "base.safetensors")
    model = nn.Sequential(nn.Linear(1, 4), nn.Dropout(0.3), nn.Linear(4, 1))
    model.adapter = nn.Linear(1, 1)
    load_raw(tmp_path / "base.safetensors", model, strict=False)
    assert torch.equal(model[0].weight, base.module[0].weight)
    for name, p in model.named_parameters():
        p.requires_grad = name.startswith("adapter")
    optimizer = torch.optim.AdamW(trainable_parameters(model))
    model(torch.ones(1, 1)).sum().backward()
    model.adapter(torch.ones(1, 1)).sum().backward()
    optimizer.step()
    manager = CheckpointManager(fabric, tmp_path / "run")
    manager.save(1, {"model": model, "optimizer": optimizer}, filter={"model": trainable(model)})
    saved = Checkpointer(tmp_path / "run").load_checkpoint(1)
    assert sorted(saved["model"].tensors) == ["adapter.bias", "adapter.weight"]
    assert sorted(saved["optimizer"].paths.values()) == ["adapter.bias", "adapter.weight"]
    with pytest.raises(Exception, match="Missing tensor"):
        load_raw(tmp_path / "base.safetensors", model)  # strict: the adapter is not in the file
    fresh = nn.Sequential(nn.Linear(1, 4), nn.Dropout(0.3), nn.Linear(4, 1))
    fresh.adapter = nn.Linear(1, 1)
    load_raw(tmp_path / "base.safetensors", fresh, strict=False)
    state = {"model": fresh}
    CheckpointManager(fabric, tmp_path / "run").restore(state)
    assert all(
        torch.equal(a, b)
        for a, b in zip(fresh.state_dict().values(), model.state_dict().values(), strict=True)
    )


def test_export_writes_one_burn_readable_file(tmp_path):
    state, _, manager = run(tmp_path / "run", 8)
    path = manager.export(tmp_path / "model.bpk")
    with burnpack.read(path) as pack:
        assert sorted(pack.entries) == sorted(state["model"].state_dict())
    manager.export(tmp_path / "model.safetensors", step=4)


# --- BurnpackCheckpointIO as Fabric's plugin ------------------------------------------------------


def test_fabric_save_and_load_through_the_plugin_return_exactly_the_remainder(tmp_path):
    fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[BurnpackCheckpointIO()])
    model, optimizer = model_and_optimizer(fabric)
    path = tmp_path / "step-1.ckpt"
    fabric.save(
        path,
        {"model": model, "optimizer": optimizer, "step": 1, "note": "x"},
        filter={"model": lambda name, _: "weight" in name},
    )
    with burnpack.read(path) as pack:
        assert all("bias" not in name for name in pack.entries if name.startswith("model"))
    expected = torch.rand(3)
    state = {"model": model, "optimizer": optimizer, "step": 0}
    remainder = fabric.load(path, state, strict=False)
    assert remainder == {"note": "x"} and state["step"] == 1
    assert torch.equal(torch.rand(3), expected)  # the RNG states saved with the file


def test_an_async_plugin_write_is_drained_by_the_strategy_teardown(tmp_path, monkeypatch):
    """Fabric never tears its strategy down itself: the next load waits for the write in flight,
    and so does ``fabric.strategy.teardown()``, which raises the write's failure."""
    io = BurnpackCheckpointIO(async_save=True)
    fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[io])
    fabric.save(tmp_path / "a.ckpt", {"w": torch.arange(1000.0)})
    assert torch.equal(fabric.load(tmp_path / "a.ckpt")["w"], torch.arange(1000.0))
    monkeypatch.setattr(files, "write_record", _fail_with_enospc)  # the plugin's writer
    fabric.save(tmp_path / "b.ckpt", {"w": torch.zeros(3)})
    with pytest.raises(OSError, match="No space left"):
        fabric.strategy.teardown()
    assert not (tmp_path / "b.ckpt").exists()


def _fail_with_enospc(record, path, storage_options=None):
    raise OSError(28, "No space left on device (injected)", str(path))


def test_slurm_requeue_applies_with_slurm_auto_requeue_only():
    from lightning.fabric.plugins.environments import LightningEnvironment, SLURMEnvironment
    from lightning.fabric.strategies import DDPStrategy, SingleDeviceStrategy

    from lightning_bpk.fabric._preemption import FabricPreemption, requeue_signal

    slurm = DDPStrategy(cluster_environment=SLURMEnvironment(requeue_signal=signal.SIGUSR2))
    assert requeue_signal(slurm) == signal.SIGUSR2
    off = DDPStrategy(cluster_environment=SLURMEnvironment(auto_requeue=False))
    assert requeue_signal(off) is None
    assert requeue_signal(DDPStrategy(cluster_environment=LightningEnvironment())) is None
    assert requeue_signal(SingleDeviceStrategy(torch.device("cpu"))) is None
    preemption = FabricPreemption(["SIGTERM"], slurm, auto_requeue=True)
    try:  # the requeue signal is handled too, and flags a requeue
        signal.raise_signal(signal.SIGUSR2)
        assert preemption.flag() == 2
    finally:
        preemption.restore()
    assert signal.getsignal(signal.SIGUSR2) == signal.SIG_DFL


def test_the_best_by_a_metric_passed_to_save_are_kept_across_a_restart(tmp_path):
    scores = {1: 0.5, 2: 0.3, 3: 0.9, 4: 0.2, 5: 0.6, 6: 0.4, 7: 0.1, 8: 0.8}
    options = dict(checkpoint_duration=1, monitor="loss", save_top_k=2)
    for steps in (range(1, 5), range(5, 9)):  # a restart: a new manager over the directory
        fabric = make_fabric()
        model, optimizer = model_and_optimizer(fabric)
        manager = CheckpointManager(fabric, tmp_path, **options)
        state = {"model": model, "optimizer": optimizer, "step": 0}
        manager.restore(state)
        for step in steps:
            state["step"] = step
            manager.save(step, state, metric=torch.tensor(scores[step]))
        manager.close()
    kept = sorted(e.number for e in list_checkpoints(tmp_path) if e.complete)
    assert kept == [4, 7, 8]  # the two best (0.1, 0.2) and the newest
    assert (manager.best_step, manager.best_k_steps) == (7, [7, 4])
    again = CheckpointManager(make_fabric(), tmp_path, **options)
    assert again.best_k_steps == [7, 4]  # read back from the manifests
    with pytest.raises(ValueError, match="set monitor"):
        CheckpointManager(make_fabric(), tmp_path / "other", save_top_k=3)
