"""dots.llm1 (model_type "dots1", Dots1ForCausalLM): rednote's dots.llm1.

The maths, as transformers' Dots1 implements it:
- grouped-query attention with optional biases on q/k/v/o together (`attention_bias`) and a per-head RMSNorm on q
  and k (always), full RoPE; `sliding_window` applies to the layers `layer_types` marks (absent: layers from
  `max_window_layers` on, when a window is set) — one kind for every layer imports, mixed kinds are refused;
- the first `first_k_dense_replace` layers dense, every later layer MoE with DeepSeek-V3's router (sigmoid scores,
  selection with the fp32 `e_score_correction_bias`, `n_group` groups scored by their two best biased scores,
  `topk_group` kept, weights renormalised when `norm_topk_prob`, times `routed_scaling_factor`) plus
  `n_shared_experts` always-on experts fused into one SwiGLU; no multi-token prediction.
config.json carries no balancing-loss coefficient (an export writes none): an import trains with the aux-loss-free
expert bias and an `aux_loss` of coefficient 0.001 (`router_aux_loss_coef` when the file has one); set a run's own
in its recipe.

Tensor names: GLM-4.5's (`families/glm4_moe.py`): GQA under model.layers.i.self_attn, DeepSeek's MoE names under
model.layers.i.mlp (gate.weight, gate.e_score_correction_bias, experts.j.* or transformers' fused experts,
shared_experts.*).
"""

from __future__ import annotations

from collections.abc import Collection

from moecore.config import Config
from moecore.hf.families import TensorMap
from moecore.hf.families.common import (
    HFFields,
    base_config,
    base_to_hf,
    embed_maps,
    qk_norm_scope_checks,
    refuse_export_unless,
    validated,
)
from moecore.hf.families.glm4_moe import deepseek_moe_checks, deepseek_moe_from_hf, deepseek_moe_to_hf, layer_maps
from moecore.hf.families.qwen2_moe import one_window

MODEL_TYPE = "dots1"
ARCHITECTURE = "Dots1ForCausalLM"
IGNORED_HF_TENSORS = (r"\.rotary_emb\.inv_freq$",)

# transformers' Dots1Config defaults, for fields a config.json leaves out.
DEFAULTS = {
    "vocab_size": 152064,
    "hidden_size": 4608,
    "intermediate_size": 10944,
    "moe_intermediate_size": 1408,
    "num_hidden_layers": 62,
    "num_attention_heads": 32,
    "num_key_value_heads": 32,
    "n_shared_experts": None,
    "n_routed_experts": None,
    "n_group": 1,
    "topk_group": 1,
    "num_experts_per_tok": None,
    "first_k_dense_replace": 0,
    "norm_topk_prob": False,
    "hidden_act": "silu",
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "attention_bias": False,
    "routed_scaling_factor": 1.0,
    "sliding_window": 4096,
    "max_window_layers": 62,
}


def _sliding_window(f: HFFields, num_layers: int) -> int | None:
    """One window for every layer (from `layer_types`, or derived as transformers does), or None."""
    window = f.get("sliding_window")
    first = f.integer("max_window_layers", lo=0)
    types = f.get("layer_types", None)
    if types is None:
        types = [
            "sliding_attention" if window is not None and i >= first else "full_attention" for i in range(num_layers)
        ]
    if not isinstance(types, list) or len(types) != num_layers:
        f.refuse("layer_types", types, f"a list with one entry per layer ({num_layers})")
    return one_window(f, types, window)


def config_from_hf(hf: dict) -> Config:
    """config.json -> Config, refusing (one line naming the field) what transformers' Dots1 does not compute."""
    f = HFFields(hf, MODEL_TYPE, DEFAULTS)
    cfg = base_config(f)
    m = cfg.model
    m.qkv_bias = m.attn_out_bias = f.expect("attention_bias", (True, False))
    m.qk_norm = True
    m.sliding_window = _sliding_window(f, m.num_layers)
    deepseek_moe_from_hf(f, cfg)
    f.finish()
    return validated(cfg)


def config_to_hf(cfg: Config) -> dict:
    """Our Config -> config.json, refusing options Dots1ForCausalLM cannot express."""
    m = cfg.model
    refuse_export_unless(
        MODEL_TYPE,
        [
            ("model.attention_type", m.attention_type, m.attention_type == "gqa", "grouped-query attention only"),
            ("model.layer_types", m.layer_types, m.layer_types is None, "one attention kind for every layer"),
            ("model.qk_norm", m.qk_norm, m.qk_norm, "dots.llm1 always normalises q and k per head"),
            *qk_norm_scope_checks(m),
            ("model.attn_out_bias", m.attn_out_bias, m.attn_out_bias == m.qkv_bias, "attention_bias covers q/k/v/o"),
            ("model.attn_output_gate", m.attn_output_gate, not m.attn_output_gate, "no attention output gate"),
            ("model.attn_sinks", m.attn_sinks, not m.attn_sinks, "no attention sinks"),
            ("model.norm_zero_centered", m.norm_zero_centered, not m.norm_zero_centered, "plain RMSNorm only"),
            ("model.partial_rotary_factor", m.partial_rotary_factor, m.partial_rotary_factor == 1.0, "full rotary"),
            ("model.activation", m.activation, m.activation == "swiglu", "SwiGLU only"),
            ("model.mtp_num_layers", m.mtp_num_layers, m.mtp_num_layers == 0, "no multi-token prediction"),
            *deepseek_moe_checks(cfg),
        ],
    )
    n = m.num_layers
    return {
        **base_to_hf(m),
        "attention_bias": m.qkv_bias,
        "sliding_window": m.sliding_window,
        "max_window_layers": 0 if m.sliding_window is not None else n,
        "layer_types": ["sliding_attention" if m.sliding_window is not None else "full_attention"] * n,
        **deepseek_moe_to_hf(cfg),
    }


def tensor_maps(cfg: Config, available: Collection[str] | None) -> list[TensorMap]:
    """Every parameter (and the expert-bias buffers) of our model and the checkpoint tensors it is made of."""
    m = cfg.model
    maps = embed_maps(m)
    for i in range(m.num_layers):
        maps += layer_maps(f"layers.{i}", f"model.layers.{i}", cfg.moe.is_moe_layer(i, m.num_layers), cfg, available)
    return maps
