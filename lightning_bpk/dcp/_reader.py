"""The reading half of the DCP storage layer: :class:`BurnpackStorageReader`, and loading a
whole checkpoint in one process without a process group (:func:`load_full_state_dict`,
:func:`load_nested`, :func:`module_record`)."""

from __future__ import annotations

import io
import itertools
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import LoadPlan, LoadPlanner, Metadata, StorageReader
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import LoadItemType
from torch.futures import Future

from lightning_bpk import _device, burnpack
from lightning_bpk.dcp import ShardedCheckpointError, is_sharded
from lightning_bpk.dcp._packs import Index, _object, _opened, _Packs, read_index, servable
from lightning_bpk.errors import summarise
from lightning_bpk.layout import MODEL_KEY, PARAM_IDS_KEY, SHARDED_PREFIX
from lightning_bpk.records import ModuleRecord
from lightning_bpk.store import location


class BurnpackStorageReader(StorageReader):
    """DCP storage reader for checkpoints written by :class:`BurnpackStorageWriter`.

    Each rank opens only the rank files holding chunks it needs and copies the overlapping
    part of each chunk into its own tensors; every tensor read is checked against its xxh3
    checksum (``verify=False`` skips that). ``path`` may be an object-store URL
    (``storage_options`` go to fsspec): then only the heads of those files and the byte ranges
    of those chunks are fetched.
    """

    def __init__(
        self,
        path: str | os.PathLike[str] | None = None,
        *,
        prefix: str = SHARDED_PREFIX,
        verify: bool = True,
        storage_options: Mapping[str, Any] | None = None,
    ) -> None:
        super().__init__()
        self.path = None if path is None else location(path)
        self.prefix = prefix
        self.verify = verify
        self.storage_options = storage_options
        self.index: Index | None = None
        self.storage_data: dict[MetadataIndex, tuple[str, str]] = {}

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        if checkpoint_id:
            self.path = location(checkpoint_id)
        self.index = None
        self.storage_data = {}

    @property
    def checkpoint_id(self) -> Path | str | None:
        return self.path

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if self.path is None:
            raise ShardedCheckpointError("no checkpoint directory: pass path or checkpoint_id")
        self.index = read_index(self.path, self.prefix, self.storage_options)
        problems = self.index.check_files()
        if problems:
            raise ShardedCheckpointError(summarise(problems))
        return self.index.metadata()

    def set_up_storage_reader(
        self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any
    ) -> None:
        if self.index is None:  # DCP always reads the metadata first; be safe if not
            self.read_metadata()
        self.storage_data = metadata.storage_data

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        assert self.index is not None
        with _opened(self.index, self.verify) as packs:
            for req in sorted(plan.items, key=lambda r: self.storage_data[r.storage_index]):
                file, name = self.storage_data[req.storage_index]
                if req.type == LoadItemType.BYTE_IO:
                    value = _object(packs, file, name, req.storage_index.fqn)
                    buffer = io.BytesIO()
                    torch.save(value, buffer)  # the planner's interface; made here, not read
                    buffer.seek(0)
                    planner.load_bytes(req, buffer)
                    continue
                target = planner.resolve_tensor(req).detach()
                whole = not any(req.storage_offsets)  # same layout: one read, no extra copy
                if not (whole and packs.read_into(file, name, target)):
                    self._copy_part(packs, file, name, req, target)
                planner.commit_tensor(req, target)
        future: Future[None] = Future()
        future.set_result(None)
        return future

    @staticmethod
    def _copy_part(packs: _Packs, file: str, name: str, req: Any, target: torch.Tensor) -> None:
        """Copy the part of a stored chunk that ``req`` asks for (another layout) into target."""
        stored = packs.tensor(file, name)
        for dim, (start, length) in enumerate(zip(req.storage_offsets, req.lengths, strict=True)):
            stored = stored.narrow(dim, start, length)
        if target.size() != stored.size():
            raise ShardedCheckpointError(
                f"{file}: chunk '{name}' gives {list(stored.size())}, the target "
                f"{list(target.size())}"
            )
        with torch.no_grad():
            target.copy_(stored)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        try:
            return servable(checkpoint_id) and is_sharded(checkpoint_id)
        except OSError:
            return False


# --- without a process group ----------------------------------------------------------------------


def load_full_state_dict(
    directory: str | os.PathLike[str],
    *,
    prefix: str = SHARDED_PREFIX,
    verify: bool = True,
    storage_options: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The full (unsharded) flat state dict of a sharded checkpoint, in this process alone.

    Keys are DCP's flattened keys (``state_dict.layer.weight``, ``optimizer_0.state...``); each
    tensor is assembled from its chunks, whatever the world size that saved it. Objects come back
    as their plain-data values. No process group is needed. ``directory`` may be a URL.
    """
    index = read_index(directory, prefix, storage_options)
    problems = index.check_files()
    if problems:
        raise ShardedCheckpointError(summarise(problems))
    out: dict[str, Any] = {}
    with _opened(index, verify) as packs:
        for fqn, t in index.tensors.items():  # read_index checked that the chunks tile it
            full = _device.empty(t["shape"], burnpack._torch_dtype(t["dtype"]))
            for c in t["chunks"]:
                region = full
                for dim, (start, length) in enumerate(zip(c["offsets"], c["sizes"], strict=True)):
                    region = region.narrow(dim, start, length)
                region.copy_(packs.tensor(c["file"], c["name"]))
            out[fqn] = full
        for fqn, o in index.objects.items():
            out[fqn] = _object(packs, o["file"], o["name"], fqn)
    return out


def _put(root: dict, path: tuple, value: Any) -> None:
    """Set ``value`` at ``path`` (keys and list indices) in ``root``, creating what is missing."""
    node: Any = root
    for key, following in itertools.pairwise(path):
        if isinstance(node, list):
            node.extend([None] * (key + 1 - len(node)))
        child = node[key] if isinstance(node, list) else node.get(key)
        if child is None:
            child = [] if isinstance(following, int) else {}
            node[key] = child
        node = child
    if isinstance(node, list):
        node.extend([None] * (path[-1] + 1 - len(node)))
    node[path[-1]] = value


def load_nested(
    directory: str | os.PathLike[str],
    *,
    prefix: str = SHARDED_PREFIX,
    verify: bool = True,
    storage_options: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The state dict as it was saved (nested again by the planner's key paths), every tensor
    full-size, in this process alone (``directory`` may be a URL).

    >>> import tempfile, torch, torch.distributed.checkpoint as dcp
    >>> from lightning_bpk.dcp import BurnpackStorageWriter
    >>> path = tempfile.mkdtemp()
    >>> state = {"opt": {"groups": [{"lr": 0.1}], "w": torch.ones(2)}}
    >>> _ = dcp.save(state, storage_writer=BurnpackStorageWriter(path))
    >>> load_nested(path)["opt"]["groups"]
    [{'lr': 0.1}]
    """
    flat = load_full_state_dict(
        directory, prefix=prefix, verify=verify, storage_options=storage_options
    )
    mapping = read_index(directory, prefix, storage_options).metadata().planner_data
    if not isinstance(mapping, dict):
        return flat
    nested: dict[str, Any] = {}
    for key, value in flat.items():
        path = mapping.get(key, (key,))
        _put(nested, tuple(path), value)
    return nested


def module_record(
    path: str | os.PathLike[str],
    *,
    verify: bool = True,
    storage_options: Mapping[str, Any] | None = None,
) -> ModuleRecord:
    """The model of a sharded checkpoint as one unsharded :class:`ModuleRecord`, assembled in this
    process without a process group (what ``lightning-bpk convert`` writes; ``.apply(module)``
    loads it into a plain ``nn.Module``). Tensors equal the gathered full state dict.

    A DCP checkpoint written without this package's callback (no ``model.`` keys) gives every
    tensor under its flattened DCP key.
    """
    full = load_full_state_dict(path, verify=verify, storage_options=storage_options)
    tensors = {k: v for k, v in full.items() if isinstance(v, torch.Tensor)}
    model = {
        k[len(MODEL_KEY) + 1 :]: v for k, v in tensors.items() if k.startswith(MODEL_KEY + ".")
    }
    if not model:
        return ModuleRecord(tensors)
    prefix = PARAM_IDS_KEY + "."
    ids = {k[len(prefix) :]: v for k, v in full.items() if k.startswith(prefix)}
    return ModuleRecord(model, param_ids={k: v for k, v in ids.items() if k in model})
