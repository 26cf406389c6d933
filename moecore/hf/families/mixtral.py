"""Mixtral (model_type "mixtral"): Mixtral-8x7B, Mixtral-8x22B.

Every layer is MoE: softmax over all experts, top-k, renormalised (norm_topk_prob is always on), no
shared expert, no biases, optional sliding-window attention on every layer. `router_jitter_noise`
(training-time noise on the MoE input, 0 in every released checkpoint) is refused on import: ours,
`moe.input_jitter_eps`, jitters only the router's input.
On disk each MoE block is `model.layers.i.block_sparse_moe` with a router `gate` and experts
`experts.j.{w1 (gate), w3 (up), w2 (down)}`; transformers 5 renames the block to `mlp` in memory.
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
    base_to_hf,
    check_exportable,
    embed_maps,
    expert_maps,
    moe_pattern,
    num_experts,
    refuse_export_unless,
    renormalises,
    validated,
)

MODEL_TYPE = "mixtral"
ARCHITECTURE = "MixtralForCausalLM"
IGNORED_HF_TENSORS = (r"\.rotary_emb\.inv_freq$",)

# transformers' MixtralConfig defaults, used for fields a config.json leaves out.
DEFAULTS = {
    "vocab_size": 32000,
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "hidden_act": "silu",
    "max_position_embeddings": 4096 * 32,
    "rms_norm_eps": 1e-5,
    "rope_theta": 1e6,
    "num_experts_per_tok": 2,
    "num_local_experts": 8,
    "router_aux_loss_coef": 0.001,
    "router_jitter_noise": 0.0,
}


def config_from_hf(hf: dict) -> Config:
    f = HFFields(hf, MODEL_TYPE, DEFAULTS)
    cfg = base_config(f)
    m, e = cfg.model, cfg.moe
    e.num_experts = num_experts(f, "num_local_experts", "num_experts")
    e.ffn_hidden_size = m.ffn_hidden_size  # Mixtral's intermediate_size is the expert width
    e.norm_topk_prob = True
    e.shared_expert_intermediate_size = None
    e.layer_freq = 1
    jitter = f.get("router_jitter_noise")
    if jitter:  # transformers jitters the experts' input too; ours (Megatron-Core's) only the router's
        f.refuse("router_jitter_noise", jitter, "only 0 imports; set moe.input_jitter_eps for router-input jitter")
    window = f.get("sliding_window", None)
    m.sliding_window = None if window is None else f.integer("sliding_window")
    f.finish()
    return validated(cfg)


def config_to_hf(cfg: Config) -> dict:
    m, e = cfg.model, cfg.moe
    check_exportable(cfg, MODEL_TYPE)
    shared = e.shared_expert_intermediate_size
    refuse_export_unless(
        MODEL_TYPE,
        [
            ("model.qkv_bias", m.qkv_bias, not m.qkv_bias, "Mixtral has no attention biases"),
            ("model.attn_out_bias", m.attn_out_bias, not m.attn_out_bias, "Mixtral has no attention biases"),
            ("model.qk_norm", m.qk_norm, not m.qk_norm, "Mixtral has no q/k norm"),
            ("moe.shared_expert_intermediate_size", shared, not shared, "Mixtral has no shared expert"),
            ("moe.layer_freq", e.layer_freq, all(moe_pattern(cfg)), "every Mixtral layer is MoE"),
            ("moe.norm_topk_prob", e.norm_topk_prob, renormalises(e), "Mixtral renormalises the top-k weights"),
        ],
    )
    return {**base_to_hf(m), **experts_to_hf(cfg), "sliding_window": m.sliding_window}


def experts_to_hf(cfg: Config) -> dict:
    """The expert fields of Mixtral's config.json (also MiniMax-M2's): every MLP is the experts'."""
    e = cfg.moe
    return {
        "intermediate_size": e.ffn_hidden_size,  # the only MLP is the experts'
        "num_local_experts": e.num_experts,
        "num_experts_per_tok": e.router_topk,
        "router_aux_loss_coef": aux_coef_to_hf(e),
        "router_jitter_noise": 0.0,  # training-time noise; transformers' differs from ours, so none is written
        "output_router_logits": False,
    }


def tensor_maps(cfg: Config, available: Collection[str] | None) -> list[TensorMap]:
    m, e = cfg.model, cfg.moe
    maps = embed_maps(m)
    for i in range(m.num_layers):
        maps += attention_maps(i, m)
        maps += expert_maps(
            i,
            e.num_experts,
            f"model.layers.{i}.block_sparse_moe",
            names=("w1", "w3", "w2"),
            fused_moe=f"model.layers.{i}.mlp",
            available=available,
        )
    return maps
