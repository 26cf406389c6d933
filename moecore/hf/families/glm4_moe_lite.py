"""GLM-4.7-Flash (model_type "glm4_moe_lite", Glm4MoeLiteForCausalLM): GLM's MoE on DeepSeek-V3's attention.

The maths is DeepSeek-V3's decoder as families/deepseek_v3.py reads it — multi-latent attention (optional q LoRA,
`rope_interleave`), dense layers then MoE layers with shared experts, the sigmoid router with the fp32
`e_score_correction_bias`, `n_group` / `topk_group` groups scored by their top-2 sums, renormalised weights times
`routed_scaling_factor` — with GLM's config.json and training choices:
- which layers are dense is `mlp_layer_types` ("dense" | "sparse" per layer; transformers' default: the first
  dense, the rest sparse), which moecore reads as `moe.first_k_dense_replace` (a run of dense layers then MoE;
  other patterns are refused);
- no `scoring_func`, `topk_method`, `aux_loss_alpha`, `seq_aux` fields (the router is always DeepSeek-V3's); like
  families/glm4_moe.py, an import takes GLM's published balancing recipe: the aux-loss-free bias (update rate
  1e-3) plus a sequence-level balance loss of weight 1e-4;
- MTP: `num_nextn_predict_layers` modules stored as decoder layers num_hidden_layers + k, as DeepSeek-V3's
  (transformers skips them; we import and write them back).
Tensor names are DeepSeek-V3's (self_attn.q_a_proj / q_b_proj / kv_a_proj_with_mqa / kv_b_proj / o_proj, mlp.gate,
mlp.experts, mlp.shared_experts).
"""

from __future__ import annotations

from collections.abc import Collection

from moecore.config import Config
from moecore.hf.families import TensorMap
from moecore.hf.families.common import HFFields, refuse_export_unless, validated
from moecore.hf.families.deepseek_v2 import (
    check_deepseek_exportable,
    deepseek_base_config,
    main_model_maps,
    mla_experts_to_hf,
)
from moecore.hf.families.deepseek_v3 import IGNORED_HF_TENSORS, mtp_maps, shared_copies  # noqa: F401  (read by moecore.hf.pretrained)
from moecore.hf.families.glm4_moe import (
    glm_balancing,
    mtp_count,
    sigmoid_router_checks,
    sigmoid_router_from_hf,
    sigmoid_router_to_hf,
    split_partial_rotary,
)

MODEL_TYPE = "glm4_moe_lite"
ARCHITECTURE = "Glm4MoeLiteForCausalLM"
# IGNORED_HF_TENSORS: DeepSeek-V3's (the MTP layers' copies of the shared embedding and head).

# transformers' Glm4MoeLiteConfig defaults, for fields a config.json leaves out (the DeepSeek-only balancing
# fields are given their DeepSeek defaults so that the shared reader finds them; GLM's recipe replaces them).
DEFAULTS = {
    "vocab_size": 154880,
    "hidden_size": 2048,
    "intermediate_size": 10240,
    "moe_intermediate_size": 1536,
    "num_hidden_layers": 47,
    "num_attention_heads": 20,
    "n_shared_experts": 1,
    "n_routed_experts": 64,
    "routed_scaling_factor": 1.8,
    "kv_lora_rank": 512,
    "q_lora_rank": 768,
    "qk_rope_head_dim": 64,
    "v_head_dim": 256,
    "qk_nope_head_dim": 192,
    "n_group": 1,
    "topk_group": 1,
    "num_experts_per_tok": 4,
    "norm_topk_prob": True,
    "hidden_act": "silu",
    "max_position_embeddings": 202752,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "rope_interleave": True,
    "num_nextn_predict_layers": 0,
    "aux_loss_alpha": 0.0,
    "seq_aux": True,
}


def leading_dense_layers(f: HFFields, num_layers: int) -> int | None:
    """`mlp_layer_types` -> how many leading layers are dense (the rest must be sparse); None without the field."""
    types = f.get("mlp_layer_types", None)
    if types is None:
        return None
    if not isinstance(types, list) or len(types) != num_layers or any(t not in ("dense", "sparse") for t in types):
        f.refuse("mlp_layer_types", types, f"a list of {num_layers} entries dense | sparse")
    k = types.index("sparse") if "sparse" in types else num_layers
    if types[k:] != ["sparse"] * (num_layers - k):
        f.refuse("mlp_layer_types", types, "dense layers first, then sparse ones (a run of each)")
    return k


def _first_dense(f: HFFields, num_layers: int) -> int:
    """How many leading layers are dense: `mlp_layer_types`, else transformers' default (one dense layer)."""
    k = leading_dense_layers(f, num_layers)
    return 1 if k is None else k


def config_from_hf(hf: dict, available: Collection[str] | None = None) -> Config:
    """config.json -> Config; with `available` (the checkpoint's tensor names), MTP modules it lacks are dropped."""
    hf, partial = split_partial_rotary(hf, 1.0)
    if partial != 1.0:  # transformers would rotate only that share of qk_rope_head_dim
        raise ValueError(
            f"config.json field partial_rotary_factor={partial!r} is not supported for {MODEL_TYPE}: multi-latent "
            "attention rotates all qk_rope_head_dim channels (allowed: 1.0)"
        )
    f = HFFields(hf, MODEL_TYPE, DEFAULTS)
    first_dense = _first_dense(f, f.integer("num_hidden_layers"))
    if f.has("first_k_dense_replace") and f.get("first_k_dense_replace") != first_dense:
        f.refuse(
            "first_k_dense_replace", f.hf["first_k_dense_replace"], f"disagrees with mlp_layer_types ({first_dense})"
        )
    f.hf["first_k_dense_replace"] = first_dense  # read below by the DeepSeek reader (f.hf: split_partial_rotary's copy)
    cfg = deepseek_base_config(f)
    m, e = cfg.model, cfg.moe
    m.rope_interleave = bool(f.get("rope_interleave"))
    sigmoid_router_from_hf(f, cfg)
    glm_balancing(e)
    m.mtp_num_layers = mtp_count(f, m.num_layers, available, DEFAULTS["num_nextn_predict_layers"])
    f.finish()
    return validated(cfg)


def config_to_hf(cfg: Config) -> dict:
    """Our Config -> config.json, refusing options Glm4MoeLiteForCausalLM cannot express."""
    m, e = cfg.model, cfg.moe
    check_deepseek_exportable(cfg, MODEL_TYPE)
    refuse_export_unless(MODEL_TYPE, sigmoid_router_checks(e))
    return {
        **mla_experts_to_hf(cfg),
        "mlp_layer_types": ["dense" if i < e.first_k_dense_replace else "sparse" for i in range(m.num_layers)],
        **sigmoid_router_to_hf(e),
        "rope_interleave": m.rope_interleave,
        "num_nextn_predict_layers": m.mtp_num_layers,
    }


def tensor_maps(cfg: Config, available: Collection[str] | None) -> list[TensorMap]:
    return main_model_maps(cfg, available) + mtp_maps(cfg, available)
