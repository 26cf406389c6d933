"""Qwen3-Next (`model_type: qwen3_next`, Qwen3NextForCausalLM): hybrid gated DeltaNet + gated attention MoE.

What differs from the Llama-style families (see `common.py` for the shared names):
- `layer_types` (or, in Hub config.json files, `full_attention_interval` N: every N-th layer is full
  attention) picks per layer between gated full attention (`self_attn`, q_proj twice as wide: query
  then gate per head; zero-centred q/k norms) and gated DeltaNet (`linear_attn`). Our DeltaNet
  parameters carry the checkpoint's names, so those tensors map by prefix only:
      layers.i.attn.{in_proj_qkvz,in_proj_ba,conv1d,norm,out_proj}.weight, .dt_bias, .A_log
      <-> model.layers.i.linear_attn.<same>
- every RMSNorm except the DeltaNet's gated one is zero-centred (weight stored as an offset from 1);
- partial rotary: `partial_rotary_factor` (0.25 by default) of each head's channels are rotated;
- MoE: softmax over all experts, top-k, optional renormalisation (`norm_topk_prob`), and a shared
  expert with a sigmoid gate; the dense/MoE pattern comes from `decoder_sparse_step`/`mlp_only_layers`.
Hub checkpoints also hold a multi-token-prediction module (`mtp_num_hidden_layers: 1`), which transformers
does not load. We import it into `mtp.layers.0` (moecore/models/mtp.py) when the weights hold it and write
it back:
    mtp.layers.0.enorm / hnorm / eh_proj   mtp.pre_fc_norm_embedding / pre_fc_norm_hidden / fc (.weight)
    mtp.layers.0.block.*                   mtp.layers.0.* (a gated-attention MoE decoder layer)
    mtp.layers.0.head_norm.weight          mtp.norm.weight
It predicts token t+2 from [norm(Emb(t_{i+1})); norm(h_i)] like DeepSeek-V3's MTP module, its norms
zero-centred like the rest of the model. Checkpoints with several MTP blocks (`mtp_num_hidden_layers` > 1
stacks them inside one prediction depth) or with dedicated MTP embeddings are refused.
"""

from __future__ import annotations

from collections.abc import Collection

from moecore.config import Config, ModelConfig
from moecore.hf.families import TensorMap
from moecore.hf.families.common import (
    HFFields,
    attention_maps,
    aux_coef_to_hf,
    base_config,
    base_to_hf,
    dense_mlp_maps,
    grouped_expert_maps,
    holds_fused_experts,
    moe_pattern_from_hf,
    moe_pattern_to_hf,
    norm_maps,
    qk_norm_scope_checks,
    qwen_tensor_maps,
    refuse_export_unless,
    renormalises,
    softmax_router_checks,
    validated,
)
from moecore.hf.families.glm4_moe import gqa_layer_maps

MODEL_TYPE = "qwen3_next"
ARCHITECTURE = "Qwen3NextForCausalLM"
IGNORED_HF_TENSORS = (r"\.rotary_emb\.inv_freq$",)

# transformers' Qwen3NextConfig defaults, for fields a config.json leaves out.
DEFAULTS = {
    "vocab_size": 151936,
    "hidden_size": 2048,
    "intermediate_size": 5632,
    "num_hidden_layers": 48,
    "num_attention_heads": 16,
    "num_key_value_heads": 2,
    "hidden_act": "silu",
    "max_position_embeddings": 32768,
    "initializer_range": 0.02,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "rope_theta": 10000.0,
    "attention_bias": False,
    "attention_dropout": 0.0,
    "head_dim": 256,
    "partial_rotary_factor": 0.25,
    "full_attention_interval": 4,
    "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 32,
    "decoder_sparse_step": 1,
    "moe_intermediate_size": 512,
    "shared_expert_intermediate_size": 512,
    "num_experts_per_tok": 10,
    "num_experts": 512,
    "norm_topk_prob": True,
    "router_aux_loss_coef": 0.001,
    "mlp_only_layers": [],
}

_LINEAR_FIELDS = (
    ("linear_num_key_heads", "linear_num_key_heads"),
    ("linear_num_value_heads", "linear_num_value_heads"),
    ("linear_key_head_dim", "linear_key_head_dim"),
    ("linear_value_head_dim", "linear_value_head_dim"),
    ("linear_conv_kernel_dim", "linear_conv_kernel_dim"),
)
_DELTANET_TENSORS = (
    "in_proj_qkvz.weight",
    "in_proj_ba.weight",
    "conv1d.weight",
    "dt_bias",
    "A_log",
    "norm.weight",
    "out_proj.weight",
)


def _split_partial_rotary(hf: dict) -> tuple[dict, float]:
    """Take `partial_rotary_factor` out of config.json (top level or inside `rope_parameters`) so that the
    shared RoPE reader, which refuses partial rotary for the other families, sees the rest."""
    hf = dict(hf)
    partial = hf.pop("partial_rotary_factor", None)
    params = hf.get("rope_parameters")
    if isinstance(params, dict) and "partial_rotary_factor" in params:
        params = dict(params)
        partial = params.pop("partial_rotary_factor")
        hf["rope_parameters"] = params
    return hf, float(DEFAULTS["partial_rotary_factor"] if partial is None else partial)


def _layer_types(f: HFFields, num_layers: int) -> list[str]:
    types = f.get("layer_types", None)
    interval = f.get("full_attention_interval")
    if types is None:
        if isinstance(interval, bool) or not isinstance(interval, int) or interval < 1:
            f.refuse("full_attention_interval", interval, "an integer >= 1")
        return ["linear_attention" if (i + 1) % interval else "full_attention" for i in range(num_layers)]
    if not isinstance(types, list) or len(types) != num_layers:
        f.refuse("layer_types", types, f"a list with one entry per layer (num_hidden_layers={num_layers})")
    for t in types:
        if t not in ("full_attention", "linear_attention"):
            f.refuse("layer_types", t, "entries full_attention | linear_attention")
    return list(types)


def _mtp_layers(f: HFFields, available: Collection[str] | None) -> int:
    """1 when the checkpoint holds the MTP module (or, without `available`, when config.json announces it)."""
    announced = f.get("mtp_num_hidden_layers", 0)
    if isinstance(announced, bool) or not isinstance(announced, int) or announced < 0:
        f.refuse("mtp_num_hidden_layers", announced, "an integer >= 0")
    if announced > 1:
        f.refuse("mtp_num_hidden_layers", announced, "one MTP block (several stacked in one depth are not supported)")
    if f.get("mtp_use_dedicated_embeddings", False):
        f.refuse("mtp_use_dedicated_embeddings", True, "the MTP module shares the model's embedding")
    if available is None:
        return announced
    return int("mtp.fc.weight" in available)


def config_from_hf(hf: dict, available: Collection[str] | None = None) -> Config:
    """config.json -> our Config (model and moe sections); with `available` (the checkpoint's tensor names)
    the MTP module is imported when the weights hold it."""
    hf, partial = _split_partial_rotary(hf)
    return build_config(HFFields(hf, MODEL_TYPE, DEFAULTS), partial, available)


def build_config(f: HFFields, partial: float, available: Collection[str] | None, moe_pattern: bool = True) -> Config:
    """The Config of a Qwen3-Next-style config.json read through `f` (also Qwen3.5-MoE's, families/qwen3_5_moe.py).
    `moe_pattern=False`: every layer is MoE and top-k weights are renormalised (no `decoder_sparse_step`,
    `mlp_only_layers`, `norm_topk_prob` fields)."""
    cfg = base_config(f)
    m, e = cfg.model, cfg.moe
    # Qwen3-Next attention always has a head_dim of its own, zero-centred q/k norms and the output gate.
    m.head_dim = f.integer("head_dim")
    m.partial_rotary_factor = partial
    m.qk_norm = True
    m.attn_output_gate = True
    m.norm_zero_centered = True
    m.qkv_bias = m.attn_out_bias = bool(f.get("attention_bias"))
    m.layer_types = _layer_types(f, m.num_layers)
    for ours, theirs in _LINEAR_FIELDS:
        setattr(m, ours, f.integer(theirs))
    m.mtp_num_layers = _mtp_layers(f, available)
    # Fields Qwen3NextConfig does not define, so transformers' model ignores them and so do we:
    # sliding-window switches (Qwen3-Next has no window).
    for key in (
        "use_sliding_window",
        "sliding_window",
        "max_window_layers",
    ):
        f.get(key, None)

    e.num_experts = f.integer("num_experts", lo=0)
    if e.num_experts:
        e.ffn_hidden_size = f.integer("moe_intermediate_size")
        e.shared_expert_intermediate_size = f.integer("shared_expert_intermediate_size")
        e.shared_expert_gate = True
        e.norm_topk_prob = bool(f.get("norm_topk_prob")) if moe_pattern else True
        e.layer_freq = moe_pattern_from_hf(f, m.num_layers, e.num_experts) if moe_pattern else 1
    else:
        pattern = ("norm_topk_prob", "decoder_sparse_step", "mlp_only_layers") if moe_pattern else ()
        for key in ("moe_intermediate_size", "shared_expert_intermediate_size", *pattern):
            f.get(key)
        e.layer_freq = 1
    f.finish()
    return validated(cfg)


def config_to_hf(cfg: Config, model_type: str = MODEL_TYPE, moe_pattern: bool = True) -> dict:
    """Our Config -> config.json, refusing options Qwen3NextForCausalLM cannot express (`model_type` and
    `moe_pattern` as in `build_config`: Qwen3.5-MoE's refuses dense layers and top-k weights left unnormalised)."""
    m, e = cfg.model, cfg.moe
    checks = [
        ("model.attention_type", m.attention_type, m.attention_type == "gqa", "only gqa attention"),
        ("model.qk_norm", m.qk_norm, m.qk_norm, "Qwen3-Next always normalises q and k"),
        *qk_norm_scope_checks(m),
        ("model.attn_output_gate", m.attn_output_gate, m.attn_output_gate, "Qwen3-Next always gates attention"),
        ("model.norm_zero_centered", m.norm_zero_centered, m.norm_zero_centered, "Qwen3-Next norms are zero-centred"),
        (
            "model.attn_out_bias",
            m.attn_out_bias,
            m.qkv_bias == m.attn_out_bias,
            "attention_bias covers q, k, v and o alike",
        ),
        ("model.activation", m.activation, m.activation == "swiglu", "SwiGLU only"),
        ("model.sliding_window", m.sliding_window, m.sliding_window is None, "no sliding window"),
        ("model.mtp_num_layers", m.mtp_num_layers, m.mtp_num_layers in (0, 1), "at most one MTP module"),
    ]
    if e.num_experts:
        shared = e.shared_expert_intermediate_size
        checks += [
            *softmax_router_checks(e),
            (
                "moe.norm_topk_prob",
                e.norm_topk_prob,
                e.router_pre_softmax or renormalises(e),
                "top-k softmax renormalises",
            ),
            ("moe.shared_expert_intermediate_size", shared, bool(shared), "Qwen3-Next always has a shared expert"),
            ("moe.shared_expert_gate", e.shared_expert_gate, e.shared_expert_gate, "the shared expert is always gated"),
        ]
        if not moe_pattern:
            n = m.num_layers
            all_moe = all(e.is_moe_layer(i, n) for i in range(n))
            checks += [
                ("moe.norm_topk_prob", e.norm_topk_prob, renormalises(e), "top-k weights are always renormalised"),
                ("moe.layer_freq", e.layer_freq, all_moe, "every layer is MoE (no dense layers)"),
            ]
    refuse_export_unless(model_type, checks)
    layer_types = list(m.layer_types or ["full_attention"] * m.num_layers)
    out = {
        **base_to_hf(m),
        "attention_bias": m.qkv_bias,
        "partial_rotary_factor": m.partial_rotary_factor,
        "layer_types": layer_types,
        **{theirs: getattr(m, ours) for ours, theirs in _LINEAR_FIELDS},
        "num_experts": e.num_experts,
    }
    if m.mtp_num_layers:
        out.update(mtp_num_hidden_layers=m.mtp_num_layers, mtp_use_dedicated_embeddings=False)
    interval = layer_types.index("full_attention") + 1 if "full_attention" in layer_types else 0
    if interval and layer_types == [
        "linear_attention" if (i + 1) % interval else "full_attention" for i in range(m.num_layers)
    ]:
        out["full_attention_interval"] = interval
    if e.num_experts:
        out.update(
            num_experts_per_tok=e.router_topk,
            moe_intermediate_size=e.ffn_hidden_size,
            shared_expert_intermediate_size=e.shared_expert_intermediate_size,
            router_aux_loss_coef=aux_coef_to_hf(e),
        )
        if moe_pattern:
            out.update(norm_topk_prob=renormalises(e), **moe_pattern_to_hf(cfg))
    return out


def _attention_maps(i: int, m: ModelConfig) -> list[TensorMap]:
    """Norms and gated DeltaNet (by prefix) or gated full attention (the Llama-style names) of layer i."""
    if m.layer_types is None or m.layer_types[i] != "linear_attention":
        return attention_maps(i, m)
    ours, hf = f"layers.{i}", f"model.layers.{i}"
    return norm_maps(ours, hf) + [
        TensorMap.copy(f"{ours}.attn.{t}", f"{hf}.linear_attn.{t}") for t in _DELTANET_TENSORS
    ]


def mtp_maps(cfg: Config, available: Collection[str] | None) -> list[TensorMap]:
    """The MTP module (see the module docstring): its norms and projection, and a gated-attention decoder
    layer that is MoE whenever the model has experts."""
    if not cfg.model.mtp_num_layers:
        return []
    ours, hf = "mtp.layers.0", "mtp"
    maps = [
        TensorMap.copy(f"{ours}.enorm.weight", f"{hf}.pre_fc_norm_embedding.weight"),
        TensorMap.copy(f"{ours}.hnorm.weight", f"{hf}.pre_fc_norm_hidden.weight"),
        TensorMap.copy(f"{ours}.eh_proj.weight", f"{hf}.fc.weight"),
        TensorMap.copy(f"{ours}.head_norm.weight", f"{hf}.norm.weight"),
        *gqa_layer_maps(f"{ours}.block", f"{hf}.layers.0", cfg.model),
    ]
    block, moe = f"{ours}.block.mlp", f"{hf}.layers.0.mlp"
    e = cfg.moe
    if not e.num_experts:
        return maps + dense_mlp_maps(block, moe)
    maps.append(TensorMap.copy(f"{block}.router.weight", f"{moe}.gate.weight"))
    maps += grouped_expert_maps(block, moe, e.num_experts, holds_fused_experts(moe, available))
    maps += dense_mlp_maps(f"{block}.shared_experts", f"{moe}.shared_expert")
    maps.append(TensorMap.copy(f"{block}.shared_expert_gate.weight", f"{moe}.shared_expert_gate.weight"))
    return maps


def tensor_maps(cfg: Config, available: Collection[str] | None = None) -> list[TensorMap]:
    """Every parameter of our model and the checkpoint tensors it is made of."""
    return qwen_tensor_maps(cfg, available, shared_expert=True, attention=_attention_maps) + mtp_maps(cfg, available)
