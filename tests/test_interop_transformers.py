"""Parity with transformers itself (pinned in the dev extras): every op on the same random tensors
both ways, and the Mixtral and Qwen2-MoE mappings on tiny models built from configs (no hub)."""

from __future__ import annotations

import re
import types
from pathlib import Path

import pytest
import safetensors.torch
import torch

from lightning_bpk.interop import (
    Chunk,
    Concatenate,
    Interleave,
    KeyRemapper,
    MergeModulelist,
    PermuteForRope,
    SplitModulelist,
    Transpose,
    WeightConverter,
    WeightRenaming,
    apply_remapped,
    load_module_record,
    record_remapped,
    save_module_record,
)
from lightning_bpk.interop.loading import load_remapped

transformers = pytest.importorskip("transformers", minversion="5.23")
hf = pytest.importorskip("transformers.core_model_loading")
from transformers.conversion_mapping import get_checkpoint_conversion_mapping  # noqa: E402

HEADS = 3


def _rand(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _config(heads: int = HEADS) -> types.SimpleNamespace:
    return types.SimpleNamespace(num_attention_heads=heads)


# (ours, transformers', input_dict factory, source_patterns, target_patterns)
CASES = [
    (
        "chunk",
        Chunk(dim=1),
        hf.Chunk(dim=1),
        lambda: {"qkv": [_rand(4, 12, seed=1)]},
        ["qkv"],
        ["q", "k", "v"],
    ),
    (
        "chunk-uneven",
        Chunk(dim=0),
        hf.Chunk(dim=0),
        lambda: {"w": [_rand(7, 2, seed=2)]},
        ["w"],
        ["a", "b"],
    ),
    (
        "concatenate",
        Concatenate(dim=0),
        hf.Concatenate(dim=0),
        lambda: {"gate": [_rand(3, 4, seed=3)], "up": [_rand(3, 4, seed=4)]},
        ["gate", "up"],
        ["gate_up"],
    ),
    (
        "merge-single",
        MergeModulelist(dim=0),
        hf.MergeModulelist(dim=0),
        lambda: {"e.*.w2": [_rand(2, 5, seed=10 + i) for i in range(4)]},
        ["e.*.w2"],
        ["e.down"],
    ),
    (
        "merge-chain-first",
        MergeModulelist(dim=1),
        hf.MergeModulelist(dim=1),
        lambda: {
            p: [_rand(2, 5, seed=20 + i + 7 * k) for i in range(3)]
            for k, p in enumerate(["e.*.w1", "e.*.w3"])
        },
        ["e.*.w1", "e.*.w3"],
        ["e.gate_up"],
    ),
    (
        "split-single",
        SplitModulelist(dim=0),
        hf.SplitModulelist(dim=0),
        lambda: {"e.down": [_rand(4, 2, 5, seed=30)]},
        ["e.down"],
        ["e.*.w2"],
    ),
    (
        "split-chain-last",
        SplitModulelist(dim=1),
        hf.SplitModulelist(dim=1),
        lambda: {"e.*.w1": _rand(2, 3, 5, seed=31), "e.*.w3": _rand(2, 3, 5, seed=32)},
        ["e.gate_up"],
        ["e.*.w1", "e.*.w3"],
    ),
    (
        "transpose",
        Transpose(0, 1),
        hf.Transpose(0, 1),
        lambda: {"w": [_rand(3, 5, seed=40)]},
        ["w"],
        ["w_t"],
    ),
    (
        "transpose-3d",
        Transpose(2, 1),
        hf.Transpose(2, 1),
        lambda: {"w": _rand(2, 3, 5, seed=41)},
        ["w"],
        ["w"],
    ),
    (
        "interleave",
        Interleave(dim=1),
        hf.Interleave(dim=1),
        lambda: {"w": [_rand(3, 8, seed=50)]},
        ["w"],
        ["w"],
    ),
    (
        "interleave-inverse",
        Interleave(dim=0, inverse=True),
        hf.Interleave(dim=0, inverse=True),
        lambda: {"w": [_rand(6, 2, seed=51)]},
        ["w"],
        ["w"],
    ),
    (
        "rope-2d",
        PermuteForRope(num_heads=HEADS),
        hf.PermuteForRope(),
        lambda: {"q_proj.weight": [_rand(HEADS * 8, 5, seed=60)]},
        ["q_proj.weight"],
        ["q_proj.weight"],
    ),
    (
        "rope-1d-inverse",
        PermuteForRope(num_heads=HEADS, inverse=True),
        hf.PermuteForRope(inverse=True),
        lambda: {"q_proj.bias": [_rand(HEADS * 4, seed=61)]},
        ["q_proj.bias"],
        ["q_proj.bias"],
    ),
    (
        "rope-layer-names",
        PermuteForRope(num_heads=HEADS, permute_layer_names=["k_proj"]),
        hf.PermuteForRope(permute_layer_names=["k_proj"]),
        lambda: {
            "q_proj": [_rand(HEADS * 2, 3, seed=62)],
            "k_proj": [_rand(HEADS * 2, 3, seed=63)],
        },
        ["q_proj", "k_proj"],
        ["qk"],
    ),
]


def _convert(op, input_dict, sources, targets):
    return op.convert(
        input_dict, source_patterns=sources, target_patterns=targets, config=_config()
    )


def _same(ours: dict, theirs: dict) -> None:
    assert list(ours) == list(theirs)
    for key in theirs:
        a, b = ours[key], theirs[key]
        a = a[0] if isinstance(a, list) else a
        b = b[0] if isinstance(b, list) else b
        assert a.shape == b.shape and a.dtype == b.dtype, key
        assert torch.equal(a, b), key


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_op_matches_transformers_both_ways(case):
    _, ours, theirs, make, sources, targets = case
    assert type(ours).__name__ == type(theirs).__name__
    forward = _convert(ours, make(), sources, targets)
    _same(forward, _convert(theirs, make(), sources, targets))
    # the reverse op on the forward result, with the patterns swapped, as a reversed converter
    back = _convert(ours.reverse_op, dict(forward), targets, sources)
    _same(back, _convert(theirs.reverse_op, dict(forward), targets, sources))
    assert type(ours.reverse_op).__name__ == type(theirs.reverse_op).__name__


# --- mappings on real transformers models --------------------------------------------------------

# pasted from transformers/conversion_mapping.py (5.23.0), changed only in the import
MIXTRAL = [
    WeightRenaming(".block_sparse_moe.", ".mlp."),
    WeightConverter(
        source_patterns=[
            ".experts.*.w1.weight",
            ".experts.*.w3.weight",
        ],
        target_patterns=".experts.gate_up_proj",
        operations=[
            MergeModulelist(dim=0),
            Concatenate(dim=1),
        ],
    ),
    WeightConverter(
        source_patterns=[
            ".experts.*.w2.weight",
        ],
        target_patterns=".experts.down_proj",
        operations=[
            MergeModulelist(dim=0),
        ],
    ),
]
QWEN2_MOE = [
    WeightConverter(
        source_patterns=[
            "mlp.experts.*.gate_proj.weight",
            "mlp.experts.*.up_proj.weight",
        ],
        target_patterns="mlp.experts.gate_up_proj",
        operations=[MergeModulelist(dim=0), Concatenate(dim=1)],
    ),
    WeightConverter(
        source_patterns="mlp.experts.*.down_proj.weight",
        target_patterns="mlp.experts.down_proj",
        operations=[MergeModulelist(dim=0)],
    ),
]


def _mixtral():
    config = transformers.MixtralConfig(
        vocab_size=32,
        hidden_size=16,
        intermediate_size=8,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        num_local_experts=3,
        num_experts_per_tok=2,
        max_position_embeddings=16,
    )
    return config, transformers.MixtralForCausalLM


def _qwen2_moe():
    config = transformers.Qwen2MoeConfig(
        vocab_size=32,
        hidden_size=16,
        intermediate_size=8,
        moe_intermediate_size=4,
        shared_expert_intermediate_size=8,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        num_experts=3,
        num_experts_per_tok=2,
        max_position_embeddings=16,
    )
    return config, transformers.Qwen2MoeForCausalLM


def _signature(rules) -> list:
    """A mapping as comparable data: kinds, patterns, ops and their arguments."""
    out = []
    for rule in rules:
        ops = [
            (type(op).__name__, {k: v for k, v in vars(op).items() if k in ("dim", "dim0", "dim1")})
            for op in getattr(rule, "operations", [])
        ]
        out.append(
            (type(rule).__name__, list(rule.source_patterns), list(rule.target_patterns), ops)
        )
    return out


def _state(model) -> dict[str, torch.Tensor]:
    return {n: t.detach() for n, t in model.state_dict().items()}


@pytest.mark.parametrize(
    ("model_type", "build", "mapping"),
    [("mixtral", _mixtral, MIXTRAL), ("qwen2_moe", _qwen2_moe, QWEN2_MOE)],
)
def test_mapping_matches_transformers_both_ways(tmp_path, model_type, build, mapping):
    assert _signature(mapping) == _signature(get_checkpoint_conversion_mapping(model_type))
    config, cls = build()
    torch.manual_seed(0)
    original = cls(config)
    # transformers saves in the checkpoint layout (its reverse mapping): per-expert tensors
    original.save_pretrained(tmp_path / "hf")
    checkpoint = safetensors.torch.load_file(tmp_path / "hf" / "model.safetensors")
    assert any(".experts.0." in n for n in checkpoint)
    remapper = KeyRemapper(mapping)

    # load: ours (sequential and on the pool) and transformers' give the same model
    theirs = _state(cls.from_pretrained(tmp_path / "hf"))
    assert theirs.keys() == _state(original).keys()
    for load in ("apply_remapped", "load_remapped"):
        torch.manual_seed(1)
        ours = cls(config)
        path = tmp_path / "hf" / "model.safetensors"
        if load == "apply_remapped":
            unmatched = apply_remapped(load_module_record(path), ours, remapper)
        else:
            unmatched = load_remapped(path, ours, remapper, workers=3)
        assert unmatched == []
        state = _state(ours)
        assert state.keys() == theirs.keys()
        for name, tensor in theirs.items():
            assert torch.equal(state[name], tensor), (load, name)

    # save: ours gives transformers' checkpoint, names, shapes and values
    record, unmatched = record_remapped(original, remapper)
    assert unmatched == []
    assert sorted(record.tensors) == sorted(checkpoint)
    for name, tensor in checkpoint.items():
        assert torch.equal(record.tensors[name], tensor), name
    # and transformers loads what we saved
    (tmp_path / "ours").mkdir()
    (tmp_path / "ours" / "config.json").write_bytes((tmp_path / "hf" / "config.json").read_bytes())
    save_module_record(record, tmp_path / "ours" / "model.safetensors")
    reloaded = _state(cls.from_pretrained(tmp_path / "ours"))
    for name, tensor in theirs.items():
        assert torch.equal(reloaded[name], tensor), name


def test_docs_mixtral_example_runs_as_written(tmp_path, monkeypatch):
    page = (Path(__file__).resolve().parents[1] / "docs" / "interop.md").read_text()
    block = page.split("<!-- mixtral-example -->", 1)[1].split("```python\n", 1)[1]
    code = block.split("```", 1)[0]
    monkeypatch.chdir(tmp_path)
    exec(compile(code, "docs/interop.md", "exec"), {})
    assert (tmp_path / "mixtral-again.safetensors").is_file()
    reloaded = transformers.MixtralForCausalLM.from_pretrained(tmp_path / "mixtral")
    assert reloaded.model.layers[1].mlp.experts.down_proj.shape == (4, 16, 8)


def _sample_key(pattern: str) -> str:
    """A name a (regex) source pattern plausibly matches: its literal text, groups filled in."""
    text = re.sub(r"\(\?<?[!=][^)]*\)", "", pattern.removeprefix("^"))
    text = re.sub(r"\((?:\\d\+|\[0-9\]\+)\)|\\d\+", "3", text)
    text = re.sub(r"\(\.[+*]\??\)|\.[+*]\??", "x", text)
    text = re.sub(r"\(([^()|]*)\|[^()]*\)", r"\1", text)
    return text.replace("*", "0").replace("\\", "")


def _all_renamings() -> list:
    """Every distinct plain WeightRenaming of transformers' tables."""
    from transformers.conversion_mapping import _build_checkpoint_conversion_mapping

    distinct = {}
    for rules in _build_checkpoint_conversion_mapping().values():
        for rule in rules:
            if type(rule) is hf.WeightRenaming:
                key = (tuple(rule._original_source_patterns), tuple(rule._original_target_patterns))
                distinct.setdefault(key, rule)
    return list(distinct.values())


def test_every_renaming_of_transformers_tables_renames_as_transformers():
    """Every plain WeightRenaming of transformers' tables, ours built from the same patterns,
    on names made from every table's patterns: the same new name (or none) both ways."""
    renamings = _all_renamings()
    assert len(renamings) > 100
    samples = {}  # renaming -> names made from its own patterns
    for rule in renamings:
        names = set()
        for pattern in rule._original_source_patterns + rule._original_target_patterns:
            sample = _sample_key(pattern)
            names |= {sample, f"model.layers.1.{sample.strip('.')}.weight"}
        samples[id(rule)] = names
    others = sorted(set().union(*samples.values()))[::25]  # and a spread of everyone else's
    # built first: transformers' reverse_transform rewrites the pattern lists it was given, which
    # tables share, in place
    pairs = [
        (WeightRenaming(t._original_source_patterns, t._original_target_patterns), t)
        for t in renamings
    ]
    matched = 0
    for ours, theirs in pairs:
        back, their_back = ours.reverse_transform(), theirs.reverse_transform()
        for key in samples[id(theirs)].union(others):
            assert ours.rename_source_key(key) == theirs.rename_source_key(key), (theirs, key)
            assert back.rename_source_key(key) == their_back.rename_source_key(key), (theirs, key)
            matched += ours.rename_source_key(key)[1] is not None
    assert matched > len(renamings)  # most renamings matched at least one name


def _their_load(rules: list, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers' load path on a plain state dict, as convert_and_load_state_dict_in_model
    runs it (renamings, then at most one converter per key, converters per target)."""
    import copy

    renamings = [r for r in rules if isinstance(r, hf.WeightRenaming)]
    converters = [r for r in rules if isinstance(r, hf.WeightConverter)]
    by_pattern = {p: c for c in converters for p in c.source_patterns}
    pending: dict[str, object] = {}
    for key in sorted(state, key=hf.dot_natural_key):
        renamed, pattern = hf.rename_source_key(key, renamings, converters)
        if pattern is None:
            mapping = pending.setdefault(renamed, hf.WeightRenaming(key, renamed))
            pattern = key
        else:
            mapping = pending.setdefault(renamed, copy.deepcopy(by_pattern[pattern]))
        mapping.add_tensor(renamed, key, pattern, state[key])
    out = {}
    for first, mapping in pending.items():
        for name, value in mapping.convert(first, config=_config()).items():
            out[name] = value[0] if isinstance(value, list) else value
    return out


CHAINS = {
    # inkling_mm_model's shared expert: one-to-many through a chain
    "interleave-chunk": (
        lambda m: [
            m.WeightConverter(
                "mlp.w13_dn.weight",
                ["mlp.gate_proj.weight", "mlp.up_proj.weight"],
                [m.Interleave(dim=0), m.Chunk(dim=0)],
            )
        ],
        {f"model.layers.{i}.mlp.w13_dn.weight": _rand(8, 3, seed=70 + i) for i in range(2)},
    ),
    # RoPE-permuted q and k fused into one projection, after a prefix renaming
    "rope-fuse": (
        lambda m: [
            m.WeightRenaming(r"^transformer\.", "model."),
            m.WeightConverter(
                ["attn.q.weight", "attn.k.weight"],
                "attn.qk.weight",
                [m.PermuteForRope(**ROPE_ARGS[m is hf]), m.Concatenate(dim=0)],
            ),
        ],
        {
            f"transformer.h.{i}.attn.{p}.weight": _rand(HEADS * 4, 5, seed=80 + 2 * i + k)
            for i in range(2)
            for k, p in enumerate("qk")
        },
    ),
}
ROPE_ARGS = {True: {}, False: {"num_heads": HEADS}}  # transformers reads the heads from config
OURS = types.SimpleNamespace(
    WeightConverter=WeightConverter,
    WeightRenaming=WeightRenaming,
    Interleave=Interleave,
    Chunk=Chunk,
    PermuteForRope=PermuteForRope,
    Concatenate=Concatenate,
)


@pytest.mark.parametrize("chain", sorted(CHAINS))
def test_converter_chains_match_transformers_both_ways(chain):
    build, state = CHAINS[chain]
    theirs = _their_load(build(hf), state)
    ours = KeyRemapper(build(OURS)).load({n: (t, None) for n, t in state.items()})
    assert sorted(ours.tensors) == sorted(theirs)
    for name, tensor in theirs.items():
        assert torch.equal(ours.tensors[name][0], tensor), name
    # saving: transformers' revert_weight_conversion, and ours
    model = types.SimpleNamespace(_weight_conversions=build(hf), config=_config())
    reverted = hf.revert_weight_conversion(model, dict(theirs))
    saved = KeyRemapper(build(OURS)).save(ours.tensors).tensors
    assert sorted(saved) == sorted(reverted) == sorted(state)
    for name, tensor in state.items():
        assert torch.equal(saved[name][0], tensor) and torch.equal(reverted[name], tensor), name
