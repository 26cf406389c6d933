"""GLM-4.5 MoE (model_type "glm4_moe", Glm4MoeForCausalLM): GLM-4.5, GLM-4.5-Air, GLM-4.6 and relatives.

The maths, as transformers' Glm4Moe implements it:
- grouped-query attention with biases on q/k/v (`attention_bias`; o_proj never has one), an optional
  per-head RMSNorm on q and k (`use_qk_norm`), and RoPE on the first `partial_rotary_factor` (0.5) of
  each head's channels, half-split pairing;
- the first `first_k_dense_replace` layers dense, every later layer MoE with DeepSeek-V3's router: sigmoid
  scores, selection with the fp32 `e_score_correction_bias` (our aux-loss-free `router.expert_bias`),
  `n_group` groups scored by the sum of their two best biased scores, `topk_group` kept, weights = the
  unbiased scores of the chosen experts / (their sum + 1e-20) when `norm_topk_prob`, times
  `routed_scaling_factor`; plus `n_shared_experts` always-on experts fused into one SwiGLU;
- multi-token prediction: `num_nextn_predict_layers` (transformers: `num_mtp_layers`) modules stored,
  like DeepSeek-V3's, as decoder layers num_hidden_layers + k with `enorm`, `hnorm`, `eh_proj`,
  `shared_head.norm` (and, in some checkpoints, copies of the embedding and head). transformers'
  Glm4MoeForCausalLM does not load them; we import them into `mtp.layers.k` when the checkpoint holds them
  and write them back (copies included).
config.json carries no balancing-loss coefficient; an import uses GLM-4.5's published training recipe
(aux-loss-free bias with update rate 1e-3 plus a sequence-level balance loss of weight 1e-4).

Tensor names: `attention_maps`-style GQA names under model.layers.i.self_attn, DeepSeek's MoE names under
model.layers.i.mlp (gate.weight, gate.e_score_correction_bias, experts.j.*, shared_experts.*).
"""

from __future__ import annotations

from collections.abc import Collection

from moecore.config import Config, ModelConfig, MoEConfig
from moecore.hf.families import TensorMap
from moecore.hf.families.common import (
    HFFields,
    base_config,
    base_to_hf,
    dense_mlp_maps,
    embed_maps,
    num_experts,
    qk_norm_scope_checks,
    refuse_export_unless,
    validated,
)
from moecore.hf.families.deepseek_v2 import moe_maps
from moecore.hf.families.deepseek_v3 import mtp_layers_in_checkpoint

MODEL_TYPE = "glm4_moe"
ARCHITECTURE = "Glm4MoeForCausalLM"
# The MTP layers' copies of the shared embedding and head: the main model's tensors on import.
IGNORED_HF_TENSORS = (r"\.rotary_emb\.inv_freq$", r"^model\.layers\.\d+\.(embed_tokens|shared_head\.head)\.weight$")

# transformers' Glm4MoeConfig defaults, for fields a config.json leaves out.
DEFAULTS = {
    "vocab_size": 151552,
    "hidden_size": 4096,
    "intermediate_size": 10944,
    "num_hidden_layers": 46,
    "num_attention_heads": 96,
    "num_key_value_heads": 8,
    "hidden_act": "silu",
    "max_position_embeddings": 131072,
    "initializer_range": 0.02,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
    "rope_theta": 10000.0,
    "partial_rotary_factor": 0.5,
    "attention_bias": False,
    "attention_dropout": 0.0,
    "moe_intermediate_size": 1408,
    "num_experts_per_tok": 8,
    "n_shared_experts": 1,
    "n_routed_experts": 128,
    "routed_scaling_factor": 1.0,
    "n_group": 1,
    "topk_group": 1,
    "first_k_dense_replace": 1,
    "norm_topk_prob": True,
    "use_qk_norm": False,
    "num_nextn_predict_layers": 1,
}

# GLM-4.5's training recipe for load balancing (not in config.json).
SEQ_AUX_COEFF = 1e-4
BIAS_UPDATE_RATE = 1e-3


def split_partial_rotary(hf: dict, default: float) -> tuple[dict, float]:
    """Take `partial_rotary_factor` out of config.json (top level or inside `rope_parameters`) so that the
    shared RoPE reader, which refuses partial rotary, sees the rest."""
    hf = dict(hf)
    partial = hf.pop("partial_rotary_factor", None)
    params = hf.get("rope_parameters")
    if isinstance(params, dict) and "partial_rotary_factor" in params:
        params = dict(params)
        inner = params.pop("partial_rotary_factor")
        if partial is not None and inner is not None and float(inner) != float(partial):
            raise ValueError(
                f"config.json field partial_rotary_factor={partial!r} disagrees with "
                f"rope_parameters.partial_rotary_factor={inner!r}"
            )
        partial = inner if inner is not None else partial
        hf["rope_parameters"] = params
    return hf, float(default if partial is None else partial)


def mtp_count(f: HFFields, num_layers: int, available: Collection[str] | None, default: int) -> int:
    """MTP modules: `num_nextn_predict_layers` (alias `num_mtp_layers`); with `available`, those the weights hold."""
    a, b = f.get("num_nextn_predict_layers", None), f.get("num_mtp_layers", None)
    if a is not None and b is not None and a != b:
        f.refuse("num_mtp_layers", b, f"disagrees with num_nextn_predict_layers={a}")
    announced = int(a if a is not None else b if b is not None else default)
    return announced if available is None else mtp_layers_in_checkpoint(num_layers, announced, available)


def sigmoid_router_from_hf(f: HFFields, cfg: Config) -> None:
    """DeepSeek-V3's router fields (sigmoid, correction bias, groups, scaling) onto `cfg.moe`."""
    e = cfg.moe
    f.expect("scoring_func", ("sigmoid", None))
    f.expect("topk_method", ("noaux_tc", None))
    e.router_score_function, e.router_pre_softmax = "sigmoid", False
    e.router_enable_expert_bias = True
    e.norm_topk_prob = bool(f.get("norm_topk_prob"))
    scale = float(f.get("routed_scaling_factor"))
    e.router_topk_scaling_factor = None if scale == 1.0 else scale
    n_group, topk_group = f.integer("n_group"), f.integer("topk_group")
    if e.num_experts % n_group:
        f.refuse("n_group", n_group, f"must divide n_routed_experts={e.num_experts}")
    if topk_group > n_group:
        f.refuse("topk_group", topk_group, f"an integer in [1, n_group={n_group}]")
    if n_group > 1:
        e.router_num_groups, e.router_group_topk, e.router_group_score = n_group, topk_group, "top2_sum"


def sigmoid_router_checks(e: MoEConfig) -> list[tuple]:
    """`refuse_export_unless` checks of the router `sigmoid_router_from_hf` reads (GLM's families)."""
    grouped = e.router_num_groups is not None and e.router_num_groups > 1
    return [
        ("moe.router_score_function", e.router_score_function, e.router_score_function == "sigmoid", "sigmoid"),
        ("moe.router_enable_expert_bias", e.router_enable_expert_bias, e.router_enable_expert_bias, "needs it"),
        (
            "moe.router_group_score",
            e.router_group_score,
            not grouped or e.router_group_score == "top2_sum",
            "a group is scored by its top-2 sum",
        ),
    ]


def glm_balancing(e: MoEConfig) -> None:
    """GLM-4.5's published balancing recipe (config.json carries none): the aux-loss-free bias and a sequence-level
    balance loss."""
    e.router_load_balancing_type, e.aux_loss_coeff = "seq_aux_loss", SEQ_AUX_COEFF
    e.router_bias_update_rate = BIAS_UPDATE_RATE


def sigmoid_router_to_hf(e: MoEConfig) -> dict:
    """The config.json fields of that router (the reverse of `sigmoid_router_from_hf`)."""
    grouped = e.router_num_groups is not None and e.router_num_groups > 1
    return {
        "norm_topk_prob": e.norm_topk_prob,
        "routed_scaling_factor": e.router_topk_scaling_factor or 1.0,
        "n_group": e.router_num_groups if grouped else 1,
        "topk_group": e.router_group_topk if grouped else 1,
    }


def deepseek_moe_from_hf(f: HFFields, cfg: Config) -> None:
    """The MoE fields GLM-4.5 and dots.llm1 share with DeepSeek-V3 (`n_routed_experts`, `moe_intermediate_size`,
    `n_shared_experts` fused into one ungated SwiGLU, `first_k_dense_replace`, the sigmoid router) onto `cfg.moe`."""
    e = cfg.moe
    e.num_experts = num_experts(f, "n_routed_experts", "num_local_experts")
    e.ffn_hidden_size = f.integer("moe_intermediate_size")
    shared = 0 if f.get("n_shared_experts") is None else f.integer("n_shared_experts", lo=0)
    e.shared_expert_intermediate_size = shared * e.ffn_hidden_size or None
    e.shared_expert_gate = False
    e.first_k_dense_replace = f.integer("first_k_dense_replace", lo=0)
    e.layer_freq = 1
    sigmoid_router_from_hf(f, cfg)


def deepseek_moe_checks(cfg: Config) -> list[tuple]:
    """`refuse_export_unless` checks of what `deepseek_moe_from_hf` reads."""
    e = cfg.moe
    shared = e.shared_expert_intermediate_size or 0
    return [
        ("moe.num_experts", e.num_experts, e.num_experts > 0, "needs routed experts"),
        ("moe.layer_freq", e.layer_freq, dense_then_moe(cfg), "every layer after moe.first_k_dense_replace is MoE"),
        *sigmoid_router_checks(e),
        ("moe.shared_expert_gate", e.shared_expert_gate, not e.shared_expert_gate, "the shared experts are ungated"),
        (
            "moe.shared_expert_intermediate_size",
            shared,
            shared % e.ffn_hidden_size == 0,
            "a multiple of moe.ffn_hidden_size",
        ),
    ]


def deepseek_moe_to_hf(cfg: Config) -> dict:
    """The config.json fields of `deepseek_moe_from_hf` (its reverse)."""
    e = cfg.moe
    return {
        "n_routed_experts": e.num_experts,
        "num_experts_per_tok": e.router_topk,
        "moe_intermediate_size": e.ffn_hidden_size,
        "n_shared_experts": (e.shared_expert_intermediate_size or 0) // e.ffn_hidden_size,
        "first_k_dense_replace": e.first_k_dense_replace,
        **sigmoid_router_to_hf(e),
    }


def config_from_hf(hf: dict, available: Collection[str] | None = None) -> Config:
    """config.json -> Config; with `available` (the checkpoint's tensor names), MTP modules it lacks are dropped."""
    hf, partial = split_partial_rotary(hf, DEFAULTS["partial_rotary_factor"])
    f = HFFields(hf, MODEL_TYPE, DEFAULTS)
    cfg = base_config(f)
    m, e = cfg.model, cfg.moe
    m.partial_rotary_factor = partial
    m.qkv_bias = bool(f.get("attention_bias"))
    m.attn_out_bias = False
    m.qk_norm = bool(f.get("use_qk_norm"))
    if f.get("moe_layer_freq", 1) != 1:  # transformers makes every layer after the dense ones MoE
        f.refuse("moe_layer_freq", f.hf["moe_layer_freq"], "allowed: 1")

    deepseek_moe_from_hf(f, cfg)
    glm_balancing(e)
    m.mtp_num_layers = mtp_count(f, m.num_layers, available, DEFAULTS["num_nextn_predict_layers"])
    f.finish()
    return validated(cfg)


def dense_then_moe(cfg: Config) -> bool:
    """Whether our dense/MoE pattern is the first `first_k_dense_replace` layers dense, the rest MoE."""
    k, n = cfg.moe.first_k_dense_replace, cfg.model.num_layers
    return all(cfg.moe.is_moe_layer(i, n) == (i >= k) for i in range(n))


def config_to_hf(cfg: Config) -> dict:
    """Our Config -> config.json, refusing options Glm4MoeForCausalLM cannot express."""
    m = cfg.model
    refuse_export_unless(
        MODEL_TYPE,
        [
            ("model.attention_type", m.attention_type, m.attention_type == "gqa", "grouped-query attention only"),
            ("model.layer_types", m.layer_types, m.layer_types is None, "one attention kind for every layer"),
            ("model.attn_output_gate", m.attn_output_gate, not m.attn_output_gate, "no attention output gate"),
            ("model.attn_out_bias", m.attn_out_bias, not m.attn_out_bias, "o_proj has no bias"),
            ("model.attn_sinks", m.attn_sinks, not m.attn_sinks, "no attention sinks"),
            ("model.norm_zero_centered", m.norm_zero_centered, not m.norm_zero_centered, "plain RMSNorm only"),
            ("model.sliding_window", m.sliding_window, m.sliding_window is None, "no sliding window"),
            ("model.activation", m.activation, m.activation == "swiglu", "SwiGLU only"),
            *qk_norm_scope_checks(m),
            *deepseek_moe_checks(cfg),
        ],
    )
    return {
        **base_to_hf(m),
        "partial_rotary_factor": m.partial_rotary_factor,
        "attention_bias": m.qkv_bias,
        "use_qk_norm": m.qk_norm,
        **deepseek_moe_to_hf(cfg),
        "num_nextn_predict_layers": m.mtp_num_layers,
    }


# --------------------------------------------------------------------------------------------------
# Tensor maps
# --------------------------------------------------------------------------------------------------


def gqa_layer_maps(ours: str, hf: str, m: ModelConfig) -> list[TensorMap]:
    """Norms and grouped-query attention of one decoder layer (`ours` / `hf`: the layer prefixes)."""
    maps = [
        TensorMap.copy(f"{ours}.attn_norm.weight", f"{hf}.input_layernorm.weight"),
        TensorMap.copy(f"{ours}.mlp_norm.weight", f"{hf}.post_attention_layernorm.weight"),
    ]
    for p in ("q", "k", "v", "o"):
        maps.append(TensorMap.copy(f"{ours}.attn.{p}_proj.weight", f"{hf}.self_attn.{p}_proj.weight"))
        if (m.qkv_bias and p != "o") or (m.attn_out_bias and p == "o"):
            maps.append(TensorMap.copy(f"{ours}.attn.{p}_proj.bias", f"{hf}.self_attn.{p}_proj.bias"))
    if m.qk_norm:
        for p in ("q", "k"):
            maps.append(TensorMap.copy(f"{ours}.attn.{p}_norm.weight", f"{hf}.self_attn.{p}_norm.weight"))
    return maps


def layer_maps(ours: str, hf: str, is_moe: bool, cfg: Config, available: Collection[str] | None) -> list[TensorMap]:
    maps = gqa_layer_maps(ours, hf, cfg.model)
    if is_moe:
        return maps + moe_maps(f"{ours}.mlp", f"{hf}.mlp", cfg, available)
    return maps + dense_mlp_maps(f"{ours}.mlp", f"{hf}.mlp")


def mtp_maps(cfg: Config, available: Collection[str] | None) -> list[TensorMap]:
    """MTP module k <-> checkpoint layer num_hidden_layers + k (an MoE decoder layer plus the MTP tensors)."""
    maps = []
    for k in range(cfg.model.mtp_num_layers):
        ours, hf = f"mtp.layers.{k}", f"model.layers.{cfg.model.num_layers + k}"
        maps += [TensorMap.copy(f"{ours}.{n}.weight", f"{hf}.{n}.weight") for n in ("enorm", "hnorm", "eh_proj")]
        maps.append(TensorMap.copy(f"{ours}.head_norm.weight", f"{hf}.shared_head.norm.weight"))
        maps += layer_maps(f"{ours}.block", hf, True, cfg, available)
    return maps


def shared_copies(cfg: Config) -> list[tuple[str, str]]:
    """(checkpoint name, our tensor) for the MTP layers' copies of the shared embedding and output head."""
    out = []
    head = "embed.weight" if cfg.model.tie_embeddings else "lm_head.weight"
    for k in range(cfg.model.mtp_num_layers):
        hf = f"model.layers.{cfg.model.num_layers + k}"
        out += [(f"{hf}.embed_tokens.weight", "embed.weight"), (f"{hf}.shared_head.head.weight", head)]
    return out


def tensor_maps(cfg: Config, available: Collection[str] | None) -> list[TensorMap]:
    """Every parameter (and the expert-bias buffers) of our model and the checkpoint tensors it is made of."""
    m = cfg.model
    maps = embed_maps(m)
    for i in range(m.num_layers):
        maps += layer_maps(f"layers.{i}", f"model.layers.{i}", cfg.moe.is_moe_layer(i, m.num_layers), cfg, available)
    return maps + mtp_maps(cfg, available)
