"""Writing burnpack files and bytes: planning offsets, streaming tensors, atomic writes."""

from __future__ import annotations

import contextlib
import functools
import math
import os
import struct
from collections.abc import Callable, Iterable, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import cbor2
import torch
import xxhash

from lightning_bpk import _fs
from lightning_bpk.burnpack import _parallel
from lightning_bpk.burnpack.base import (
    _CHECKSUM_PLACEHOLDER,
    _FORMAT_VERSION,
    _I64_MAX,
    _MAGIC_BYTES,
    _QFLOAT,
    _TORCH_DTYPE_KEY,
    _U32_MAX,
    _U64_MAX,
    CHECKSUM_PREFIX,
    HEADER_SIZE,
    TENSOR_ALIGNMENT,
    BurnpackError,
    BurnpackIOError,
    MetadataError,
    Scalar,
    SizeMismatchError,
    ValidationError,
    _carried_spec,
    _dtype_info,
)
from lightning_bpk.burnpack.entry import TensorEntry, _as_bytes

__all__ = [
    "TensorsArg",
    "data_section_start",
    "dumps",
    "offsets",
    "size",
    "write",
]


# --- Writing ------------------------------------------------------------------------------------


class _Float:
    """A float to be encoded in the smallest lossless CBOR width (as ciborium does)."""

    __slots__ = ("encoded",)

    def __init__(self, value: float) -> None:
        bits = struct.pack(">d", value)
        for code, fmt in ((b"\xf9", ">e"), (b"\xfa", ">f")):
            try:
                narrow = struct.pack(fmt, value)
            except OverflowError:
                continue
            if struct.pack(">d", struct.unpack(fmt, narrow)[0]) == bits:
                self.encoded = code + narrow
                return
        self.encoded = b"\xfb" + bits


def _encode_default(encoder: cbor2.CBOREncoder, value: object) -> None:
    if isinstance(value, _Float):
        encoder.write(value.encoded)
        return
    raise MetadataError(f"cannot encode {type(value).__name__} in burnpack metadata")


def _cbor_value(value: Any) -> Any:
    """Prepare a dtype value (possibly QFloat's nested struct) for encoding, floats narrowed."""
    if isinstance(value, float):
        return _Float(value)
    if isinstance(value, dict):
        return {k: _cbor_value(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_cbor_value(v) for v in value]
    return value


@dataclass
class _Planned:
    name: str
    entry: TensorEntry
    start: int  # relative to the data section
    end: int


@dataclass
class _Plan:
    tensors: list[_Planned]
    metadata: dict[str, str]
    scalars: dict[str, Scalar]
    checksums: bool
    encoded: bytes = b""  # the metadata blob (checksum placeholders), set once planning succeeds
    # offset in ``encoded`` of each tensor's checksum placeholder, by tensor name
    digest_offsets: dict[str, int] = field(default_factory=dict)

    def encode_metadata(self) -> None:
        """Encode the metadata once, with placeholders, and find where each digest goes.

        Digests are patched into ``encoded`` in place after the data is written (re-encoding
        would cost as much again: ~10 ms for 5,000 tensors).
        """
        descriptors = {}
        for p in sorted(self.tensors, key=lambda p: p.name):
            desc: dict[str, Any] = {
                "dtype": _cbor_value(p.entry.dtype),
                "shape": list(p.entry.shape),
                "data_offsets": [p.start, p.end],
            }
            if p.entry.param_id is not None:
                desc["param_id"] = p.entry.param_id
            if p.entry.torch_dtype is not None:
                desc[_TORCH_DTYPE_KEY] = p.entry.torch_dtype
            descriptors[p.name] = desc
        top: dict[str, Any] = {"tensors": descriptors}
        metadata = dict(self.metadata)
        if self.checksums:
            for p in self.tensors:
                metadata[CHECKSUM_PREFIX + p.name] = _CHECKSUM_PLACEHOLDER
        keys = sorted(metadata)
        if metadata:
            top["metadata"] = {k: metadata[k] for k in keys}
        if self.scalars:
            top["scalars"] = {
                k: {s.kind: _Float(s.value) if s.kind == "Float" else s.value}
                for k, s in sorted(self.scalars.items())
            }
        self.encoded = _cbor(top)
        if not (self.checksums and self.tensors):
            return
        # Keys sharing the prefix are adjacent once sorted, so the checksum entries are one run
        # of the metadata map; what follows the run (later user keys, then the scalars) is
        # encoded on its own to find where the run ends.
        first = next(i for i, k in enumerate(keys) if k.startswith(CHECKSUM_PREFIX))
        after = first + len(self.tensors)
        tail = sum(len(_cbor(k)) + len(_cbor(metadata[k])) for k in keys[after:])
        if "scalars" in top:
            tail += len(_cbor("scalars")) + len(_cbor(top["scalars"]))
        position = len(self.encoded) - tail
        value_size = len(_cbor(_CHECKSUM_PLACEHOLDER))
        for key in reversed(keys[first:after]):
            position -= value_size  # the digest text: a 1-byte header, then 16 hex digits
            self.digest_offsets[key[len(CHECKSUM_PREFIX) :]] = position + 1
            position -= _text_size(key)

    def patched(self, digests: Mapping[str, str]) -> bytearray:
        """``encoded`` with every placeholder replaced by its tensor's digest."""
        blob = bytearray(self.encoded)
        for name, offset in self.digest_offsets.items():
            blob[offset : offset + len(_CHECKSUM_PLACEHOLDER)] = digests[name].encode()
        return blob

    @property
    def data_size(self) -> int:
        return self.tensors[-1].end if self.tensors else 0


def _cbor(value: Any) -> bytes:
    return cbor2.dumps(value, default=_encode_default)


def _text_size(text: str) -> int:
    """Bytes of ``text`` encoded as a CBOR text string: header (1-9 bytes, minimal) + UTF-8."""
    n = len(text.encode())
    return n + (1 if n < 24 else 2 if n < 2**8 else 3 if n < 2**16 else 5 if n < 2**32 else 9)


def _align(n: int) -> int:
    return -(-n // TENSOR_ALIGNMENT) * TENSOR_ALIGNMENT


def data_section_start(metadata_size: int) -> int:
    """Absolute offset of the data section for a metadata blob of ``metadata_size`` bytes.

    >>> [data_section_start(m) for m in (0, 246, 247)]
    [256, 256, 512]
    """
    return _align(HEADER_SIZE + metadata_size)


TensorsArg = Mapping[str, torch.Tensor | TensorEntry] | Iterable[tuple]
"""The tensors of :func:`write`, :func:`dumps` and :func:`size`: a mapping of name to tensor or
:class:`TensorEntry`, or ``(name, tensor or entry)`` pairs (written in that order; a name may
appear once)."""


@_parallel.gc_paused_call  # one object per tensor: see burnpack._parallel
def _plan(
    tensors: TensorsArg,
    metadata: Mapping[str, str] | None,
    scalars: Mapping[str, Any] | None,
    checksums: bool,
) -> _Plan:
    items = tensors.items() if isinstance(tensors, Mapping) else tensors
    planned: list[_Planned] = []
    seen: set[str] = set()
    offset = 0
    for name, value in items:
        if not isinstance(name, str):
            raise ValidationError(f"tensor name {name!r} is not a string")
        if name in seen:
            raise ValidationError(f"Duplicate tensor name '{name}'")
        seen.add(name)
        entry = value if isinstance(value, TensorEntry) else None
        if entry is None:
            if not isinstance(value, torch.Tensor):
                raise ValidationError(
                    f"tensor '{name}': expected a torch.Tensor or TensorEntry, "
                    f"got {type(value).__name__}"
                )
            try:
                entry = TensorEntry.from_tensor(value)
            except ValidationError as e:
                raise ValidationError(f"tensor '{name}': {e}") from None
        _check_entry(name, entry)
        start = _align(offset)
        planned.append(_Planned(name, entry, start, start + entry.nbytes))
        offset = start + entry.nbytes
    meta = dict(metadata or {})
    for k, v in meta.items():
        if not isinstance(k, str) or not isinstance(v, str):
            raise ValidationError(f"metadata entry {k!r}: keys and values must be strings")
        if k.startswith(CHECKSUM_PREFIX):
            raise ValidationError(
                f"metadata key {k!r} uses the reserved prefix {CHECKSUM_PREFIX!r}"
            )
    scal = {}
    for k, v in (scalars or {}).items():
        if not isinstance(k, str):
            raise ValidationError(f"scalar name {k!r} is not a string")
        try:
            scal[k] = Scalar.coerce(v)
        except (TypeError, ValueError) as e:
            raise ValidationError(f"scalar '{k}': {e}") from None
    plan = _Plan(planned, meta, scal, checksums)
    try:
        plan.encode_metadata()
    except UnicodeEncodeError as e:  # lone surrogates cannot be stored as UTF-8 text
        raise ValidationError(f"{e.object!r} is not valid UTF-8 text: {e.reason}") from None
    if len(plan.encoded) > _U32_MAX:
        raise BurnpackIOError(f"metadata of {len(plan.encoded)} bytes does not fit the u32 header")
    return plan


def _check_entry(name: str, entry: TensorEntry) -> None:
    info = _dtype_info(entry.dtype)
    if info is None:
        raise ValidationError(f"tensor '{name}': unknown dtype {entry.dtype!r}")
    if any(not 0 <= d <= _I64_MAX for d in entry.shape):
        raise ValidationError(
            f"tensor '{name}': shape {list(entry.shape)} has a negative or over-i64 dim"
        )
    if entry.torch_dtype is not None and (
        _carried_spec(entry.torch_dtype, entry.dtype, entry.shape) is None
    ):
        raise ValidationError(
            f"tensor '{name}': torch_dtype {entry.torch_dtype!r} is not a torch dtype stored as "
            f"{entry.dtype!r} with shape {list(entry.shape)}"
        )
    if entry.param_id is not None and not (
        isinstance(entry.param_id, int) and 0 <= entry.param_id <= _U64_MAX
    ):
        raise ValidationError(f"tensor '{name}': param_id {entry.param_id!r} is not a u64")
    if info is not _QFLOAT:
        need = math.prod(entry.shape) * info.itemsize
        if entry.nbytes != need:
            raise ValidationError(
                f"tensor '{name}' declares {entry.nbytes} bytes but its shape "
                f"{list(entry.shape)} and dtype {entry.dtype} need {need}"
            )
    data = entry.data
    if isinstance(data, torch.Tensor) and data.dtype == torch.bool and info.itemsize != 1:
        raise ValidationError(f"tensor '{name}': a torch.bool tensor must be stored as 1 byte")


def _known_digest(p: _Planned) -> str | None:
    """The digest the entry came with (its provider asked now, once), checked to be an xxh3-64
    hex digest; None when it has none."""
    digest = p.entry.digest
    if callable(digest):
        digest = digest()
    if digest is not None and not (
        isinstance(digest, str)
        and len(digest) == len(_CHECKSUM_PLACEHOLDER)
        and all(c in "0123456789abcdef" for c in digest)
    ):
        raise ValidationError(
            f"tensor '{p.name}': digest {str(digest)[:40]!r} is not an xxh3-64 hex digest"
        )
    return digest


def _materialize(p: _Planned) -> memoryview:
    """Call a deferred provider exactly once and check the length it returns."""
    data = p.entry.data
    if callable(data) and not isinstance(data, torch.Tensor):
        try:
            data = data()
        except BurnpackError as e:
            raise type(e)(f"tensor '{p.name}': {e}") from e
        except Exception as e:
            raise BurnpackIOError(f"tensor '{p.name}': {e}") from e
    view = _as_bytes(data)
    if view.nbytes != p.entry.nbytes:
        raise SizeMismatchError(
            f"tensor '{p.name}': deferred source has inconsistent length "
            f"(expected {p.entry.nbytes}, got {view.nbytes})"
        )
    return view


# Tensors of at least this many bytes are checksummed on the helper thread while this thread
# hands them to the sink: xxhash releases the GIL, so on two cores the hash costs no wall time.
# Below it, handing the work over costs more than hashing inline (xxh3 runs at ~10 GB/s).
_PARALLEL_HASH_MIN = 1024 * 1024
_ZEROS = bytes(TENSOR_ALIGNMENT)  # the padding before a tensor is shorter than the alignment


def _write_plan(plan: _Plan, sink: _fs.Sink) -> bytes:
    """Stream header, metadata and tensors into ``sink``; patch the checksums in at the end.
    Returns the head as written (header, metadata with checksums, padding).

    Large tensors are hashed on the helper thread while the sink takes them (each hash finishes
    before the next tensor's provider runs, so peak memory stays one tensor); small ones are
    hashed inline. The sink gathers small pieces into few writes.
    """
    meta = plan.encoded
    header = _MAGIC_BYTES + struct.pack("<HI", _FORMAT_VERSION, len(meta))
    padding = _ZEROS[: data_section_start(len(meta)) - HEADER_SIZE - len(meta)]
    sink.write(header + meta + padding)
    position = 0
    digests: dict[str, str] = {}
    for p in plan.tensors:
        if p.start > position:
            sink.write(_ZEROS[: p.start - position])
        view = _materialize(p)
        if not plan.checksums:
            sink.write(view)
        elif (known := _known_digest(p)) is not None:  # hashed as made: no second pass
            digests[p.name] = known
            sink.write(view)
        elif view.nbytes < _PARALLEL_HASH_MIN:
            digests[p.name] = xxhash.xxh3_64_hexdigest(view)
            sink.write(view)
        else:
            digest = _parallel.submit(xxhash.xxh3_64_hexdigest, view)
            sink.write(view)
            digests[p.name] = digest.result()
        del view  # drop this tensor's bytes before the next provider runs
        position = p.end
    if plan.digest_offsets:
        patched = plan.patched(digests)
        sink.patch(HEADER_SIZE, patched)
        meta = bytes(patched)
    sink.finish()
    return header + meta + padding


class _Written(NamedTuple):
    """What :func:`_write_to` wrote: the file's size and its head (see :func:`_write_plan`)."""

    size: int
    head: bytes


def _write_to(
    sinks: Callable[[int], AbstractContextManager[_fs.Sink]],
    name: str,
    tensors: TensorsArg,
    *,
    metadata: Mapping[str, str] | None = None,
    scalars: Mapping[str, Any] | None = None,
    checksums: bool = True,
) -> _Written:
    """The one write path: plan every offset (nothing is opened when that fails), then stream
    the pack into the sink ``sinks(size)`` opens: a file (:mod:`lightning_bpk._fs`), a store's
    key (:meth:`Store.sink <lightning_bpk.store.Store.sink>`), memory. An error while writing
    names ``name`` (an ``OSError`` becomes a :class:`BurnpackIOError`); what opening and
    publishing the sink raise (a rename, an upload) passes unchanged: the store's own."""
    plan = _plan(tensors, metadata, scalars, checksums)
    size = data_section_start(len(plan.encoded)) + plan.data_size
    with sinks(size) as sink:
        try:
            head = _write_plan(plan, sink)
        except BurnpackError as e:
            raise type(e)(f"{name}: {e}") from e
        except OSError as e:
            raise BurnpackIOError(f"cannot write {name}: {e.strerror or e}") from e
    return _Written(size, head)


def dumps(
    tensors: TensorsArg,
    *,
    metadata: Mapping[str, str] | None = None,
    scalars: Mapping[str, Any] | None = None,
    checksums: bool = True,
) -> bytes:
    """Encode tensors, string metadata and typed scalars as burnpack bytes.

    ``tensors`` maps names to tensors or :class:`TensorEntry`; its order is the data order.
    ``checksums=False`` writes exactly what Burn would (no checksum entries).

    >>> len(dumps({}))  # an empty pack is one aligned block
    256
    """
    plan = _plan(tensors, metadata, scalars, checksums)
    memory = _fs.MemorySink()
    _write_plan(plan, memory)
    return memory.file.getvalue()


def size(
    tensors: TensorsArg,
    *,
    metadata: Mapping[str, str] | None = None,
    scalars: Mapping[str, Any] | None = None,
    checksums: bool = True,
) -> int:
    """The exact byte size :func:`dumps` would produce, computed without calling any provider."""
    plan = _plan(tensors, metadata, scalars, checksums)
    return data_section_start(len(plan.encoded)) + plan.data_size


def offsets(
    tensors: TensorsArg,
    *,
    metadata: Mapping[str, str] | None = None,
    scalars: Mapping[str, Any] | None = None,
    checksums: bool = True,
) -> dict[str, int]:
    """Where each tensor's bytes start in the file :func:`dumps` would produce, computed
    without calling any provider (so memory can hold a tensor at its file offset within a page,
    for a writer that bypasses the page cache).

    >>> at = offsets({"a": torch.zeros(3), "b": torch.zeros(1)})
    >>> at["b"] - at["a"], at["a"] % TENSOR_ALIGNMENT
    (256, 0)
    """
    plan = _plan(tensors, metadata, scalars, checksums)
    data = data_section_start(len(plan.encoded))
    return {p.name: data + p.start for p in plan.tensors}


def _with_suffix(path: str | os.PathLike[str]) -> Path:
    """``path`` with ``.bpk`` appended when it has no suffix (Burn's rule for writers)."""
    p = Path(path)
    return p if p.suffix else p.with_name(p.name + ".bpk")


def write(
    path: str | os.PathLike[str],
    tensors: TensorsArg,
    *,
    metadata: Mapping[str, str] | None = None,
    scalars: Mapping[str, Any] | None = None,
    atomic: bool = True,
    checksums: bool = True,
    add_suffix: bool = True,
) -> Path:
    """Write a burnpack file and return its path (``.bpk`` added when the path has no suffix,
    unless ``add_suffix=False``: then exactly ``path``, as Lightning's ``CheckpointIO`` needs).

    With ``atomic=True`` (default) the bytes go to a scratch file in the same directory, which is
    fsynced and renamed over ``path``: a failure leaves no scratch file and an existing file
    untouched. ``atomic=False`` is Burn's plain ``write_to_file``: a failure partway leaves a
    short, corrupt file in place of the old one. Offsets are planned before any I/O, each deferred
    provider is called once, in order, and tensors are streamed, so peak extra memory is about
    the largest tensor. Files of :data:`~lightning_bpk._fs.DIRECT_MIN` bytes and more bypass the
    page cache (``O_DIRECT``) where the filesystem supports it (see :mod:`lightning_bpk._fs`).

    >>> import tempfile, torch
    >>> write(tempfile.mkdtemp() + "/model", {"w": torch.zeros(3)}).name
    'model.bpk'
    """
    target = _with_suffix(path) if add_suffix else Path(path)

    def in_place(size: int) -> AbstractContextManager[_fs.Sink]:
        # Burn truncates in place; unlinking first gives the same clobbering semantics but
        # keeps packs that still map the old file (their tensors are views) intact.
        with contextlib.suppress(FileNotFoundError):
            os.unlink(target)
        return _fs.open_sink(target, size)

    sinks = functools.partial(_fs.atomic_sink, target) if atomic else in_place
    try:
        _write_to(
            sinks, str(target), tensors, metadata=metadata, scalars=scalars, checksums=checksums
        )
    except BurnpackError:
        raise
    except OSError as e:  # creating the scratch file, fsync, rename
        raise BurnpackIOError(f"cannot write {target}: {e.strerror or e}") from e
    return target
