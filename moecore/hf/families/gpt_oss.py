"""gpt-oss (model_type "gpt_oss", GptOssForCausalLM): gpt-oss-20b and gpt-oss-120b.

The maths, as transformers' GptOss implements it:
- grouped-query attention with biases on q, k, v and o (`attention_bias`), a learned logit per head in the
  softmax denominator (`self_attn.sinks`, our `model.attn_sinks`; moecore/models/sinks.py), layers
  alternating between a sliding window (`sliding_window`, 128) and full attention (`layer_types`);
- RoPE over the whole head, half-split pairing, YaRN (factor 32, `truncate: false`) by default;
- every layer MoE: router logits = x W^T + `router.bias`, top-k of the logits, softmax over those k;
  experts with biased projections and the clamped SwiGLU (`swiglu_alpha`, `swiglu_limit`; the up
  projection enters as up + 1; moecore/models/biased_moe.py); no shared expert.

Expert tensors differ from ours in layout: transformers (and the bf16 checkpoints) hold
`experts.gate_up_proj` [E, H, 2F] with gate and up *interleaved* along the last dim (gate = columns 0, 2,
4, ...), `gate_up_proj_bias` [E, 2F] interleaved the same way, `down_proj` [E, F, H] and `down_proj_bias`
[E, H]. Ours are `w13` [E, 2F, H] (gate rows then up rows), `b13` [E, 2F], `w2` [E, H, F], `b2` [E, H]:
the maps transpose and de-interleave on import and do the reverse on export.

OpenAI's original checkpoints store the expert matrices as MXFP4 (`quantization_config.quant_method: mxfp4`):
`experts.gate_up_proj_blocks` [E, 2F, H/32, 16] and `down_proj_blocks` [E, H, F/32, 16] (uint8, two 4-bit e2m1
values per byte, the low nibble first) with `*_scales` [E, rows, blocks] (uint8 e8m0: 2^(s - 127) per block of
32 values); everything else in bf16. Import dequantizes them, one tensor at a time, into our bf16 (or the
requested dtype) `w13` / `w2`: the rows of gate_up_proj_blocks are gate/up interleaved, those of
down_proj_blocks are already our `w2` rows. Export always writes unquantized tensors (no quantization_config).
"""

from __future__ import annotations

from collections.abc import Collection

import torch

from moecore.config import Config
from moecore.hf.families import TensorMap
from moecore.hf.families.common import (
    HFFields,
    aux_coef_to_hf,
    base_config,
    base_to_hf,
    embed_maps,
    num_experts,
    refuse_export_unless,
    validated,
)

MODEL_TYPE = "gpt_oss"
ARCHITECTURE = "GptOssForCausalLM"
IGNORED_HF_TENSORS = (r"\.rotary_emb\.inv_freq$",)

# transformers' GptOssConfig defaults, for fields a config.json leaves out.
DEFAULTS = {
    "num_hidden_layers": 36,
    "num_local_experts": 128,
    "vocab_size": 201088,
    "hidden_size": 2880,
    "intermediate_size": 2880,
    "head_dim": 64,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "sliding_window": 128,
    "tie_word_embeddings": False,
    "hidden_act": "silu",
    "initializer_range": 0.02,
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-5,
    "rope_theta": 150000.0,
    "rope_parameters": {
        "rope_type": "yarn",
        "factor": 32.0,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "truncate": False,
        "original_max_position_embeddings": 4096,
    },
    "attention_dropout": 0.0,
    "num_experts_per_tok": 4,
    "swiglu_alpha": 1.702,
    "swiglu_limit": 7.0,
    "router_aux_loss_coef": 0.001,
    "attention_bias": True,
}


def _layer_types(f: HFFields, num_layers: int) -> list[str]:
    """`layer_types` (transformers' default: sliding on even layers, full on odd ones)."""
    types = f.get("layer_types", None)
    if types is None:
        return ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(num_layers)]
    if not isinstance(types, list) or len(types) != num_layers:
        f.refuse("layer_types", types, f"a list with one entry per layer (num_hidden_layers={num_layers})")
    for t in types:
        if t not in ("sliding_attention", "full_attention"):
            f.refuse("layer_types", t, "entries sliding_attention | full_attention")
    return list(types)


def config_from_hf(hf: dict) -> Config:
    """config.json -> our Config (model and moe sections); an MXFP4 quantization_config is accepted (import
    dequantizes the experts), any other is refused."""
    quant = hf.get("quantization_config")
    if isinstance(quant, dict) and quant.get("quant_method") == "mxfp4":
        hf = {k: v for k, v in hf.items() if k != "quantization_config"}
    f = HFFields(hf, MODEL_TYPE, DEFAULTS)
    cfg = base_config(f)
    m, e = cfg.model, cfg.moe
    m.head_dim = f.integer("head_dim")
    bias = bool(f.get("attention_bias"))
    m.qkv_bias = m.attn_out_bias = bias
    m.attn_sinks = True
    m.layer_types = _layer_types(f, m.num_layers)
    window = f.get("sliding_window")
    if "sliding_attention" in m.layer_types:
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            f.refuse("sliding_window", window, "an integer >= 1 (layer_types has sliding_attention layers)")
        m.sliding_window = window
    m.activation = "swiglu_clamped"
    m.swiglu_alpha = float(f.get("swiglu_alpha"))
    m.swiglu_limit = float(f.get("swiglu_limit"))
    m.expert_linear_bias = m.router_logit_bias = True

    e.num_experts = num_experts(f, "num_experts", "num_local_experts")
    e.ffn_hidden_size = m.ffn_hidden_size  # intermediate_size is the experts' width
    e.router_score_function, e.router_pre_softmax, e.norm_topk_prob = "softmax", False, True
    e.shared_expert_intermediate_size = None
    e.layer_freq, e.first_k_dense_replace = 1, 0
    # Fields of OpenAI's own config.json that repeat others.
    if f.get("experts_per_token", e.router_topk) != e.router_topk:
        f.refuse("experts_per_token", f.hf["experts_per_token"], f"must equal num_experts_per_tok={e.router_topk}")
    f.get("initial_context_length", None)  # YaRN's original context, also in rope_parameters
    f.finish()
    return validated(cfg)


def config_to_hf(cfg: Config) -> dict:
    """Our Config -> config.json, refusing options GptOssForCausalLM cannot express."""
    m, e = cfg.model, cfg.moe
    types = list(m.layer_types or ["full_attention"] * m.num_layers)
    all_moe = all(e.is_moe_layer(i, m.num_layers) for i in range(m.num_layers))
    scaled, shared = e.router_topk_scaling_factor not in (None, 1.0), e.shared_expert_intermediate_size
    refuse_export_unless(
        MODEL_TYPE,
        [
            ("model.attention_type", m.attention_type, m.attention_type == "gqa", "grouped-query attention only"),
            ("model.attn_sinks", m.attn_sinks, m.attn_sinks, "gpt-oss attention always has sinks"),
            ("model.layer_types", m.layer_types, set(types) <= {"sliding_attention", "full_attention"}, "no linear"),
            ("model.attn_out_bias", m.attn_out_bias, m.attn_out_bias == m.qkv_bias, "one bias switch for q/k/v/o"),
            ("model.qk_norm", m.qk_norm, not m.qk_norm, "no q/k norm"),
            ("model.attn_output_gate", m.attn_output_gate, not m.attn_output_gate, "no attention output gate"),
            ("model.norm_zero_centered", m.norm_zero_centered, not m.norm_zero_centered, "plain RMSNorm only"),
            ("model.partial_rotary_factor", m.partial_rotary_factor, m.partial_rotary_factor == 1.0, "full rotary"),
            ("model.activation", m.activation, m.activation == "swiglu_clamped", "the clamped SwiGLU"),
            ("model.expert_linear_bias", m.expert_linear_bias, m.expert_linear_bias, "experts have biases"),
            ("model.router_logit_bias", m.router_logit_bias, m.router_logit_bias, "the router has a bias"),
            ("model.mtp_num_layers", m.mtp_num_layers, m.mtp_num_layers == 0, "no multi-token prediction"),
            ("moe.num_experts", e.num_experts, e.num_experts > 0, "needs routed experts"),
            ("moe.layer_freq", e.layer_freq, all_moe, "every layer is MoE"),
            ("moe.router_score_function", e.router_score_function, e.router_score_function == "softmax", "softmax"),
            ("moe.router_pre_softmax", e.router_pre_softmax, not e.router_pre_softmax, "softmax over the top-k"),
            ("moe.router_enable_expert_bias", e.router_enable_expert_bias, not e.router_enable_expert_bias, "none"),
            ("moe.router_topk_scaling_factor", e.router_topk_scaling_factor, not scaled, "no routed scaling"),
            ("moe.router_num_groups", e.router_num_groups, e.router_num_groups is None, "no group-limited routing"),
            ("moe.shared_expert_intermediate_size", shared, not shared, "no shared expert"),
        ],
    )  # fmt: skip
    out = {
        **base_to_hf(m),
        "intermediate_size": e.ffn_hidden_size,
        "attention_bias": m.qkv_bias,
        "layer_types": types,
        "sliding_window": m.sliding_window,
        "num_local_experts": e.num_experts,
        "num_experts_per_tok": e.router_topk,
        "swiglu_alpha": m.swiglu_alpha,
        "swiglu_limit": m.swiglu_limit,
        "router_aux_loss_coef": aux_coef_to_hf(e),
        "output_router_logits": False,
    }
    if out["rope_scaling"] is None:  # transformers would fill in its YaRN default
        out["rope_scaling"] = {"rope_type": "default"}
    return out


# --------------------------------------------------------------------------------------------------
# Tensor maps
# --------------------------------------------------------------------------------------------------


def _deinterleave(t: torch.Tensor) -> torch.Tensor:
    """[..., 2F] gate/up interleaved -> [..., 2F] gate half then up half."""
    return torch.cat((t[..., 0::2], t[..., 1::2]), dim=-1)


def _interleave(t: torch.Tensor) -> torch.Tensor:
    """[..., 2F] gate half then up half -> gate/up interleaved."""
    g, u = t.chunk(2, dim=-1)
    return torch.stack((g, u), dim=-1).flatten(-2).contiguous()


# e2m1 (4-bit float) values by code: sign bit, two exponent bits, one mantissa bit.
_FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """[..., G, 16] uint8 blocks and [..., G] uint8 e8m0 scales -> [..., G * 32] fp32: value k of a block is
    byte k // 2's low nibble (k even) or high nibble (k odd), times 2^(scale - 127)."""
    lut = torch.tensor(_FP4_VALUES, dtype=torch.float32)
    b = blocks.to(torch.int64)
    values = torch.stack((lut[b & 0x0F], lut[b >> 4]), dim=-1).flatten(-2)  # [..., G, 32]
    values = torch.ldexp(values, scales.to(torch.int32).unsqueeze(-1) - 127)
    return values.flatten(-2)


def _mxfp4_maps(ours: str, hf: str, num: int, hidden: int, ffn: int) -> list[TensorMap]:
    """The expert matrices of an MXFP4 checkpoint, dequantized on import (module docstring)."""
    up, down = f"{hf}.experts.gate_up_proj", f"{hf}.experts.down_proj"
    return [
        TensorMap.combined(
            f"{ours}.experts.w13",
            [f"{up}_blocks", f"{up}_scales"],
            lambda t: _deinterleave(dequantize_mxfp4(*t).transpose(1, 2)).transpose(1, 2),
            [(num, 2 * ffn, hidden // 32, 16), (num, 2 * ffn, hidden // 32)],
        ),
        TensorMap.combined(
            f"{ours}.experts.w2",
            [f"{down}_blocks", f"{down}_scales"],
            lambda t: dequantize_mxfp4(*t),
            [(num, hidden, ffn // 32, 16), (num, hidden, ffn // 32)],
        ),
    ]


def expert_maps(
    ours: str, hf: str, num: int, hidden: int, ffn: int, available: Collection[str] | None = None
) -> list[TensorMap]:
    """Router and biased experts of one MoE block (`ours` / `hf`: the mlp prefixes); MXFP4 expert matrices
    when the checkpoint (`available`) holds them."""
    maps = _expert_maps(ours, hf, num, hidden, ffn)
    if available is not None and f"{hf}.experts.gate_up_proj_blocks" in available:
        quantized = _mxfp4_maps(ours, hf, num, hidden, ffn)
        maps = [mp for mp in maps if mp.ours not in (f"{ours}.experts.w13", f"{ours}.experts.w2")] + quantized
    return maps


def _expert_maps(ours: str, hf: str, num: int, hidden: int, ffn: int) -> list[TensorMap]:
    return [
        TensorMap.copy(f"{ours}.router.weight", f"{hf}.router.weight"),
        TensorMap.copy(f"{ours}.router.bias", f"{hf}.router.bias"),
        TensorMap.transformed(
            f"{ours}.experts.w13",
            f"{hf}.experts.gate_up_proj",
            lambda t: _deinterleave(t).transpose(1, 2),
            lambda w: _interleave(w.transpose(1, 2)),
            (num, hidden, 2 * ffn),
        ),
        TensorMap.transformed(
            f"{ours}.experts.b13", f"{hf}.experts.gate_up_proj_bias", _deinterleave, _interleave, (num, 2 * ffn)
        ),
        TensorMap.transformed(
            f"{ours}.experts.w2",
            f"{hf}.experts.down_proj",
            lambda t: t.transpose(1, 2),
            lambda w: w.transpose(1, 2).contiguous(),
            (num, ffn, hidden),
        ),
        TensorMap.copy(f"{ours}.experts.b2", f"{hf}.experts.down_proj_bias"),
    ]


def tensor_maps(cfg: Config, available: Collection[str] | None = None) -> list[TensorMap]:
    """Every parameter of our model and the checkpoint tensors it is made of."""
    m, e = cfg.model, cfg.moe
    maps = embed_maps(m)
    for i in range(m.num_layers):
        ours, hf = f"layers.{i}", f"model.layers.{i}"
        maps += [
            TensorMap.copy(f"{ours}.attn_norm.weight", f"{hf}.input_layernorm.weight"),
            TensorMap.copy(f"{ours}.mlp_norm.weight", f"{hf}.post_attention_layernorm.weight"),
            TensorMap.copy(f"{ours}.attn.sinks", f"{hf}.self_attn.sinks"),
        ]
        for p in ("q", "k", "v", "o"):
            maps.append(TensorMap.copy(f"{ours}.attn.{p}_proj.weight", f"{hf}.self_attn.{p}_proj.weight"))
            if m.qkv_bias:
                maps.append(TensorMap.copy(f"{ours}.attn.{p}_proj.bias", f"{hf}.self_attn.{p}_proj.bias"))
        maps += expert_maps(f"{ours}.mlp", f"{hf}.mlp", e.num_experts, m.hidden_size, e.ffn_hidden_size, available)
    return maps
