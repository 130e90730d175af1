"""Reading burnpack files: strict parsing of the index, zero-copy tensors, in-place loads."""

from __future__ import annotations

import contextlib
import functools
import math
import mmap
import os
import stat
import struct
import warnings
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
import xxhash

from lightning_bpk import _device
from lightning_bpk.burnpack import _parallel
from lightning_bpk.burnpack._inplace import READ_STEP, Into, damaged, fill, writable_bytes
from lightning_bpk.burnpack._metadata import (
    TensorInfo,
    decode_metadata,
    parse_descriptor,
    parse_scalar,
    parse_string_map,
)
from lightning_bpk.burnpack.base import (
    _FORMAT_VERSION,
    _MAGIC_BYTES,
    _MAX_TENSOR_COUNT,
    _MAX_TENSOR_SIZE,
    _QFLOAT,
    CHECKSUM_PREFIX,
    HEADER_SIZE,
    MAX_FILE_SIZE,
    MAX_METADATA_SIZE,
    TENSOR_ALIGNMENT,
    BurnpackError,
    BurnpackIOError,
    ChecksumError,
    HeaderError,
    MagicError,
    MetadataError,
    Scalar,
    TensorNotFoundError,
    ValidationError,
    VersionError,
    _dtype_info,
    _is_digest,
    _parsed_dtype_info,
    _short,
)
from lightning_bpk.burnpack.entry import BytesLike
from lightning_bpk.burnpack.writer import data_section_start

__all__ = [
    "Pack",
    "TensorInfo",
    "loads",
    "read",
    "read_into",
]


class Pack:
    """A parsed burnpack: the index is read eagerly, tensor bytes lazily and without copies.

    Use as a context manager to release the file mapping deterministically. Tensors returned by
    :meth:`tensor` are views on the file's bytes; they stay valid after :meth:`close` (the mapping
    then lives as long as they do).
    """

    def __init__(self, buffer: Any, *, source: str = "<bytes>", _mmap: mmap.mmap | None = None):
        self._buffer = memoryview(buffer).cast("B")
        self._mmap = _mmap
        self._closed = False
        self._readonly = self._buffer.readonly
        self.source = source
        self.file_size = self._buffer.nbytes
        self._verified: set[str] = set()
        try:
            with _parallel.gc_paused():  # one object per tensor: see burnpack._parallel
                self._parse()
        except BurnpackError as e:
            self.close()
            raise type(e)(f"{source}: {e}") from None

    def _parse(self) -> None:
        buf = self._buffer
        total = buf.nbytes
        if total < HEADER_SIZE:
            raise HeaderError(f"Invalid header: insufficient bytes ({total} < {HEADER_SIZE})")
        if bytes(buf[:4]) != _MAGIC_BYTES:
            raise MagicError(f"Invalid magic number {bytes(buf[:4])!r} (expected b'NRUB')")
        version, meta_size = struct.unpack_from("<HI", buf, 4)
        if version != _FORMAT_VERSION:
            raise VersionError(f"Unsupported version {version} (this reader knows 1)")
        if meta_size > MAX_METADATA_SIZE:
            raise ValidationError(
                f"Metadata size {meta_size} exceeds maximum allowed size of "
                f"{MAX_METADATA_SIZE} bytes (potential DoS attack)"
            )
        if HEADER_SIZE + meta_size > total:
            raise HeaderError(
                f"Invalid header: insufficient bytes (metadata needs {HEADER_SIZE + meta_size}, "
                f"have {total})"
            )
        self.version = version
        self.metadata_size = meta_size
        self.data_start = data_section_start(meta_size)
        top = decode_metadata(buf[HEADER_SIZE : HEADER_SIZE + meta_size])
        if "tensors" not in top:
            raise MetadataError("missing 'tensors' map")
        raw_tensors = top["tensors"]
        if not isinstance(raw_tensors, dict):
            raise MetadataError("'tensors' must be a map")
        if len(raw_tensors) > _MAX_TENSOR_COUNT:
            raise ValidationError(
                f"File contains {len(raw_tensors)} tensors, "
                f"exceeding maximum of {_MAX_TENSOR_COUNT}"
            )
        entries = {name: parse_descriptor(name, d) for name, d in raw_tensors.items()}
        metadata = parse_string_map(top.get("metadata", {}))
        raw_scalars = top.get("scalars", {})
        if not isinstance(raw_scalars, dict):
            raise MetadataError("'scalars' must be a map")
        self.scalars: dict[str, Scalar] = {k: parse_scalar(k, v) for k, v in raw_scalars.items()}
        self.checksums: dict[str, str] = {}
        self.metadata: dict[str, str] = {}
        for k, v in metadata.items():
            if k.startswith(CHECKSUM_PREFIX):
                if not _is_digest(v):
                    raise MetadataError(f"checksum entry {_short(k)}: {_short(v)} is not xxh3 hex")
                self.checksums[k[len(CHECKSUM_PREFIX) :]] = v
            else:
                self.metadata[k] = v
        self._validate_layout(entries, total)
        self.entries: dict[str, TensorInfo] = {k: entries[k] for k in sorted(entries)}
        self.names: list[str] = list(self.entries)
        self._data_order = tuple(sorted(self.names, key=lambda n: self.entries[n].data_offsets))
        unknown = sorted(set(self.checksums) - set(entries))
        if unknown:
            raise ValidationError(f"checksums recorded for absent tensors: {unknown[:5]}")

    def _validate_layout(self, entries: dict[str, TensorInfo], total: int) -> None:
        end_max = 0
        for name, info in sorted(entries.items(), key=lambda kv: kv[1].data_offsets):
            start, end = info.data_offsets
            if end < start:
                raise ValidationError(f"tensor '{name}': end offset {end} < start {start}")
            if end - start > _MAX_TENSOR_SIZE:
                raise ValidationError(
                    f"Tensor '{name}' size {end - start} exceeds maximum {_MAX_TENSOR_SIZE}"
                )
            if start % TENSOR_ALIGNMENT:
                raise ValidationError(f"tensor '{name}': start {start} is not 256-byte aligned")
            if start < end_max:
                raise ValidationError(f"tensor '{name}': bytes {start}..{end} overlap another")
            info_dtype = _parsed_dtype_info(info.dtype)
            if info_dtype is not _QFLOAT:
                need = math.prod(info.shape) * info_dtype.itemsize
                if need != end - start:
                    raise ValidationError(
                        f"tensor '{name}': {end - start} bytes stored but shape "
                        f"{list(info.shape)} and dtype {info.dtype} need {need}"
                    )
            end_max = max(end_max, end)
        # Stricter than Burn, which skips this check for a pack without tensors.
        expected = self.data_start + end_max
        if expected > total:
            raise ValidationError(
                f"File truncated: expected at least {expected} bytes, got {total} bytes"
            )
        if total > expected:
            raise ValidationError(
                f"{total - expected} unexpected bytes after the data section (file ends at "
                f"{expected})"
            )

    # -- access --

    def __contains__(self, name: object) -> bool:
        return name in self.entries

    def __iter__(self) -> Iterator[str]:
        return iter(self.names)

    def __len__(self) -> int:
        return len(self.entries)

    def _info(self, name: str) -> TensorInfo:
        try:
            return self.entries[name]
        except KeyError:
            raise TensorNotFoundError(f"{self.source}: no tensor named '{name}'") from None

    def raw(self, name: str, *, verify: bool = True) -> memoryview:
        """The stored bytes of tensor ``name`` (a zero-copy view), checksum-verified by default."""
        info = self._info(name)
        if self._closed:
            raise BurnpackError(f"{self.source}: pack is closed; tensor '{name}' is unavailable")
        start, end = info.data_offsets
        view = self._buffer[self.data_start + start : self.data_start + end]
        if verify and name not in self._verified:
            expected = self.checksums.get(name)
            if expected is not None and xxhash.xxh3_64_hexdigest(view) != expected:
                raise self._damaged(name)
            self._verified.add(name)
        return view

    def _damaged(self, name: str) -> ChecksumError:
        return damaged(self.source, name)

    def tensor(self, name: str, *, verify: bool = True) -> torch.Tensor:
        """Tensor ``name`` as a torch tensor viewing the pack's bytes (copied only for Bool
        variants stored as U8/U32). QFloat tensors are opaque: use :meth:`raw`.

        >>> from lightning_bpk.burnpack import dumps
        >>> loads(dumps({"w": torch.ones(2)})).tensor("w")
        tensor([1., 1.])
        """
        with self._quiet_readonly():
            return self._tensor(name, verify)

    def tensors(self, *, verify: bool = True) -> dict[str, torch.Tensor]:
        """Every non-quantized tensor, by name (sorted); the checksums are verified by two
        threads at once (:meth:`check`)."""
        names = [n for n, info in self.entries.items() if _dtype_info(info.dtype) is not _QFLOAT]
        if verify:
            self.check(names)
        with self._quiet_readonly(), _parallel.gc_paused():  # one object per tensor
            return {n: self._tensor(n, verify) for n in names}

    def check(self, names: Iterable[str]) -> None:
        """Verify the checksums of ``names`` now, shared by the caller's thread and a helper
        (each tensor over a MiB alone, smaller ones together): :meth:`tensor` and :meth:`raw`
        then return them without hashing again. :class:`ChecksumError` names the first damaged
        tensor by name; :meth:`verify` names them all."""
        bad = self._failing(names)
        if bad:
            raise self._damaged(bad[0])

    def _failing(self, names: Iterable[str]) -> list[str]:
        """The damaged tensors among ``names`` (sorted); the others are marked verified."""
        todo = [n for n in names if n not in self._verified and n in self.checksums]
        todo.sort(key=lambda n: self.entries[n].data_offsets)
        bad: list[str] = []

        def check(batch: list[str]) -> None:
            for name in batch:
                try:
                    self.raw(name)
                except ChecksumError:
                    bad.append(name)

        sizes = {n: self.entries[n].nbytes for n in todo}
        units = [
            functools.partial(check, batch)
            for batch in _parallel.batches(todo, sizes.__getitem__, READ_STEP)
        ]
        _parallel.run(units)
        return sorted(bad)

    @contextlib.contextmanager
    def _quiet_readonly(self) -> Iterator[None]:
        """Silence torch's "buffer is not writable" warning for read-only sources (``bytes``).

        The tensors still share memory. Only entered when needed: ``catch_warnings`` costs
        microseconds per call and swaps process-wide warning state.
        """
        if not self._readonly:
            yield
            return
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            yield

    def _tensor(self, name: str, verify: bool) -> torch.Tensor:
        info = self._info(name)
        dinfo = _parsed_dtype_info(info.dtype)
        if dinfo is _QFLOAT:
            raise ValidationError(
                f"{self.source}: tensor '{name}' is quantized (QFloat); read it with raw()"
            )
        view = self.raw(name, verify=verify)
        if info.carried is not None or view.nbytes == 0:
            shape, dtype = info.torch_spec()
            if view.nbytes == 0:
                return _device.empty(shape, dtype)
            return torch.frombuffer(view, dtype=dtype).reshape(shape)
        assert dinfo.torch_dtype is not None  # only QFloat has none, refused above
        flat = torch.frombuffer(view, dtype=dinfo.torch_dtype)
        tensor = flat.reshape(info.shape)
        if isinstance(info.dtype, dict):  # Bool variants
            if dinfo.torch_dtype is torch.bool:
                if bool((flat.view(torch.uint8) > 1).any()):
                    raise ValidationError(
                        f"{self.source}: tensor '{name}' holds bool bytes other than 0 and 1"
                    )
            else:
                tensor = tensor != 0
        return tensor

    def verify(self) -> None:
        """Check every checksummed tensor; raise :class:`ChecksumError` naming all bad ones."""
        bad = self._failing(self.names)
        if bad:
            raise ChecksumError(f"{self.source}: tensors failing their checksum: {bad}")

    @property
    def data_order(self) -> list[str]:
        """Tensor names in the order their bytes lie in the data section: the order the writer
        was given them (Burn: the module's visiting order). :attr:`names` is sorted by name.

        >>> import torch
        >>> from lightning_bpk import burnpack
        >>> pack = burnpack.loads(burnpack.dumps({"b": torch.ones(1), "a": torch.zeros(1)}))
        >>> pack.names, pack.data_order
        (['a', 'b'], ['b', 'a'])
        """
        return list(self._data_order)

    @property
    def nbytes(self) -> int:
        """Size of the whole pack in bytes."""
        return self.file_size

    def close(self) -> None:
        """Release the file mapping (deferred while tensors still view it)."""
        # While tensors still view the bytes, the mapping is unmapped when they are freed.
        self._closed = True
        with contextlib.suppress(BufferError):
            self._buffer.release()
        if self._mmap is not None:
            with contextlib.suppress(BufferError):
                self._mmap.close()
            self._mmap = None

    def __enter__(self) -> Pack:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<Pack {self.source}: {len(self.entries)} tensors, {len(self.scalars)} scalars>"


def loads(data: BytesLike) -> Pack:
    """Parse burnpack bytes; tensors are views on ``data`` (no copy).

    >>> from lightning_bpk.burnpack import dumps
    >>> loads(dumps({}, metadata={"k": "v"})).metadata
    {'k': 'v'}
    """
    return Pack(data)


def _resolve_path(path: str | os.PathLike[str]) -> Path:
    """Burn's reader rule: add ``.bpk`` only when ``path`` has no suffix and does not exist."""
    p = Path(path)
    if not p.suffix and not p.exists():
        return p.with_name(p.name + ".bpk")
    return p


def read(path: str | os.PathLike[str]) -> Pack:
    """Open a burnpack file lazily: only the header and metadata are read now.

    The file is memory-mapped copy-on-write, so tensors are zero-copy views that stay intact if
    the file is later replaced (writers here always replace, never rewrite in place; a foreign
    program that truncates the file in place would break the mapping, as with any mmap reader).

    >>> import tempfile, torch
    >>> from lightning_bpk.burnpack import write
    >>> path = write(tempfile.mkdtemp() + "/m.bpk", {"w": torch.arange(3.0)})
    >>> with read(path) as pack:
    ...     pack.names, pack.tensor("w").tolist()
    (['w'], [0.0, 1.0, 2.0])
    """
    with _opened(_resolve_path(path)) as (fd, p):
        return _map(fd, p)  # the mapping keeps the file's pages reachable on its own


@contextlib.contextmanager
def _opened(p: Path) -> Iterator[tuple[int, Path]]:
    """``(fd, p)``: the file ``p`` open for reading, closed when the block ends."""
    try:
        # O_NONBLOCK: opening a FIFO must not wait for a writer (no effect on regular files).
        fd = os.open(p, os.O_RDONLY | os.O_NONBLOCK)
    except OSError as e:
        raise BurnpackIOError(f"cannot read {p}: {e.strerror or e}") from e
    try:
        yield fd, p
    finally:
        os.close(fd)


def _map(fd: int, p: Path) -> Pack:
    """Parse the open file ``fd`` (named ``p``) through a copy-on-write mapping."""
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ValidationError(f"{p}: not a regular file")
        if st.st_size > MAX_FILE_SIZE:
            raise ValidationError(
                f"{p}: File size {st.st_size} bytes exceeds maximum allowed size of "
                f"{MAX_FILE_SIZE} bytes"
            )
        if st.st_size < HEADER_SIZE:
            raise HeaderError(
                f"{p}: Invalid header: insufficient bytes ({st.st_size} < {HEADER_SIZE})"
            )
        mapping = mmap.mmap(fd, 0, access=mmap.ACCESS_COPY)
    except OSError as e:
        raise BurnpackIOError(f"cannot read {p}: {e.strerror or e}") from e
    except ValueError:
        # mmap sizes the file itself and refuses an empty one: another program truncated it to
        # 0 bytes after the fstat above (a file truncated to any other size is mapped as it is
        # now, and the parse reports it short).
        raise HeaderError(
            f"{p}: Invalid header: insufficient bytes (the file became empty while it was opened)"
        ) from None
    return Pack(mapping, source=str(p), _mmap=mapping)


@_parallel.gc_paused_call  # one object per tensor: see burnpack._parallel
def read_into(
    path: str | os.PathLike[str], targets: Mapping[str, torch.Tensor], *, verify: bool = True
) -> None:
    """Load tensors of a burnpack file into existing tensors, in place (what resuming does).

    Every name in ``targets`` must be in the file, with the same shape. A contiguous CPU target
    of the stored dtype is read straight into (``preadv``) in steps of 1 MiB, each hashed while it
    is still in the CPU cache (one pass over the bytes), the work shared by the caller's thread
    and a helper thread (see :mod:`lightning_bpk.burnpack._inplace`). Any other target (another
    dtype, a view, a GPU tensor) is filled with ``copy_`` after its checksum is verified.

    Everything is checked before any target is touched except the checksums of tensors copied
    straight into their targets: if one fails, :class:`ChecksumError` names it and that target
    holds the damaged bytes (reload from an intact checkpoint).

    >>> import tempfile, torch
    >>> from lightning_bpk.burnpack import write
    >>> path = write(tempfile.mkdtemp() + "/m.bpk", {"w": torch.arange(3.0)})
    >>> w = torch.zeros(3); read_into(path, {"w": w}); w.tolist()
    [0.0, 1.0, 2.0]
    """
    with _opened(_resolve_path(path)) as (fd, p), _map(fd, p) as pack:
        direct, other = [], []
        for name, target in targets.items():
            info = pack._info(name)
            if target.shape != info.shape:
                raise ValidationError(
                    f"{pack.source}: tensor '{name}' has shape {list(info.shape)}, the "
                    f"target {list(target.shape)}"
                )
            flat = writable_bytes(target, info.dtype)
            if flat is None:
                other.append((name, target))
                continue
            offset = pack.data_start + info.data_offsets[0]
            stored = pack._buffer[offset : offset + info.nbytes]
            expected = pack.checksums.get(name) if verify else None
            direct.append(Into(name, offset, stored, flat, target.data_ptr(), expected))
        direct.sort(key=lambda i: i.offset)  # the file front to back: readahead when cold
        fill(pack.source, fd, direct)
        torch.autograd.graph.increment_version([targets[i.name] for i in direct])
        with torch.no_grad():
            for name, target in other:
                target.copy_(pack.tensor(name, verify=verify))
