"""transformers' conversion vocabulary as KeyRemapper rules: ops, converters, chains, errors,
saving back, and Burn's names (parity with transformers itself: test_interop_transformers.py)."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
from torch import nn

from lightning_bpk.interop import (
    BurnToPyTorchAdapter,
    Chunk,
    Concatenate,
    Interleave,
    KeyRemapper,
    MergeModulelist,
    PermuteForRope,
    PyTorchToBurnAdapter,
    RemapError,
    Rename,
    SplitModulelist,
    Transpose,
    WeightConverter,
    WeightRenaming,
    apply_remapped,
    conversions,
    load_module_record,
    record_remapped,
    remap,
)
from lightning_bpk.interop._placing import placing
from lightning_bpk.records.module import ModuleRecord, param_ids

EXPERTS, HIDDEN, INTER = 3, 4, 6

MIXTRAL = [
    WeightRenaming(".block_sparse_moe.", ".mlp."),
    WeightConverter(
        source_patterns=[".experts.*.w1.weight", ".experts.*.w3.weight"],
        target_patterns=".experts.gate_up_proj",
        operations=[MergeModulelist(dim=0), Concatenate(dim=1)],
    ),
    WeightConverter(
        source_patterns=[".experts.*.w2.weight"],
        target_patterns=".experts.down_proj",
        operations=[MergeModulelist(dim=0)],
    ),
]


class Experts(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.zeros(EXPERTS, 2 * INTER, HIDDEN))
        self.down_proj = nn.Parameter(torch.zeros(EXPERTS, HIDDEN, INTER))


class Moe(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate = nn.Linear(HIDDEN, EXPERTS, bias=False)
        self.experts = Experts()


def fused_model(layers: int = 2) -> nn.Module:
    """A Mixtral-shaped model as transformers v5 lays it out: fused expert parameters."""
    model = nn.Module()
    model.layers = nn.ModuleList()
    for _ in range(layers):
        layer = nn.Module()
        layer.mlp = Moe()
        model.layers.append(layer)
    return model


def legacy_state(layers: int = 2, seed: int = 0) -> dict[str, torch.Tensor]:
    """A Mixtral checkpoint's names and shapes: one w1/w2/w3 per expert."""
    g = torch.Generator().manual_seed(seed)
    state = {}
    for i in range(layers):
        prefix = f"layers.{i}.block_sparse_moe"
        state[f"{prefix}.gate.weight"] = torch.randn(EXPERTS, HIDDEN, generator=g)
        for e in range(EXPERTS):
            state[f"{prefix}.experts.{e}.w1.weight"] = torch.randn(INTER, HIDDEN, generator=g)
            state[f"{prefix}.experts.{e}.w2.weight"] = torch.randn(HIDDEN, INTER, generator=g)
            state[f"{prefix}.experts.{e}.w3.weight"] = torch.randn(INTER, HIDDEN, generator=g)
    return state


def test_mixtral_experts_fuse_on_load_and_split_back_on_save(tmp_path):
    state = legacy_state()
    ids = {n: 1000 + k for k, n in enumerate(state)}
    path = ModuleRecord(state, param_ids=ids).save(tmp_path / "mixtral.bpk")
    model = fused_model()
    remapper = KeyRemapper(MIXTRAL)
    assert apply_remapped(load_module_record(path), model, remapper) == []
    experts = model.layers[1].mlp.experts
    for e in range(EXPERTS):
        w1 = state[f"layers.1.block_sparse_moe.experts.{e}.w1.weight"]
        w3 = state[f"layers.1.block_sparse_moe.experts.{e}.w3.weight"]
        assert torch.equal(experts.gate_up_proj[e], torch.cat([w1, w3]))
        assert torch.equal(
            experts.down_proj[e], state[f"layers.1.block_sparse_moe.experts.{e}.w2.weight"]
        )
    # the fused parameter takes the id of its first source (expert 0's w1)
    assert (
        param_ids(model)["layers.1.mlp.experts.gate_up_proj"]
        == (ids["layers.1.block_sparse_moe.experts.0.w1.weight"])
    )

    record, unmatched = record_remapped(model, remapper)
    assert unmatched == []
    assert sorted(record.tensors) == sorted(state)
    for name, tensor in state.items():
        assert torch.equal(record.tensors[name], tensor), name
        assert record.tensors[name].shape == tensor.shape
    # ids: every first part gets its source's id back
    assert (
        record.param_ids["layers.0.block_sparse_moe.experts.0.w1.weight"]
        == (ids["layers.0.block_sparse_moe.experts.0.w1.weight"])
    )
    assert (
        record.param_ids["layers.0.block_sparse_moe.gate.weight"]
        == (ids["layers.0.block_sparse_moe.gate.weight"])
    )


def test_converter_problems_name_pattern_and_every_key_at_once():
    state = legacy_state()
    del state["layers.0.block_sparse_moe.experts.1.w3.weight"]  # w3 has experts 0, 2
    del state["layers.1.block_sparse_moe.experts.2.w2.weight"]  # w2 stops at 1: fine alone
    state["layers.1.block_sparse_moe.experts.7.w2.weight"] = torch.zeros(HIDDEN, INTER)
    items = {n: (t, None) for n, t in state.items()}
    with pytest.raises(RemapError) as info:
        KeyRemapper(MIXTRAL).load(items)
    message = str(info.value)
    assert "'.experts.*.w3.weight' for 'layers.0.mlp.experts.gate_up_proj'" in message
    assert "indices ['0', '2']" in message
    # keys are named as the file names them, before the renamings
    assert "'layers.0.block_sparse_moe.experts.2.w3.weight'" in message
    assert "different numbers of keys" in message
    # the second converter's problem is in the same error
    assert "'.experts.*.w2.weight' for 'layers.1.mlp.experts.down_proj'" in message
    assert "indices ['0', '1', '7']" in message


def test_a_pattern_that_matches_nothing_in_a_group_is_named():
    fuse = WeightConverter(["gate.weight", "up.weight"], "gate_up.weight", [Concatenate(0)])
    items = {"a.gate.weight": (torch.zeros(1, 2), None), "b.up.weight": (torch.ones(1, 2), None)}
    with pytest.raises(RemapError, match=r"'up.weight' matches no key for 'a.gate_up.weight'"):
        KeyRemapper([fuse]).load(items)


def test_op_failures_are_collected_per_target():
    rope = WeightConverter("q.weight", "q.weight", [PermuteForRope(num_heads=4)])
    items = {f"l{i}.q.weight": (torch.zeros(6, 2), None) for i in range(2)}
    with pytest.raises(RemapError) as info:
        KeyRemapper([rope]).load(items)
    assert "'l0.q.weight' from ['l0.q.weight']" in str(info.value)
    assert "'l1.q.weight' from ['l1.q.weight']" in str(info.value)
    assert "6 rows are not 4 heads" in str(info.value)


def test_chunk_one_to_many_with_ids_round_trips():
    qkv = WeightConverter(
        "attn.qkv.weight", ["attn.q.weight", "attn.k.weight", "attn.v.weight"], [Chunk(0)]
    )
    fused = torch.arange(24.0).reshape(6, 4)
    remapper = KeyRemapper([qkv])
    loaded = remapper.load({"x.attn.qkv.weight": (fused, 5)})
    assert list(loaded.tensors) == ["x.attn.q.weight", "x.attn.k.weight", "x.attn.v.weight"]
    assert torch.equal(loaded.tensors["x.attn.k.weight"][0], fused[2:4])
    assert loaded.tensors["x.attn.q.weight"][1] == 5
    assert loaded.tensors["x.attn.v.weight"][1] not in (None, 5)
    saved = remapper.save(loaded.tensors)
    assert list(saved.tensors) == ["x.attn.qkv.weight"]
    assert torch.equal(saved.tensors["x.attn.qkv.weight"][0], fused)
    assert saved.tensors["x.attn.qkv.weight"][1] == 5


@pytest.mark.parametrize(
    "op",
    [
        Chunk(1),
        Concatenate(0),
        MergeModulelist(1),
        SplitModulelist(0),
        Transpose(0, 2),
        Interleave(1),
        PermuteForRope(num_heads=2),
        PermuteForRope(num_heads=3, permute_layer_names=["q_proj"], inverse=True),
    ],
)
def test_reverse_op_of_the_reverse_op_is_the_op(op):
    assert op.reverse_op.reverse_op == op
    assert op.reverse_op != op


def test_interleave_and_rope_undo_themselves():
    t = torch.randn(12, 5)
    for op in (Interleave(0), PermuteForRope(num_heads=3), Transpose(0, 1)):
        out = op.convert({"w": [t]}, ["w"], ["w"])["w"]
        back = op.reverse_op.convert({"w": [out]}, ["w"], ["w"])["w"]
        assert torch.equal(back, t), op
        assert not torch.equal(out.reshape(-1), t.reshape(-1)) or out.shape != t.shape, op
    # interleave: [a0 a1 b0 b1] -> [a0 b0 a1 b1] along the dim
    pairs = Interleave(0).convert({"w": torch.tensor([0, 1, 2, 3])}, ["w"], ["w"])["w"]
    assert pairs.tolist() == [0, 2, 1, 3]


def test_transpose_is_the_rule_with_a_pattern_and_the_op_without():
    assert Transpose is conversions.Transpose is remap.Transpose  # one class
    assert isinstance(Transpose(dim0=1, dim1=0), conversions.ConversionOps)
    rule = Transpose(r".+\.w", 0, 1)
    assert rule.pattern == r".+\.w" and Transpose(0, 1).pattern is None
    with pytest.raises(RemapError, match="without a pattern it is an op"):
        KeyRemapper([Transpose(0, 1)]).load({"a.w": (torch.zeros(2, 3), None)})
    loaded = KeyRemapper([rule]).load({"a.w": (torch.zeros(2, 3), None)})
    assert loaded.tensors["a.w"][0].shape == (3, 2)
    # copies and pickles stay what they were
    for obj in (rule, Transpose(1, 2)):
        for again in (copy.deepcopy(obj), pickle.loads(pickle.dumps(obj))):
            assert type(again) is type(obj) and again == obj


_A, _B = [torch.randn(2, 3, 4) for _ in range(2)], [torch.randn(2, 3, 4) for _ in range(2)]


@pytest.mark.parametrize(
    ("sources", "ops", "in_place"),
    [
        (["a.*.w", "b.*.w"], [MergeModulelist(0), Concatenate(1)], True),  # Mixtral's gate_up
        (["a.*.w"], [MergeModulelist(1)], True),
        (["a.*.w", "b.*.w"], [Concatenate(2)], True),
        (["a.*.w"], [MergeModulelist(0), Transpose(1, 3)], True),
        (["a.0.w"], [Transpose(0, 1)], True),
        (["a.0.w"], [Interleave(0)], False),  # ops that permute within a tensor compute it
        (["a.0.w"], [PermuteForRope(num_heads=1)], False),
    ],
)
def test_a_converter_builds_its_result_in_the_tensor_placing_gives(sources, ops, in_place):
    """Under ``placing``, a converter whose ops all run backward writes each source tensor
    into its slice of the destination and gives the destination itself as its result; other
    converters, and a destination of another shape or dtype, leave the destination as it was.
    The values are the same either way."""
    tensors = {f"m.a.{e}.w": (_A[e], None) for e in range(2)}
    tensors |= {f"m.b.{e}.w": (_B[e], None) for e in range(2)}
    if "a.0.w" in sources:
        tensors = {"m.a.0.w": (_A[0].reshape(6, 4), None)}
    converter = WeightConverter(sources, "fused", ops)
    expected = converter.forward(tensors)[0]["m.fused"][0]
    for dest, used in (
        (torch.zeros(expected.shape), in_place),
        (torch.zeros(expected.shape, dtype=torch.float64), False),
        (torch.zeros(expected.numel() + 1), False),
    ):
        before = dest.clone()
        with placing({"m.fused": dest}):
            result = converter.forward(tensors)[0]["m.fused"][0]
        assert torch.equal(result, expected)
        assert (result is dest) is used, (ops, dest.dtype, dest.shape)
        assert torch.equal(dest, expected if used else before)


def test_transformers_rules_run_as_a_block_renamings_first():
    """transformers applies every renaming before any converter, whatever the table's order;
    a converter's output is not converted again by a later converter."""
    fuse = WeightConverter(["mlp.w1.weight", "mlp.w3.weight"], "mlp.w13.weight", [Concatenate(0)])
    again = WeightConverter("mlp.w13.weight", "mlp.fused.weight", [Transpose(0, 1)])
    rename = WeightRenaming(r"^ffn\.", "mlp.")
    items = {
        n: (torch.full((1, 2), float(k)), None)
        for k, n in enumerate(["ffn.w1.weight", "ffn.w3.weight"])
    }
    remapper = KeyRemapper([fuse, again, rename])
    loaded = remapper.load(items)
    assert list(loaded.tensors) == ["mlp.w13.weight"]
    assert loaded.tensors["mlp.w13.weight"][0].tolist() == [[0.0, 0.0], [1.0, 1.0]]
    assert loaded.unmatched == [str(again)]
    saved = remapper.save(loaded.tensors)
    assert list(saved.tensors) == ["ffn.w1.weight", "ffn.w3.weight"]
    # our own rules around the block still run in order
    mixed = KeyRemapper([Rename(r"^model\.", ""), *MIXTRAL])
    state = {f"model.{n}": (t, None) for n, t in legacy_state(layers=1).items()}
    assert sorted(mixed.load(state).tensors) == [
        "layers.0.mlp.experts.down_proj",
        "layers.0.mlp.experts.gate_up_proj",
        "layers.0.mlp.gate.weight",
    ]


def test_renaming_capture_groups_and_save_check():
    rename = WeightRenaming(r"(layers\.\d+)\.attn\.", r"\1.self_attn.")
    assert (
        rename.rename_source_key("m.layers.3.attn.q.weight")[0] == "m.layers.3.self_attn.q.weight"
    )
    remapper = KeyRemapper([rename])
    loaded = remapper.load({"m.layers.3.attn.q.weight": (torch.zeros(1), None)})
    assert list(remapper.save(loaded.tensors).tensors) == ["m.layers.3.attn.q.weight"]
    # a renaming whose reverse does not load back is refused on save, naming the key
    lossy = KeyRemapper([WeightRenaming(r"norm\d", "ln")])
    loaded = lossy.load({"x.norm1.w": (torch.zeros(1), None), "y.norm2.w": (torch.zeros(1), None)})
    assert list(loaded.tensors) == ["x.ln.w", "y.ln.w"]
    with pytest.raises(RemapError) as info:
        lossy.save(loaded.tensors)
    assert "'x.ln.w' saves as" in str(info.value)
    assert "'y.ln.w' saves as" in str(info.value)


def test_converter_validation():
    with pytest.raises(RemapError, match="one-to-many, many-to-one or one-to-one"):
        WeightConverter(["a", "b"], ["c", "d"], [Concatenate(0)])
    with pytest.raises(RemapError, match="at least one operation"):
        WeightConverter("a", "b", [])
    with pytest.raises(TypeError, match="not a ConversionOps"):
        WeightConverter("a", "b", [Rename("a", "b")])


# --- Burn's side ---------------------------------------------------------------------------------


class TorchBlock(nn.Module):
    """Separate q/k/v projections and a norm, as a torch model has them."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)
        self.norm = nn.LayerNorm(4)


def test_burn_model_with_fused_layers_loads_into_separate_torch_layers_and_back(tmp_path):
    """A Burn record (Burn's names: ``gamma``/``beta``, Linear weights ``[in, out]``) with one
    fused ``qkv`` Linear: the rules carry Burn's names, the adapter Burn's layouts."""
    g = torch.Generator().manual_seed(3)
    burn = {
        "attn.qkv.weight": torch.randn(4, 12, generator=g),  # Burn: [in, 3 * out]
        "attn.qkv.bias": torch.randn(12, generator=g),
        "attn.norm.gamma": torch.randn(4, generator=g),
        "attn.norm.beta": torch.randn(4, generator=g),
    }
    ids = {n: 77 + k for k, n in enumerate(burn)}
    path = ModuleRecord(burn, param_ids=ids).save(tmp_path / "burn.bpk")
    remapper = KeyRemapper(
        [
            WeightConverter("qkv.weight", ["q.weight", "k.weight", "v.weight"], [Chunk(dim=1)]),
            WeightConverter("qkv.bias", ["q.bias", "k.bias", "v.bias"], [Chunk(dim=0)]),
        ]
    )
    net = nn.Module()
    net.attn = TorchBlock()
    apply_remapped(load_module_record(path), net, remapper, adapter=BurnToPyTorchAdapter())
    assert torch.equal(net.attn.k.weight, burn["attn.qkv.weight"][:, 4:8].t())
    assert torch.equal(net.attn.v.bias, burn["attn.qkv.bias"][8:])
    assert torch.equal(net.attn.norm.weight, burn["attn.norm.gamma"])
    x = torch.randn(2, 4, generator=g)
    assert torch.allclose(
        net.attn.q(x), x @ burn["attn.qkv.weight"][:, :4] + burn["attn.qkv.bias"][:4]
    )

    record, unmatched = record_remapped(net, remapper, adapter=PyTorchToBurnAdapter())
    assert unmatched == []
    again = record.save(tmp_path / "again.bpk")
    assert again.read_bytes() == path.read_bytes()
