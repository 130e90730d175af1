"""A sharded checkpoint's index: written (:func:`encode`) and checked before anything it names
is opened (:func:`parse`), in one place.

An index (JSON in the metadata of ``sharded.index.bpk``, see :mod:`lightning_bpk.dcp`) is read
from a file or an object, so it is hostile until checked. :func:`parse` checks all of it at
once, and every reader goes through it (:func:`lightning_bpk.dcp.read_index`):

- its JSON nests at most :data:`MAX_DEPTH` levels and lists at most :data:`MAX_ENTRIES` files,
  tensors, chunks and objects (bounded before anything is iterated or allocated);
- every field has its type; every file name is a plain name inside the checkpoint
  (:func:`lightning_bpk.layout.member_name_problem`), so it resolves inside its directory or
  below its prefix, never outside, never absolute;
- each tensor's dtype is known, its shape has at most ``MAX_RANK`` non-negative dimensions, and
  its chunks lie inside it and cover it exactly: no gap, no overlap, no duplicate; each chunk's
  bytes fit in the file that holds it, and no two chunks or objects share stored data;
- ``planner_data`` maps keys to short paths whose list indices are bounded.

When a rank file is opened, :func:`check_rank_file` checks that it holds every chunk the index
places there with the dtype and shape the index gives, before any byte of it is read. A problem
raises :class:`~lightning_bpk.dcp.ShardedCheckpointError` naming the index (or rank file) and
the entry.

Also the rule that a checkpoint is real files in a real directory (:mod:`lightning_bpk.layout`):
:func:`refuse_links` refuses a symlink anywhere on the way to a member or at the checkpoint
itself, through the store (which refuses nothing on object storage), before it is read.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from torch.distributed.checkpoint import Metadata
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex

from lightning_bpk import burnpack
from lightning_bpk.burnpack.base import _short
from lightning_bpk.dcp import ShardedCheckpointError
from lightning_bpk.layout import member_name_problem
from lightning_bpk.store import Store

FORMAT = "lightning_bpk/dcp"
VERSION = 1
MAX_DEPTH = 32  # an index nests 7 levels (to a chunk's offsets): room to spare, never a stack
MAX_ENTRIES = 1_000_000  # files + tensors + chunks + objects + planner keys of one index
MAX_PATH = 64  # steps of one planner path: state dicts nest far less deeply
_DIGEST_CHARS = 16  # xxh3-64 as hex


_Placed = tuple[str, burnpack.DType | None, tuple[int, ...]]  # what, dtype (None: object), shape


@dataclass(frozen=True)
class Document:
    """A checked index: the fields of :class:`lightning_bpk.dcp.Index` and, per rank file, what
    the index places there (stored name -> (what, burn dtype or None for an object, shape))."""

    save_id: str
    files: dict[str, dict[str, Any]]
    tensors: dict[str, dict[str, Any]]
    objects: dict[str, dict[str, Any]]
    planner_data: Any
    placed: dict[str, dict[str, _Placed]] = field(repr=False)


class _Problem(Exception):
    """Raised inside the checks; :func:`parse` turns it into the error naming the index."""


def _int(value: object, what: str, low: int = 0, high: int = 2**63 - 1) -> int:
    if type(value) is not int or not low <= value <= high:
        raise _Problem(f"{what} is {_short(value)}, not an integer in [{low}, {high}]")
    return value


def _str(value: object, what: str) -> str:
    if not isinstance(value, str) or not value:
        raise _Problem(f"{what} is {_short(value)}, not a non-empty string")
    return value


def _dict(value: object, what: str, fields: tuple[str, ...] = ()) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise _Problem(f"{what} is a {type(value).__name__}, not an object")
    missing = [f for f in fields if f not in value]
    if missing:
        raise _Problem(f"{what} lacks {', '.join(map(repr, missing))}")
    return value


def _ints(value: object, what: str, high: int) -> tuple[int, ...]:
    if not isinstance(value, list) or len(value) > burnpack.MAX_RANK:
        raise _Problem(f"{what} is not a list of at most {burnpack.MAX_RANK} integers")
    return tuple(_int(v, f"{what}[{i}]", 0, high) for i, v in enumerate(value))


def _files(value: object) -> dict[str, dict[str, Any]]:
    files = _dict(value, "'files'")
    for name, info in files.items():
        problem = member_name_problem(name)
        if problem is not None:
            raise _Problem(f"file {problem}")
        what = f"file {name!r}"
        _dict(info, what, ("size", "head_xxh3"))
        size = _int(info["size"], f"{what}: size", 1, burnpack.MAX_FILE_SIZE)
        if "head_size" in info:
            _int(info["head_size"], f"{what}: head_size", 1, size)
        digest = info["head_xxh3"]
        if not (isinstance(digest, str) and len(digest) == _DIGEST_CHARS):
            raise _Problem(f"{what}: head_xxh3 is {_short(digest)}, not a digest")
    return files


class _Placer:
    """Records where each chunk and object is stored; refuses two entries on the same data."""

    def __init__(self, files: Mapping[str, Mapping[str, Any]]) -> None:
        self.files = files
        self.placed: dict[str, dict[str, _Placed]] = {}

    def place(
        self, entry: Mapping[str, Any], what: str, dtype: burnpack.DType | None, shape: tuple
    ) -> None:
        file = _str(entry.get("file"), f"{what}: file")
        name = _str(entry.get("name"), f"{what}: name")
        if file not in self.files:
            raise _Problem(f"{what}: file {file!r} is not one of the index's files")
        stored = self.placed.setdefault(file, {})
        if name in stored:
            raise _Problem(f"{what} and {stored[name][0]} both name '{name}' in {file}")
        stored[name] = (what, dtype, shape)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _overlap(a: tuple[tuple[int, ...], tuple[int, ...]], b: tuple[tuple[int, ...], ...]) -> bool:
    return all(
        oa < ob + sb and ob < oa + sa for oa, sa, ob, sb in zip(a[0], a[1], b[0], b[1], strict=True)
    )


def _check_cover(fqn: str, shape: tuple[int, ...], boxes: list[tuple[tuple, tuple]]) -> None:
    """The chunks (offsets, sizes) of ``fqn`` cover its shape exactly: as they lie inside it,
    no overlap and volumes summing to its size mean no gap either."""
    total = sum(_numel(sizes) for _, sizes in boxes)
    if total != _numel(shape):
        raise _Problem(
            f"tensor '{fqn}': its chunks hold {total} elements, its shape {list(shape)} "
            f"{_numel(shape)} (a gap or an overlap)"
        )
    if not shape:
        return
    # sweep along the dimension with most distinct offsets: only chunks that meet there compare
    axis = max(range(len(shape)), key=lambda d: len({o[d] for o, _ in boxes}))
    active: list[tuple[tuple, tuple]] = []
    for box in sorted((b for b in boxes if _numel(b[1])), key=lambda b: b[0][axis]):
        active = [a for a in active if a[0][axis] + a[1][axis] > box[0][axis]]
        for other in active:
            if _overlap(box, other):
                raise _Problem(
                    f"tensor '{fqn}': chunks at {list(other[0])} and {list(box[0])} overlap"
                )
        active.append(box)


def _tensor(fqn: str, value: object, placer: _Placer) -> None:
    t = _dict(value, f"tensor '{fqn}'", ("dtype", "shape", "requires_grad", "chunks"))
    dtype = t["dtype"]
    try:
        itemsize = burnpack._torch_dtype(dtype).itemsize
    except (burnpack.BurnpackError, TypeError):
        raise _Problem(f"tensor '{fqn}': unknown dtype {_short(dtype)}") from None
    if not isinstance(t["requires_grad"], bool):
        raise _Problem(f"tensor '{fqn}': requires_grad is not a boolean")
    shape = _ints(t["shape"], f"tensor '{fqn}': shape", 2**62)
    chunks = t["chunks"]
    if not isinstance(chunks, list) or not chunks:
        raise _Problem(f"tensor '{fqn}': chunks is not a non-empty list")
    boxes, seen = [], set()
    for i, c in enumerate(chunks):
        what = f"tensor '{fqn}' chunk {i}"
        c = _dict(c, what, ("offsets", "sizes", "file", "name"))
        offsets = _ints(c["offsets"], f"{what}: offsets", 2**62)
        sizes = _ints(c["sizes"], f"{what}: sizes", 2**62)
        if not len(offsets) == len(sizes) == len(shape):
            raise _Problem(f"{what}: offsets and sizes need {len(shape)} entries (its shape)")
        for d, (o, s, n) in enumerate(zip(offsets, sizes, shape, strict=True)):
            if o + s > n:
                raise _Problem(
                    f"{what}: offsets {list(offsets)} + sizes {list(sizes)} leave the shape "
                    f"{list(shape)} in dimension {d}"
                )
        if offsets in seen:
            raise _Problem(f"{what}: a second chunk at offsets {list(offsets)}")
        seen.add(offsets)
        nbytes = _numel(sizes) * itemsize
        placer.place(c, what, dtype, sizes)
        if nbytes > placer.files[c["file"]]["size"]:
            raise _Problem(f"{what}: {nbytes} bytes cannot fit in {c['file']}")
        boxes.append((offsets, sizes))
    _check_cover(fqn, shape, boxes)


def _planner_data(value: object, keys: int) -> None:
    """DCP's default planner data: flattened key -> the path of keys and list indices to it.
    The paths must form one tree (what :func:`lightning_bpk.dcp.load_nested` rebuilds): no path
    runs through another's value, and the steps below one node are all keys or all indices."""
    if not isinstance(value, dict):
        return  # another planner's: handed to it as it is (its depth is bounded)
    kinds: dict[tuple, type] = {}  # an inner node (a path prefix) -> the type of its steps
    leaves: dict[tuple, str] = {}  # a value's full path -> its key
    for key, path in value.items():
        what = f"planner_data '{key}'"
        if not isinstance(path, list) or not 0 < len(path) <= MAX_PATH:
            raise _Problem(f"{what} is not a path of 1 to {MAX_PATH} steps")
        for i, step in enumerate(path):
            if not isinstance(step, str):
                _int(step, f"{what}: list index", 0, keys)  # a list holds at most every key
            prefix = tuple(path[:i])
            if prefix in leaves or kinds.setdefault(prefix, type(step)) is not type(step):
                raise _Problem(f"{what}: its path {path} conflicts with another key's")
        full = tuple(path)
        if full in kinds or full in leaves:
            raise _Problem(f"{what}: its path {path} conflicts with another key's")
        leaves[full] = key


def _count(doc: Mapping[str, Any]) -> int:
    """How many entries ``doc`` lists (bounded before any of them is looked at)."""
    count = 0
    for part in ("files", "tensors", "objects", "planner_data"):
        value = doc.get(part)
        count += len(value) if isinstance(value, dict) else 0
    for t in doc["tensors"].values() if isinstance(doc.get("tensors"), dict) else ():
        chunks = t.get("chunks") if isinstance(t, dict) else None
        count += len(chunks) if isinstance(chunks, list) else 0
    return count


def _document(doc: object) -> Document:
    doc = _dict(doc, "the index", ("format", "version", "save_id", "files", "tensors", "objects"))
    if doc["format"] != FORMAT:
        raise _Problem(f"not a {FORMAT} index")
    if doc["version"] != VERSION:
        raise _Problem(f"index version {doc['version']!r} is not supported ({VERSION})")
    count = _count(doc)
    if count > MAX_ENTRIES:
        raise _Problem(f"{count} entries, more than {MAX_ENTRIES}")
    save_id = _str(doc["save_id"], "save_id")
    files = _files(doc["files"])
    placer = _Placer(files)
    tensors = _dict(doc["tensors"], "'tensors'")
    for fqn, t in tensors.items():
        _tensor(fqn, t, placer)
    objects = _dict(doc["objects"], "'objects'")
    for fqn, o in objects.items():
        if fqn in tensors:
            raise _Problem(f"'{fqn}' is both a tensor and an object")
        placer.place(_dict(o, f"object '{fqn}'"), f"object '{fqn}'", None, ())
    planner_data = doc.get("planner_data")
    _planner_data(planner_data, count)
    return Document(save_id, files, tensors, objects, planner_data, placer.placed)


@dataclass(frozen=True)
class Location:
    """Where one chunk was written (a WriteResult's ``storage_data``)."""

    file: str
    name: str
    file_size: int
    head_xxh3: str
    head_size: int = 0


def encode(
    metadata: Metadata, locations: Mapping[MetadataIndex, Any], save_id: str
) -> tuple[str, dict[str, dict[str, Any]]]:
    """The index document (JSON) and its table of files (name -> size, head size and digest)."""
    files: dict[str, dict[str, Any]] = {}
    tensors: dict[str, Any] = {}
    objects: dict[str, Any] = {}

    def where(index: MetadataIndex) -> tuple[str, str]:
        location = locations.get(index)
        if not isinstance(location, Location):
            raise ShardedCheckpointError(f"no rank reported writing '{index.fqn}' {index.offset}")
        files[location.file] = {
            "size": location.file_size,
            "head_size": location.head_size,
            "head_xxh3": location.head_xxh3,
        }
        return location.name, location.file

    for fqn, md in metadata.state_dict_metadata.items():
        if isinstance(md, BytesStorageMetadata):
            name, file = where(MetadataIndex(fqn))
            objects[fqn] = {"file": file, "name": name}
            continue
        chunks = []
        for chunk in md.chunks:
            name, file = where(MetadataIndex(fqn, chunk.offsets))
            chunks.append(
                {
                    "offsets": list(chunk.offsets),
                    "sizes": list(chunk.sizes),
                    "file": file,
                    "name": name,
                }
            )
        tensors[fqn] = {
            "dtype": burnpack._burn_dtype(md.properties.dtype),
            "shape": list(md.size),
            "requires_grad": bool(md.properties.requires_grad),
            "chunks": chunks,
        }
    planner_data = metadata.planner_data
    try:
        json.dumps(planner_data)
    except (TypeError, ValueError) as e:
        raise ShardedCheckpointError(f"the planner's data is not plain data: {e}") from e
    document = {
        "format": FORMAT,
        "version": VERSION,
        "save_id": save_id,
        "files": files,
        "tensors": tensors,
        "objects": objects,
        "planner_data": planner_data,
    }
    return json.dumps(document, separators=(",", ":")), files


def parse(raw: object, where: str) -> Document:
    """The checked index held by ``raw`` (the index's metadata entry) read from ``where``."""
    if raw is None:
        raise ShardedCheckpointError(f"{where}: not a {FORMAT} index")
    try:
        return _document(burnpack._decode_json(raw, what="the index", max_depth=MAX_DEPTH))
    except burnpack.MetadataError as e:
        raise ShardedCheckpointError(f"{where}: {e}") from None
    except _Problem as e:
        raise ShardedCheckpointError(f"{where}: {e}") from None


def check_rank_file(placed: Mapping[str, _Placed], pack: burnpack.Pack) -> None:
    """``pack`` (a rank file, just opened) holds every chunk and object the index places in it
    (``Document.placed[file]``), each with the index's dtype and shape; raises naming the file
    and the entry."""
    for name, (what, dtype, shape) in placed.items():
        info = pack.entries.get(name)
        if info is None:
            raise ShardedCheckpointError(f"{pack.source}: no '{name}', which the {what} names")
        if dtype is None and (info.dtype != "U8" or len(info.shape) != 1):
            raise ShardedCheckpointError(
                f"{pack.source}: '{name}' ({what}) is {info.dtype} {list(info.shape)}, not bytes"
            )
        if dtype is not None and (info.dtype != dtype or tuple(info.shape) != shape):
            raise ShardedCheckpointError(
                f"{pack.source}: '{name}' is {info.dtype} {list(info.shape)}; the index's "
                f"{what} says {dtype} {list(shape)}"
            )


def refuse_links(store: Store, key: str) -> None:
    """Refuse member ``key`` of the checkpoint in ``store`` (a checked member name; ``""``: the
    checkpoint itself) when it, or a folder on the way to it, is a symlink: a checkpoint's files
    are read only from inside it (:mod:`lightning_bpk.layout`). What counts is what the store
    refuses (:meth:`~lightning_bpk.store.Store.refused`: symlinks on local disk, nothing on an
    object store, which holds objects only)."""
    steps = key.split("/") if key else [""]
    for i in range(len(steps)):
        member = "/".join(steps[: i + 1])
        url = store.url_of(member)
        if any(problem.startswith(url + " ") for problem in store.refused(member)):
            raise ShardedCheckpointError(
                f"{url}: a symlink; a checkpoint's files are never followed"
            )
