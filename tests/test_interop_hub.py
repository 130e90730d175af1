"""rules_for / save_pretrained / tied weights against transformers itself: tiny random models of
five model types (and tied-embedding ones) written by ``save_pretrained`` in the hub's layout,
as one file and as a sharded set whose converters' sources are split over shards; each loaded
by this package must equal ``from_pretrained`` tensor for tensor and in its outputs, and save
back to the checkpoint's names and tensors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import safetensors.torch
import torch

from lightning_bpk.interop import (
    COVERED,
    KeyRemapper,
    PrefixChange,
    RemapError,
    apply_remapped,
    load_module_record,
    load_remapped,
    record_remapped,
    rules_for,
    save_pretrained,
    tied_weights,
)
from lightning_bpk.interop import hub as hub_module
from lightning_bpk.records import RecordError

transformers = pytest.importorskip("transformers", minversion="5.23")
hf = pytest.importorskip("transformers.core_model_loading")
from transformers.conversion_mapping import get_checkpoint_conversion_mapping  # noqa: E402

transformers.utils.logging.disable_progress_bar()
transformers.utils.logging.set_verbosity_error()
SHARD = "1KB"  # two expert matrices a shard: every layer's experts spread over several shards


def _text(**extra):
    return dict(
        vocab_size=32,
        hidden_size=16,
        intermediate_size=8,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=32,
        **extra,
    )


def _build(model_type: str):
    t = transformers
    if model_type == "mixtral":
        return t.MixtralConfig(
            **_text(num_local_experts=3, num_experts_per_tok=2)
        ), t.MixtralForCausalLM
    if model_type == "mixtral-tied":
        config = t.MixtralConfig(
            **_text(num_local_experts=3, num_experts_per_tok=2), tie_word_embeddings=True
        )
        return config, t.MixtralForCausalLM
    if model_type == "qwen2-tied":
        return t.Qwen2Config(**_text(), tie_word_embeddings=True), t.Qwen2ForCausalLM
    if model_type == "phimoe":
        return t.PhimoeConfig(
            **_text(num_local_experts=3, num_experts_per_tok=2)
        ), t.PhimoeForCausalLM
    if model_type == "qwen2_moe":
        config = t.Qwen2MoeConfig(
            **_text(
                moe_intermediate_size=4,
                shared_expert_intermediate_size=8,
                num_experts=3,
                num_experts_per_tok=2,
            )
        )
        return config, t.Qwen2MoeForCausalLM
    if model_type == "nomic_bert":
        config = t.NomicBertConfig(
            vocab_size=32,
            hidden_size=16,
            intermediate_size=8,
            num_hidden_layers=2,
            num_attention_heads=2,
            max_position_embeddings=32,
        )
        return config, t.NomicBertModel
    assert model_type == "llava"
    config = t.LlavaConfig(
        text_config=dict(model_type="llama", **_text()),
        vision_config=dict(
            model_type="clip_vision_model",
            hidden_size=16,
            intermediate_size=8,
            num_hidden_layers=1,
            num_attention_heads=2,
            image_size=8,
            patch_size=4,
        ),
        image_token_index=31,
    )
    return config, t.LlavaForConditionalGeneration


MODELS = ["mixtral", "qwen2_moe", "phimoe", "llava", "nomic_bert", "mixtral-tied", "qwen2-tied"]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Per model type: its config and class, and where save_pretrained wrote it as one file and
    as a sharded set."""
    out = {}
    for model_type in MODELS:
        config, cls = _build(model_type)
        torch.manual_seed(0)
        model = cls(config)
        root = tmp_path_factory.mktemp(model_type)
        model.save_pretrained(root / "single")
        model.save_pretrained(root / "sharded", max_shard_size=SHARD)
        out[model_type] = (config, cls, root)
    return out


def _outputs(model) -> torch.Tensor:
    ids = torch.arange(12).reshape(2, 6) % 30
    with torch.no_grad():
        result = model(input_ids=ids)
    return result.logits if hasattr(result, "logits") else result.last_hidden_state


def _checkpoint(directory: Path) -> dict[str, torch.Tensor]:
    files = sorted(directory.glob("*.safetensors"))
    return {n: t for f in files for n, t in safetensors.torch.load_file(f).items()}


@pytest.mark.parametrize("layout", ["single", "sharded"])
@pytest.mark.parametrize("model_type", MODELS)
def test_loads_as_from_pretrained_and_saves_back_its_checkpoint(
    saved, tmp_path, model_type, layout
):
    config, cls, root = saved[model_type]
    source = root / layout
    if layout == "sharded":
        assert (source / "model.safetensors.index.json").is_file()
    theirs = cls.from_pretrained(source).eval()
    torch.manual_seed(1)
    ours = cls(config).eval()
    rules = rules_for(ours)
    unmatched = load_remapped(source, ours, rules, workers=2)
    state = ours.state_dict()
    for name, tensor in theirs.state_dict().items():
        assert torch.equal(state[name], tensor), (model_type, layout, name)
    assert torch.equal(_outputs(ours), _outputs(theirs))
    # save back: the checkpoint's own names and tensors (a tied lm_head left out, as there)
    checkpoint = _checkpoint(source)
    back = safetensors.torch.load_file(
        save_pretrained(ours, tmp_path / "back.safetensors", rules, unmatched)
    )
    assert sorted(back) == sorted(checkpoint)
    for name, tensor in checkpoint.items():
        assert torch.equal(back[name], tensor), name
    if layout == "sharded":  # saved back as a set, which transformers loads as its own
        index = save_pretrained(ours, tmp_path / "set", rules, unmatched, max_shard_size=2048)
        assert (
            index.name == "model.safetensors.index.json" and len(list(index.parent.glob("*"))) > 2
        )
        (tmp_path / "set" / "config.json").write_bytes((source / "config.json").read_bytes())
        again = cls.from_pretrained(tmp_path / "set").state_dict()
        for name, tensor in theirs.state_dict().items():
            assert torch.equal(again[name], tensor), name


def test_a_converters_sources_lie_in_several_shards(saved):
    _, _, root = saved["mixtral"]
    index = json.loads((root / "sharded" / "model.safetensors.index.json").read_text())
    shards = {
        index["weight_map"][f"model.layers.0.block_sparse_moe.experts.{e}.{w}.weight"]
        for e in range(3)
        for w in ("w1", "w3")
    }
    assert len(shards) > 1


@pytest.mark.parametrize("model_type", ["mixtral-tied", "qwen2-tied"])
def test_tied_weights_come_from_the_declarations_and_stay_strict(saved, model_type):
    config, cls, root = saved[model_type]
    torch.manual_seed(1)
    ours = cls(config)
    assert tied_weights(ours) == {"lm_head.weight": "model.embed_tokens.weight"}
    assert "lm_head.weight" not in _checkpoint(root / "single")  # save_pretrained omits it
    # without the declarations, the omitted tensor is missing
    with pytest.raises(RecordError, match=r"lm_head\.weight"):
        load_remapped(root / "single", ours, rules_for(ours), ties={})
    # with them, every other tensor is still required
    pruned = root / "pruned.safetensors"
    state = _checkpoint(root / "single")
    del state["model.norm.weight"]
    safetensors.torch.save_file(state, pruned)
    with pytest.raises(RecordError, match=r"model\.norm\.weight"):
        load_remapped(pruned, ours, rules_for(ours))
    # an untied model declares nothing
    untied, _ = _build("mixtral")
    assert (
        tied_weights(
            cls(untied) if model_type == "mixtral-tied" else transformers.MixtralForCausalLM(untied)
        )
        == {}
    )


@pytest.mark.parametrize("loader", ["load_remapped", "apply_remapped"])
def test_a_tied_head_the_file_holds_with_other_values_is_untied_and_used(saved, tmp_path, loader):
    """As transformers does: a tied config whose file holds a different ``lm_head.weight``
    gets its own head; the same values keep the tie; a file without it loads from the tie
    through either loader."""
    config, cls, root = saved["qwen2-tied"]
    state = _checkpoint(root / "single")
    head = torch.randn_like(state["model.embed_tokens.weight"])

    def load(path):
        torch.manual_seed(1)
        ours = cls(config)
        rules = rules_for(ours)
        if loader == "load_remapped":
            load_remapped(path, ours, rules)
        else:
            apply_remapped(load_module_record(path), ours, rules)
        return ours

    safetensors.torch.save_file({**state, "lm_head.weight": head}, tmp_path / "other.safetensors")
    with pytest.warns(UserWarning, match="different values for 'lm_head.weight'.*untied"):
        ours = load(tmp_path / "other.safetensors")
    assert torch.equal(ours.lm_head.weight, head)
    assert torch.equal(ours.model.embed_tokens.weight, state["model.embed_tokens.weight"])
    assert ours.lm_head.weight is not ours.model.embed_tokens.weight
    same = {**state, "lm_head.weight": state["model.embed_tokens.weight"].clone()}
    safetensors.torch.save_file(same, tmp_path / "same.safetensors")
    ours = load(tmp_path / "same.safetensors")
    assert ours.lm_head.weight is ours.model.embed_tokens.weight  # still tied
    ours = load(root / "single")  # the head omitted: from its tie, with either loader
    assert ours.lm_head.weight is ours.model.embed_tokens.weight
    assert torch.equal(ours.lm_head.weight, state["model.embed_tokens.weight"])


def test_save_back_undoes_only_what_the_load_applied(saved, tmp_path):
    """NomicBert's checkpoint has emb_ln.weight: the legacy LayerNorm.gamma renaming never
    applies at load, so saving must not apply its inverse (emb_ln.gamma)."""
    config, cls, root = saved["nomic_bert"]
    ours = cls(config)
    rules = rules_for(ours)
    unmatched = load_remapped(root / "single", ours, rules)
    assert any("LayerNorm.gamma" in u for u in unmatched)
    every_rule, _ = record_remapped(ours, rules)  # what undoing every rule gives
    assert "emb_ln.gamma" in every_rule.tensors
    applied, _ = record_remapped(ours, rules.applied(unmatched))
    assert "emb_ln.weight" in applied.tensors and "emb_ln.gamma" not in applied.tensors


@pytest.mark.parametrize("model_type", COVERED)
def test_the_own_table_is_transformers_registry(model_type):
    ours = [(type(r).__name__, r._original, _ops(r)) for r in hub_module._own(model_type, True)]
    theirs = get_checkpoint_conversion_mapping(model_type) + get_checkpoint_conversion_mapping(
        "legacy"
    )
    assert ours == [
        (
            type(r).__name__,
            (list(r._original_source_patterns), list(r._original_target_patterns)),
            _ops(r),
        )
        for r in theirs
    ]
    assert str(rules_for(model_type)) == str(KeyRemapper(hub_module._own(model_type, True)))


def _ops(rule) -> list:
    return [(type(op).__name__, getattr(op, "dim", None)) for op in getattr(rule, "operations", [])]


def test_without_transformers_the_table_is_used(monkeypatch):
    monkeypatch.setattr(hub_module, "_have_transformers", lambda: False)
    config, cls = _build("mixtral")
    assert str(rules_for(cls(config))) == str(rules_for("mixtral"))
    with pytest.raises(RemapError, match=r"no rules for model type .gpt2.*covered: llava"):
        rules_for("gpt2")


def test_an_unknown_model_type_is_refused_with_the_closest_known_ones():
    with pytest.raises(RemapError, match=r"unknown model type 'mixtrall'.*did you mean 'mixtral'"):
        rules_for("mixtrall")
    assert str(rules_for("gpt2")) == str(rules_for("gpt2"))  # known, even without own rules


def test_prefix_change_renames_as_transformers():
    for kwargs in (
        {"prefix_to_remove": "vision_model"},
        {"prefix_to_add": "language_model", "model_prefix": "model"},
    ):
        ours, theirs = PrefixChange(**kwargs), hf.PrefixChange(**kwargs)
        for key in ("vision_model.enc.w", "model.layers.0.w", "model.language_model.x", "w"):
            assert ours.rename_source_key(key) == theirs.rename_source_key(key), (kwargs, key)
            back, their_back = ours.reverse_transform(), theirs.reverse_transform()
            assert back.rename_source_key(key) == their_back.rename_source_key(key), (kwargs, key)


def test_an_unknown_transform_is_refused_by_name():
    class Strange(hf.WeightRenaming):
        pass

    with pytest.raises(RemapError, match="Strange"):
        hub_module._ours(Strange("a", "b"), "strange", None)


@pytest.mark.parametrize("model_type", ["mixtral-tied", "qwen2_moe"])
def test_fsdp2_shards_of_a_model_load_from_its_sharded_set(saved, model_type):
    """Each rank of 2 (torch's fake process group: the loader needs no collective) fully_shards
    the model and loads the set through rules_for: its shards equal transformers' slices, and it
    reads about half the bytes."""
    from test_interop_shards import rank_of
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    from lightning_bpk.interop import load_into_shards

    config, cls, root = saved[model_type]
    full = cls.from_pretrained(root / "sharded").state_dict()
    total = sum(t.numel() * t.element_size() for t in _checkpoint(root / "sharded").values())
    for rank in range(2):
        with rank_of((2,), rank) as mesh:
            model = cls(config)
            for layer in model.model.layers:
                fully_shard(layer, mesh=mesh)
            fully_shard(model, mesh=mesh)
            done = load_into_shards(root / "sharded", model, rules_for(model))
            for name, value in model.state_dict().items():
                shape, offset = compute_local_shape_and_global_offset(
                    value.shape, value.device_mesh, value.placements
                )
                want = full[name][
                    tuple(slice(o, o + n) for o, n in zip(offset, shape, strict=True))
                ]
                assert torch.equal(value.to_local(), want), (rank, name)
            assert done.bytes_read < 0.7 * total


def test_a_base_model_checkpoint_loads_into_the_head_model(saved, tmp_path):
    """A MixtralModel checkpoint (no ``model.`` prefix, no lm_head) into a tied
    MixtralForCausalLM: the prefix added as from_pretrained adds it, the lm_head from its tie,
    also into FSDP2 shards (the prefix is a renaming the shard loader reads through)."""
    from test_interop_shards import rank_of
    from torch.distributed.fsdp import fully_shard

    from lightning_bpk.interop import load_into_shards

    config, cls, _ = saved["mixtral-tied"]
    torch.manual_seed(2)
    cls(config).model.save_pretrained(tmp_path / "base", max_shard_size=SHARD)
    theirs = cls.from_pretrained(tmp_path / "base").state_dict()
    ours = cls(config)
    rules = rules_for(ours)
    assert "BaseModelPrefix('model')" not in load_remapped(tmp_path / "base", ours, rules)
    for name, tensor in theirs.items():
        assert torch.equal(ours.state_dict()[name], tensor), name
    with rank_of((2,), 1) as mesh:
        sharded = cls(config)
        fully_shard(sharded, mesh=mesh)
        load_into_shards(tmp_path / "base", sharded, rules_for(sharded))
        norm = sharded.state_dict()["model.norm.weight"].to_local()
        assert torch.equal(norm, theirs["model.norm.weight"][8:])


TRANSFORMERS4 = Path(__file__).resolve().parents[1] / ".venv-transformers4"
_LOAD_WITH_4X = """
import sys, torch, transformers
assert transformers.__version__.startswith("4."), transformers.__version__
source, out = sys.argv[1], sys.argv[2]
model, info = transformers.AutoModelForCausalLM.from_pretrained(source, output_loading_info=True)
assert not any(info.values()), info  # nothing missing, unexpected or mismatched
ids = torch.arange(12).reshape(2, 6) % 30
with torch.no_grad():
    torch.save(model.eval()(input_ids=ids).logits, out)
"""


@pytest.mark.parametrize("max_shard_size", [None, "2KB"])
def test_transformers_4_loads_what_save_pretrained_writes(saved, tmp_path, max_shard_size):
    """transformers 4.x (``make transformers4`` installs it beside, in its own folder) refuses a
    safetensors file without ``"format": "pt"``; it loads ours, one file or a set."""
    assert (TRANSFORMERS4 / "transformers").is_dir(), f"run `make transformers4` ({TRANSFORMERS4})"
    _, cls, root = saved["mixtral"]  # 4.x names experts one by one: the legacy layout
    theirs = cls.from_pretrained(root / "single").eval()
    rules = rules_for(theirs)
    target = tmp_path / "out"
    if max_shard_size is None:
        target.mkdir()
        save_pretrained(theirs, target / "model.safetensors", rules)
    else:
        index = save_pretrained(theirs, target, rules, max_shard_size=max_shard_size)
        assert len(json.loads(index.read_text())["weight_map"]) > 0
        assert len(list(target.glob("model-*.safetensors"))) > 1
    (target / "config.json").write_bytes((root / "single" / "config.json").read_bytes())
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(TRANSFORMERS4), *sys.path[1:]]))
    done = subprocess.run(
        [sys.executable, "-c", _LOAD_WITH_4X, str(target), str(tmp_path / "logits.pt")],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    logits = torch.load(tmp_path / "logits.pt", weights_only=True)
    torch.testing.assert_close(logits, _outputs(theirs))
