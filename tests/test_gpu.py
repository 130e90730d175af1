"""Saves and loads of tensors on a CUDA device (issue 26): pinned staging off the training
stream, loads through pinned bounce buffers, CUDA RNG states, a SIGKILLed run resumed.

Every test marked ``needs_cuda`` is skipped, with that reason, where torch sees no CUDA device
(this project's CI); the CPU paths of the same code are pinned by tests/test_device.py,
tests/test_async_save.py and tests/test_records_base.py. The resume test also runs on CPU.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lightning_bpk import _device
from lightning_bpk.checkpointer import Checkpointer
from lightning_bpk.interop import read_content, save_module_record
from lightning_bpk.records import ModuleRecord, OptimizerRecord, load_record
from lightning_bpk.runtime import rng
from lightning_bpk.runtime.async_save import AsyncCheckpointSaver

needs_cuda = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device; torch sees none on this machine"
)
SCRIPT = Path(__file__).parent / "scripts" / "gpu_resume.py"


def _net(device: str) -> torch.nn.Module:
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.Linear(512, 64))
    return net.to(dtype=torch.bfloat16).to(device)


@needs_cuda
def test_cuda_and_cpu_tensors_give_byte_identical_files(tmp_path: Path) -> None:
    cpu, cuda = _net("cpu"), _net("cuda")
    sync_cpu = ModuleRecord.from_module(cpu).save(tmp_path / "cpu")
    sync_cuda = ModuleRecord.from_module(cuda).save(tmp_path / "cuda")
    with AsyncCheckpointSaver() as saver:
        saver.save_record(ModuleRecord.from_module(cuda), tmp_path / "async_cuda.bpk")
    expected = sync_cpu.read_bytes()
    assert sync_cuda.read_bytes() == expected
    assert (tmp_path / "async_cuda.bpk").read_bytes() == expected


@needs_cuda
def test_async_save_stages_in_pinned_memory_and_allocates_nothing_on_the_device(
    tmp_path: Path,
) -> None:
    net = _net("cuda")
    optimizer = torch.optim.Adam(net.parameters())
    net(torch.ones(4, 256, device="cuda", dtype=torch.bfloat16)).float().sum().backward()
    optimizer.step()
    checkpointer = Checkpointer(tmp_path)

    def data() -> dict:
        return {
            "model": ModuleRecord.from_module(net),
            "optim": OptimizerRecord.from_optimizer(optimizer, net),
        }

    with AsyncCheckpointSaver() as saver:
        saver.save_checkpoint(checkpointer, 0, data())  # the first save allocates the buffers
        saver.wait()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        saver.save_checkpoint(checkpointer, 1, data())
        saver.wait()
        torch.cuda.synchronize()
        assert torch.cuda.max_memory_allocated() == before  # no second copy on the device
        slots = saver.staging._slots.values()
        assert slots and all(slot.raw.is_pinned() for slot in slots)
    loaded = checkpointer.load_checkpoint(1)
    assert loaded is not None
    for name, tensor in net.state_dict().items():
        assert torch.equal(loaded["model"].tensors[name], tensor.cpu())


@needs_cuda
def test_a_tensor_changed_right_after_the_save_returns_is_not_torn(tmp_path: Path) -> None:
    # Queue long work on the training stream first, so the side stream's copy cannot have run
    # when save_checkpoint returns; the in-place change queued next must still come after it.
    big = torch.full((64, 1024, 1024), 1.0, device="cuda")  # 256 MiB
    busy = torch.randn(4096, 4096, device="cuda")
    checkpointer = Checkpointer(tmp_path)
    with AsyncCheckpointSaver() as saver:
        for _ in range(20):
            busy = busy @ busy / 4096
        saver.save_checkpoint(checkpointer, 0, {"state": {"big": big}})
        big.add_(1.0)
        big.mul_(3.0)
    loaded = checkpointer.load_checkpoint(0)
    assert loaded is not None
    saved = loaded["state"]["big"]
    assert torch.equal(saved, torch.ones_like(saved))
    assert torch.equal(big, torch.full_like(big, 6.0))


@needs_cuda
def test_loads_go_to_the_device_and_into_device_parameters(tmp_path: Path) -> None:
    source = _net("cpu")
    path = ModuleRecord.from_module(source).save(tmp_path / "m")
    on_device = ModuleRecord.load(path, device="cuda")
    assert all(t.is_cuda for t in on_device.tensors.values())
    assert all(t.is_cuda for t in load_record(path, device="cuda:0").tensors.values())
    st = save_module_record(ModuleRecord.from_module(source), tmp_path / "m.safetensors")
    assert all(t.is_cuda for t in read_content(st, device="cuda").tensors.values())
    target = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.Linear(512, 64))
    target = target.to(dtype=torch.bfloat16, device="cuda")
    weight = target[0].weight
    ModuleRecord.load(path).apply(target)  # host record -> device parameters (bounce buffers)
    assert target[0].weight is weight  # the same parameter object, filled in place
    for name, tensor in source.state_dict().items():
        assert torch.equal(target.state_dict()[name].cpu(), tensor)
        assert torch.equal(on_device.tensors[name].cpu(), tensor)
    with pytest.raises(ValueError, match="CUDA device"):
        ModuleRecord.load(path, device=f"cuda:{torch.cuda.device_count()}")
    checkpointer = Checkpointer(tmp_path / "run")
    checkpointer.save_checkpoint(1, {"model": ModuleRecord.from_module(source), "w": torch.ones(2)})
    loaded = checkpointer.load_checkpoint(1, device="cuda")
    assert all(t.is_cuda for t in loaded["model"].tensors.values()) and loaded["w"].is_cuda


@needs_cuda
def test_bounce_buffers_are_pinned_and_copy_chunk_by_chunk() -> None:
    source = torch.randn(3 * 1024 * 1024 + 5)
    target = torch.empty_like(source, device="cuda")
    with _device.HostToDevice(target.device, chunk=1 << 20) as copier:
        assert all(b.is_pinned() for b in copier._buffers)
        copier.copy(target, source)
    assert torch.equal(target.cpu(), source)


@needs_cuda
def test_cuda_rng_states_round_trip_per_device() -> None:
    states = rng.capture_rng()
    assert sorted(states["cuda_devices"]) == [str(i) for i in range(torch.cuda.device_count())]
    expected = torch.rand(8, device="cuda")
    rng.restore_rng(states)
    assert torch.equal(torch.rand(8, device="cuda"), expected)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda:0", marks=needs_cuda)])
def test_a_run_killed_and_resumed_ends_bit_identical(device: str, tmp_path: Path) -> None:
    def run(base: str, *extra: str) -> subprocess.CompletedProcess:
        command = [sys.executable, str(SCRIPT), str(tmp_path / base), str(tmp_path / f"{base}.pt")]
        command += ["--steps", "23", "--every", "5", "--device", device, *extra]
        return subprocess.run(command, capture_output=True, text=True, timeout=600)

    straight = run("straight")
    assert straight.returncode == 0, straight.stderr
    killed = run("resumed", "--kill-at", "17")
    assert killed.returncode == -9, killed.stderr  # SIGKILL: nothing after it ran
    assert not (tmp_path / "resumed.pt").exists()
    resumed = run("resumed")
    assert resumed.returncode == 0, resumed.stderr
    expected = torch.load(tmp_path / "straight.pt")
    final = torch.load(tmp_path / "resumed.pt")
    assert expected.keys() == final.keys()
    assert all(torch.equal(final[k], v) for k, v in expected.items())


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal where torch sees no GPU")
def test_the_gpu_benchmark_says_why_it_measures_nothing_without_cuda(tmp_path: Path) -> None:
    script = Path(__file__).parents[1] / "benchmarks" / "gpu.py"
    out = tmp_path / "never.md"
    done = subprocess.run(
        [sys.executable, str(script), "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 2, done.stderr
    assert "no CUDA device" in done.stderr and "Traceback" not in done.stderr
    assert not out.exists()
