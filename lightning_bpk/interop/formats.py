"""Files from and for other tools: ``.safetensors`` <-> ``.bpk``, PyTorch/Lightning imports, export.

- ``.bpk`` <-> ``.safetensors``: tensors, dtypes (bf16, f16, bool, every int width) and string
  metadata carry over both ways. What safetensors cannot express (param ids, the burnpack data
  order, Burn-only dtypes such as ``Flex32`` or ``Bool(U32)``, typed scalars) travels in one
  safetensors metadata entry, :data:`SAFETENSORS_INFO_KEY` (JSON), so ``.bpk -> .safetensors ->
  .bpk`` gives back the same file. Quantized (QFloat) tensors have no safetensors form: refused.
- ``.pt``/``.pth`` (a ``state_dict``) and Lightning ``.ckpt`` files (their ``state_dict``) are
  read with ``torch.load(weights_only=True)`` only: never an arbitrary unpickler.
- :func:`export_checkpoint` writes a checkpointer checkpoint's ``model.bpk`` as safetensors,
  the format inference servers load.

Safetensors files are written here (not by the ``safetensors`` package) so they stream tensor by
tensor into :meth:`Store.sink <lightning_bpk.store.Store.sink>`, as ``.bpk`` files are
(:func:`lightning_bpk.records.files.save_pack`): durable, atomic, no second copy in memory.
Tensors are ordered as the ``safetensors`` package orders them (widest dtype first, then name),
so every tensor stays aligned to its element size; the official reader loads them.

Example::

    >>> import tempfile, torch
    >>> from lightning_bpk.records import ModuleRecord
    >>> d = tempfile.mkdtemp()
    >>> _ = ModuleRecord.from_module(torch.nn.Linear(2, 2)).save(d + "/m.bpk")
    >>> convert(d + "/m.bpk", d + "/m.safetensors").name
    'm.safetensors'
    >>> sorted(load_module_record(d + "/m.safetensors").tensors)
    ['bias', 'weight']
"""

from __future__ import annotations

import json
import os
import pickle
import struct
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from lightning_bpk import _device, burnpack
from lightning_bpk.dcp import is_sharded
from lightning_bpk.interop._mapped import (
    SAFETENSORS_INFO_KEY,
    burn_info,
    open_safetensors,
    st_name,
    st_order,
    st_shape,
)
from lightning_bpk.layout import MODEL_FILE
from lightning_bpk.records import files
from lightning_bpk.records.base import RECORD_KIND_KEY, RecordError
from lightning_bpk.records.module import ALIAS_PREFIX, ModuleRecord
from lightning_bpk.store import join, location, name_of, open_parent, open_store

__all__ = [
    "SAFETENSORS_INFO_KEY",
    "Content",
    "Progress",
    "convert",
    "export_checkpoint",
    "file_kind",
    "load_module_record",
    "read_content",
    "record_content",
    "register_set_reader",
    "save_module_record",
    "write_content",
]

_BPK_SUFFIXES = (".bpk",)
_SAFETENSORS_SUFFIXES = (".safetensors",)
_TORCH_SUFFIXES = (".pt", ".pth", ".ckpt", ".bin")  # torch.save output; read-only here
_ST_HEADER_ALIGN = 8  # safetensors pads its JSON header with spaces to a multiple of 8
ST_FORMAT_KEY, ST_FORMAT = "format", "pt"  # transformers 4.x refuses files without it

CHECKPOINT_MODEL_FILE = MODEL_FILE  # the file the Lightning callback saves weights in
# Storage of Burn's bool variants, for writing back a bool tensor in the variant it came in.
_BOOL_STORAGE = {"Native": torch.bool, "U8": torch.uint8, "U32": torch.uint32}

Progress = Callable[[int, int, str], None]
"""Called as ``progress(done, total, name)`` after each tensor of a long write."""


@dataclass
class Content:
    """A file's content in a format-neutral form: tensors in data order and what goes with them."""

    tensors: dict[str, torch.Tensor]
    param_ids: dict[str, int] = field(default_factory=dict)
    dtypes: dict[str, burnpack.DType] = field(default_factory=dict)  # only non-default Burn dtypes
    metadata: dict[str, str] = field(default_factory=dict)
    scalars: dict[str, burnpack.Scalar] = field(default_factory=dict)


def file_kind(path: Path) -> str:
    """The format a path's suffix says: ``bpk``, ``safetensors`` or ``torch``; RecordError else."""
    suffix = path.suffix.lower()
    for kind, suffixes in (
        ("bpk", _BPK_SUFFIXES),
        ("safetensors", _SAFETENSORS_SUFFIXES),
        ("torch", _TORCH_SUFFIXES),
    ):
        if suffix in suffixes:
            return kind
    known = _BPK_SUFFIXES + _SAFETENSORS_SUFFIXES + _TORCH_SUFFIXES
    raise RecordError("io", f"{path}: unknown suffix {suffix!r} (expected one of {known})")


# --- burnpack ------------------------------------------------------------------------------------


def _read_bpk(path: Path | str, options: Options) -> Content:
    """A burnpack's content (tensors are zero-copy, checksum-verified views of the file), read
    by the package's one record-file reader
    (:func:`lightning_bpk.records.files.open_record`)."""
    try:
        with files.open_record(path, options) as pack:
            quantized = [n for n, i in pack.entries.items() if _is_quantized(i.dtype)]
            if quantized:
                raise RecordError(
                    "validation",
                    [f"{pack.source}: tensor '{n}' is quantized (QFloat)" for n in quantized],
                )
            tensors = {n: pack.tensor(n) for n in pack.data_order}
            entries = pack.entries
            return Content(
                tensors,
                param_ids={n: e.param_id for n, e in entries.items() if e.param_id is not None},
                dtypes={
                    n: entries[n].dtype
                    for n, t in tensors.items()
                    if _default_dtype(t.dtype) != entries[n].dtype
                },
                metadata=dict(pack.metadata),
                scalars=dict(pack.scalars),
            )
    except burnpack.BurnpackError as e:
        raise RecordError.from_format_error(e) from e


def _default_dtype(dtype: torch.dtype) -> burnpack.DType | None:
    """The Burn dtype a tensor of ``dtype`` is written as by default (a carried one's stand-in:
    :meth:`burnpack.TensorEntry.from_tensor`); ``None`` where there is none."""
    try:
        return burnpack.TensorEntry.from_tensor(_device.empty((0,), dtype)).dtype
    except burnpack.ValidationError:
        return None


def _is_quantized(dtype: burnpack.DType) -> bool:
    return isinstance(dtype, dict) and "QFloat" in dtype


def _write_bpk(path: Path | str, content: Content, progress: Progress | None = None) -> Path | str:
    """Write ``content`` as a burnpack file, durably and whole, through the package's one
    ``.bpk`` writer (:func:`lightning_bpk.records.files.save_pack`)."""
    total = len(content.tensors)
    entries, problems = [], []
    for k, (name, tensor) in enumerate(content.tensors.items()):
        dtype = content.dtypes.get(name)
        data = tensor
        if isinstance(dtype, dict) and "Bool" in dtype:
            data = tensor.to(_BOOL_STORAGE[dtype["Bool"]])
        try:
            entry = burnpack.TensorEntry.from_tensor(data, content.param_ids.get(name))
        except burnpack.ValidationError as e:
            problems.append(f"{path}: tensor '{name}': {e}")
            continue
        if dtype is not None:
            entry.dtype = dtype
        entry.data = _reporting(data, k + 1, total, name, progress)
        entries.append((name, entry))
    if problems:
        raise RecordError("validation", problems)
    store, key = open_parent(path)
    try:
        files.save_pack(store, key, entries, metadata=content.metadata, scalars=content.scalars)
    except burnpack.BurnpackError as e:
        raise RecordError.from_format_error(e) from e
    return path


def _reporting(
    tensor: torch.Tensor, done: int, total: int, name: str, progress: Progress | None
) -> Callable[[], torch.Tensor]:
    """A deferred provider returning ``tensor``, reporting progress as the write reaches it."""

    def provide() -> torch.Tensor:
        if progress is not None:
            progress(done, total, name)
        return tensor

    return provide


# --- safetensors ---------------------------------------------------------------------------------


def _read_safetensors(path: Path | str, options: Options) -> Content:
    """A safetensors file's content, mapped through its store (zero-copy views of the file on
    local disk, fetched ranges at a URL), its header checked before use; param ids, order,
    Burn dtypes and scalars come back from :data:`SAFETENSORS_INFO_KEY` when the file was
    written from a burnpack."""
    try:
        with open_safetensors(path, options) as file:
            metadata = dict(file.metadata)
            tensors = {name: file.tensor(name) for name in sorted(file.specs)}
    except RecordError as e:
        if e.kind == "io":
            raise
        problems = "; ".join(e.problems)
        raise RecordError("io", f"{path}: not a readable safetensors file: {problems}") from e
    info = burn_info(metadata.pop(SAFETENSORS_INFO_KEY, None), path)
    if info is None:  # a foreign file, or one needing no more: names sorted
        metadata.setdefault(RECORD_KIND_KEY, ModuleRecord.kind)
        return Content(tensors, metadata=metadata)
    if info.format_added:
        metadata.pop(ST_FORMAT_KEY, None)
    if info.order is None or sorted(info.order) != sorted(tensors):
        raise RecordError(
            "validation",
            f"{path}: bad {SAFETENSORS_INFO_KEY} entry: its tensor list does not match the "
            "file's tensors",
        )
    return Content(
        {n: tensors[n] for n in info.order},
        param_ids=info.param_ids,
        dtypes=info.dtypes,
        metadata=metadata,
        scalars=info.scalars,
    )


def _write_safetensors(
    path: Path | str, content: Content, progress: Progress | None = None
) -> Path | str:
    """Write ``content`` as a safetensors file, durably and whole, streaming one tensor at a
    time into the store's sink, laid out as the ``safetensors`` package lays it out."""
    dtypes, problems = {}, []
    for name, tensor in content.tensors.items():
        try:
            dtypes[name] = st_name(tensor.dtype)
        except ValueError as e:
            problems.append(f"{path}: tensor '{name}': {e}")
    if problems:
        raise RecordError("validation", problems)
    order = st_order(dtypes)
    header: dict[str, Any] = {}
    metadata = _st_metadata(content)
    if metadata:
        header["__metadata__"] = metadata
    offset = 0
    for name in order:
        t = content.tensors[name]
        nbytes = t.numel() * t.element_size()
        header[name] = {
            "dtype": dtypes[name],
            "shape": list(st_shape(dtypes[name], tuple(t.shape), to_torch=False)),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    blob = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    blob += b" " * (-len(blob) % _ST_HEADER_ALIGN)
    store, key = open_parent(path)
    head = struct.pack("<Q", len(blob)) + blob
    try:
        with store.sink(key, len(head) + offset) as sink:
            sink.write(head)
            for k, name in enumerate(order):
                sink.write(burnpack.tensor_bytes(content.tensors[name]))
                if progress is not None:
                    progress(k + 1, len(order), name)
            sink.finish()
    except OSError as e:
        raise RecordError("io", f"cannot write {path}: {e.strerror or e}") from e
    return path


def _st_metadata(content: Content) -> dict[str, str]:
    """The ``__metadata__`` of a safetensors file holding ``content``: ``"format": "pt"`` (which
    transformers 4.x needs) and its metadata; :data:`SAFETENSORS_INFO_KEY` only when something
    safetensors cannot say is there (param ids, Burn dtypes, scalars, an order other than the
    reader's sorted names, a ``format`` entry added here, which the reader then drops), and
    else no module record kind (what the reader assumes). A file transformers wrote (the
    ``safetensors`` package, ``{"format": "pt"}``) thus converts back byte-identically, as does
    a ``.bpk``."""
    metadata = {ST_FORMAT_KEY: ST_FORMAT, **content.metadata}
    order = list(content.tensors)
    added = ST_FORMAT_KEY not in content.metadata
    if added or content.param_ids or content.dtypes or content.scalars or order != sorted(order):
        info: dict[str, Any] = {
            "order": order,
            "format_added": added,
            "param_ids": {n: str(v) for n, v in content.param_ids.items()},
            "dtypes": content.dtypes,
            "scalars": {
                n: [s.kind, float(s.value).hex() if s.kind == "Float" else s.value]
                for n, s in content.scalars.items()
            },
        }
        metadata[SAFETENSORS_INFO_KEY] = json.dumps(info)
    elif metadata.get(RECORD_KIND_KEY) == ModuleRecord.kind:
        del metadata[RECORD_KIND_KEY]
    return metadata


# --- torch.save files ----------------------------------------------------------------------------

NO_PICKLE_ADVICE = (
    "lightning_bpk unpickles nothing but tensors and plain data (anything else could run code "
    "from the file), so there is no weights_only=False fallback; where the file is trusted, save "
    "just its tensors (torch.save(model.state_dict(), ...)) or convert them to .safetensors, and "
    "import that"
)
"""Why a pickle that needs more than tensors and plain data is refused, and what to do instead."""

# Lines of torch's weights-only refusal that advise loading anyway (weights_only=False) or point
# elsewhere, rather than saying what the file holds.
_TORCH_ADVICE = ("Weights only load failed", "(1)", "(2)", "Check the documentation")


def _refusal_reason(error: pickle.UnpicklingError) -> str:
    """What torch's weights-only unpickler refused (``Unsupported global: GLOBAL x.Y ...``),
    without its advice to retry with ``weights_only=False`` or to allowlist the global."""
    for line in str(error).splitlines():
        text = line.strip()
        if text.startswith(_TORCH_ADVICE):
            continue
        text = text.split("WeightsUnpickler error:")[-1].split(" Please use")[0].strip()
        if text:
            return text
    return "an object that is neither a tensor nor plain data"


def _torch_load(loc: Path | str, options: Options) -> Any:
    """``torch.load(weights_only=True)`` of the file at ``loc``, opened through its store."""
    with open_store(loc, options, follow_links=True).open_file("") as file:
        return torch.load(file, map_location="cpu", weights_only=True)


def _read_torch(loc: Path | str, options: Options) -> Content:
    """The ``state_dict`` of a ``torch.save`` file or Lightning ``.ckpt``, loaded with
    ``weights_only=True`` (so no code in the file can run). Non-tensor entries are refused.

    A file whose pickle needs more than tensors and plain data is refused for good: unpickling
    it could run code, and this package never does (no ``weights_only=False`` fallback).
    The file is read through its store (:meth:`~lightning_bpk.store.Store.open_file`: a local
    file, or an object read in ranges), one tensor's storage at a time.
    """
    try:
        obj = _torch_load(loc, options)
    except pickle.UnpicklingError as e:
        # `from None`: torch's own message advises weights_only=False, which is not an option
        raise RecordError(
            "io",
            f"{loc}: refused to unpickle: torch.load(weights_only=True) stopped at "
            f"{_refusal_reason(e)!r}. {NO_PICKLE_ADVICE}",
        ) from None
    except Exception as e:  # torch raises RuntimeError, EOFError, OSError...
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise RecordError("io", f"{loc}: torch.load(weights_only=True) failed: {first}") from e
    state = obj.get("state_dict") if isinstance(obj, Mapping) else None
    if not isinstance(state, Mapping):
        state = obj
    if not isinstance(state, Mapping):
        raise RecordError("validation", f"{loc}: holds a {type(obj).__name__}, not a state_dict")
    problems = [
        f"{loc}: entry {k!r} is a {type(v).__name__}, not a tensor"
        for k, v in state.items()
        if not isinstance(k, str) or not isinstance(v, torch.Tensor)
    ]
    if problems:
        raise RecordError("validation", problems)
    return Content(dict(state), metadata={RECORD_KIND_KEY: ModuleRecord.kind})


# --- records and conversion ----------------------------------------------------------------------

_READERS = {"bpk": _read_bpk, "safetensors": _read_safetensors, "torch": _read_torch}
_WRITERS = {"bpk": _write_bpk, "safetensors": _write_safetensors}


Options = Mapping[str, Any] | None
"""``storage_options`` for fsspec (credentials, endpoint) of a URL; ignored for a local path."""
SetReader = Callable[[Path | str, Options], "Content | None"]
_set_readers: list[SetReader] = []


def register_set_reader(reader: SetReader) -> None:
    """Let :func:`read_content` (and so :func:`convert`, :func:`load_module_record`) read a
    checkpoint set: ``reader(path, storage_options)`` returns its content, or ``None`` when
    ``path`` is not one. :mod:`lightning_bpk.interop.sets`, which sits above this module,
    registers itself."""
    if reader not in _set_readers:
        _set_readers.append(reader)


def _read_set(path: Path | str, options: Options) -> Content | None:
    for reader in _set_readers:
        content = reader(path, options)
        if content is not None:
            return content
    return None


def read_content(
    path: str | os.PathLike[str],
    *,
    device: str | torch.device = "cpu",
    storage_options: Options = None,
) -> Content:
    """Read ``.bpk``, ``.safetensors`` or a ``torch.save`` file (by suffix), a checkpoint set
    (an index or its directory: see :mod:`lightning_bpk.interop.sets`), or the model of a
    sharded checkpoint directory, assembled from every rank's shards; on local disk or at a
    URL (``storage_options`` go to fsspec), through its store (a ``torch.save`` file: local
    disk only).

    ``device``: where the tensors go, ``cpu`` or a CUDA device (checked before anything is
    read; a ``ValueError`` names any other). They are read and verified on the host, then
    copied to a CUDA device through reused pinned bounce buffers."""
    target = _device.target_device(device)
    content = _read_content(location(path), storage_options)
    if target.type != "cpu":
        content.tensors = _device.to_device(content.tensors, target)
    return content


def _read_content(loc: Path | str, options: Options) -> Content:
    """:func:`read_content` on the host."""
    content = _read_set(loc, options)
    if content is not None:
        return content
    if is_sharded(loc, storage_options=options):
        from lightning_bpk.dcp import module_record  # torch.distributed: imported on use

        return record_content(module_record(loc, storage_options=options))
    loc = _directory_file(loc, options)
    return _READERS[file_kind(Path(name_of(loc)))](loc, options)


def _directory_file(loc: Path | str, options: Options) -> Path | str:
    """The file a directory stands for: a checkpoint directory's model file, else its one
    file of a known suffix (a model downloaded into a folder); ``loc`` itself when it is not
    a directory. A directory with none, or several, is a ``RecordError`` listing them."""
    store = open_store(loc, options)
    if store.size("") is not None:
        return loc
    entries = store.list("")
    if not entries:
        return loc  # nothing there: the reader names the missing file
    if entries.get(CHECKPOINT_MODEL_FILE) is not None:
        return join(loc, CHECKPOINT_MODEL_FILE)
    known = _BPK_SUFFIXES + _SAFETENSORS_SUFFIXES + _TORCH_SUFFIXES
    found = sorted(
        n for n, size in entries.items() if size is not None and Path(n).suffix.lower() in known
    )
    if len(found) != 1:
        what = f"{len(found)} files of a known suffix ({', '.join(found)})" if found else "none"
        raise RecordError(
            "io", f"{loc}: a directory read as one file must hold one model file; it holds {what}"
        )
    return join(loc, found[0])


def write_content(
    path: str | os.PathLike[str], content: Content, progress: Progress | None = None
) -> Path | str:
    """Write ``.bpk`` or ``.safetensors`` (by suffix) at a path or URL, through its
    :class:`~lightning_bpk.store.Store`; torch files are never written. Returns the location."""
    loc = location(path)
    kind = file_kind(Path(name_of(loc)))
    if kind not in _WRITERS:
        suffix = Path(name_of(loc)).suffix
        raise RecordError(
            "io", f"{loc}: {suffix} is an import format only; write .bpk or .safetensors"
        )
    return _WRITERS[kind](loc, content, progress)


def convert(
    src: str | os.PathLike[str], dst: str | os.PathLike[str], progress: Progress | None = None
) -> Path | str:
    """Convert between formats by suffix: ``.bpk``/``.safetensors``/``.pt``/``.ckpt`` to
    ``.bpk``/``.safetensors``; a checkpoint directory stands for its ``model.bpk``, a sharded
    one for its model assembled from every rank's shards (no process group). ``dst`` may be a
    URL (written through its store). Returns where it was written."""
    loc = location(src)
    content = _read_set(loc, None)
    if content is not None:
        return write_content(dst, content, progress)
    if open_store(loc).size("") is None and open_store(loc).list("") and not is_sharded(loc):
        loc = join(loc, CHECKPOINT_MODEL_FILE)  # a checkpoint directory: its model
        if open_store(loc).size("") is None:
            raise RecordError("io", f"{loc}: no such model file in the checkpoint directory")
    return write_content(dst, read_content(loc), progress)


def load_module_record(
    path: str | os.PathLike[str],
    *,
    device: str | torch.device = "cpu",
    storage_options: Mapping[str, Any] | None = None,
) -> ModuleRecord:
    """A :class:`ModuleRecord` from any supported file or checkpoint set, its tensors on
    ``device`` (see :func:`read_content`). A ``.bpk`` file, local or at a URL
    (``storage_options`` go to fsspec), is read by ``ModuleRecord.load``: the package's one
    record-file reader, so a damaged tensor is a
    :class:`~lightning_bpk.records.RecordChecksumError` here as there."""
    loc = location(path)
    is_file = open_store(loc, storage_options).size("") is not None  # not a folder named *.bpk
    if Path(name_of(loc)).suffix.lower() == ".bpk" and is_file:
        return ModuleRecord.load(loc, device=device, storage_options=storage_options)
    content = read_content(path, device=device, storage_options=storage_options)
    kind = content.metadata.pop(RECORD_KIND_KEY, ModuleRecord.kind)
    if kind != ModuleRecord.kind:
        raise RecordError("validation", f"{path} holds a {kind!r} record, not 'module'")
    aliases = {
        k[len(ALIAS_PREFIX) :]: v for k, v in content.metadata.items() if k.startswith(ALIAS_PREFIX)
    }
    metadata = {k: v for k, v in content.metadata.items() if not k.startswith(ALIAS_PREFIX)}
    return ModuleRecord(
        content.tensors, param_ids=content.param_ids, aliases=aliases, metadata=metadata
    )


def save_module_record(record: ModuleRecord, path: str | os.PathLike[str]) -> Path:
    """Save a :class:`ModuleRecord` as ``.bpk`` or ``.safetensors`` (by suffix)."""
    path = Path(path)
    if file_kind(path) == "bpk":
        return Path(record.save(path))
    return Path(write_content(path, record_content(record)))


def record_content(record: ModuleRecord) -> Content:
    """A :class:`ModuleRecord` as a :class:`Content` (its tensors, ids and metadata)."""
    tensors, _, metadata = record.content()
    return Content(
        {n: e.data for n, e in tensors.items()},
        param_ids={n: e.param_id for n, e in tensors.items() if e.param_id is not None},
        metadata=dict(metadata),
    )


def export_checkpoint(
    checkpoint: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    *,
    progress: Progress | None = None,
) -> Path | str:
    """Write a checkpoint's model as safetensors for serving.

    ``checkpoint`` is a checkpointer checkpoint directory (``{base}/{prefix}.{N}/``, whose
    ``model.bpk`` is exported) or a ``.bpk`` file; ``dst`` must end in ``.safetensors``.
    """
    dst = Path(dst)
    if file_kind(dst) != "safetensors":
        raise RecordError("io", f"{dst}: export writes .safetensors")
    return convert(checkpoint, dst, progress)
