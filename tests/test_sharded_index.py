"""lightning_bpk.dcp._index: a hostile sharded index is refused by every reader, before
anything it names is opened, on local disk and on an object store (memory:// here; one case
through moto over HTTP is in tests/test_sharded_object_storage.py).

Each case writes a real checkpoint (``w`` is a 4x4 tensor saved as two 2x4 chunks, plus a plain
value), rewrites its index, and runs it through DCP's load, ``load_full_state_dict``, the verify
API, and the command line's ``verify``, ``inspect`` and ``convert``. Every error names the index
(or rank file) and the entry; a canary outside the checkpoint, a valid copy of its rank file that
the escaping names point at, is never opened.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import sys
import uuid
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from lightning_bpk import burnpack, cli
from lightning_bpk.dcp import (
    INDEX_KEY,
    INDEX_KIND,
    BurnpackStorageReader,
    BurnpackStorageWriter,
    ShardedCheckpointError,
    load_full_state_dict,
    read_index,
)
from lightning_bpk.dcp._index import MAX_DEPTH
from lightning_bpk.errors import LightningBpkError
from lightning_bpk.layout import _sharded_index_name
from lightning_bpk.lightning import sharded
from lightning_bpk.records.base import RECORD_KIND_KEY
from lightning_bpk.store import LocalStore, ObjectStore, object_store, open_store

OPENED: list[str] = []  # every path os.open/open is asked for while a test records


def _audit(event: str, args: tuple) -> None:
    if event == "open" and OPENED and isinstance(args[0], (str, bytes, os.PathLike)):
        OPENED.append(os.fsdecode(args[0]))


sys.addaudithook(_audit)  # process-wide and permanent: records only between start and stop


@pytest.fixture(autouse=True)
def _quiet_no_dist():
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        warnings.filterwarnings("ignore", ".*assuming the intent is to", UserWarning)
        yield


@contextlib.contextmanager
def recording() -> Iterator[list[str]]:
    """The paths this process opens meanwhile (and a first placeholder)."""
    OPENED[:] = ["<recording>"]
    try:
        yield OPENED
    finally:
        OPENED.clear()


@pytest.fixture
def opened() -> Iterator[list[str]]:
    """The paths opened while the test runs (trim it after the set-up)."""
    with recording() as paths:
        yield paths


STATE = {"a": torch.arange(8.0).reshape(2, 4), "b": -torch.arange(8.0).reshape(2, 4)}


def write_checkpoint(where: Path | str) -> dict[str, Any]:
    """A real checkpoint whose index is rewritten so ``w`` (4x4) is made of the stored tensors
    ``a`` (its rows 0-1) and ``b`` (rows 2-3): a valid index. Its JSON document."""
    dcp.save({**STATE, "opt": {"lr": 0.5}}, storage_writer=BurnpackStorageWriter(where))
    doc = _document(where)
    a, b = doc["tensors"].pop("a"), doc["tensors"].pop("b")
    b["chunks"][0]["offsets"] = [2, 0]
    doc["tensors"]["w"] = {**a, "shape": [4, 4], "chunks": a["chunks"] + b["chunks"]}
    doc["planner_data"] = {"w": ["w"], "opt.lr": ["opt", "lr"]}
    _write_index(where, json.dumps(doc))
    return doc


def _document(where: Path | str) -> dict[str, Any]:
    with burnpack.loads(_store(where).read(_sharded_index_name())) as pack:
        return json.loads(pack.metadata[INDEX_KEY])


def _store(where: Path | str) -> ObjectStore | LocalStore:
    return open_store(where)  # both read a key (a file name inside a directory)


def _write_index(where: Path | str, text: str) -> None:
    data = burnpack.dumps({}, metadata={RECORD_KIND_KEY: INDEX_KIND, INDEX_KEY: text})
    if isinstance(where, Path):
        (where / _sharded_index_name()).write_bytes(data)
    else:
        object_store(where).put(_sharded_index_name(), data)


def _rename_rank_file(doc: dict[str, Any], name: str) -> None:
    ((_, info),) = doc["files"].items()
    doc["files"] = {name: info}
    for t in doc["tensors"].values():
        for c in t["chunks"]:
            c["file"] = name
    for o in doc["objects"].values():
        o["file"] = name


def _chunk(doc: dict[str, Any], i: int) -> dict[str, Any]:
    return doc["tensors"]["w"]["chunks"][i]


Edit = Callable[[dict[str, Any], str], str | None]  # (document, canary) -> raw text, or None


def _escaping(doc: dict[str, Any], canary: str) -> None:
    _rename_rank_file(doc, "../outside/evil.bpk")


def _absolute(doc: dict[str, Any], canary: str) -> None:
    _rename_rank_file(doc, canary)


def _set(path: tuple, value: Any) -> Edit:
    def edit(doc: dict[str, Any], canary: str) -> None:
        node: Any = doc["tensors"]["w"]
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = value

    return edit


def _planner(planner_data: dict[str, list]) -> Edit:
    def edit(doc: dict[str, Any], canary: str) -> None:
        doc["planner_data"] = planner_data

    return edit


def _duplicate(doc: dict[str, Any], canary: str) -> None:
    doc["tensors"]["w"]["chunks"][1] = dict(_chunk(doc, 0))


def _overlap(doc: dict[str, Any], canary: str) -> None:
    _chunk(doc, 1)["offsets"] = [1, 0]


def _deep(doc: dict[str, Any], canary: str) -> str:
    text = json.dumps({**doc, "planner_data": None})
    depth = 50_000  # json.loads alone raises RecursionError on this
    return text.replace('"planner_data": null', '"planner_data": ' + "[" * depth + "]" * depth)


INDEX = r"sharded\.index\.bpk"
RANK_FILE = r"sharded\.rank-0\.[0-9a-f]{8}\.bpk"
CASES: dict[str, tuple[Edit, str, str]] = {  # edit, file named, entry named
    "escaping name": (_escaping, INDEX, r"'\.\./outside/evil\.bpk' is not a plain name"),
    "absolute name": (_absolute, INDEX, r"'/.*evil\.bpk' is not a plain name .*absolute"),
    "offset 1e18": (_set(("chunks", 1, "offsets"), [10**18, 0]), INDEX, r"'w' chunk 1: offsets"),
    "negative offset": (_set(("chunks", 1, "offsets"), [-5, 0]), INDEX, r"'w' chunk 1: offsets"),
    "negative size": (_set(("chunks", 0, "sizes"), [-2, 4]), INDEX, r"'w' chunk 0: sizes"),
    "huge size": (_set(("chunks", 0, "sizes"), [2**40, 4]), INDEX, r"'w' chunk 0: offsets"),
    "huge shape": (_set(("shape",), [10**15, 4]), INDEX, r"tensor 'w': its chunks hold 16"),
    "negative shape": (_set(("shape",), [-4, 4]), INDEX, r"tensor 'w': shape\[0\] is -4"),
    "float shape": (_set(("shape",), [4.0, 4]), INDEX, r"tensor 'w': shape\[0\] is 4\.0"),
    "unknown dtype": (_set(("dtype",), "F128"), INDEX, r"tensor 'w': unknown dtype 'F128'"),
    "duplicated chunk": (_duplicate, INDEX, r"'w' chunk 1: a second chunk at offsets \[0, 0\]"),
    "overlapping chunks": (_overlap, INDEX, r"'w': chunks at \[0, 0\] and \[1, 0\] overlap"),
    "gap": (_set(("shape",), [5, 4]), INDEX, r"tensor 'w': its chunks hold 16 .* 20 \(a gap"),
    "dtype disagrees with the rank file": (
        _set(("dtype",), "F64"),
        RANK_FILE,
        r"'a' is F32 \[2, 4\]; the index's tensor 'w' chunk 0 says F64 \[2, 4\]",
    ),
    "deep nesting": (_deep, INDEX, r"JSON nested 50001 levels deep"),
    "conflicting planner paths": (
        _planner({"w": ["w"], "opt.lr": ["w", "lr"]}),
        INDEX,
        r"planner_data 'opt\.lr': its path \['w', 'lr'\] conflicts",
    ),
}
RANK_LEVEL = {"dtype disagrees with the rank file"}  # found when the rank file is opened


@pytest.fixture(params=["local", "memory"])
def place(request, tmp_path) -> Iterator[tuple[Path | str, Path]]:
    """(the checkpoint: a directory or a memory:// URL, a local folder beside it)."""
    outside = tmp_path / "outside"
    outside.mkdir()
    if request.param == "local":
        yield tmp_path / "ckpt", outside
        return
    url = f"memory://hostile-{uuid.uuid4().hex[:8]}/ckpt"
    yield url, outside
    object_store(url).remove(list(object_store(url).list("")))


def _canary(place: tuple[Path | str, Path]) -> str:
    """A valid copy of the checkpoint's rank file where the escaping names point."""
    where, outside = place
    (rank_file,) = _document(where)["files"]
    (outside / "evil.bpk").write_bytes(_store(where).read(rank_file))
    if isinstance(where, str):  # the same object "outside" the prefix, too
        object_store(where.rsplit("/", 1)[0]).put("outside/evil.bpk", _store(where).read(rank_file))
    return str(outside / "evil.bpk")


def _refusal(call: Callable[[], object]) -> str:
    """The message of the error ``call`` raises: ours, or DCP's wrapping of ours."""
    with pytest.raises((ShardedCheckpointError, CheckpointException)) as caught:
        call()
    if isinstance(caught.value, CheckpointException):
        # DCP wraps what the metadata read raised in an AssertionError, what a read raised as is
        failures = [exc for exc, _ in caught.value.failures.values()]
        assert all(isinstance(f, (ShardedCheckpointError, AssertionError)) for f in failures)
    else:
        assert isinstance(caught.value, LightningBpkError)
    return str(caught.value)


def test_the_rewritten_index_is_valid_and_loads(place, opened):
    where, _ = place
    write_checkpoint(where)
    target = {"w": torch.zeros(4, 4), "opt": {"lr": 0.0}}
    dcp.load(target, storage_reader=BurnpackStorageReader(where))
    assert torch.equal(target["w"], torch.cat([STATE["a"], STATE["b"]])) and target["opt"]["lr"]
    assert read_index(where).check_files(verify_tensors=True) == []
    assert torch.equal(load_full_state_dict(where)["w"], target["w"])


@pytest.mark.parametrize("case", list(CASES))
def test_a_hostile_index_is_refused_by_every_reader(case, place, capsys, opened):
    where, outside = place
    edit, file, entry = CASES[case]
    doc = write_checkpoint(where)
    canary = _canary(place)
    raw = edit(doc, canary)
    _write_index(where, raw if raw is not None else json.dumps(doc))
    named = rf"{file}.*{entry}"
    del opened[1:]

    target = {"w": torch.zeros(4, 4)}
    message = _refusal(lambda: dcp.load(target, storage_reader=BurnpackStorageReader(where)))
    assert re_search(named, message) and not target["w"].any()
    assert re_search(named, _refusal(lambda: load_full_state_dict(where)))
    try:  # the verify API: the index is refused, or its check names the problem
        problems = read_index(where).check_files(verify_tensors=True)
    except ShardedCheckpointError as e:
        problems = [str(e)]
    assert case in RANK_LEVEL or not problems or re_search(named, problems[0])
    assert any(re_search(named, p) for p in problems), problems

    capsys.readouterr()
    assert cli.main(["verify", str(where)]) == cli.EXIT_FOUND
    assert re_search(named, capsys.readouterr().out)
    status = cli.main(["inspect", str(where)])
    err = capsys.readouterr().err
    if case in RANK_LEVEL:  # inspect shows the index, which is well formed: it reads no rank file
        assert status == cli.EXIT_OK
    else:
        assert status == cli.EXIT_BAD_FILE and re_search(named, err)
    converted = outside.parent / "converted.safetensors"
    assert cli.main(["convert", str(where), str(converted)]) == cli.EXIT_BAD_FILE
    assert re_search(named, capsys.readouterr().err) and not converted.exists()

    assert not [p for p in opened if str(outside) in p or "outside/evil" in p], opened


def re_search(pattern: str, text: str) -> bool:
    return re.search(pattern, text, re.DOTALL) is not None


def test_a_symlinked_checkpoint_or_rank_file_is_refused(tmp_path, opened):
    real = tmp_path / "real"
    write_checkpoint(real)
    (tmp_path / "link").symlink_to(real, target_is_directory=True)
    with pytest.raises(ShardedCheckpointError, match=r"link: a symlink"):
        read_index(tmp_path / "link")
    with pytest.raises(ShardedCheckpointError, match=r"link: a symlink"):  # resume's path
        sharded.load(tmp_path / "link", torch.nn.Linear(4, 4))
    assert cli.main(["verify", str(tmp_path / "link")]) == cli.EXIT_FOUND

    (rank_file,) = read_index(real).files
    shutil.move(real / rank_file, tmp_path / rank_file)
    (real / rank_file).symlink_to(tmp_path / rank_file)  # the same bytes, outside
    del opened[1:]
    with pytest.raises(ShardedCheckpointError, match=rf"{rank_file}: a symlink"):
        load_full_state_dict(real)
    problems = read_index(real).check_files(verify_tensors=True)
    assert len(problems) == 1 and f"{rank_file}: a symlink" in problems[0]

    # a plain member name through a symlinked directory inside the checkpoint
    (real / rank_file).unlink()
    (real / "sub").symlink_to(tmp_path, target_is_directory=True)
    doc = _document(real)
    _rename_rank_file(doc, f"sub/{rank_file}")
    _write_index(real, json.dumps(doc))
    with pytest.raises(ShardedCheckpointError, match=r"real/sub: a symlink"):
        load_full_state_dict(real)
    assert not [p for p in opened if p == str(tmp_path / rank_file)], opened


def test_nesting_is_bounded_before_it_is_parsed(tmp_path):
    write_checkpoint(tmp_path)
    doc = _document(tmp_path)
    for depth, refused in ((MAX_DEPTH - 3, False), (MAX_DEPTH - 2, True)):  # 3 levels above
        nested = json.loads("[" * depth + "]" * depth)
        doc["objects"]["deep"] = {"file": "x", "name": "y", "extra": nested}
        _write_index(tmp_path, json.dumps(doc))
        with pytest.raises(ShardedCheckpointError, match="nested" if refused else "not one of"):
            read_index(tmp_path)


def test_ls_checks_the_index_of_each_sharded_checkpoint(tmp_path, capsys):
    """A Dopamine ``b'done'`` sentinel has no manifest to hold the index's digest: ``ls`` (and
    ``verify`` of the run directory) check what the index says, as every reader does."""
    doc = write_checkpoint(tmp_path / "ckpt.0")
    burnpack.write(tmp_path / "ckpt.0" / "trainer.bpk", {})
    (tmp_path / "sentinel_checkpoint_complete.0").write_bytes(b"done")
    assert cli.main(["ls", str(tmp_path)]) == cli.EXIT_OK
    _chunk(doc, 1)["offsets"] = [10**18, 0]
    _write_index(tmp_path / "ckpt.0", json.dumps(doc))
    capsys.readouterr()
    assert cli.main(["ls", str(tmp_path)]) == cli.EXIT_FOUND
    assert re_search(rf"ckpt\.0/{INDEX}: tensor 'w' chunk 1: offsets", capsys.readouterr().out)
    assert cli.main(["verify", str(tmp_path)]) == cli.EXIT_FOUND


def test_an_index_object_is_sized_before_it_is_fetched(monkeypatch):
    url = f"memory://hostile-{uuid.uuid4().hex[:8]}/ckpt"
    write_checkpoint(url)
    monkeypatch.setattr(burnpack, "MAX_METADATA_SIZE", 16)  # the index is larger than this now
    with pytest.raises(ShardedCheckpointError, match=rf"{INDEX}: [0-9]+ bytes, too big for an"):
        read_index(url)


def test_an_index_naming_many_absent_files_gives_a_short_message(tmp_path):
    """A hostile index listing 20,000 files that are not there: the refusal names the first few
    and counts the rest (it was one message of every name: 15 MB for 200,000), while the
    verify API still lists each."""
    doc = write_checkpoint(tmp_path)
    ((_, info),) = doc["files"].items()
    absent = {f"sharded.rank-{i}.{'0' * 8}.bpk": dict(info) for i in range(20_000)}
    doc["files"].update(absent)
    _write_index(tmp_path, json.dumps(doc))
    message = _refusal(lambda: load_full_state_dict(tmp_path))
    assert "listed in the index but missing" in message and "... and 19995 more" in message
    assert len(message) < 2_000
    assert len(read_index(tmp_path).check_files()) == 20_000
