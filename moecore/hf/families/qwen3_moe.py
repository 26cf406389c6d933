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
    base_config,
    base_to_hf,
    check_exportable,
    num_experts,
    qwen_experts_from_hf,
    qwen_experts_to_hf,
    qwen_tensor_maps,
    refuse_export_unless,
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
    qwen_experts_from_hf(f, cfg, num_experts(f, "num_experts", "num_local_experts"))
    e.shared_expert_intermediate_size = None
    f.finish()
    return validated(cfg)


def config_to_hf(cfg: Config) -> dict:
    m, e = cfg.model, cfg.moe
    check_exportable(cfg, MODEL_TYPE)
    shared = e.shared_expert_intermediate_size
    refuse_export_unless(
        MODEL_TYPE,
        [
            ("model.qk_norm", m.qk_norm, m.qk_norm, "Qwen3-MoE always normalises q and k per head"),
            (
                "model.attn_out_bias",
                m.attn_out_bias,
                m.attn_out_bias == m.qkv_bias,
                "attention_bias covers q/k/v and o together",
            ),
            ("moe.shared_expert_intermediate_size", shared, not shared, "Qwen3-MoE has no shared expert"),
        ],
    )
    return {
        **base_to_hf(m),
        "attention_bias": m.qkv_bias,
        "use_sliding_window": m.sliding_window is not None,
        "sliding_window": m.sliding_window,
        **qwen_experts_to_hf(cfg),
    }


def tensor_maps(cfg: Config, available: Collection[str] | None) -> list[TensorMap]:
    return qwen_tensor_maps(cfg, available, shared_expert=False)
