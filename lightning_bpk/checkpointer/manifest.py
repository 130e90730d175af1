"""The sentinel's content: a manifest of one checkpoint, its codec, and the entry of one file.

A sentinel is written last and says "iteration N is complete": format tag and version, the
iteration, the data directory's name (``ckpt.7``, or ``ckpt.7~<hex>`` for a re-save), the
generation of the lease its writer held (:mod:`lightning_bpk.store.lease`; absent without one,
and in older manifests), the monitored metric of a checkpointer that keeps the best checkpoints
(:class:`Metric`: its name, value and mode; absent otherwise) and, per
data key, its file's record kind, size and the xxh3-64 of its head (header and CBOR metadata up
to the data section). The head holds the per-tensor xxh3 checksums every record file carries,
so the few-KiB head digest pins every byte that matters without reading the tensors back (a
whole-file hash would cost one more full read per save, about 0.1 s/GiB here; verification costs
the same either way, since it checks the tensor checksums at ~28 GiB/s). Only the zero padding
between tensors is not covered.

A sentinel holding exactly ``b'done'`` (Dopamine's) parses as ``None``: complete when its data
exists, but unverifiable. Everything else that is not a valid manifest raises ``ValueError``
saying what is wrong; names read from a manifest are checked by
:func:`lightning_bpk.layout.member_name_problem` before anything is opened.

>>> raw = encode(3, Manifest("ckpt.3", {"model": FileEntry("module", 300, 256, "0" * 16)}))
>>> parse(raw, 3).files["model"].size
300
"""

from __future__ import annotations

import json
import math
import re
import reprlib
from dataclasses import dataclass

from lightning_bpk.layout import (
    RECORD_SUFFIX,
    VERSION_MARK,
    _safe_name,
    member_name_problem,
    parse_data_name,
)

__all__ = [
    "LEGACY_SENTINEL",
    "MANIFEST_FORMAT",
    "MANIFEST_VERSION",
    "MAX_SENTINEL_SIZE",
    "FileEntry",
    "Manifest",
    "Metric",
    "encode",
    "parse",
    "quote",
]

MANIFEST_FORMAT = "lightning_bpk/checkpoint"
# Bumped on incompatible manifest changes; readers refuse (skip) newer manifests.
MANIFEST_VERSION = 1
# Dopamine's sentinel content: still accepted as "complete", but carries nothing to verify.
LEGACY_SENTINEL = b"done"
# A manifest lists a few entries; anything larger is damage, and is refused before reading it.
MAX_SENTINEL_SIZE = 16 * 1024 * 1024
_DIGEST = re.compile(r"[0-9a-f]{16}")
# Values quoted in messages are cut to a readable length (a damaged manifest may hold megabytes).
_QUOTE = reprlib.Repr()
_QUOTE.maxstring = _QUOTE.maxother = 160


def quote(value: object) -> str:
    """``repr(value)`` cut to a readable length."""
    return _QUOTE.repr(value)


@dataclass(frozen=True)
class FileEntry:
    """One data file of a checkpoint as its manifest records it."""

    kind: str
    size: int
    head_size: int
    head_xxh3: str


@dataclass(frozen=True)
class Metric:
    """The monitored metric of one checkpoint, as its manifest records it: ``name``, ``value``
    (``None``: the metric was not logged when it was saved; NaN and infinities are kept as they
    were) and ``mode`` (``"min"`` or ``"max"``: which way is better)."""

    name: str
    value: float | None
    mode: str


# JSON has no NaN or infinities: they are written as these strings
_NON_FINITE = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}


def _encode_value(value: float | None) -> float | str | None:
    if value is None or math.isfinite(value):
        return value
    return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")


def _metric(doc: object) -> Metric | None:
    if doc is None:
        return None
    if not isinstance(doc, dict):
        raise ValueError(f"manifest metric {quote(doc)} is not a map")
    name, value, mode = doc.get("name"), doc.get("value"), doc.get("mode")
    if isinstance(value, str) and value in _NON_FINITE:
        value = _NON_FINITE[value]
    elif isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if (
        not isinstance(name, str)
        or not name
        or mode not in ("min", "max")
        or not (value is None or isinstance(value, float))
    ):
        raise ValueError(f"manifest metric {quote(doc)} is malformed")
    return Metric(name, value, mode)


@dataclass(frozen=True)
class Manifest:
    """What a sentinel says: the data directory's name and its files by data key."""

    data: str  # data directory name, e.g. "ckpt.7"
    files: dict[str, FileEntry]  # data key -> entry, in save order
    lease: int | None = None  # the writer's lease generation (None: it held none)
    metric: Metric | None = None  # the monitored metric (None: the checkpointer monitors none)


def encode(iteration: int, manifest: Manifest) -> bytes:
    """The sentinel bytes of ``manifest`` for ``iteration`` (JSON)."""
    doc = {
        "format": MANIFEST_FORMAT,
        "version": MANIFEST_VERSION,
        "iteration": iteration,
        "data": manifest.data,
        "files": {
            key: {"file": key + RECORD_SUFFIX, **vars(entry)}
            for key, entry in manifest.files.items()
        },
    }
    if manifest.lease is not None:
        doc["lease"] = manifest.lease
    if manifest.metric is not None:
        metric = manifest.metric
        doc["metric"] = {
            "name": metric.name,
            "value": _encode_value(metric.value),
            "mode": metric.mode,
        }
    return (json.dumps(doc, indent=1) + "\n").encode()


def parse(raw: bytes, iteration: int, prefix: str | None = None) -> Manifest | None:
    """The manifest in a sentinel's bytes; ``None`` for Dopamine's ``b'done'``.

    Raises ``ValueError`` saying what is wrong with anything else, including a manifest that
    names data of another checkpointer ``prefix`` (None: any prefix).
    """
    if raw == LEGACY_SENTINEL:
        return None
    if not raw:
        raise ValueError("empty sentinel")
    try:
        doc = json.loads(raw)
    except (ValueError, RecursionError):
        raise ValueError("sentinel is neither a manifest (JSON) nor Dopamine's b'done'") from None
    if not isinstance(doc, dict) or doc.get("format") != MANIFEST_FORMAT:
        raise ValueError(f"sentinel is not a {MANIFEST_FORMAT} manifest")
    if doc.get("version") != MANIFEST_VERSION:
        raise ValueError(
            f"manifest version {quote(doc.get('version'))} is not supported (this reader knows "
            f"{MANIFEST_VERSION})"
        )
    if doc.get("iteration") != iteration:
        raise ValueError(
            f"manifest is for iteration {quote(doc.get('iteration'))}, not {iteration}"
        )
    data = doc.get("data")
    if not isinstance(data, str) or parse_data_name(data, None) != iteration:
        raise ValueError(f"manifest names data {quote(data)}, not '<prefix>.{iteration}'")
    problem = member_name_problem(data)
    if problem is not None:
        raise ValueError(f"manifest data directory: {problem}")
    _safe_name(data.partition(VERSION_MARK)[0], "manifest data directory")
    if prefix is not None and parse_data_name(data, prefix) != iteration:
        raise ValueError(f"manifest names data {data!r}, not {f'{prefix}.{iteration}'!r}")
    lease = doc.get("lease")
    if lease is not None and not (_is_count(lease) and lease > 0):
        raise ValueError(f"manifest lease {quote(lease)} is not a generation number")
    return Manifest(data, _entries(doc.get("files")), lease, _metric(doc.get("metric")))


def _entries(files: object) -> dict[str, FileEntry]:
    if not isinstance(files, dict):
        raise ValueError("manifest has no 'files' map")
    entries = {}
    for key, entry in files.items():
        _safe_name(key, "manifest key")
        problem = member_name_problem(entry.get("file")) if isinstance(entry, dict) else None
        if problem is not None:
            raise ValueError(f"manifest entry {quote(key)}: {problem}")
        fields = ("kind", "size", "head_size", "head_xxh3")
        if (
            not isinstance(entry, dict)
            or entry.get("file") != key + RECORD_SUFFIX
            or not isinstance(entry.get("kind"), str)
            or any(not _is_count(entry.get(f)) for f in ("size", "head_size"))
            or not _DIGEST.fullmatch(str(entry.get("head_xxh3")))
        ):
            raise ValueError(f"manifest entry {quote(key)} is malformed")
        entries[key] = FileEntry(*(entry[f] for f in fields))
    return entries


def _is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0
