"""GLM-4.7-Flash (glm4_moe_lite) against transformers: DeepSeek-V3's multi-latent attention and sigmoid router with
correction bias and groups under GLM's config fields (mlp_layer_types); import/export, one training step, refusals,
the recipes. Tiny random models, fp32, tolerance 1e-4 * max(1, max |reference|)."""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "Glm4MoeLiteConfig"):
    pytest.skip("this transformers has no GLM-4.7-Flash (Glm4MoeLite)", allow_module_level=True)
from hf_parity import build_hf, check_real_size_recipe, check_tiny_recipe_exports, import_export_parity  # noqa: E402
from lm_parity import lm_train_step_parity, set_buffers, tiny_recipe_trains  # noqa: E402

from moecore.config import load_config  # noqa: E402
from moecore.hf import load_pretrained  # noqa: E402
from moecore.hf.families import glm4_moe_lite as family  # noqa: E402
from moecore.models.transformer import MoETransformer  # noqa: E402

V = 96


def lite_config(**over) -> transformers.Glm4MoeLiteConfig:
    fields = dict(
        vocab_size=V, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=4, q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=8,
        qk_rope_head_dim=8, v_head_dim=12, n_routed_experts=8, num_experts_per_tok=3, n_shared_experts=1, n_group=4,
        topk_group=2, routed_scaling_factor=1.8, max_position_embeddings=128,
    )  # fmt: skip
    return transformers.Glm4MoeLiteConfig(**{**fields, **over})


def build(cfg):
    ref = build_hf(cfg)
    set_buffers(ref, "e_score_correction_bias", 0.1)
    return ref


def test_import_export(tmp_path):
    """q LoRA, interleaved RoPE, 4 groups (2 kept) of 8 experts top-3 with the correction bias, 1 dense layer
    (transformers' default mlp_layer_types): logits match on import and after export."""
    ref = build(lite_config())
    ours, out = import_export_parity(ref, tmp_path)
    m, e = ours.cfg.model, ours.cfg.moe
    assert (m.attention_type, m.q_lora_rank, m.v_head_dim, m.rope_interleave) == ("mla", 24, 12, True)
    assert (e.router_score_function, e.router_num_groups, e.router_group_topk, e.router_group_score) == (
        "sigmoid", 4, 2, "top2_sum",
    )  # fmt: skip
    assert e.router_enable_expert_bias and e.router_topk_scaling_factor == 1.8 and e.first_k_dense_replace == 1
    assert (e.router_load_balancing_type, e.aux_loss_coeff, e.router_bias_update_rate) == ("seq_aux_loss", 1e-4, 1e-3)
    assert [layer.is_moe for layer in ours.layers] == [False, True, True]
    bias = ref.model.layers[1].mlp.gate.e_score_correction_bias
    torch.testing.assert_close(ours.layers[1].mlp.router.expert_bias, bias, rtol=0, atol=0)
    written = json.loads((out / "config.json").read_text())
    assert written["mlp_layer_types"] == ["dense", "sparse", "sparse"] and "first_k_dense_replace" not in written


def test_import_export_options(tmp_path):
    """No q LoRA, two dense layers, no groups, no scaling, half-split RoPE, tied embeddings, no renormalisation."""
    cfg = lite_config(
        q_lora_rank=None, mlp_layer_types=["dense", "dense", "sparse"], n_group=1, topk_group=1,
        routed_scaling_factor=1.0, rope_interleave=False, tie_word_embeddings=True, norm_topk_prob=False,
    )  # fmt: skip
    ours, out = import_export_parity(build(cfg), tmp_path)
    m, e = ours.cfg.model, ours.cfg.moe
    assert m.q_lora_rank is None and not m.rope_interleave and m.tie_embeddings
    assert e.router_num_groups is None and e.router_topk_scaling_factor is None and not e.norm_topk_prob
    assert [layer.is_moe for layer in ours.layers] == [False, False, True]
    assert json.loads((out / "config.json").read_text())["mlp_layer_types"] == ["dense", "dense", "sparse"]


def test_train_step(tmp_path):
    ref = build(lite_config())
    ref.save_pretrained(tmp_path)
    lm_train_step_parity(load_pretrained(tmp_path), ref)


def test_refusals():
    base = lite_config().to_dict()
    with pytest.raises(ValueError, match="mlp_layer_types"):
        family.config_from_hf({**base, "mlp_layer_types": ["sparse", "dense", "sparse"]})
    with pytest.raises(ValueError, match="mlp_layer_types"):
        family.config_from_hf({**base, "mlp_layer_types": ["dense", "sparse"]})
    with pytest.raises(ValueError, match="first_k_dense_replace"):
        family.config_from_hf({**base, "first_k_dense_replace": 2})
    with pytest.raises(ValueError, match="partial_rotary_factor"):
        family.config_from_hf({**base, "partial_rotary_factor": 0.5})
    assert family.config_from_hf({**base, "partial_rotary_factor": 1.0}).model.partial_rotary_factor == 1.0
    with pytest.raises(ValueError, match="num_key_value_heads"):
        family.config_from_hf({**base, "num_key_value_heads": 2})
    cfg = load_config("tiny-glm4-moe-lite")
    cfg.moe.router_score_function = "softmax"
    with pytest.raises(ValueError, match="moe.router_score_function"):
        family.config_to_hf(cfg)


# transformers' Glm4MoeLiteConfig defaults (the GLM-4.7-Flash shape) with its one MTP layer
GLM_4_7_FLASH = {
    **{k: v for k, v in transformers.Glm4MoeLiteConfig().to_dict().items() if k != "rope_parameters"},
    "model_type": "glm4_moe_lite",
    "rope_theta": 10000.0,
    "num_nextn_predict_layers": 1,
}


def test_real_size_recipe():
    """The recipe builds the model of transformers' defaults, with its parameter count plus the MTP layer."""
    check_real_size_recipe("glm-4.7-flash", GLM_4_7_FLASH)
    ours = load_config("glm-4.7-flash").validate()
    ref = family.config_from_hf(GLM_4_7_FLASH)
    for f in ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "mtp_num_layers"):
        assert getattr(ours.model, f) == getattr(ref.model, f), f
    with torch.device("meta"):
        model = MoETransformer(ours)
        total, _ = model.num_params()
        hf_total = sum(
            p.numel() for p in transformers.Glm4MoeLiteForCausalLM(transformers.Glm4MoeLiteConfig()).parameters()
        )
    assert total - sum(p.numel() for p in model.mtp.parameters()) == hf_total  # transformers has no MTP layer
    assert 29e9 < hf_total < 31e9


def test_tiny_recipe_exports_and_trains(tmp_path):
    check_tiny_recipe_exports("tiny-glm4-moe-lite", "glm4_moe_lite")
    tiny_recipe_trains("tiny-glm4-moe-lite", tmp_path, extra=("model.num_layers=2", "model.hidden_size=64"))
