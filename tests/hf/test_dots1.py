"""dots.llm1 (dots1) against transformers: per-head q/k RMSNorm, DeepSeek-V3's sigmoid router with the correction bias,
groups and routed scaling, shared experts, dense first layers, attention biases, a sliding window on every layer;
import/export, one training step's every gradient, refusals, the recipes. Tiny random models, fp32, tolerance
1e-4 * max(1, max |reference|)."""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "Dots1Config"):
    pytest.skip("this transformers has no dots.llm1", allow_module_level=True)
from hf_parity import (  # noqa: E402
    build_hf,
    check_tiny_recipe_exports,
    import_export_parity,
)
from lm_parity import lm_train_step_parity, set_buffers, tiny_recipe_trains  # noqa: E402

from moecore.config import load_config  # noqa: E402
from moecore.hf import load_pretrained  # noqa: E402
from moecore.hf.families import dots1 as family  # noqa: E402

V = 96


def dots1_config(**over) -> transformers.Dots1Config:
    fields = dict(
        vocab_size=V, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=3,
        n_group=4, topk_group=2, routed_scaling_factor=2.5, first_k_dense_replace=1, norm_topk_prob=True,
        max_position_embeddings=128,
    )  # fmt: skip
    return transformers.Dots1Config(**{**fields, **over})


def build(cfg):
    ref = build_hf(cfg)
    set_buffers(ref, "e_score_correction_bias", 0.1)  # sigmoid scores lie in (0, 1): 0.1 changes the selection
    return ref


def test_import_export(tmp_path):
    """Per-head q/k norms, 4 groups (2 kept) with top-3 of 8 experts, the correction bias, routed scaling 2.5, one
    shared expert, a dense first layer: logits match on import and after export."""
    ref = build(dots1_config())
    ours, out = import_export_parity(ref, tmp_path)
    m, e = ours.cfg.model, ours.cfg.moe
    assert (m.qk_norm, m.qk_norm_scope, m.qkv_bias, m.sliding_window) == (True, "head", False, None)
    assert (e.router_score_function, e.router_num_groups, e.router_group_topk, e.router_topk_scaling_factor) == (
        "sigmoid", 4, 2, 2.5,
    )  # fmt: skip
    assert e.router_enable_expert_bias and e.shared_expert_intermediate_size == 16
    assert [layer.is_moe for layer in ours.layers] == [False, True, True]
    bias = ref.model.layers[1].mlp.gate.e_score_correction_bias
    torch.testing.assert_close(ours.layers[1].mlp.router.expert_bias, bias, rtol=0, atol=0)
    written = json.loads((out / "config.json").read_text())
    assert written["n_group"] == 4 and written["n_shared_experts"] == 1 and written["first_k_dense_replace"] == 1


def test_import_export_options(tmp_path):
    """q/k/v/o biases, a window of 6 on every layer (sequence 12), no groups, no scaling, no renormalisation, two
    shared experts, tied embeddings."""
    cfg = dots1_config(
        attention_bias=True, sliding_window=6, max_window_layers=0, n_group=1, topk_group=1, routed_scaling_factor=1.0,
        norm_topk_prob=False, n_shared_experts=2, tie_word_embeddings=True,
    )  # fmt: skip
    ours, _ = import_export_parity(build(cfg), tmp_path)
    m, e = ours.cfg.model, ours.cfg.moe
    assert (m.qkv_bias, m.attn_out_bias, m.sliding_window, m.tie_embeddings) == (True, True, 6, True)
    assert e.router_num_groups is None and e.router_topk_scaling_factor is None and not e.norm_topk_prob
    assert e.shared_expert_intermediate_size == 32


def test_train_step(tmp_path):
    ref = build(dots1_config())
    ref.save_pretrained(tmp_path)
    lm_train_step_parity(load_pretrained(tmp_path), ref)


def test_refusals():
    base = dots1_config().to_dict()
    mixed = ["full_attention", "sliding_attention", "full_attention"]
    for field, value in [("layer_types", mixed), ("scoring_func", "softmax"), ("some_new_field", 1)]:
        with pytest.raises(ValueError, match=field):
            family.config_from_hf({**base, field: value})
    for field, value, match in [
        ("model.qk_norm", "false", "model.qk_norm"),
        ("model.qk_norm_scope", "projection", "model.qk_norm_scope"),
        ("moe.router_score_function", "softmax", "moe.router_score_function"),
        ("moe.shared_expert_gate", "true", "moe.shared_expert_gate"),
    ]:
        bad = load_config("tiny-dots1", [f"{field}={value}"])
        with pytest.raises(ValueError, match=match):
            family.config_to_hf(bad)


def test_tiny_recipe(tmp_path):
    """The tiny recipe exports as dots1 and trains on a CPU (no real-size recipe: import the checkpoint's config.json
    with `moecore convert --from-hf`)."""
    check_tiny_recipe_exports("tiny-dots1", "dots1")
    tiny_recipe_trains("tiny-dots1", tmp_path)
