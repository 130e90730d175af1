"""The states and the methods ``benchmarks/run.py`` compares: durable saves and loads into the
existing parameters, burnpack beside the physical limits and the peers.

Saves (every one ends with the file fsynced):

- the limits: raw ``write`` + fsync of the same bytes (the page cache), and raw ``O_DIRECT``
  (one reused page-aligned 8 MiB buffer, ``pwrite``, fsync; the last block padded and the file
  cut back), the fastest durable write here;
- burnpack: ``burnpack.write`` (scratch file, fsync, rename, directory fsync, checksums),
  ``ModuleRecord.save``, and an :class:`~lightning_bpk.runtime.async_save.AsyncCheckpointSaver`
  save (the part that blocks training, and the time until the file is durable);
- the peers: ``torch.save`` + fsync, ``safetensors`` ``save_file`` + fsync, DCP ``save``
  (single process, ``sync_files=True``) and DCP ``async_save`` in thread mode with the
  ``DefaultStager`` options that work on a CPU (the blocking part, and until durable).

Loads fill the module's existing parameters (what resuming does). Before each one, the file
it reads is read once through the page cache ("warm": an ``O_DIRECT`` writer leaves nothing
there, a buffered one leaves everything), or dropped from it ("cold": fsync, then
``POSIX_FADV_DONTNEED``).
"""

from __future__ import annotations

import mmap
import os
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

import safetensors
import safetensors.torch
import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType, AsyncSaveResponse

from lightning_bpk import _fs, burnpack
from lightning_bpk.records import ModuleRecord
from lightning_bpk.runtime.async_save import AsyncCheckpointSaver

MiB = 1024 * 1024
# name -> (tensor count, bytes per tensor): large weights, a mid-size model, many tiny tensors.
STATES = {
    "64 MiB (16 tensors)": (16, 4 * MiB),
    "1 GiB (16 tensors)": (16, 64 * MiB),
    "5,000 x 4 KiB": (5000, 4096),
}
QUICK_STATES = ("64 MiB (16 tensors)", "5,000 x 4 KiB")
RAW_READ_CHUNK = MiB  # the raw readinto limit reads in steps of this size (see load_raw)
RAW_DIRECT_BUFFER = 8 * MiB  # the raw O_DIRECT limit's one reused buffer

warnings.filterwarnings("ignore", message="torch.distributed is disabled")  # DCP, one process
warnings.filterwarnings("ignore", message="Detected an existing checkpoint")  # DCP rewrites


class _Layer(nn.Module):
    def __init__(self, numel: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(numel))


class Model(nn.Module):
    """``count`` float32 parameters ``layers.<i>.weight`` of ``nbytes`` each, uniform(-1, 1)."""

    def __init__(self, count: int, nbytes: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(_Layer(nbytes // 4) for _ in range(count))
        generator = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for p in self.parameters():
                p.uniform_(-1, 1, generator=generator)


@dataclass
class Bench:
    """One state on disk: the module, its state_dict, files of every method, the async savers."""

    name: str
    model: Model
    directory: Path
    saver: AsyncCheckpointSaver = field(default_factory=AsyncCheckpointSaver)
    dcp_stager: DefaultStager | None = None
    dcp_pending: AsyncSaveResponse | None = None

    def __post_init__(self) -> None:
        self.sd = {k: v.detach() for k, v in self.model.state_dict().items()}
        self.nbytes = sum(t.nbytes for t in self.sd.values())
        self.largest = max(t.nbytes for t in self.sd.values())

    def path(self, name: str) -> Path:
        return self.directory / name

    def close(self) -> None:
        self.saver.close()
        if self.dcp_stager is not None:
            self.dcp_stager.close()


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# --- saves --------------------------------------------------------------------------------------


def save_raw(b: Bench) -> None:
    fd = os.open(b.path("raw.bin"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for t in b.sd.values():
            view = burnpack.tensor_bytes(t)
            while view:
                view = view[os.write(fd, view) :]
        os.fsync(fd)
    finally:
        os.close(fd)


_DIRECT_BUFFER = mmap.mmap(-1, RAW_DIRECT_BUFFER)  # page-aligned; reused by every save


def direct_supported(directory: Path) -> str | None:
    """None when ``directory`` takes ``O_DIRECT`` writes, else why not."""
    probe = directory / ".direct-probe"
    fd = os.open(probe, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        alignment, why = _fs.direct_alignment(fd)
    finally:
        os.close(fd)
        probe.unlink()
    return None if alignment is not None else why


def save_raw_direct(b: Bench) -> None:
    raw_direct_write(b.path("raw-direct.bin"), b.sd.values())


def raw_direct_write(path: Path, tensors: Iterable[torch.Tensor]) -> None:
    """The bytes of ``tensors`` through one reused aligned buffer, ``pwrite`` with ``O_DIRECT``
    when it is full, the tail padded and the file cut back, then fsync: the fastest durable
    write of those bytes here."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o644)
    try:
        buffer, used, offset = memoryview(_DIRECT_BUFFER), 0, 0
        for t in tensors:
            view = burnpack.tensor_bytes(t)
            while view:
                n = min(view.nbytes, buffer.nbytes - used)
                buffer[used : used + n] = view[:n]
                used, view = used + n, view[n:]
                if used == buffer.nbytes:
                    offset += os.pwrite(fd, buffer, offset)
                    used = 0
        if used:
            padded = used + (-used) % mmap.PAGESIZE
            buffer[used:padded] = bytes(padded - used)
            os.pwrite(fd, buffer[:padded], offset)
            os.ftruncate(fd, offset + used)
        os.fsync(fd)
    finally:
        os.close(fd)


def save_burnpack(b: Bench) -> None:
    burnpack.write(b.path("state.bpk"), b.sd)


def save_record(b: Bench) -> None:
    ModuleRecord.from_module(b.model).save(b.path("model.bpk"))


def save_torch(b: Bench) -> None:
    torch.save(b.sd, b.path("state.pt"))
    _fsync(b.path("state.pt"))


def save_safetensors(b: Bench) -> None:
    safetensors.torch.save_file(b.sd, b.path("state.safetensors"))
    _fsync(b.path("state.safetensors"))


def save_dcp(b: Bench) -> None:
    dcp.save(b.sd, checkpoint_id=b.path("dcp"))


def save_async(b: Bench) -> None:
    b.saver.save_record(ModuleRecord.from_module(b.model), b.path("async.bpk"))


def save_dcp_async(b: Bench) -> None:
    if b.dcp_stager is None:  # CPU: no pinned memory, no non-blocking copy (see io-limits)
        options = StagingOptions(
            use_pinned_memory=False,
            use_shared_memory=True,
            use_async_staging=True,
            use_non_blocking_copy=False,
        )
        b.dcp_stager = DefaultStager(options)
    response = dcp.async_save(
        b.sd,
        checkpoint_id=b.path("dcp-async"),
        async_checkpointer_type=AsyncCheckpointerType.THREAD,
        async_stager=b.dcp_stager,
    )
    assert isinstance(response, AsyncSaveResponse)
    b.dcp_pending = response


def wait_dcp_async(b: Bench) -> None:
    assert b.dcp_pending is not None
    b.dcp_pending.staging_completion.result()
    b.dcp_pending.upload_completion.result()
    b.dcp_pending = None


# --- loads into the existing parameters ----------------------------------------------------------


def _copy_into(b: Bench, tensors: dict[str, torch.Tensor]) -> None:
    with torch.no_grad():
        for name, target in b.sd.items():
            target.copy_(tensors[name])


def load_raw(b: Bench) -> None:
    # Chunks of RAW_READ_CHUNK: on these VMs 1 MiB reads beat one read per tensor, so this is
    # the faster of the two ways (an honest limit), and it skips the checksums.
    with open(b.path("raw.bin"), "rb", buffering=0) as f:
        for t in b.sd.values():
            view = memoryview(t.view(-1).view(torch.uint8).numpy())
            while view:
                view = view[f.readinto(view[:RAW_READ_CHUNK]) :]


def load_burnpack_into(b: Bench) -> None:
    burnpack.read_into(b.path("state.bpk"), b.sd)


def load_burnpack_copy(b: Bench) -> None:
    with burnpack.read(b.path("state.bpk")) as pack:
        _copy_into(b, {n: pack.tensor(n) for n in b.sd})


def load_record(b: Bench) -> None:
    ModuleRecord.load(b.path("model.bpk")).apply(b.model)


def load_torch(b: Bench) -> None:
    _copy_into(b, torch.load(b.path("state.pt"), weights_only=True))


def load_torch_mmap(b: Bench) -> None:
    _copy_into(b, torch.load(b.path("state.pt"), weights_only=True, mmap=True))


def load_safetensors(b: Bench) -> None:
    _copy_into(b, safetensors.torch.load_file(b.path("state.safetensors")))


def load_dcp(b: Bench) -> None:
    dcp.load(b.sd, checkpoint_id=b.path("dcp"))


@dataclass(frozen=True)
class Method:
    """A measured row. ``after`` runs untimed after ``run`` (an async save's wait); with
    ``durable`` set, ``run`` + ``after`` is a second row of that label. A load reads ``files``
    (relative to the state's directory) from a warm page cache, or a cold one with ``cold``."""

    label: str
    family: str  # chart colour: raw, burnpack, records, peer
    run: Callable[[Bench], None]
    after: Callable[[Bench], object] | None = None
    durable: str | None = None
    files: tuple[str, ...] = ()
    cold: bool = False


ASYNC_BLOCKING = "async save: blocking part"
DCP_ASYNC_BLOCKING = "DCP async_save (thread): blocking part"
SAVES = [
    Method("raw write + fsync", "raw", save_raw),
    Method("raw O_DIRECT write + fsync", "raw", save_raw_direct),
    Method("burnpack.write", "burnpack", save_burnpack),
    Method("ModuleRecord.save", "records", save_record),
    Method(
        ASYNC_BLOCKING, "records", save_async, lambda b: b.saver.wait(), "async save: until durable"
    ),
    Method("torch.save + fsync", "peer", save_torch),
    Method("safetensors save_file + fsync", "peer", save_safetensors),
    Method("DCP save (sync_files)", "peer", save_dcp),
    Method(
        DCP_ASYNC_BLOCKING,
        "peer",
        save_dcp_async,
        wait_dcp_async,
        "DCP async_save (thread): until durable",
    ),
]
_RAW, _PACK, _MODEL, _ST = ("raw.bin",), ("state.bpk",), ("model.bpk",), ("state.safetensors",)
LOADS = [
    Method("raw readinto", "raw", load_raw, files=_RAW),
    Method("burnpack.read_into", "burnpack", load_burnpack_into, files=_PACK),
    Method("burnpack.read + copy_", "burnpack", load_burnpack_copy, files=_PACK),
    Method("ModuleRecord.load + apply", "records", load_record, files=_MODEL),
    Method("torch.load + copy_", "peer", load_torch, files=("state.pt",)),
    Method("torch.load(mmap) + copy_", "peer", load_torch_mmap, files=("state.pt",)),
    Method("safetensors load_file + copy_", "peer", load_safetensors, files=_ST),
    Method("DCP load (in place)", "peer", load_dcp, files=("dcp",)),
]
# The same from a cold page cache, for the large states: what a resume after a reboot reads.
COLD_LOADS = [
    Method("cold: raw readinto", "raw", load_raw, files=_RAW, cold=True),
    Method("cold: burnpack.read_into", "burnpack", load_burnpack_into, files=_PACK, cold=True),
    Method("cold: ModuleRecord.load + apply", "records", load_record, files=_MODEL, cold=True),
    Method("cold: safetensors load_file + copy_", "peer", load_safetensors, files=_ST, cold=True),
]
METHODS = {m.label: m for m in SAVES + LOADS + COLD_LOADS}


def prepare(b: Bench, m: Method) -> None:
    """Put the files a load reads in the page cache (warm) or out of it (cold): :func:`recache`."""
    for name in m.files:
        recache(b.path(name), cold=m.cold)


def recache(path: Path, *, cold: bool) -> None:
    """Drop the file ``path`` (or every file below the folder) from the page cache and, unless
    ``cold``, read it back once, so every method's file sits in the cache the same way.

    Left as its writer left it, a file written through the cache (safetensors, torch.save, DCP's
    ``FileSystemWriter``) keeps the large folios of its write, or stays cached at all, while one
    written with ``O_DIRECT`` (burnpack) is not cached and enters the cache by readahead: mapping
    every page of 64 MiB then took 0.2 ms for the first and 5 ms for the second on this VM, a
    difference of how the file was written, not of the reader measured."""
    for file in sorted(path.rglob("*")) if path.is_dir() else [path]:
        if not file.is_file():
            continue
        fd = os.open(file, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            while not cold and os.read(fd, 8 * MiB):
                pass
        finally:
            os.close(fd)
