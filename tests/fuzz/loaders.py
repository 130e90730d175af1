"""The targets and the oracle of the loader fuzzer (``tests/fuzz/fuzz_loaders.py``), shared with
the suite's replay of the inputs it found (``tests/test_fuzz_regressions.py``).

A target takes hostile bytes, puts them where a user's file would be (a ``.bpk``, a
``.safetensors`` file, a checkpoint's sentinel or record, a sharded checkpoint's index or rank
file) and runs a public loader on it. The oracle: the loader returns, or raises one of this
package's errors (:class:`~lightning_bpk.errors.LightningBpkError`); any other exception is
*untyped* (a bug, with the input kept as a regression case), and so is a load that succeeds
after a byte of checksummed tensor data was flipped (a *missed corruption*). The command line
must answer with an exit status, never a traceback.
"""

from __future__ import annotations

import contextlib
import functools
import io
import json
import shutil
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save as safetensors_save

from lightning_bpk import burnpack, cli, interop
from lightning_bpk.checkpointer import Checkpointer, CheckpointWarning, get_latest_checkpoint_number
from lightning_bpk.errors import LightningBpkError
from lightning_bpk.layout import _sharded_index_name, sentinel_name
from lightning_bpk.records import ModuleRecord, load_record


class Untyped(AssertionError):
    """A loader raised something other than the package's errors (``__cause__``), or the
    command line crashed."""


class Missed(AssertionError):
    """A load succeeded although a byte of checksummed tensor data was flipped."""


@dataclass(frozen=True)
class Seed:
    """A valid input of a target, and the byte ranges of its checksummed tensors' data (a flip
    there must be caught; the alignment padding between them is no tensor's): ``(start, end)``
    each, none where nothing is checksummed."""

    data: bytes
    checked: tuple[tuple[int, int], ...] = ()


def _tensors(scale: float = 1.0) -> dict[str, torch.Tensor]:
    return {
        "layer.weight": torch.arange(12.0).reshape(3, 4) * scale,
        "layer.bias": torch.linspace(-1, 1, 3),
        "bn.running_mean": torch.zeros(0),  # an empty tensor too
        "steps": torch.tensor([7], dtype=torch.int64),
    }


def _record_bytes(scale: float = 1.0) -> bytes:
    return burnpack.dumps(_tensors(scale), metadata={"lightning_bpk/kind": "module"})


def _checked(blob: bytes) -> Seed:
    """``blob`` as a seed whose tensors' bytes are checksummed."""
    with burnpack.loads(blob) as pack:
        spans = [pack.entries[n].data_offsets for n in pack.names]
        ranges = tuple((pack.data_start + s, pack.data_start + e) for s, e in spans if e > s)
    return Seed(blob, ranges)


def _load(blob: bytes) -> None:
    with burnpack.loads(blob) as pack:
        for name in pack.names:
            pack.raw(name)
        pack.tensors()


def _record(blob: bytes, scratch: Path) -> None:
    path = scratch / "model.bpk"
    path.write_bytes(blob)
    record = load_record(path)
    if isinstance(record, ModuleRecord):
        record.tensors  # noqa: B018 - every tensor materialised


def _safetensors(blob: bytes, scratch: Path) -> None:
    path = scratch / "model.safetensors"
    path.write_bytes(blob)
    content = interop.read_content(path)
    for tensor in content.tensors.values():
        tensor.sum()


@functools.cache
def _checkpoint_directory(scratch: Path) -> tuple[Path, str]:
    """A committed checkpoint 0 in ``scratch/run``, made once per scratch folder (each input
    puts its file back as it was), and its model record's name below it: the seeds of the
    checkpoint targets are its sentinel and that record."""
    base = scratch / "run"
    shutil.rmtree(base, ignore_errors=True)
    Checkpointer(base).save_checkpoint(
        0, {"model": ModuleRecord(_tensors()), "trainer": {"step": 3}}
    )
    manifest = json.loads((base / sentinel_name("checkpoint", 0)).read_bytes())
    return base, f"{manifest['data']}/model.bpk"


@contextlib.contextmanager
def _replaced(path: Path, blob: bytes) -> Iterator[None]:
    """``path`` holds ``blob`` for the block, then its own bytes again."""
    original = path.read_bytes()
    path.write_bytes(blob)
    try:
        yield
    finally:
        path.write_bytes(original)


def _load_checkpoint(base: Path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CheckpointWarning)
        latest = get_latest_checkpoint_number(base, verify=True)
        if latest >= 0:
            Checkpointer(base).load_checkpoint(latest)


def _sentinel(blob: bytes, scratch: Path) -> None:
    base, _ = _checkpoint_directory(scratch)
    with _replaced(base / sentinel_name("checkpoint", 0), blob):
        _load_checkpoint(base)
        Checkpointer(base).load_checkpoint(0)


def _checkpoint_record(blob: bytes, scratch: Path) -> None:
    base, model = _checkpoint_directory(scratch)
    with _replaced(base / model, blob):
        Checkpointer(base).load_checkpoint(0)


def _sharded_directory(scratch: Path) -> Path:
    """A sharded (DCP) checkpoint in ``scratch/sharded``, made once per scratch folder."""
    import torch.distributed.checkpoint as dcp

    from lightning_bpk.dcp import BurnpackStorageWriter

    base = scratch / "sharded"
    if not (base / _sharded_index_name()).exists():
        shutil.rmtree(base, ignore_errors=True)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # no process group: one rank
            dcp.save(dict(_tensors()), storage_writer=BurnpackStorageWriter(base))
    return base


def _dcp_index(blob: bytes, scratch: Path) -> None:
    from lightning_bpk.dcp import load_full_state_dict

    base = _sharded_directory(scratch)
    with _replaced(base / _sharded_index_name(), blob):
        load_full_state_dict(base)


def _cli_verify(blob: bytes, scratch: Path) -> bool:
    path = scratch / "model.bpk"
    path.write_bytes(blob)
    out, err = io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            status = cli.main(["verify", str(path)])
    except SystemExit as e:  # argparse's own exits are answers too
        status = e.code if isinstance(e.code, int) else 2
    except Exception as e:
        raise Untyped(f"lightning-bpk verify raised {type(e).__name__}: {e}") from e
    if status not in (cli.EXIT_OK, cli.EXIT_FOUND, cli.EXIT_BAD_FILE):
        raise Untyped(f"lightning-bpk verify exited {status}: {err.getvalue()[-500:]}")
    return status != cli.EXIT_OK  # the damage was reported


@dataclass(frozen=True)
class Target:
    """A public loader under fuzz: ``run(blob, scratch)`` (True: it reported the input as bad
    without raising, as the command line does) and how to make its seeds."""

    run: Callable[[bytes, Path], bool | None]
    seeds: Callable[[Path], list[Seed]]


def _record_seeds(scratch: Path) -> list[Seed]:
    return [_checked(_record_bytes()), _checked(_record_bytes(-2.0))]


def _safetensors_seeds(scratch: Path) -> list[Seed]:
    """A plain file, a half-precision one, and one this package wrote from a record (its
    param ids, scalars and metadata in the ``__metadata__`` info entry)."""
    plain = {k: v for k, v in _tensors().items() if v.numel()}
    ours = scratch / "ours.safetensors"
    interop.save_module_record(ModuleRecord(_tensors()), ours)
    return [
        Seed(safetensors_save(plain, metadata={"format": "pt"})),
        Seed(safetensors_save({"w": torch.ones(2, 2, dtype=torch.float16)})),
        Seed(ours.read_bytes()),
    ]


def _sentinel_seeds(scratch: Path) -> list[Seed]:
    base, _ = _checkpoint_directory(scratch)
    return [Seed((base / sentinel_name("checkpoint", 0)).read_bytes())]


def _checkpoint_record_seeds(scratch: Path) -> list[Seed]:
    base, model = _checkpoint_directory(scratch)
    return [_checked((base / model).read_bytes())]


def _dcp_index_seeds(scratch: Path) -> list[Seed]:
    return [Seed((_sharded_directory(scratch) / _sharded_index_name()).read_bytes())]


TARGETS: dict[str, Target] = {
    "burnpack": Target(lambda blob, _: _load(blob), _record_seeds),
    "record": Target(_record, _record_seeds),
    "safetensors": Target(_safetensors, _safetensors_seeds),
    "sentinel": Target(_sentinel, _sentinel_seeds),
    "checkpoint-record": Target(_checkpoint_record, _checkpoint_record_seeds),
    "dcp-index": Target(_dcp_index, _dcp_index_seeds),
    "cli-verify": Target(_cli_verify, _record_seeds),
}


def check(target: str, blob: bytes, scratch: Path, *, corrupted: bool = False) -> None:
    """Run ``target`` on ``blob`` under the oracle: raise :class:`Untyped` or :class:`Missed`
    on a finding, return otherwise. ``corrupted``: a byte of checksummed tensor data was
    flipped, so the load must fail."""
    try:
        reported = TARGETS[target].run(blob, scratch)
    except (Untyped, Missed):
        raise
    except LightningBpkError:
        return
    except Exception as e:
        raise Untyped(f"{target}: {type(e).__name__}: {str(e)[:300]}") from e
    if corrupted and not reported:
        raise Missed(f"{target}: a flipped byte of checksummed tensor data loaded without error")
