"""Qwen2-MoE (model_type "qwen2_moe"): Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B.

Biases on q/k/v (`qkv_bias`, on by default), softmax over all experts then top-k, renormalised only
with `norm_topk_prob` (off by default), a shared expert whose output is scaled by
sigmoid(shared_expert_gate(x)), and dense layers where `mlp_only_layers` lists them or where
(i + 1) % `decoder_sparse_step` != 0. Sliding-window attention applies to the layers `layer_types`
marks `sliding_attention` (derived from `max_window_layers` when absent) and only with
`use_sliding_window`; we support it when every layer slides or none does.
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
    qwen_experts_from_hf,
    qwen_experts_to_hf,
    qwen_tensor_maps,
    refuse_export_unless,
    validated,
)

MODEL_TYPE = "qwen2_moe"
ARCHITECTURE = "Qwen2MoeForCausalLM"

# transformers' Qwen2MoeConfig defaults, used for fields a config.json leaves out.
DEFAULTS = {
    "vocab_size": 151936,
    "hidden_size": 2048,
    "intermediate_size": 5632,
    "num_hidden_layers": 24,
    "num_attention_heads": 16,
    "num_key_value_heads": 16,
    "hidden_act": "silu",
    "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "use_sliding_window": False,
    "sliding_window": 4096,
    "max_window_layers": 28,
    "decoder_sparse_step": 1,
    "moe_intermediate_size": 1408,
    "shared_expert_intermediate_size": 5632,
    "num_experts_per_tok": 4,
    "num_experts": 60,
    "norm_topk_prob": False,
    "router_aux_loss_coef": 0.001,
    "qkv_bias": True,
}


def sliding_window_from_hf(f: HFFields, num_layers: int, derive_types: bool) -> int | None:
    """One window for every layer, or None; mixed full/sliding layers are refused.

    With `derive_types` (Qwen2-MoE), absent `layer_types` are derived as transformers does: layer i slides
    when i is even and below `max_window_layers`. Otherwise (Qwen3-MoE) every layer slides.
    """
    use = f.expect("use_sliding_window", (True, False))
    window = f.get("sliding_window")
    max_window_layers = f.get("max_window_layers")
    types = f.get("layer_types", None) if derive_types else None
    if types is not None and (not isinstance(types, list) or len(types) != num_layers):
        f.refuse("layer_types", types, f"a list with one entry per layer ({num_layers})")
    if not use:
        if types is not None and "sliding_attention" in types:
            f.refuse("layer_types", types, "sliding_attention layers need use_sliding_window=true")
        return None
    if derive_types and types is None:
        types = [
            "sliding_attention" if i % 2 == 0 and i < max_window_layers else "full_attention" for i in range(num_layers)
        ]
    if types is None:
        types = ["sliding_attention"] * num_layers
    return one_window(f, types, window)


def one_window(f: HFFields, types: list, window) -> int | None:
    """The window of per-layer `layer_types` that are all one kind: None when every layer is full, the checked
    `sliding_window` when every layer slides; other kinds and mixed layers are refused."""
    for t in types:
        if t not in ("full_attention", "sliding_attention"):
            f.refuse("layer_types", t, "allowed: 'full_attention' | 'sliding_attention'")
    if len(set(types)) > 1:
        f.refuse("layer_types", types, "sliding and full attention mixed across layers is not supported")
    if types[0] == "full_attention":
        return None
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        f.refuse("sliding_window", window, "an integer >= 1")
    return window


def config_from_hf(hf: dict) -> Config:
    f = HFFields(hf, MODEL_TYPE, DEFAULTS)
    cfg = base_config(f)
    m, e = cfg.model, cfg.moe
    m.qkv_bias = f.expect("qkv_bias", (True, False))
    m.sliding_window = sliding_window_from_hf(f, m.num_layers, derive_types=True)
    qwen_experts_from_hf(f, cfg, f.integer("num_experts", lo=1))
    shared = f.get("shared_expert_intermediate_size")
    if isinstance(shared, bool) or not isinstance(shared, int) or shared < 1:
        f.refuse(
            "shared_expert_intermediate_size",
            shared,
            "an integer >= 1 (Qwen2-MoE layers always hold a gated shared expert)",
        )
    e.shared_expert_intermediate_size = shared
    e.shared_expert_gate = True
    f.finish()
    return validated(cfg)


def config_to_hf(cfg: Config) -> dict:
    m, e = cfg.model, cfg.moe
    check_exportable(cfg, MODEL_TYPE)
    shared = e.shared_expert_intermediate_size
    refuse_export_unless(
        MODEL_TYPE,
        [
            ("model.attn_out_bias", m.attn_out_bias, not m.attn_out_bias, "Qwen2-MoE has no o_proj bias"),
            ("model.qk_norm", m.qk_norm, not m.qk_norm, "Qwen2-MoE has no q/k norm"),
            ("moe.shared_expert_intermediate_size", shared, bool(shared), "Qwen2-MoE needs a shared expert"),
            (
                "moe.shared_expert_gate",
                e.shared_expert_gate,
                e.shared_expert_gate,
                "Qwen2-MoE always gates its shared expert",
            ),
        ],
    )
    out = {
        **base_to_hf(m),
        "qkv_bias": m.qkv_bias,
        "use_sliding_window": m.sliding_window is not None,
        "sliding_window": m.sliding_window,
        "max_window_layers": m.num_layers,
        **qwen_experts_to_hf(cfg),
        "shared_expert_intermediate_size": shared,
    }
    if m.sliding_window is not None:
        out["layer_types"] = ["sliding_attention"] * m.num_layers
    return out


def tensor_maps(cfg: Config, available: Collection[str] | None) -> list[TensorMap]:
    return qwen_tensor_maps(cfg, available, shared_expert=True)
