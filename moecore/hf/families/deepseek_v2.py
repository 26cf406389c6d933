"""DeepSeek-V2 (model_type "deepseek_v2"): DeepSeek-V2, DeepSeek-V2-Lite, DeepSeek-V2.5, DeepSeek-Coder-V2.

The maths, as transformers' DeepseekV2 implements it:
- multi-latent attention (moecore/models/mla.py), q LoRA when `q_lora_rank` is set, RoPE channels
  stored interleaved (always, V2 has no `rope_interleave` field), YaRN with mscale / mscale_all_dim;
- the first `first_k_dense_replace` layers dense, every later layer MoE: softmax over all experts,
  `topk_method` greedy or group_limited_greedy (experts in `n_group` groups, a group scored by its best
  expert, the best `topk_group` groups kept), weights = the chosen softmax probabilities times
  `routed_scaling_factor`, never renormalised (transformers ignores `norm_topk_prob`, so a checkpoint
  that sets it is refused), plus `n_shared_experts` always-on experts fused into one SwiGLU of width
  n_shared_experts * moe_intermediate_size.
Training-only fields map onto our balancing losses: `aux_loss_alpha` is the coefficient, of the
sequence-level loss when `seq_aux` is true (DeepSeek's default) and of the micro-batch loss otherwise.

Tensor names are those of the checkpoints (transformers' in-memory fused experts are read too):
    layers.i.attn.{q_proj | q_a_proj, q_a_layernorm, q_b_proj}, kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj, o_proj
                                              model.layers.i.self_attn.<same>
    layers.i.mlp.router.weight               model.layers.i.mlp.gate.weight
    layers.i.mlp.router.expert_bias          model.layers.i.mlp.gate.e_score_correction_bias (V3)
    layers.i.mlp.experts.w13 / w2            model.layers.i.mlp.experts.j.{gate_proj, up_proj / down_proj}.weight
    layers.i.mlp.shared_experts.*            model.layers.i.mlp.shared_experts.*
The helpers here are shared with deepseek_v3.py.
"""

from __future__ import annotations

from collections.abc import Collection

from moecore.config import Config, ModelConfig
from moecore.hf.families import TensorMap
from moecore.hf.families.common import (
    HFFields,
    base_config,
    base_to_hf,
    dense_mlp_maps,
    embed_maps,
    grouped_expert_maps,
    holds_fused_experts,
    norm_maps,
    refuse_export,
    refuse_export_unless,
    validated,
)

MODEL_TYPE = "deepseek_v2"
ARCHITECTURE = "DeepseekV2ForCausalLM"
IGNORED_HF_TENSORS = (r"\.rotary_emb\.inv_freq$",)

# transformers' DeepseekV2Config defaults, used for fields a config.json leaves out.
DEFAULTS = {
    "vocab_size": 102400,
    "hidden_size": 4096,
    "intermediate_size": 11008,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "hidden_act": "silu",
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "first_k_dense_replace": 0,
    "kv_lora_rank": 512,
    "q_lora_rank": 1536,
    "n_routed_experts": 64,
    "n_shared_experts": 2,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "routed_scaling_factor": 1.0,
    "topk_method": "greedy",
    "norm_topk_prob": False,
    "moe_intermediate_size": 1407,
    "aux_loss_alpha": 0.001,
    "seq_aux": True,
}


# --------------------------------------------------------------------------------------------------
# config.json -> Config (pieces shared with DeepSeek-V3)
# --------------------------------------------------------------------------------------------------


def _nullable_int(f: HFFields, key: str) -> int | None:
    """An integer field where an explicit null means 'off' (not 'default'), e.g. q_lora_rank: null."""
    if key in f.hf:
        f.used.add(key)
        return None if f.hf[key] is None else f.integer(key)
    value = f.get(key)
    return None if value is None else int(value)


def deepseek_base_config(f: HFFields) -> Config:
    """Everything V2 and V3 share: the decoder, MLA, the dense/MoE layout, experts and shared experts."""
    cfg = base_config(f)
    m, e = cfg.model, cfg.moe
    # MLA: every head has its own latent-expanded key and value, so k/v heads == heads.
    kv_heads = f.get("num_key_value_heads", m.num_attention_heads)
    if kv_heads != m.num_attention_heads:
        f.refuse(
            "num_key_value_heads", kv_heads, f"multi-latent attention needs num_attention_heads={m.num_attention_heads}"
        )
    m.num_kv_heads = m.num_attention_heads
    m.attention_type = "mla"
    m.q_lora_rank = _nullable_int(f, "q_lora_rank")
    m.kv_lora_rank = f.integer("kv_lora_rank")
    m.qk_nope_head_dim = f.integer("qk_nope_head_dim", lo=0)
    m.qk_rope_head_dim = f.integer("qk_rope_head_dim")
    m.v_head_dim = f.integer("v_head_dim")
    # transformers writes these derived values into config.json; they must agree with the above.
    for key, want in (("head_dim", m.qk_rope_head_dim), ("qk_head_dim", m.qk_nope_head_dim + m.qk_rope_head_dim)):
        if f.get(key, None) not in (None, want):
            f.refuse(key, f.hf[key], f"must equal {want} for this MLA shape")
    m.head_dim = None if m.hidden_size % m.num_attention_heads == 0 else m.qk_nope_head_dim + m.qk_rope_head_dim
    f.expect("attention_bias", (False, None))
    f.expect("mlp_bias", (False, None))
    f.expect("pretraining_tp", (1, None))
    f.get("ep_size", None)  # inference-time expert parallel degree of DeepSeek's own code; no effect on the maths
    freq = f.get("moe_layer_freq", 1)
    if freq != 1:
        f.refuse("moe_layer_freq", freq, "transformers makes every layer after first_k_dense_replace MoE; allowed: 1")

    e.num_experts = f.integer("n_routed_experts")
    e.router_topk = f.integer("num_experts_per_tok")
    e.ffn_hidden_size = f.integer("moe_intermediate_size")
    shared = f.integer("n_shared_experts", lo=0)
    e.shared_expert_intermediate_size = shared * e.ffn_hidden_size or None
    e.shared_expert_gate = False
    e.first_k_dense_replace = f.integer("first_k_dense_replace", lo=0)
    e.layer_freq = 1
    scale = float(f.get("routed_scaling_factor"))
    e.router_topk_scaling_factor = None if scale == 1.0 else scale
    e.aux_loss_coeff = float(f.get("aux_loss_alpha"))
    e.router_load_balancing_type = "seq_aux_loss" if f.get("seq_aux") else "aux_loss"
    f.used.add("router_aux_loss_coef")  # superseded by aux_loss_alpha (DeepSeek's name)
    return cfg


def config_from_hf(hf: dict) -> Config:
    f = HFFields(hf, MODEL_TYPE, DEFAULTS)
    cfg = deepseek_base_config(f)
    m, e = cfg.model, cfg.moe
    m.rope_interleave = True
    f.expect("scoring_func", ("softmax", None))
    e.router_score_function = "softmax"
    e.router_pre_softmax = True
    if f.get("norm_topk_prob"):
        f.refuse(
            "norm_topk_prob", True, "transformers' DeepseekV2 never renormalises the top-k weights; allowed: false"
        )
    e.norm_topk_prob = False
    method = f.expect("topk_method", ("greedy", "group_limited_greedy"))
    n_group, topk_group = f.get("n_group", None), f.get("topk_group", None)
    if method == "group_limited_greedy":
        if not isinstance(n_group, int) or n_group < 1 or e.num_experts % n_group:
            f.refuse(
                "n_group",
                n_group,
                f"group_limited_greedy needs a group count dividing n_routed_experts={e.num_experts}",
            )
        if not isinstance(topk_group, int) or not 1 <= topk_group <= n_group:
            f.refuse("topk_group", topk_group, f"an integer in [1, n_group={n_group}]")
        e.router_num_groups, e.router_group_topk, e.router_group_score = n_group, topk_group, "max"
    f.finish()
    return validated(cfg)


# --------------------------------------------------------------------------------------------------
# Config -> config.json
# --------------------------------------------------------------------------------------------------


def check_deepseek_exportable(cfg: Config, model_type: str) -> None:
    """Refuse our options that a DeepSeek config.json cannot express (shared by V2 and V3)."""
    m, e = cfg.model, cfg.moe
    shared = e.shared_expert_intermediate_size or 0
    checks = (
        ("model.attention_type", m.attention_type, m.attention_type == "mla", "DeepSeek uses multi-latent attention"),
        ("model.layer_types", m.layer_types, m.layer_types is None, "no linear-attention layers"),
        ("model.qk_norm", m.qk_norm, not m.qk_norm, "no q/k norm"),
        ("model.attn_output_gate", m.attn_output_gate, not m.attn_output_gate, "no attention output gate"),
        ("model.norm_zero_centered", m.norm_zero_centered, not m.norm_zero_centered, "plain RMSNorm only"),
        ("model.partial_rotary_factor", m.partial_rotary_factor, m.partial_rotary_factor == 1.0, "full rotary only"),
        ("model.sliding_window", m.sliding_window, m.sliding_window is None, "no sliding window"),
        ("model.activation", m.activation, m.activation == "swiglu", "SwiGLU only"),
        ("moe.num_experts", e.num_experts, e.num_experts > 0, "needs routed experts"),
        ("moe.layer_freq", e.layer_freq, _layout_ok(cfg), "every layer after moe.first_k_dense_replace is MoE"),
        ("moe.shared_expert_gate", e.shared_expert_gate, not e.shared_expert_gate, "the shared experts are ungated"),
        (
            "moe.shared_expert_intermediate_size",
            shared,
            shared % e.ffn_hidden_size == 0,
            "a multiple of moe.ffn_hidden_size",
        ),
    )
    refuse_export_unless(model_type, checks)


def _layout_ok(cfg: Config) -> bool:
    k, n = cfg.moe.first_k_dense_replace, cfg.model.num_layers
    return all(cfg.moe.is_moe_layer(i, n) == (i >= k) for i in range(n))


def _balancing_to_hf(cfg: Config, model_type: str) -> dict:
    e = cfg.moe
    types = [t for t in e.balancing_types if t != "none"]
    coeffs = dict(zip(e.balancing_types, e.aux_loss_coeffs))
    if len(types) > 1:
        refuse_export(model_type, "moe.router_load_balancing_type", e.router_load_balancing_type, "one balancing loss")
    kind = types[0] if types else "seq_aux_loss"
    if kind not in ("aux_loss", "seq_aux_loss"):
        refuse_export(model_type, "moe.router_load_balancing_type", kind, "aux_loss | seq_aux_loss")
    return {"aux_loss_alpha": coeffs.get(kind, 0.0) if types else 0.0, "seq_aux": kind == "seq_aux_loss"}


def mla_experts_to_hf(cfg: Config) -> dict:
    """The decoder, multi-latent attention and expert fields of a DeepSeek-style config.json (also GLM-4.7-Flash's)."""
    m, e = cfg.model, cfg.moe
    out = {
        **base_to_hf(m),
        "num_key_value_heads": m.num_attention_heads,
        "attention_bias": False,
        "q_lora_rank": m.q_lora_rank,
        "kv_lora_rank": m.kv_lora_rank,
        "qk_nope_head_dim": m.qk_nope_head_dim,
        "qk_rope_head_dim": m.qk_rope_head_dim,
        "v_head_dim": m.v_head_dim,
        "n_routed_experts": e.num_experts,
        "num_experts_per_tok": e.router_topk,
        "moe_intermediate_size": e.ffn_hidden_size,
        "n_shared_experts": (e.shared_expert_intermediate_size or 0) // e.ffn_hidden_size,
        "routed_scaling_factor": e.router_topk_scaling_factor or 1.0,
    }
    del out["head_dim"]  # MLA's head sizes are the qk_*_head_dim / v_head_dim fields
    return out


def deepseek_base_to_hf(cfg: Config, model_type: str) -> dict:
    return {
        **mla_experts_to_hf(cfg),
        "first_k_dense_replace": cfg.moe.first_k_dense_replace,
        "moe_layer_freq": 1,
        **_balancing_to_hf(cfg, model_type),
    }


def config_to_hf(cfg: Config) -> dict:
    m, e = cfg.model, cfg.moe
    check_deepseek_exportable(cfg, MODEL_TYPE)
    grouped, score = e.router_num_groups is not None and e.router_num_groups > 1, e.router_group_score
    checks = (
        ("model.rope_interleave", m.rope_interleave, m.rope_interleave, "DeepSeek-V2 stores RoPE channels interleaved"),
        (
            "model.mtp_num_layers",
            m.mtp_num_layers,
            m.mtp_num_layers == 0,
            "no multi-token prediction (use deepseek_v3)",
        ),
        ("moe.router_score_function", e.router_score_function, e.router_score_function == "softmax", "softmax"),
        ("moe.router_pre_softmax", e.router_pre_softmax, e.router_pre_softmax, "softmax over all experts before top-k"),
        ("moe.norm_topk_prob", e.norm_topk_prob, not e.norm_topk_prob, "the top-k weights are not renormalised"),
        (
            "moe.router_enable_expert_bias",
            e.router_enable_expert_bias,
            not e.router_enable_expert_bias,
            "no expert bias",
        ),
        ("moe.router_group_score", score, not grouped or score == "max", "DeepSeek-V2 scores a group by its max"),
    )
    refuse_export_unless(MODEL_TYPE, checks)
    return {
        **deepseek_base_to_hf(cfg, MODEL_TYPE),
        "scoring_func": "softmax",
        "norm_topk_prob": False,
        "topk_method": "group_limited_greedy" if grouped else "greedy",
        "n_group": e.router_num_groups if grouped else None,
        "topk_group": e.router_group_topk if grouped else None,
    }


# --------------------------------------------------------------------------------------------------
# Tensor maps
# --------------------------------------------------------------------------------------------------


def mla_maps(ours: str, hf: str, m: ModelConfig) -> list[TensorMap]:
    """Norms and multi-latent attention of one decoder layer (`ours` / `hf`: the layer prefixes)."""
    names = ["q_proj"] if m.q_lora_rank is None else ["q_a_proj", "q_a_layernorm", "q_b_proj"]
    names += ["kv_a_proj_with_mqa", "kv_a_layernorm", "kv_b_proj", "o_proj"]
    return norm_maps(ours, hf) + [
        TensorMap.copy(f"{ours}.attn.{n}.weight", f"{hf}.self_attn.{n}.weight") for n in names
    ]


def moe_maps(ours: str, hf: str, cfg: Config, available: Collection[str] | None) -> list[TensorMap]:
    """Router (+ expert bias), routed experts and shared experts of one MoE block (`ours`/`hf`: the mlp prefixes)."""
    e = cfg.moe
    maps = [TensorMap.copy(f"{ours}.router.weight", f"{hf}.gate.weight")]
    if e.router_enable_expert_bias:
        maps.append(TensorMap.copy(f"{ours}.router.expert_bias", f"{hf}.gate.e_score_correction_bias"))
    maps += grouped_expert_maps(ours, hf, e.num_experts, holds_fused_experts(hf, available))
    if e.shared_expert_intermediate_size:
        maps += dense_mlp_maps(f"{ours}.shared_experts", f"{hf}.shared_experts")
    return maps


def decoder_layer_maps(
    ours: str, hf: str, is_moe: bool, cfg: Config, available: Collection[str] | None
) -> list[TensorMap]:
    maps = mla_maps(ours, hf, cfg.model)
    if is_moe:
        return maps + moe_maps(f"{ours}.mlp", f"{hf}.mlp", cfg, available)
    return maps + dense_mlp_maps(f"{ours}.mlp", f"{hf}.mlp")


def main_model_maps(cfg: Config, available: Collection[str] | None) -> list[TensorMap]:
    m = cfg.model
    maps = embed_maps(m)
    for i in range(m.num_layers):
        is_moe = cfg.moe.is_moe_layer(i, m.num_layers)
        maps += decoder_layer_maps(f"layers.{i}", f"model.layers.{i}", is_moe, cfg, available)
    return maps


def tensor_maps(cfg: Config, available: Collection[str] | None) -> list[TensorMap]:
    return main_model_maps(cfg, available)
