"""MiniMax-M2 (model_type "minimax_m2", MiniMaxM2ForCausalLM): MiniMax-M2, M2.1 and M2.5.

The maths, as transformers' MiniMaxM2 implements it:
- grouped-query attention without biases; q and k each pass one RMSNorm over the whole projection (every
  head's channels at once: weights of num_attention_heads * head_dim and num_key_value_heads * head_dim) before
  they are split into heads and before RoPE — our `model.qk_norm_scope: projection`;
- RoPE on the first `rotary_dim` channels of each head (half-split pairing, as ours): Hub checkpoints write the
  legacy `rotary_dim`, transformers 5 turns it into `partial_rotary_factor` = rotary_dim / head_dim (an explicit
  `partial_rotary_factor` wins); no sliding window;
- every layer MoE: sigmoid scores, the top-k chosen on scores + the fp32 `e_score_correction_bias` (our
  aux-loss-free `router.expert_bias`), weights = the unbiased scores of the chosen experts over their sum; no
  groups, no routed scaling, no shared expert; Mixtral's SwiGLU experts of width `intermediate_size`.
Balancing: `router_aux_loss_coef` maps to our `aux_loss` coefficient, computed (Megatron-Core's way) on the
normalised sigmoid scores; transformers' own auxiliary loss takes a softmax of the router logits instead, so the
two balancing terms differ (the LM loss and its gradients are the same). The correction bias is updated at
`moe.router_bias_update_rate` (config.json has no field for it).

Tensors: the attention names of families/common.py (`self_attn.{q,k,v,o}_proj`, `self_attn.{q,k}_norm`); on disk
(Hub checkpoints, and what transformers saves) each MoE block is Mixtral's `block_sparse_moe` with `gate.weight`,
`experts.j.{w1,w3,w2}.weight` and `e_score_correction_bias`; transformers' in-memory layout (`mlp.gate`,
`mlp.experts.gate_up_proj` / `down_proj`, `mlp.e_score_correction_bias`) is read as well.

MiniMax's own remote-code config.json carries fields transformers ignores (`use_qk_norm`, `qk_norm_type`,
`scoring_func`, `use_routing_bias`, `attn_type_list`, ...): they are read and accepted only at the values under
which transformers' model is theirs (see `_remote_code_fields`); any other value is refused.
"""

from __future__ import annotations

from collections.abc import Collection

from moecore.config import Config
from moecore.hf.families import TensorMap
from moecore.hf.families.common import (
    HFFields,
    attention_maps,
    base_config,
    base_to_hf,
    embed_maps,
    expert_maps,
    holds_fused_experts,
    moe_pattern,
    num_experts,
    projection_norm_attention_checks,
    refuse_export_unless,
    validated,
)
from moecore.hf.families.mixtral import experts_to_hf

MODEL_TYPE = "minimax_m2"
ARCHITECTURE = "MiniMaxM2ForCausalLM"
IGNORED_HF_TENSORS = (r"\.rotary_emb\.inv_freq$",)

# transformers' MiniMaxM2Config defaults, for fields a config.json leaves out (its rope_theta is `default_theta`).
DEFAULTS = {
    "vocab_size": 200064,
    "hidden_size": 3072,
    "intermediate_size": 1536,
    "num_hidden_layers": 62,
    "num_attention_heads": 48,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "hidden_act": "silu",
    "max_position_embeddings": 196608,
    "initializer_range": 0.02,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "attention_dropout": 0.0,
    "num_experts_per_tok": 8,
    "num_local_experts": 256,
    "router_aux_loss_coef": 0.001,
    "router_jitter_noise": 0.0,
    "rope_theta": 5e6,
}

# Remote-code fields that change nothing in the model transformers builds (a dense MLP width no layer uses,
# MTP modules transformers does not build, the linear-attention residual scale without linear-attention layers,
# a window RoPE base without windows, a serving limit, the shared-expert gate kind without shared experts).
_INERT_REMOTE_FIELDS = (
    "mlp_intermediate_size",
    "use_mtp",
    "num_mtp_modules",
    "mtp_transformer_layers",
    "layernorm_linear_attention_beta",
    "swa_rope_theta",
    "max_model_len",
    "shared_moe_mode",
)


def _partial_rotary(hf: dict, head_dim: int) -> tuple[dict, float]:
    """(config.json without `partial_rotary_factor`, the rotated share of each head) from `partial_rotary_factor`
    (top level or in `rope_parameters`) or else the legacy `rotary_dim`; both given, they must agree."""
    hf = dict(hf)
    partial = hf.pop("partial_rotary_factor", None)
    params = hf.get("rope_parameters")
    if isinstance(params, dict) and params.get("partial_rotary_factor") is not None:
        params = dict(params)
        inner = params.pop("partial_rotary_factor")
        if partial is not None and float(inner) != float(partial):
            raise ValueError(
                f"config.json field partial_rotary_factor={partial!r} disagrees with "
                f"rope_parameters.partial_rotary_factor={inner!r}"
            )
        partial = inner
        hf["rope_parameters"] = params
    rotary_dim = hf.get("rotary_dim")
    if rotary_dim is not None:
        if isinstance(rotary_dim, bool) or not isinstance(rotary_dim, int) or not 0 < rotary_dim <= head_dim:
            raise ValueError(
                f"config.json field rotary_dim={rotary_dim!r} is not supported for {MODEL_TYPE}: "
                f"an integer in [1, head_dim={head_dim}]"
            )
        if partial is not None and int(head_dim * float(partial)) != rotary_dim:
            raise ValueError(
                f"config.json field rotary_dim={rotary_dim!r} disagrees with partial_rotary_factor={partial!r} "
                f"(head_dim={head_dim})"
            )
    if partial is None:
        partial = 1.0 if rotary_dim is None else rotary_dim / head_dim
    return hf, float(partial)


def _only(f: HFFields, key: str, allowed: tuple, why: str) -> None:
    """Refuse the field unless it is absent (null) or one of `allowed`."""
    value = f.get(key, None)
    if value is not None and value not in allowed:
        f.refuse(key, value, f"{why} (allowed: {' | '.join(repr(a) for a in allowed)})")


def _remote_code_fields(f: HFFields, num_layers: int) -> None:
    """Accept MiniMax's remote-code fields only at the values transformers' maths assumes."""
    _only(f, "use_qk_norm", (True,), "transformers always normalises q and k")
    _only(f, "qk_norm_type", ("per_layer",), "transformers normalises the whole q (k) projection")
    _only(f, "scoring_func", ("sigmoid",), "transformers' router scores with a sigmoid")
    _only(f, "use_routing_bias", (True,), "transformers' router always adds e_score_correction_bias")
    _only(f, "routed_scaling_factor", (1.0,), "no routed scaling")
    _only(f, "shared_intermediate_size", (0,), "no shared expert")
    _only(f, "num_expert_group", (1,), "no group-limited routing")
    _only(f, "topk_group", (1,), "no group-limited routing")
    f.get("use_grouped_topk", None)  # without groups (above) the selection is the plain top-k
    _only(f, "attn_type_list", ([1] * num_layers,), "softmax attention in every layer")
    _only(f, "layernorm_full_attention_beta", (1.0,), "plain residual connections")
    _only(f, "layernorm_mlp_beta", (1.0,), "plain residual connections")
    if f.get("attn_window_size", None) is not None:
        f.refuse("attn_window_size", f.hf["attn_window_size"], "no sliding window (allowed: null)")
    for key in _INERT_REMOTE_FIELDS:
        f.get(key, None)


def config_from_hf(hf: dict) -> Config:
    """config.json -> Config, refusing (one line naming the field) what transformers' MiniMaxM2 does not compute."""
    hf = dict(hf)
    if hf.get("head_dim") is None:  # transformers' default is 128 whatever hidden_size / heads is
        hf["head_dim"] = DEFAULTS["head_dim"]
    hf, partial = _partial_rotary(hf, hf["head_dim"])
    f = HFFields(hf, MODEL_TYPE, DEFAULTS)
    cfg = base_config(f)
    m, e = cfg.model, cfg.moe
    f.get("rotary_dim", None)  # read by _partial_rotary
    m.partial_rotary_factor = partial
    m.qk_norm, m.qk_norm_scope = True, "projection"
    window = f.get("sliding_window", None)
    if window is not None:
        f.refuse(
            "sliding_window", window, "transformers' MiniMaxM2 attends to the whole causal context (allowed: null)"
        )
    jitter = f.get("router_jitter_noise")
    if jitter:  # transformers jitters the experts' input too; ours (Megatron-Core's) only the router's
        f.refuse("router_jitter_noise", jitter, "only 0 imports; set moe.input_jitter_eps for router-input jitter")
    e.num_experts = num_experts(f, "num_local_experts", "num_experts")
    e.ffn_hidden_size = m.ffn_hidden_size  # intermediate_size is the experts' width (there are no dense layers)
    e.router_score_function, e.router_pre_softmax = "sigmoid", False
    e.router_enable_expert_bias = True
    e.norm_topk_prob = True
    e.shared_expert_intermediate_size = None
    e.layer_freq = 1
    _remote_code_fields(f, m.num_layers)
    f.finish()
    return validated(cfg)


def _rotary_dim(cfg: Config) -> int:
    m = cfg.model
    return int(m.resolved_head_dim * m.partial_rotary_factor)


def config_to_hf(cfg: Config) -> dict:
    """Our Config -> config.json (with the legacy `rotary_dim`, as Hub checkpoints), refusing what MiniMaxM2
    cannot express."""
    m, e = cfg.model, cfg.moe
    hd = m.resolved_head_dim
    scale = e.router_topk_scaling_factor
    refuse_export_unless(
        MODEL_TYPE,
        [
            *projection_norm_attention_checks(m, "MiniMax-M2"),
            ("model.qkv_bias", m.qkv_bias, not m.qkv_bias, "no attention biases"),
            ("model.attn_out_bias", m.attn_out_bias, not m.attn_out_bias, "no attention biases"),
            (
                "model.partial_rotary_factor",
                m.partial_rotary_factor,
                _rotary_dim(cfg) == hd * m.partial_rotary_factor and _rotary_dim(cfg) > 0,
                f"a whole number of rotated channels of head_dim={hd} (rotary_dim)",
            ),
            ("moe.num_experts", e.num_experts, e.num_experts > 0, "needs routed experts"),
            ("moe.layer_freq", e.layer_freq, all(moe_pattern(cfg)), "every MiniMax-M2 layer is MoE"),
            (
                "moe.shared_expert_intermediate_size",
                e.shared_expert_intermediate_size,
                not e.shared_expert_intermediate_size,
                "no shared expert",
            ),
            ("moe.router_score_function", e.router_score_function, e.router_score_function == "sigmoid", "sigmoid"),
            ("moe.router_enable_expert_bias", e.router_enable_expert_bias, e.router_enable_expert_bias, "needs it"),
            ("moe.norm_topk_prob", e.norm_topk_prob, e.norm_topk_prob, "the top-k weights are renormalised"),
            ("moe.router_topk_scaling_factor", scale, scale in (None, 1.0), "no routed scaling"),
            ("moe.router_num_groups", e.router_num_groups, e.router_num_groups in (None, 1), "no group routing"),
        ],
    )
    return {**base_to_hf(m), **experts_to_hf(cfg), "rotary_dim": _rotary_dim(cfg)}


def tensor_maps(cfg: Config, available: Collection[str] | None) -> list[TensorMap]:
    """Every parameter (and the expert-bias buffers) of our model and the checkpoint tensors it is made of."""
    m, e = cfg.model, cfg.moe
    maps = embed_maps(m)
    for i in range(m.num_layers):
        maps += attention_maps(i, m)
        disk, memory = f"model.layers.{i}.block_sparse_moe", f"model.layers.{i}.mlp"
        maps += expert_maps(i, e.num_experts, disk, names=("w1", "w3", "w2"), fused_moe=memory, available=available)
        moe = memory if holds_fused_experts(memory, available) else disk
        maps.append(TensorMap.copy(f"layers.{i}.mlp.router.expert_bias", f"{moe}.e_score_correction_bias"))
    return maps
