"""A module's parameters and persistent buffers as one burnpack, loaded with Burn's semantics.

Names are ``module.state_dict()`` keys (``fc1.weight``, ``bn.running_mean``,
``bn.num_batches_tracked`` as I64) and the write order is the module's registration order, so a
record reads like Burn's ``ModuleRecord`` and a Burn file (no kind tag, Burn's names) loads as one.

**Parameter ids.** Every parameter is written with a u64 ``param_id`` (Burn's ``ParamId``); the
optimizer record keys its state by these ids. A parameter that was loaded from a record carries
that record's id (an attribute on the ``nn.Parameter``). A parameter that
was never loaded gets :func:`default_param_id` of its fully qualified name relative to the module
passed in: the first 8 bytes of ``blake2b(name, digest_size=8, person=b"lightning_bpk")`` read
little-endian. That is stable across processes, so a fresh run names the same state the same
way; wrapping the module (``nn.Sequential(model)``) changes the names and hence these ids,
while ids taken from a record stay on the parameter objects. :func:`param_ids` lists them.

**Tied weights** (one tensor object under several names) are stored once, under the first
name; every further name is an alias in metadata (``lightning_bpk/alias/<name>`` ->
``<first name>``). Burn reads the first name; :meth:`ModuleRecord.apply` loads into every name.

**Adapters** translate names and layouts between this package and another framework (the
interop module implements Burn <-> PyTorch ones). An adapter is any object with two methods::

    class Adapter(Protocol):
        def from_module(self, name: str, tensor: Tensor, layer: nn.Module | None)
            -> tuple[str, Tensor] | None: ...   # torch name/tensor -> record name/tensor (on save)
        def to_module(self, name: str, tensor: Tensor, layer: nn.Module | None)
            -> tuple[str, Tensor]: ...   # record name/tensor -> torch name/tensor (on apply)

``layer`` is the submodule owning the tensor: for ``from_module`` the owner of the torch name,
for ``to_module`` the submodule at the record name's prefix (``None`` when there is none, e.g.
when the adapter also renames the prefix). A returned tensor may be a new one (a transpose).
``from_module`` may return ``None`` for a tensor the other framework does not have (torch's
``num_batches_tracked`` in Burn): it is then neither recorded nor reported missing on apply.

A buffer loaded from a record that gives it an id (Burn records running statistics with ids)
keeps that id like a parameter does, so it is written back with it.

Example::

    >>> import torch
    >>> net = torch.nn.Linear(2, 3)
    >>> record = ModuleRecord.from_module(net)
    >>> list(record.tensors)
    ['weight', 'bias']
    >>> other = ModuleRecord.from_bytes(record.to_bytes()).apply(torch.nn.Linear(2, 3))
    >>> torch.equal(other.weight, net.weight), param_ids(other) == param_ids(net)
    (True, True)
"""

from __future__ import annotations

import hashlib
import warnings
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any, Protocol

import torch
from torch import nn

from lightning_bpk import _device, burnpack
from lightning_bpk.burnpack import _parallel
from lightning_bpk.records._params import (
    _PARAM_ID_ATTR,
    _load,
    owning_module,
    set_param_id,
)
from lightning_bpk.records.base import Record, RecordError, _user_metadata

__all__ = [
    "Adapter",
    "ModuleRecord",
    "default_param_id",
    "param_ids",
]

# Metadata prefix of tied-weight aliases: "<prefix><alias name>" -> "<stored name>".
ALIAS_PREFIX = "lightning_bpk/alias/"
# Personalization of the name hash, so our ids do not coincide with other blake2b uses.
_ID_PERSON = b"lightning_bpk"
_DTYPE_POLICIES = ("from_record", "cast_to_module")
# Tensors from this size on are copied by _load_all's two threads: torch copies smaller ones on
# the calling thread alone (32,768 elements and more go to its thread pool).
_PARALLEL_COPY_MIN = 256 * 1024


class Adapter(Protocol):
    """Translates names/tensors between a torch module and a record (see the module docstring)."""

    def from_module(
        self, name: str, tensor: torch.Tensor, layer: nn.Module | None
    ) -> tuple[str, torch.Tensor] | None: ...

    def to_module(
        self, name: str, tensor: torch.Tensor, layer: nn.Module | None
    ) -> tuple[str, torch.Tensor]: ...


def default_param_id(name: str) -> int:
    """The id of a never-loaded parameter: a 64-bit hash of its fully qualified name.

    >>> default_param_id("fc1.weight") == default_param_id("fc1.weight")
    True
    """
    digest = hashlib.blake2b(name.encode(), digest_size=8, person=_ID_PERSON).digest()
    return int.from_bytes(digest, "little")


def _param_table(module: nn.Module) -> dict[int, tuple[int, str, nn.Parameter]]:
    """``id(parameter) -> (param_id, first name, parameter)`` for every distinct parameter."""
    table: dict[int, tuple[int, str, nn.Parameter]] = {}
    for name, param in module.named_parameters():
        pid = getattr(param, _PARAM_ID_ATTR, None)
        table[id(param)] = (default_param_id(name) if pid is None else pid, name, param)
    return table


def param_ids(module: nn.Module) -> dict[str, int]:
    """Every parameter name (tied aliases included) -> its u64 param id.

    >>> ids = param_ids(torch.nn.Linear(1, 1))
    >>> sorted(ids), ids["bias"] == default_param_id("bias")
    (['bias', 'weight'], True)
    """
    table = _param_table(module)
    return {name: table[id(p)][0] for name, p in module.named_parameters(remove_duplicate=False)}


def _load_all(plan: list[tuple[torch.Tensor, torch.Tensor, int | None]], *, cast: bool) -> None:
    """:func:`load_tensor` for every ``(target, tensor, pid)``, a tied target once. Large
    same-dtype copies between contiguous CPU tensors are one batch shared by two threads
    (:func:`burnpack._parallel.copy <lightning_bpk.burnpack._parallel.copy>`): torch's own
    ``copy_`` of a large tensor stalls at its thread pool's barrier whenever another process
    holds a core (smaller ones it copies on one thread). Same-dtype copies from the host into
    contiguous tensors of a CUDA device go through reused pinned bounce buffers, non-blocking
    (:func:`lightning_bpk._device.upload`), not torch's pageable synchronous copy."""
    loaded: set[int] = set()  # a tied tensor appears under several names; load it once
    batch = []
    uploads = []
    with torch.no_grad():
        for target, tensor, pid in plan:
            if id(target) in loaded:
                continue
            loaded.add(id(target))
            if (
                tensor.dtype == target.dtype
                and target.nbytes >= _PARALLEL_COPY_MIN
                and target.is_cpu
                and tensor.is_cpu
                and target.is_contiguous()
                and tensor.is_contiguous()
            ):
                batch.append((target, tensor, pid))
            elif (
                tensor.dtype == target.dtype
                and tensor.is_cpu
                and _device.accelerated(target.device)
                and target.is_contiguous()
            ):
                uploads.append((target, tensor, pid))
            else:
                _load(target, tensor, pid, cast)
        _device.upload((t, s) for t, s, _ in uploads)
    _parallel.copy((burnpack.tensor_bytes(t), burnpack.tensor_bytes(s)) for t, s, _ in batch)
    torch.autograd.graph.increment_version([t for t, _, _ in batch])
    for target, _, pid in batch + uploads:
        if pid is not None:
            set_param_id(target, pid)


def _materialise(
    module: nn.Module,
    names: list[str],
    target: torch.Tensor,
    tensor: torch.Tensor,
    pid: int | None,
    cast: bool,
) -> None:
    """Replace the ``meta`` tensor ``target`` of ``module`` (under every name in ``names``: it
    may be tied) by a CPU copy of ``tensor`` (cast to ``target``'s dtype with ``cast``)."""
    data = tensor.to(device="cpu", dtype=target.dtype if cast else tensor.dtype, copy=True)
    if isinstance(target, nn.Parameter):
        data = nn.Parameter(data, requires_grad=target.requires_grad)
    if pid is not None:
        set_param_id(data, pid)
    for name in names:
        prefix, _, leaf = name.rpartition(".")
        owner = module.get_submodule(prefix)
        slots = owner._parameters if leaf in owner._parameters else owner._buffers
        slots[leaf] = data  # type: ignore[assignment]


def _mismatch(
    name: str, target: Any, tensor: torch.Tensor, dtype_policy: str
) -> tuple[str, bool] | None:
    """Why record tensor ``tensor`` cannot be loaded into the module's ``target`` named
    ``name``, and whether ``validate=False`` skips it (a shape mismatch); None: it can be. The
    others: not a tensor, a dtype that cannot hold a trainable parameter."""
    if not isinstance(target, torch.Tensor):
        return f"'{name}': module holds a {type(target).__name__}", False
    if tuple(tensor.shape) != tuple(target.shape):
        shapes = f"expected {list(target.shape)} but record has {list(tensor.shape)}"
        return f"'{name}': shape mismatch, {shapes}", True
    trainable = target.requires_grad and dtype_policy == "from_record"
    if trainable and not (tensor.is_floating_point() or tensor.is_complex()):
        return (
            f"'{name}': record dtype {tensor.dtype} cannot hold a trainable parameter "
            "(use dtype_policy='cast_to_module')"
        ), False
    return None


class ModuleRecord(Record):
    """Parameters and buffers of a module, each parameter with its u64 ``param_id``.

    ``tensors`` maps names to tensors in write order (views on the file when loaded from one),
    ``param_ids`` names to ids, ``aliases`` tied names to the stored name, ``metadata`` holds
    any other string metadata of the file (kept on re-save).
    """

    kind = "module"

    def __init__(
        self,
        tensors: Mapping[str, torch.Tensor],
        *,
        param_ids: Mapping[str, int] | None = None,
        aliases: Mapping[str, str] | None = None,
        metadata: Mapping[str, str] | None = None,
    ) -> None:
        self.tensors = dict(tensors)
        self.param_ids = dict(param_ids or {})
        self.aliases = dict(aliases or {})
        self.metadata = dict(metadata or {})
        dangling = [
            f"alias '{a}' -> '{t}'" for a, t in self.aliases.items() if t not in self.tensors
        ]
        if dangling:
            raise RecordError("validation", [f"{d} names no stored tensor" for d in dangling])

    @classmethod
    @_parallel.gc_paused_call  # one object per tensor: see burnpack._parallel
    def from_module(cls, module: nn.Module, adapter: Adapter | None = None) -> ModuleRecord:
        """Record ``module.state_dict()`` without copying (tensors are the module's own).

        >>> sorted(ModuleRecord.from_module(torch.nn.BatchNorm1d(2)).tensors)[:2]
        ['bias', 'num_batches_tracked']
        """
        ids = _param_table(module)
        tensors: dict[str, torch.Tensor] = {}
        pids: dict[str, int] = {}
        aliases: dict[str, str] = {}
        stored_as: dict[int, str] = {}  # id(tensor) -> record name it is stored under
        problems = []
        for name, value in module.state_dict(keep_vars=True).items():
            if not isinstance(value, torch.Tensor):
                problems.append(f"'{name}': {type(value).__name__} is not a tensor")
                continue
            rec_name, tensor = name, value
            if adapter is not None:
                adapted = adapter.from_module(name, value, owning_module(module, name))
                if adapted is None:
                    continue
                rec_name, tensor = adapted
            if rec_name in tensors or rec_name in aliases:
                problems.append(f"'{rec_name}': two tensors are recorded under this name")
            elif id(value) in stored_as:
                aliases[rec_name] = stored_as[id(value)]
            else:
                try:
                    burnpack._burn_dtype(tensor.dtype)
                except burnpack.BurnpackError as e:
                    problems.append(f"'{rec_name}': {e}")
                stored_as[id(value)] = rec_name
                tensors[rec_name] = tensor.detach()
                if isinstance(value, nn.Parameter):
                    pids[rec_name] = ids[id(value)][0]
                elif getattr(value, _PARAM_ID_ATTR, None) is not None:
                    pids[rec_name] = getattr(value, _PARAM_ID_ATTR)
        if problems:
            raise RecordError("validation", problems)
        return cls(tensors, param_ids=pids, aliases=aliases)

    @_parallel.gc_paused_call
    def apply(
        self,
        module: nn.Module,
        *,
        allow_partial: bool = False,
        allow_unused: bool = False,
        validate: bool = True,
        dtype_policy: str = "from_record",
        adapter: Adapter | None = None,
    ) -> nn.Module:
        """Load the record into ``module`` in place and return it, as Burn's ``load_record``.

        Record entries match module tensors by exact name. Checked before anything is changed,
        and reported together in one :class:`RecordError` (kind ``validation``):

        - shape mismatches ("apply errors"), unless ``validate=False`` (then skipped: those
          tensors keep the module's values, and one warning names each of them);
        - module tensors absent from the record ("missing"), unless ``allow_partial``;
        - record entries matching nothing ("unused"), unless ``allow_unused``.

        ``dtype_policy="from_record"`` (Burn's default) gives each tensor the record's dtype;
        ``"cast_to_module"`` keeps the module's dtype and casts the data. Parameters keep their
        identity (optimizers still reference them) and take the record's ``param_id``.

        A tensor on the ``meta`` device (a module built under ``torch.device("meta")`` to skip
        its initialisation) has no storage to copy into: it is replaced by a CPU copy of the
        record's (a new ``nn.Parameter`` with the same ``requires_grad``, for every name it is
        tied under), as ``load_state_dict(assign=True)`` does; build optimizers afterwards. A
        ``meta`` tensor the record does not hold is an error even with ``allow_partial``:
        nothing is left on ``meta`` silently. (A record of ``meta`` tensors holds no data: applying
        it runs the checks only.)

        >>> net = torch.nn.Linear(2, 2)
        >>> ModuleRecord({"weight": torch.ones(2, 2)}).apply(net, allow_partial=True).weight.sum()
        tensor(4., grad_fn=<SumBackward0>)
        """
        if dtype_policy not in _DTYPE_POLICIES:
            raise ValueError(f"dtype_policy must be one of {_DTYPE_POLICIES}, not {dtype_policy!r}")
        incoming = self._incoming(module, adapter)
        targets = module.state_dict(keep_vars=True)
        apply_errors, missing, plan, skipped = [], [], [], []
        # a meta target's id -> its names; a record of meta tensors only checks (interop's dry run)
        data = any(not tensor.is_meta for tensor, _ in incoming.values())
        meta: dict[int, list[str]] = {}
        for name, target in targets.items():
            on_meta = data and isinstance(target, torch.Tensor) and target.is_meta
            if on_meta:
                meta.setdefault(id(target), []).append(name)
            if name not in incoming:
                if on_meta:
                    apply_errors.append(
                        f"Apply error: '{name}' is on the meta device and the record does not "
                        "hold it: it would stay without data (build it on a real device)"
                    )
                elif adapter is None or adapter.from_module(
                    name, target, owning_module(module, name)
                ):
                    missing.append(f"Missing tensor: '{name}'")
                continue
            tensor, pid = incoming[name]
            found = _mismatch(name, target, tensor, dtype_policy)
            if found is None:
                plan.append((target, tensor, pid))
            elif validate or not found[1]:
                apply_errors.append(f"Apply error: {found[0]}")
            else:
                skipped.append(found[0])
        problems = apply_errors
        if not allow_partial:
            problems += missing
        if not allow_unused:
            problems += [f"Unused tensor: '{n}'" for n in incoming if n not in targets]
        if problems:
            raise RecordError("validation", problems)
        if skipped:
            warnings.warn(
                f"validate=False skipped {len(skipped)} shape mismatches, which keep the "
                f"module's values: {'; '.join(skipped)}",
                stacklevel=2,
            )
        cast = dtype_policy == "cast_to_module"
        _load_all([p for p in plan if id(p[0]) not in meta], cast=cast)
        for target, tensor, pid in plan:
            if id(target) in meta:
                _materialise(module, meta.pop(id(target)), target, tensor, pid, cast)
        return module

    def _entries(self) -> list[tuple[str, torch.Tensor, int | None]]:
        """``(name, tensor, param id)`` for every stored name, then every alias."""
        entries = [(n, t, self.param_ids.get(n)) for n, t in self.tensors.items()]
        return entries + [
            (a, self.tensors[t], self.param_ids.get(t)) for a, t in self.aliases.items()
        ]

    def state_dict(self) -> OrderedDict[str, torch.Tensor]:
        """The record as torch's ``state_dict``: every name, tied aliases included (they share
        the stored tensor), for ``module.load_state_dict`` or inspection."""
        return OrderedDict((name, tensor) for name, tensor, _ in self._entries())

    def _incoming(
        self, module: nn.Module, adapter: Adapter | None
    ) -> dict[str, tuple[torch.Tensor, int | None]]:
        """Record entries (aliases expanded) by module name, through the adapter if any."""
        incoming: dict[str, tuple[torch.Tensor, int | None]] = {}
        duplicates = []
        for name, tensor, pid in self._entries():
            if adapter is not None:
                name, tensor = adapter.to_module(name, tensor, owning_module(module, name))
            if name in incoming:
                duplicates.append(f"'{name}': the adapter maps two record entries to this name")
            incoming[name] = (tensor, pid)
        if duplicates:
            raise RecordError("validation", duplicates)
        return incoming

    # -- burnpack content --

    @_parallel.gc_paused_call
    def to_content(self) -> tuple[Mapping[str, Any], Mapping[str, Any], Mapping[str, str]]:
        tensors = {
            name: burnpack.TensorEntry.from_tensor(t, param_id=self.param_ids.get(name))
            for name, t in self.tensors.items()
        }
        aliases = {ALIAS_PREFIX + a: t for a, t in self.aliases.items()}
        return tensors, {}, {**self.metadata, **aliases}

    @classmethod
    @_parallel.gc_paused_call
    def from_pack(cls, pack: burnpack.Pack) -> ModuleRecord:
        quantized = [
            n
            for n, info in pack.entries.items()
            if isinstance(info.dtype, dict) and "QFloat" in info.dtype
        ]
        if quantized:
            raise RecordError(
                "validation",
                [
                    f"{pack.source}: tensor '{n}' is quantized (QFloat), which torch cannot load"
                    for n in quantized
                ],
            )
        order = pack.data_order  # the writer's input order (Burn: the module's visiting order)
        every = pack.tensors()  # every checksum verified at once, on two threads
        tensors = {n: every[n] for n in order}
        pids = {n: e.param_id for n in order if (e := pack.entries[n]).param_id is not None}
        metadata = _user_metadata(pack)
        aliases = {
            k[len(ALIAS_PREFIX) :]: v for k, v in metadata.items() if k.startswith(ALIAS_PREFIX)
        }
        other = {k: v for k, v in metadata.items() if not k.startswith(ALIAS_PREFIX)}
        return cls(tensors, param_ids=pids, aliases=aliases, metadata=other)
