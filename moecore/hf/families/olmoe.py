"""OLMoE (model_type "olmoe", OlmoeForCausalLM): AllenAI's OLMoE-1B-7B.

The maths, as transformers' Olmoe implements it:
- grouped-query attention (multi-head in the released checkpoints), optional biases on q/k/v/o together
  (`attention_bias`); q and k each pass one RMSNorm over the whole projection (every head's channels at once:
  weights of hidden_size and num_key_value_heads * head_dim) before they are split into heads and before RoPE —
  our `model.qk_norm_scope: projection`; full RoPE; `clip_qkv` (clamping q, k and v) is refused unless null;
- every layer MoE: softmax over all experts, top-k, the weights renormalised only with `norm_topk_prob` (off in
  the released checkpoints); no shared expert; Mixtral's SwiGLU experts of width `intermediate_size`.
Balancing: `router_aux_loss_coef` maps to our `aux_loss` coefficient (the same Switch-style loss).

Tensors: the attention names of families/common.py (`self_attn.{q,k,v,o}_proj`, `self_attn.{q,k}_norm`); each MoE
block is Qwen's `mlp` with `gate.weight` and per-expert `experts.j.{gate,up,down}_proj.weight` on disk (Hub
checkpoints), or transformers' in-memory `experts.gate_up_proj` / `down_proj`, both read.
"""

from __future__ import annotations

from collections.abc import Collection

from moecore.config import Config
from moecore.hf.families import TensorMap
from moecore.hf.families.common import (
    HFFields,
    aux_coef_to_hf,
    base_config,
    base_to_hf,
    moe_pattern,
    num_experts,
    projection_norm_attention_checks,
    qwen_tensor_maps,
    refuse_export_unless,
    renormalises,
    softmax_router_checks,
    validated,
)

MODEL_TYPE = "olmoe"
ARCHITECTURE = "OlmoeForCausalLM"
IGNORED_HF_TENSORS = (r"\.rotary_emb\.inv_freq$",)

# transformers' OlmoeConfig defaults, for fields a config.json leaves out.
DEFAULTS = {
    "vocab_size": 50304,
    "hidden_size": 2048,
    "intermediate_size": 2048,
    "num_hidden_layers": 16,
    "num_attention_heads": 16,
    "hidden_act": "silu",
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "attention_bias": False,
    "num_experts_per_tok": 8,
    "num_experts": 64,
    "router_aux_loss_coef": 0.01,
    "norm_topk_prob": False,
}


def config_from_hf(hf: dict) -> Config:
    """config.json -> Config, refusing (one line naming the field) what transformers' Olmoe does not compute."""
    f = HFFields(hf, MODEL_TYPE, DEFAULTS)
    cfg = base_config(f)
    m, e = cfg.model, cfg.moe
    if m.head_dim is not None:  # transformers sizes the k norm by hidden/heads, so only that head_dim runs there
        f.refuse("head_dim", m.head_dim, "transformers' Olmoe needs hidden_size / num_attention_heads (allowed: null)")
    bias = f.expect("attention_bias", (True, False))
    m.qkv_bias = m.attn_out_bias = bias
    m.qk_norm, m.qk_norm_scope = True, "projection"
    clip = f.get("clip_qkv", None)
    if clip is not None:
        f.refuse("clip_qkv", clip, "moecore does not clamp q, k and v (allowed: null)")
    e.num_experts = num_experts(f, "num_experts", "num_local_experts")
    e.ffn_hidden_size = m.ffn_hidden_size  # intermediate_size is the experts' width (there are no dense layers)
    e.norm_topk_prob = f.expect("norm_topk_prob", (True, False))
    e.shared_expert_intermediate_size = None
    e.layer_freq = 1
    f.finish()
    return validated(cfg)


def config_to_hf(cfg: Config) -> dict:
    """Our Config -> config.json, refusing what Olmoe cannot express."""
    m, e = cfg.model, cfg.moe
    refuse_export_unless(
        MODEL_TYPE,
        [
            *projection_norm_attention_checks(m, "OLMoE"),
            ("model.head_dim", m.head_dim, m.head_dim is None, "head_dim = hidden_size / num_attention_heads"),
            ("model.attn_out_bias", m.attn_out_bias, m.attn_out_bias == m.qkv_bias, "attention_bias covers q/k/v/o"),
            ("model.partial_rotary_factor", m.partial_rotary_factor, m.partial_rotary_factor == 1.0, "full rotary"),
            ("moe.num_experts", e.num_experts, e.num_experts > 0, "needs routed experts"),
            ("moe.layer_freq", e.layer_freq, all(moe_pattern(cfg)), "every OLMoE layer is MoE"),
            (
                "moe.shared_expert_intermediate_size",
                e.shared_expert_intermediate_size,
                not e.shared_expert_intermediate_size,
                "no shared expert",
            ),
            (
                "moe.router_pre_softmax",
                e.router_pre_softmax,
                e.router_pre_softmax,
                "softmax over all experts before the top-k",
            ),
            *softmax_router_checks(e),
        ],
    )
    out = {
        **base_to_hf(m),
        "intermediate_size": e.ffn_hidden_size,  # the only MLP is the experts'
        "attention_bias": m.qkv_bias,
        "clip_qkv": None,
        "num_experts": e.num_experts,
        "num_experts_per_tok": e.router_topk,
        "norm_topk_prob": renormalises(e),
        "router_aux_loss_coef": aux_coef_to_hf(e),
        "output_router_logits": False,
    }
    out.pop("head_dim")  # Olmoe has no such field: hidden_size / num_attention_heads
    return out


def tensor_maps(cfg: Config, available: Collection[str] | None) -> list[TensorMap]:
    return qwen_tensor_maps(cfg, available, shared_expert=False)
