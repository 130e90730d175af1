"""Checkpoint sets: an index and its shards as one source, local and at a URL (memory://), read
lazily with each shard opened once, rules across shards, and every hostile index refused."""

from __future__ import annotations

import io
import json
import uuid
from pathlib import Path

import fsspec
import pytest
import safetensors
import safetensors.torch
import torch
from torch import nn

from lightning_bpk.interop import (
    Concatenate,
    KeyRemapper,
    MergeModulelist,
    RemapError,
    WeightConverter,
    _sources,
    load_into_shards,
    load_remapped,
)
from lightning_bpk.interop.formats import Content, read_content, write_content
from lightning_bpk.interop.sets import describe_set, is_set, read_any, write_set
from lightning_bpk.records import RecordError

g = torch.Generator().manual_seed(5)
EXPERTS = {
    **{f"layer.experts.{e}.w1.weight": torch.randn(4, 6, generator=g) for e in range(3)},
    **{f"layer.experts.{e}.w3.weight": torch.randn(4, 6, generator=g) for e in range(3)},
    "layer.norm.weight": torch.randn(6, generator=g),
}
FUSE = KeyRemapper(
    [
        WeightConverter(
            [".experts.*.w1.weight", ".experts.*.w3.weight"],
            ".experts.gate_up_proj",
            [MergeModulelist(dim=0), Concatenate(dim=1)],
        )
    ]
)
SHARD_BYTES = 2 * 4 * 6 * 4  # two expert matrices a shard


class Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.experts = nn.Module()
        self.experts.gate_up_proj = nn.Parameter(torch.zeros(3, 8, 6))
        self.norm = nn.Module()
        self.norm.weight = nn.Parameter(torch.zeros(6))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = Layer()


def _expected() -> dict[str, torch.Tensor]:
    items = FUSE.load({n: (t, None) for n, t in EXPERTS.items()}).tensors
    return {n: t for n, (t, _) in items.items()}


@pytest.fixture(scope="module")
def sets(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("sets")
    content = Content(dict(EXPERTS))
    return {
        suffix: write_set(
            content, root / suffix.strip("."), max_shard_size=SHARD_BYTES, suffix=suffix
        )
        for suffix in (".safetensors", ".bpk")
    }


def _check(net: nn.Module) -> None:
    for name, tensor in _expected().items():
        assert torch.equal(net.state_dict()[name], tensor), name


@pytest.mark.parametrize("suffix", [".safetensors", ".bpk"])
@pytest.mark.parametrize("by", ["index", "directory"])
def test_a_set_loads_as_one_file_with_rules_across_shards(sets, suffix, by, monkeypatch):
    index = sets[suffix]
    found = describe_set(index)
    assert len(found.shards) == 4 and is_set(index.parent)
    # a converter group's sources lie in different shards
    assert len({found.weight_map[f"layer.experts.{e}.w1.weight"] for e in range(3)}) > 1
    opened: list[str] = []
    real = _sources._open_file

    def counting(loc, options):
        opened.append(str(loc))
        return real(loc, options)

    monkeypatch.setattr(_sources, "_open_file", counting)
    net = Net()
    assert load_remapped(index if by == "index" else index.parent, net, FUSE, workers=2) == []
    _check(net)
    assert sorted(opened) == sorted(str(index.parent / s) for s in found.shards)  # once each


def test_load_into_shards_reads_across_the_sets_files(sets):
    net = Net()
    done = load_into_shards(sets[".safetensors"], net, FUSE)
    _check(net)
    assert done.bytes_read == sum(t.numel() * 4 for t in EXPERTS.values())


def test_read_any_and_a_set_at_a_url(sets):
    fs = fsspec.filesystem("memory")
    index = sets[".safetensors"]
    for path in index.parent.iterdir():
        fs.pipe(f"/sets-test/{path.name}", path.read_bytes())
    url = "memory://sets-test/model.safetensors.index.json"
    assert is_set(url) and is_set("memory://sets-test")
    for source in (index, url):
        content = read_any(source, device="cpu")
        assert list(content.tensors) == list(EXPERTS)
        assert all(torch.equal(content.tensors[n], t) for n, t in EXPERTS.items())
        with pytest.raises(ValueError, match="'meta': it holds no data"):
            read_any(source, device="meta")
    single = next(index.parent.glob("*.safetensors"))  # one shard: a plain file
    plain = read_any(single, device="cpu")
    assert plain.tensors and all(torch.equal(t, EXPERTS[n]) for n, t in plain.tensors.items())
    net = Net()
    load_remapped(url, net, FUSE)
    _check(net)
    net = Net()
    done = load_into_shards("memory://sets-test", net, FUSE)
    _check(net)
    assert done.bytes_read == sum(t.numel() * 4 for t in EXPERTS.values())


def test_a_url_safetensors_header_is_checked_before_use():
    fs = fsspec.filesystem("memory")
    good = safetensors.torch.save({"w": torch.ones(2)})
    fs.pipe("/hdr-test/long.safetensors", (10**9).to_bytes(8, "little") + good[8:])
    fs.pipe("/hdr-test/json.safetensors", (4).to_bytes(8, "little") + b"{]  ")
    entry = {"w": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}
    blob = json.dumps(entry).encode()
    fs.pipe("/hdr-test/size.safetensors", len(blob).to_bytes(8, "little") + blob + b"\0" * 8)
    for name, words in (
        ("long", "header length"),
        ("json", "not a safetensors header"),
        ("size", "tensor 'w': bad shape or offsets"),
    ):
        with pytest.raises(RecordError, match=words):
            read_any(f"memory://hdr-test/{name}.safetensors")


def _index(directory: Path, weight_map: object, name: str = "model.safetensors.index.json") -> Path:
    directory.mkdir(exist_ok=True)
    path = directory / name
    path.write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return path


@pytest.mark.parametrize(
    ("shard", "words"),
    [
        ("../outside.safetensors", "component '..'"),
        ("/etc/passwd.safetensors", "an absolute path"),
        ("a\\b.safetensors", "a backslash"),
        ("notes.txt", "is not .safetensors/.bpk"),
        (7, "is not a file name"),
    ],
)
def test_shard_names_may_not_leave_the_set(tmp_path, shard, words):
    index = _index(tmp_path / "set", {"w": shard})
    with pytest.raises(RecordError, match=words):
        load_remapped(index, nn.Linear(1, 1))


def test_index_and_shards_must_agree(tmp_path):
    directory = tmp_path / "set"
    directory.mkdir()
    safetensors.torch.save_file(
        {"a": torch.ones(1), "extra": torch.ones(1)}, directory / "s1.safetensors"
    )
    index = _index(directory, {"a": "s1.safetensors", "b": "s1.safetensors"})
    with pytest.raises(RecordError) as e:
        read_any(index)
    assert "'b' is not in its shard 's1.safetensors'" in str(e.value)
    assert "holds 'extra', which the index places in 'no shard'" in str(e.value)
    for raw, words in ((b"{not json", "not a JSON index"), (b"[]", "no 'weight_map'")):
        index.write_bytes(raw)
        with pytest.raises(RecordError, match=words):
            read_any(index)


def test_a_pytorch_model_bin_set_is_refused_without_unpickling(tmp_path):
    directory = tmp_path / "bin"
    torch.save({"w": torch.ones(1)}, tmp_path / "pytorch_model-00001-of-00001.bin")
    _index(directory, {"w": "pytorch_model-00001-of-00001.bin"}, "pytorch_model.bin.index.json")
    for source in (directory, directory / "pytorch_model.bin.index.json"):
        with pytest.raises(RecordError, match="unpickles nothing but tensors"):
            load_remapped(source, nn.Linear(1, 1))
    other = _index(tmp_path / "other", {"w": "x.bin"})
    with pytest.raises(RecordError, match="pickle"):
        read_any(other)


def test_a_wrong_expert_shape_names_the_file_the_tensor_and_both_shapes(tmp_path):
    bad = dict(EXPERTS)
    bad["layer.experts.2.w1.weight"] = torch.zeros(5, 6)
    index = write_set(Content(bad), tmp_path / "bad", max_shard_size=SHARD_BYTES)
    shard = describe_set(index).weight_map["layer.experts.2.w1.weight"]
    with pytest.raises(RemapError) as e:
        load_remapped(index, Net(), FUSE)
    message = str(e.value)
    assert str(tmp_path / "bad" / shard) in message
    assert "'layer.experts.2.w1.weight' has shape [5, 6]" in message
    assert "'layer.experts.0.w1.weight' of the same list has [4, 6]" in message


def test_write_set_never_touches_an_existing_directory(tmp_path, sets):
    with pytest.raises(RecordError, match="exists"):
        write_set(Content(dict(EXPERTS)), sets[".bpk"].parent, max_shard_size=SHARD_BYTES)
    broken = Content(
        {"w": torch.ones(1), "q": torch.zeros(1, dtype=torch.uint8).view(torch.bits8)}
    )  # no dtype
    with pytest.raises(RecordError):
        write_set(broken, tmp_path / "new", max_shard_size=4)
    assert list(tmp_path.iterdir()) == []  # nothing left behind
    (tmp_path / "empty").mkdir()
    with pytest.raises(RecordError, match="exists"):
        write_set(Content(dict(EXPERTS)), tmp_path / "empty", max_shard_size=SHARD_BYTES)
    assert [p.name for p in tmp_path.iterdir()] == ["empty"]
    assert list((tmp_path / "empty").iterdir()) == []


@pytest.mark.parametrize("suffix", [".safetensors", ".bpk"])
def test_a_set_is_written_and_read_back_at_a_url(suffix):
    """write_set publishes through the destination's store: at a URL the shards go to their
    keys and the index last, and read_any reads the set back there."""
    url = f"memory://write-set-{uuid.uuid4().hex[:8]}/set"
    index = write_set(Content(dict(EXPERTS)), url, max_shard_size=SHARD_BYTES, suffix=suffix)
    assert str(index).startswith(url + "/model.") and is_set(url)
    back = read_any(url)
    assert list(back.tensors) == list(EXPERTS)
    assert all(torch.equal(back.tensors[n], t) for n, t in EXPERTS.items())
    with pytest.raises(RecordError, match="exists"):
        write_set(Content(dict(EXPERTS)), url, max_shard_size=SHARD_BYTES)


def test_a_shape_mismatch_with_the_module_names_the_shards(sets):
    index = sets[".safetensors"]
    found = describe_set(index)
    net = Net()
    net.layer.experts.gate_up_proj = nn.Parameter(torch.zeros(3, 8, 5))
    with pytest.raises(RecordError) as e:
        load_remapped(index, net, FUSE)
    message = str(e.value)
    assert "'layer.experts.gate_up_proj': shape mismatch, expected [3, 8, 5]" in message
    shard = index.parent / found.weight_map["layer.experts.2.w3.weight"]
    assert f"'layer.experts.2.w3.weight' in {shard}" in message


def test_the_record_loader_and_convert_read_sets_too(sets, tmp_path):
    from lightning_bpk.interop import apply_remapped, convert, load_module_record

    for index in sets.values():
        net = Net()
        assert apply_remapped(load_module_record(index.parent), net, FUSE) == []
        _check(net)
    out = convert(sets[".bpk"], tmp_path / "one.safetensors")
    loaded = safetensors.torch.load_file(out)
    assert all(torch.equal(loaded[n], t) for n, t in EXPERTS.items())


@pytest.mark.parametrize("suffix", [".safetensors", ".bpk"])
def test_a_file_at_a_url_reads_as_the_same_file_on_disk(tmp_path, suffix):
    """read_content and read_any read a file through its store: a URL gives back what the
    same file on local disk gives (param ids, data order, metadata), not a reduced copy."""
    content = Content(
        {"b": torch.arange(4, dtype=torch.int16), "a": torch.ones(2, 3)},
        param_ids={"a": 7},
        metadata={"note": "x"},
    )
    url = f"memory://read-url-{uuid.uuid4().hex[:8]}/m{suffix}"
    write_content(url, content)
    write_content(tmp_path / f"m{suffix}", content)
    local = read_content(tmp_path / f"m{suffix}")
    for remote in (read_content(url), read_any(url)):
        assert list(remote.tensors) == list(local.tensors)
        assert all(torch.equal(remote.tensors[n], t) for n, t in local.tensors.items())
        assert (remote.param_ids, remote.metadata) == (local.param_ids, local.metadata)


def test_a_torch_save_file_at_a_url_is_read_through_its_store(tmp_path):
    """torch.load reads a file object the store opens: a .pt at a URL imports as on disk,
    still with weights_only=True."""
    state = {"w": torch.arange(3.0), "b": torch.ones(2, dtype=torch.int64)}
    url = f"memory://torch-url-{uuid.uuid4().hex[:8]}/m.pt"
    buffer = io.BytesIO()
    torch.save(state, buffer)
    fsspec.filesystem("memory").pipe(url, buffer.getvalue())
    content = read_content(url)
    assert all(torch.equal(content.tensors[n], t) for n, t in state.items())


def test_a_set_keeps_its_shards_metadata(tmp_path):
    """transformers writes ``{"format": "pt"}`` (and a user what they like) into every shard:
    reading the set keeps what the shards share, and writing it again puts it in each shard."""
    root = tmp_path / "hf"
    root.mkdir()
    weight_map = {}
    for k, names in enumerate((["a", "b"], ["c"])):
        shard = f"model-{k + 1:05d}-of-00002.safetensors"
        tensors = {n: torch.full((2,), float(i)) for i, n in enumerate(names)}
        meta = {"format": "pt", "note": "shared", "part": str(k)}
        safetensors.torch.save_file(tensors, root / shard, metadata=meta)
        weight_map.update(dict.fromkeys(names, shard))
    index = {"metadata": {"total_size": 24}, "weight_map": weight_map}
    (root / "model.safetensors.index.json").write_text(json.dumps(index))
    content = read_any(root)
    assert content.metadata["format"] == "pt" and content.metadata["note"] == "shared"
    assert "part" not in content.metadata  # differs between shards: each keeps its own
    again = write_set(content, tmp_path / "again", max_shard_size=8, suffix=".bpk")
    for shard in sorted(again.parent.glob("*.bpk")):
        assert read_content(shard).metadata["note"] == "shared"
    back = write_set(read_any(again), tmp_path / "back", max_shard_size=8)
    for shard in sorted(back.parent.glob("*.safetensors")):
        with safetensors.safe_open(shard, framework="pt") as f:
            assert f.metadata()["format"] == "pt" and f.metadata()["note"] == "shared"
