"""The rules that turn a hub checkpoint's names and layouts into a transformers model's, by model
type or from a model instance, and back.

:func:`rules_for` gives a :class:`~lightning_bpk.interop.remap.KeyRemapper`:

- **with transformers installed**, from its own registry, so its handling comes along: for a
  model instance, ``get_model_conversion_mapping(model)`` (the model's mapping by class name or
  ``model_type``, every sub-model's own mapping scoped to its prefix, e.g. Llava's vision tower,
  and the *legacy* renamings transformers always appends: ``LayerNorm.gamma``, weight norm's
  ``weight_g``/``weight_v``, ALM's duplicated ``.model.model``), then the ``base_model_prefix``
  added or stripped where that gives a name of the model (a ``LlamaModel`` checkpoint into a
  ``LlamaForCausalLM``, and the opposite), as ``from_pretrained`` does; for a model type
  (``"mixtral"``), that type's mapping plus the legacy renamings;
- **without transformers**, from this package's table (:data:`COVERED`, copied from
  transformers 5.23), by model type (``model.config.model_type`` for an instance).

Each of transformers' transforms becomes this package's rule of the same name
(:class:`~lightning_bpk.interop.conversions.WeightRenaming`,
:class:`~lightning_bpk.interop.conversions.WeightConverter` and its ops), sub-model scoping
included; a transform or op with no equivalent here is refused with a
:class:`~lightning_bpk.interop.rules.RemapError` naming it and the model type.

**Saving back** undoes exactly the rules a load applied: pass the load's unmatched rules to
:meth:`~lightning_bpk.interop.remap.KeyRemapper.applied` (:func:`save_pretrained` does), as
transformers reverts a legacy renaming only when a load used it.

**Tied weights** are transformers' tie declarations (``get_expanded_tied_weights_keys``,
through :func:`tied_weights`): the loaders fill a declared tied tensor the file omits from its
tie and require every other one.
"""

from __future__ import annotations

import difflib
import importlib.util
import os
import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lightning_bpk.interop import conversions, ops
from lightning_bpk.interop._ties import tied_weights
from lightning_bpk.interop.formats import record_content, save_module_record
from lightning_bpk.interop.remap import KeyRemapper, Rename, record_remapped
from lightning_bpk.interop.rules import Items, RemapError, Rule, trace_step
from lightning_bpk.interop.select import KeyFilter
from lightning_bpk.interop.sets import write_set

__all__ = [
    "COVERED",
    "BaseModelPrefix",
    "peft_rules",
    "rules_for",
    "save_pretrained",
    "tied_weights",
]


def _moe(gate: str, up: str, down: str, prefix: str = "mlp.experts") -> list[Rule]:
    """The fused-experts converters of the MoE models (per-expert gate/up/down on the hub)."""
    return [
        conversions.WeightConverter(
            [f"{prefix}.*.{gate}.weight", f"{prefix}.*.{up}.weight"],
            f"{prefix}.gate_up_proj",
            [ops.MergeModulelist(dim=0), ops.Concatenate(dim=1)],
        ),
        conversions.WeightConverter(
            [f"{prefix}.*.{down}.weight"], f"{prefix}.down_proj", [ops.MergeModulelist(dim=0)]
        ),
    ]


def _table() -> dict[str, list[Rule]]:
    """The package's own table: transformers 5.23's mappings for the covered model types."""
    qwen = _moe("gate_proj", "up_proj", "down_proj")
    mixtral = [
        conversions.WeightRenaming(".block_sparse_moe.", ".mlp."),
        *_moe("w1", "w3", "w2", prefix=".experts"),
    ]
    return {
        "mixtral": mixtral,
        "phimoe": [
            mixtral[0],
            conversions.WeightRenaming(".gate.weight", ".router.weight"),
            *mixtral[1:],
        ],
        "qwen2_moe": qwen,
        "qwen3_moe": _moe("gate_proj", "up_proj", "down_proj"),
        "olmoe": _moe("gate_proj", "up_proj", "down_proj"),
        "llava": [
            conversions.WeightRenaming("^language_model.lm_head", "lm_head"),
            conversions.WeightRenaming("^language_model", "model.language_model"),
            conversions.WeightRenaming("^vision_tower", "model.vision_tower"),
            conversions.WeightRenaming("^multi_modal_projector", "model.multi_modal_projector"),
        ],
        "nomic_bert": [
            *(
                conversions.WeightRenaming(a, b)
                for a, b in (
                    ("encoder.layers", "layers"),
                    ("emb_ln", "embeddings.LayerNorm"),
                    ("attn.out_proj", "self_attn.o_proj"),
                    ("fc11", "up_proj"),
                    ("fc12", "gate_proj"),
                    ("fc2", "down_proj"),
                    ("norm1", "post_attention_layernorm"),
                    ("norm2", "post_mlp_layernorm"),
                )
            ),
            conversions.WeightConverter(
                "attn.Wqkv",
                ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"],
                [ops.Chunk(dim=0)],
            ),
        ],
        "legacy": [
            conversions.WeightRenaming("LayerNorm.gamma", "LayerNorm.weight"),
            conversions.WeightRenaming("LayerNorm.beta", "LayerNorm.bias"),
            conversions.WeightRenaming(".weight_g", ".parametrizations.weight.original0"),
            conversions.WeightRenaming(".weight_v", ".parametrizations.weight.original1"),
            conversions.WeightRenaming(
                [r"^model\.language_model\.model", r"^language_model\.model\.model"],
                "model.language_model",
            ),
        ],
    }


COVERED = ("llava", "mixtral", "nomic_bert", "olmoe", "phimoe", "qwen2_moe", "qwen3_moe")
"""Model types of the package's own table (used without transformers), each tested against
``from_pretrained``; with transformers installed, every type of its registry is covered."""


class BaseModelPrefix(Rule):
    """transformers' last renaming step on load: a name gets the model's ``base_model_prefix``
    added (``layers.0.w`` -> ``model.layers.0.w``) or stripped where only that gives one of the
    model's names. Saving keeps the model's names (as ``save_pretrained`` does)."""

    traced = True
    renames_only = True

    def __init__(self, prefix: str, names: Iterable[str]) -> None:
        self.prefix = prefix
        self.names = frozenset(names)

    def __str__(self) -> str:
        return f"BaseModelPrefix({self.prefix!r})"

    def forward(self, items: Items) -> tuple[Items, int]:
        out: Items = {}
        links = []
        head = self.prefix + "."
        for name, item in items.items():
            new = name
            if name.startswith(head) and name[len(head) :] in self.names:
                new = name[len(head) :]
            elif name not in self.names and head + name in self.names:
                new = head + name
            if new != name:
                links.append(([name], [new]))
            if new in out:
                raise RemapError(f"{self}: two tensors map to {new!r}")
            out[new] = item
        trace_step(links)
        return out, len(links)

    def backward(self, items: Items) -> tuple[Items, int]:
        return dict(items), 0


def _have_transformers() -> bool:
    return importlib.util.find_spec("transformers") is not None


def rules_for(model: nn.Module | str, *, legacy: bool = True) -> KeyRemapper:
    """The rules for a model instance or a model type (see the module docs); ``legacy=False``
    leaves out transformers' legacy renamings."""
    if isinstance(model, str):
        if _have_transformers():
            from transformers.conversion_mapping import get_checkpoint_conversion_mapping

            _check_model_type(model)
            theirs = list(get_checkpoint_conversion_mapping(model) or [])
            if legacy:
                theirs += get_checkpoint_conversion_mapping("legacy") or []
            return KeyRemapper([_ours(t, model, None) for t in theirs])
        return KeyRemapper(_own(model, legacy))
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None) or type(model).__name__
    if not _have_transformers() or not _is_pretrained(model):
        return KeyRemapper(_own(model_type, legacy))
    from transformers.conversion_mapping import get_model_conversion_mapping

    theirs = get_model_conversion_mapping(model, None, None, legacy)  # type: ignore[arg-type]
    rules = [_ours(t, model_type, config) for t in theirs]
    prefix = getattr(model, "base_model_prefix", "")
    if prefix:
        rules.append(BaseModelPrefix(prefix, model.state_dict().keys()))
    return KeyRemapper(rules)


def _check_model_type(model_type: str) -> None:
    """RemapError naming an unknown model type (``"mixtrall"``) and the closest known ones:
    transformers answers it with its legacy rules alone, which would load nothing right."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    if model_type in CONFIG_MAPPING_NAMES:
        return
    close = difflib.get_close_matches(model_type, list(CONFIG_MAPPING_NAMES), n=3)
    hint = f"; did you mean {' or '.join(map(repr, close))}?" if close else ""
    raise RemapError(f"unknown model type {model_type!r} (not in transformers' registry){hint}")


def _is_pretrained(model: nn.Module) -> bool:
    from transformers import PreTrainedModel

    return isinstance(model, PreTrainedModel)


def _own(model_type: str, legacy: bool) -> list[Rule]:
    table = _table()
    if model_type not in table:
        raise RemapError(
            f"no rules for model type {model_type!r} without transformers installed (covered: "
            f"{', '.join(COVERED)}); install transformers for its whole registry"
        )
    return list(table[model_type]) + (table["legacy"] if legacy else [])


_OPS: dict[str, tuple[type[ops.ConversionOps], tuple[str, ...]]] = {
    "Chunk": (ops.Chunk, ("dim",)),
    "Concatenate": (ops.Concatenate, ("dim",)),
    "MergeModulelist": (ops.MergeModulelist, ("dim",)),
    "SplitModulelist": (ops.SplitModulelist, ("dim",)),
    "Transpose": (ops.Transpose, ("dim0", "dim1")),
    "Interleave": (ops.Interleave, ("dim", "inverse")),
}


def _op(op: Any, model_type: str, config: Any) -> ops.ConversionOps:
    """Ours for one of transformers' ops; RemapError for one with no equivalent here."""
    name = type(op).__name__
    if name == "PermuteForRope":
        sub = getattr(config, op.subconfig_key, config) if op.subconfig_key else config
        heads = getattr(sub, "num_attention_heads", None)
        if heads is None:
            raise RemapError(f"{model_type}: PermuteForRope needs the model's config (heads)")
        return ops.PermuteForRope(heads, op.permute_layer_names, inverse=op.inverse)
    if name not in _OPS or getattr(op, "num_shards_attribute", None) is not None:
        raise RemapError(f"{model_type}: transformers' op {op!r} has no equivalent here")
    cls, fields = _OPS[name]
    return cls(**{f: getattr(op, f) for f in fields})


def _ours(transform: Any, model_type: str, config: Any) -> Rule:
    """Ours for one of transformers' transforms, its sub-model scope included."""
    name = type(transform).__name__
    sources = list(transform._original_source_patterns)
    targets = list(transform._original_target_patterns)
    rule: conversions.WeightTransform
    if name == "WeightRenaming":
        rule = conversions.WeightRenaming(sources, targets)
    elif name == "PrefixChange":
        rule = conversions.PrefixChange(
            transform.prefix_to_add, transform.prefix_to_remove, transform.model_prefix
        )
    elif name == "WeightConverter":
        rule = conversions.WeightConverter(
            sources, targets, [_op(op, model_type, config) for op in transform.operations]
        )
    else:
        raise RemapError(
            f"{model_type}: transformers' {name}({sources} -> {targets}) has no equivalent here"
        )
    return rule.scoped(transform.scope_prefix, transform.base_model_prefix)


def save_pretrained(
    model: nn.Module,
    path: str | os.PathLike[str],
    remapper: KeyRemapper,
    unmatched: Iterable[str] = (),
    ties: Mapping[str, str] | None = None,
    *,
    max_shard_size: int | str | None = None,
) -> Path | str:
    """Save ``model`` in its checkpoint's layout: the rules a load applied undone
    (``unmatched``, what the load returned, are left out), and each tied tensor written once,
    under its tie's name, as ``save_pretrained`` writes it. One ``.safetensors``/``.bpk`` file,
    or with ``max_shard_size`` (bytes, or ``"5GB"`` as transformers spells it) a set in the new
    directory ``path`` (returns its index). transformers 4.x loads what this writes.
    """
    ties = tied_weights(model) if ties is None else dict(ties)
    applied = remapper.applied(unmatched)
    record, _ = record_remapped(model, applied)
    dropped = _file_names(applied, ties)
    record.aliases = {a: t for a, t in record.aliases.items() if a not in dropped}
    if max_shard_size is None:
        return save_module_record(record, path)
    return write_set(record_content(record), path, max_shard_size=max_shard_size)


_LORA = r"lora_(?:A|B|embedding_A|embedding_B|magnitude_vector)"


def peft_rules(adapter_name: str = "default", *, prefix: str = "base_model.model.") -> KeyRemapper:
    """The rules between a module with LoRA layers as peft injects them
    (``q_proj.lora_A.default.weight``: the adapter's name in the path) and the adapter file
    peft saves (``adapter_model.safetensors``: ``base_model.model.q_proj.lora_A.weight``, the
    adapter's name left out, the base model's weights not saved). ``save_pretrained(model,
    "adapter_model.safetensors", peft_rules())`` writes what ``PeftModel.from_pretrained``
    reads; a load through them takes such a file (``allow_partial=True``: the base weights are
    not in it). ``prefix``: ``""`` for a module that is not wrapped in a ``PeftModel``.

    >>> rules = peft_rules()
    >>> items = {n: (torch.ones(1), None) for n in ["q.lora_A.default.weight", "q.weight"]}
    >>> list(rules.save(items).tensors)
    ['base_model.model.q.lora_A.weight']
    """
    if not re.fullmatch(r"[\w-]+", adapter_name):
        raise RemapError(f"adapter name {adapter_name!r} is not one peft would use")
    lead = re.escape(prefix)
    name = re.escape(adapter_name)
    return KeyRemapper(
        [
            KeyFilter(regex=[rf"\.{_LORA}\."]),
            Rename(
                rf"^{lead}(.+)\.({_LORA})\.(weight|bias)$",
                rf"\1.\2.{adapter_name}.\3",
                inverse=(rf"^(.+)\.({_LORA})\.{name}\.(weight|bias)$", rf"{prefix}\1.\2.\3"),
            ),
        ]
    )


def _file_names(remapper: KeyRemapper, ties: Mapping[str, str]) -> set[str]:
    """The names the tied tensors ``ties`` declares (module names) are saved under."""
    names: set[str] = set()
    for tied in ties:
        try:
            names.update(remapper.save({tied: (torch.empty(0, device="meta"), None)}).tensors)
        except RemapError:  # converted with others: not a tie save_pretrained drops
            continue
    return names
