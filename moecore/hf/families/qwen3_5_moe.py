"""Qwen3.5-MoE (`model_type: qwen3_5_moe_text`, Qwen3_5MoeForCausalLM): the Qwen3-Next architecture, re-laid out.

The maths is Qwen3-Next's (families/qwen3_next.py: hybrid gated DeltaNet + gated attention, zero-centred norms,
partial rotary, softmax top-k router with a gated shared expert, an optional MTP module). What differs is on disk:

- the gated DeltaNet's input projections are four plain matrices instead of two head-interleaved ones:
      in_proj_qkv [q (Hk*dk) | k (Hk*dk) | v (Hv*dv)],  in_proj_z [z (Hv*dv)],  in_proj_b [Hv],  in_proj_a [Hv]
  where ours (Qwen3-Next's layout) group them per key head g, r = Hv/Hk value heads each:
      in_proj_qkvz [q_g | k_g | v_g (r*dv) | z_g (r*dv)] for g = 0..Hk-1,   in_proj_ba [b_g (r) | a_g (r)]
  so those two of ours are combined from (and split back into) the four on import (export);
- every layer is MoE and the top-k weights are always renormalised (no `decoder_sparse_step`,
  `mlp_only_layers`, `norm_topk_prob` fields; export refuses dense layers and unnormalised weights);
- RoPE is multimodal (`mrope_section`, `mrope_interleaved` in `rope_parameters`: the rotary frequencies are
  split between temporal, height and width positions). For text every token's three positions are equal, which
  makes it the ordinary partial RoPE; moecore trains text only, so those two fields are checked and not written
  back (transformers' defaults then apply, which give text the same RoPE).

The checkpoints Qwen publishes are multimodal (`model_type: qwen3_5_moe`, Qwen3_5MoeForConditionalGeneration):
their `text_config` is this config and their language model's tensors are under `model.language_model.`; the
vision encoder (`model.visual.`) is not part of a language model and is skipped on import (the import says so).
Such a checkpoint imports as its language model and exports as `qwen3_5_moe_text`.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Collection

import torch

from moecore.config import Config, ModelConfig
from moecore.hf.families import TensorMap
from moecore.hf.families import qwen3_next as next_family
from moecore.hf.families.common import HFFields, attention_maps, norm_maps, qwen_tensor_maps

MODEL_TYPE = "qwen3_5_moe_text"
ARCHITECTURE = "Qwen3_5MoeForCausalLM"
MULTIMODAL_MODEL_TYPE = "qwen3_5_moe"  # Qwen3_5MoeForConditionalGeneration: imported as its language model
IGNORED_HF_TENSORS = (r"\.rotary_emb\.inv_freq$", r"^model\.visual\.")  # the vision encoder: not a language model's

# transformers' Qwen3_5MoeTextConfig defaults, for fields a config.json leaves out.
DEFAULTS = {
    **{
        k: v
        for k, v in next_family.DEFAULTS.items()
        if k not in ("decoder_sparse_step", "mlp_only_layers", "norm_topk_prob")
    },
    "vocab_size": 248320,
    "num_hidden_layers": 40,
    "num_experts": 256,
    "num_experts_per_tok": 8,
    "max_position_embeddings": 32768,
}
MROPE_FIELDS = ("mrope_section", "mrope_interleaved")
_PLAIN_DELTANET_TENSORS = ("conv1d.weight", "dt_bias", "A_log", "norm.weight", "out_proj.weight")


def _unwrap(hf: dict) -> tuple[dict, bool]:
    """(the language model's config.json fields, whether they came from a multimodal config's `text_config`)."""
    if hf.get("model_type") == MULTIMODAL_MODEL_TYPE or "text_config" in hf:
        text = hf.get("text_config")
        if not isinstance(text, dict):
            raise ValueError(f"config.json: text_config={text!r} is invalid: the language model's config (a mapping)")
        tie = hf.get("tie_word_embeddings", text.get("tie_word_embeddings", False))
        return {**text, "model_type": MODEL_TYPE, "tie_word_embeddings": tie}, True
    return hf, False


def _without_mrope(hf: dict) -> dict:
    """config.json without the multimodal RoPE fields of `rope_parameters` (see the module docstring), checked."""
    params = hf.get("rope_parameters")
    if not isinstance(params, dict):
        return hf
    section = params.get("mrope_section")
    if section is not None and (not isinstance(section, list) or not all(isinstance(x, int) for x in section)):
        raise ValueError(f"rope_parameters.mrope_section={section!r} is invalid: a list of integers")
    if not isinstance(params.get("mrope_interleaved", True), bool):
        raise ValueError(f"rope_parameters.mrope_interleaved={params['mrope_interleaved']!r} is invalid: true | false")
    return {**hf, "rope_parameters": {k: v for k, v in params.items() if k not in MROPE_FIELDS}}


def config_from_hf(hf: dict, available: Collection[str] | None = None) -> Config:
    """config.json (text or multimodal) -> our Config; with `available` the MTP module is imported when the weights
    hold it."""
    text, multimodal = _unwrap(hf)
    if multimodal and available is not None and any(n.startswith("model.visual.") for n in available):
        warnings.warn("a multimodal Qwen3.5-MoE checkpoint: importing its language model (the vision encoder, "
                      "model.visual.*, is not trained and not exported)", stacklevel=2)  # fmt: skip
    text = _without_mrope(text)
    gate = text.pop("attn_output_gate", True)  # Hub configs state it; transformers' attention always gates
    if gate is not True:
        raise ValueError(f"config.json: attn_output_gate={gate!r} is invalid: Qwen3.5-MoE's attention is always gated")
    text, partial = next_family._split_partial_rotary(text)
    cfg = next_family.build_config(HFFields(text, MODEL_TYPE, DEFAULTS), partial, _text_names(available), False)
    cfg.model.family = MODEL_TYPE
    if cfg.moe.num_experts:  # every layer is MoE: the dense width is unused (the config has none); the experts'
        cfg.model.ffn_hidden_size = cfg.moe.ffn_hidden_size
    return cfg


def config_to_hf(cfg: Config) -> dict:
    """Our Config -> a Qwen3_5MoeTextConfig config.json."""
    out = next_family.config_to_hf(cfg, MODEL_TYPE, moe_pattern=False)
    out.pop("intermediate_size", None)  # no dense layers: Qwen3_5MoeTextConfig has no such field
    return out


def _text_names(available: Collection[str] | None) -> Collection[str] | None:
    """The checkpoint's tensor names as a text checkpoint names them (a multimodal one's `model.language_model.`
    prefix read as `model.`), for the decisions that depend on which tensors exist."""
    if available is None:
        return None
    prefix = "model.language_model."
    return {("model." + n[len(prefix) :]) if n.startswith(prefix) else n for n in available}


# ------------------------------------------------------------------ the DeltaNet projections (module docstring)


def _qkvz_from_parts(m: ModelConfig):
    nk, dk, dv = m.linear_num_key_heads, m.linear_key_head_dim, m.linear_value_head_dim
    r = m.linear_num_value_heads // nk

    def combine(parts: list[torch.Tensor]) -> torch.Tensor:
        qkv, z = parts
        h = qkv.shape[-1]
        q, k, v = qkv.split([nk * dk, nk * dk, nk * r * dv])
        grouped = [q.view(nk, dk, h), k.view(nk, dk, h), v.view(nk, r * dv, h), z.view(nk, r * dv, h)]
        return torch.cat(grouped, dim=1).reshape(-1, h)

    def split(ours: torch.Tensor) -> list[torch.Tensor]:
        h = ours.shape[-1]
        q, k, v, z = ours.view(nk, -1, h).split([dk, dk, r * dv, r * dv], dim=1)
        return [torch.cat([q.reshape(-1, h), k.reshape(-1, h), v.reshape(-1, h)]), z.reshape(-1, h)]

    return combine, split


def _ba_from_parts(m: ModelConfig):
    nk = m.linear_num_key_heads
    r = m.linear_num_value_heads // nk

    def combine(parts: list[torch.Tensor]) -> torch.Tensor:
        b, a = parts
        h = b.shape[-1]
        return torch.cat([b.view(nk, r, h), a.view(nk, r, h)], dim=1).reshape(-1, h)

    def split(ours: torch.Tensor) -> list[torch.Tensor]:
        h = ours.shape[-1]
        b, a = ours.view(nk, 2 * r, h).split([r, r], dim=1)
        return [b.reshape(-1, h), a.reshape(-1, h)]

    return combine, split


def _attention_maps(i: int, m: ModelConfig) -> list[TensorMap]:
    """Norms and gated DeltaNet (four projections combined into our two) or gated full attention of layer i."""
    if m.layer_types is None or m.layer_types[i] != "linear_attention":
        return attention_maps(i, m)
    ours, hf = f"layers.{i}.attn", f"model.layers.{i}.linear_attn"
    h, nk, nv = m.hidden_size, m.linear_num_key_heads, m.linear_num_value_heads
    key, value = nk * m.linear_key_head_dim, nv * m.linear_value_head_dim
    qkvz, ba = _qkvz_from_parts(m), _ba_from_parts(m)
    return norm_maps(f"layers.{i}", f"model.layers.{i}") + [
        TensorMap.combined(f"{ours}.in_proj_qkvz.weight", [f"{hf}.in_proj_qkv.weight", f"{hf}.in_proj_z.weight"],
                           qkvz[0], [(2 * key + value, h), (value, h)], qkvz[1]),
        TensorMap.combined(f"{ours}.in_proj_ba.weight", [f"{hf}.in_proj_b.weight", f"{hf}.in_proj_a.weight"],
                           ba[0], [(nv, h), (nv, h)], ba[1]),
        *(TensorMap.copy(f"{ours}.{t}", f"{hf}.{t}") for t in _PLAIN_DELTANET_TENSORS),
    ]  # fmt: skip


def tensor_maps(cfg: Config, available: Collection[str] | None = None) -> list[TensorMap]:
    """Every parameter of our model and the checkpoint tensors it is made of (a multimodal checkpoint's language
    model under `model.language_model.`)."""
    text = _text_names(available)
    maps = qwen_tensor_maps(cfg, text, shared_expert=True, attention=_attention_maps)
    maps += next_family.mtp_maps(cfg, text)
    if available is None or text == set(available):
        return maps
    return [_renamed(mp, set(available)) for mp in maps]


def _renamed(mp: TensorMap, available: set[str]) -> TensorMap:
    """`mp` with its `model.` names read under `model.language_model.` where the checkpoint has them there."""

    def name(n: str) -> str:
        moved = "model.language_model." + n[len("model.") :] if n.startswith("model.") else n
        return moved if moved in available else n

    hf = tuple(tuple(name(n) for n in parts) for parts in mp.hf)
    return dataclasses.replace(mp, hf=hf)
