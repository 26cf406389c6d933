"""Qwen3-MoE (model_type "qwen3_moe"): Qwen3-30B-A3B, Qwen3-235B-A22B.

Per-head RMSNorm on q and k before RoPE (always), `head_dim` set on its own (128 where
hidden/heads is 64 for the 30B), optional biases on q/k/v/o together (`attention_bias`), softmax over
all experts then top-k, renormalised with `norm_topk_prob`, no shared expert, dense layers from
`mlp_only_layers` / `decoder_sparse_step`, and with `use_sliding_window` a window on every layer.
transformers 5 writes the expert count as `num_local_experts`; Hub checkpoints as `num_experts`.
"""

from __future__ import annotations

from collections.abc import Collection

from moecore.config import Config
from moecore.hf.families import TensorMap
from moecore.hf.families.common import (
    HFFields,
    attention_maps,
    aux_coef_to_hf,
    base_config,
    check_exportable,
    dense_mlp_maps,
    embed_maps,
    expert_maps,
    moe_pattern,
    moe_pattern_from_hf,
    moe_pattern_to_hf,
    num_experts,
    refuse_export,
    renormalises,
    rope_to_hf,
    validated,
)
from moecore.hf.families.qwen2_moe import sliding_window_from_hf

MODEL_TYPE = "qwen3_moe"
ARCHITECTURE = "Qwen3MoeForCausalLM"

# transformers' Qwen3MoeConfig defaults, used for fields a config.json leaves out.
DEFAULTS = {
    "vocab_size": 151936,
    "hidden_size": 2048,
    "intermediate_size": 6144,
    "num_hidden_layers": 24,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "hidden_act": "silu",
    "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "attention_bias": False,
    "use_sliding_window": False,
    "sliding_window": 4096,
    "decoder_sparse_step": 1,
    "moe_intermediate_size": 768,
    "num_experts_per_tok": 8,
    "num_experts": 128,
    "norm_topk_prob": False,
    "router_aux_loss_coef": 0.001,
}


def config_from_hf(hf: dict) -> Config:
    f = HFFields(hf, MODEL_TYPE, DEFAULTS)
    cfg = base_config(f)
    m, e = cfg.model, cfg.moe
    bias = f.expect("attention_bias", (True, False))
    m.qkv_bias = m.attn_out_bias = bias
    m.qk_norm = True
    m.sliding_window = sliding_window_from_hf(f, m.num_layers, derive_types=False)
    e.num_experts = num_experts(f, "num_experts", "num_local_experts")
    e.ffn_hidden_size = f.integer("moe_intermediate_size")
    e.norm_topk_prob = f.expect("norm_topk_prob", (True, False))
    e.shared_expert_intermediate_size = None
    pattern = moe_pattern_from_hf(f, m.num_layers, e.num_experts)
    e.layer_freq = 1 if all(pattern) else pattern
    f.finish()
    return validated(cfg)


def config_to_hf(cfg: Config) -> dict:
    m, e = cfg.model, cfg.moe
    check_exportable(cfg, MODEL_TYPE)
    for field, value, ok, why in (
        ("model.qk_norm", m.qk_norm, m.qk_norm, "Qwen3-MoE always normalises q and k per head"),
        (
            "model.attn_out_bias",
            m.attn_out_bias,
            m.attn_out_bias == m.qkv_bias,
            "attention_bias covers q/k/v and o together",
        ),
        (
            "moe.shared_expert_intermediate_size",
            e.shared_expert_intermediate_size,
            not e.shared_expert_intermediate_size,
            "Qwen3-MoE has no shared expert",
        ),
    ):
        if not ok:
            refuse_export(MODEL_TYPE, field, value, why)
    return {
        "vocab_size": m.vocab_size,
        "hidden_size": m.hidden_size,
        "intermediate_size": m.ffn_hidden_size,
        "num_hidden_layers": m.num_layers,
        "num_attention_heads": m.num_attention_heads,
        "num_key_value_heads": m.kv_heads,
        "head_dim": m.resolved_head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": m.max_position_embeddings,
        "initializer_range": m.init_std,
        "rms_norm_eps": m.norm_eps,
        **rope_to_hf(m),
        "attention_bias": m.qkv_bias,
        "use_sliding_window": m.sliding_window is not None,
        "sliding_window": m.sliding_window,
        "attention_dropout": m.attention_dropout,
        "tie_word_embeddings": m.tie_embeddings,
        "num_experts": e.num_experts,
        "num_experts_per_tok": e.router_topk,
        "moe_intermediate_size": e.ffn_hidden_size,
        "norm_topk_prob": renormalises(e),
        **moe_pattern_to_hf(cfg),
        "router_aux_loss_coef": aux_coef_to_hf(e),
        "output_router_logits": False,
    }


def tensor_maps(cfg: Config, available: Collection[str] | None) -> list[TensorMap]:
    m, e = cfg.model, cfg.moe
    maps = embed_maps(m)
    for i, is_moe in enumerate(moe_pattern(cfg)):
        maps += attention_maps(i, m)
        hf = f"model.layers.{i}.mlp"
        if is_moe:
            maps += expert_maps(i, e.num_experts, hf, available=available)
        else:
            maps += dense_mlp_maps(f"layers.{i}.mlp", hf)
    return maps
