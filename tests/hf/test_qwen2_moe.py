"""Qwen2-MoE against transformers: shared expert with sigmoid gate, qkv bias, dense/MoE layer patterns,
norm_topk_prob both ways, head_dim != hidden/heads, one training step."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("transformers")

from hf_parity import (  # noqa: E402
    build_hf,
    check_real_size_recipe,
    check_tiny_recipe_exports,
    import_export_parity,
    tiny_config,
    train_step_parity,
)
from transformers import Qwen2MoeConfig  # noqa: E402

from moecore.hf import load_pretrained  # noqa: E402


def qwen2_config(**over) -> Qwen2MoeConfig:
    fields = dict(
        vocab_size=96,
        intermediate_size=40,
        num_hidden_layers=3,
        num_experts=4,
        moe_intermediate_size=16,
        shared_expert_intermediate_size=24,
        max_position_embeddings=64,
    )
    return tiny_config(Qwen2MoeConfig, fields, over)


@pytest.mark.parametrize(
    "over, pattern",
    [
        # defaults: qkv bias, no renormalisation; a dense layer between two MoE layers
        (dict(mlp_only_layers=[1]), [1, 0, 1]),
        # every second layer MoE, renormalised, no qkv bias, head_dim 16 (hidden/heads is 8)
        (
            dict(num_hidden_layers=4, decoder_sparse_step=2, norm_topk_prob=True, qkv_bias=False, head_dim=16),
            [0, 1, 0, 1],
        ),
    ],
)
def test_import_export(tmp_path, over, pattern):
    hf = build_hf(qwen2_config(**over))
    ours, out = import_export_parity(hf, tmp_path)
    assert [int(layer.is_moe) for layer in ours.layers] == pattern
    assert ours.cfg.moe.shared_expert_gate and ours.cfg.moe.shared_expert_intermediate_size == 24
    assert ours.cfg.moe.norm_topk_prob == over.get("norm_topk_prob", False)
    assert ours.cfg.model.qkv_bias == over.get("qkv_bias", True)
    written = json.loads((out / "config.json").read_text())
    assert written["model_type"] == "qwen2_moe" and written["architectures"] == ["Qwen2MoeForCausalLM"]


def test_sliding_window_every_layer(tmp_path):
    """use_sliding_window with every layer below max_window_layers marked sliding (explicit layer_types)."""
    cfg = qwen2_config(use_sliding_window=True, sliding_window=4, layer_types=["sliding_attention"] * 3)
    ours, _ = import_export_parity(build_hf(cfg), tmp_path)
    assert ours.cfg.model.sliding_window == 4


def test_train_step(tmp_path):
    hf = build_hf(qwen2_config(mlp_only_layers=[1], router_aux_loss_coef=0.5))
    hf.save_pretrained(tmp_path)
    train_step_parity(load_pretrained(tmp_path), hf)


QWEN2_57B_A14B = {  # Qwen/Qwen2-57B-A14B config.json
    "architectures": ["Qwen2MoeForCausalLM"],
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "decoder_sparse_step": 1,
    "eos_token_id": 151643,
    "hidden_act": "silu",
    "hidden_size": 3584,
    "initializer_range": 0.02,
    "intermediate_size": 18944,
    "max_position_embeddings": 131072,
    "max_window_layers": 28,
    "model_type": "qwen2_moe",
    "moe_intermediate_size": 2560,
    "norm_topk_prob": False,
    "num_attention_heads": 28,
    "num_experts": 64,
    "num_experts_per_tok": 8,
    "num_hidden_layers": 28,
    "num_key_value_heads": 4,
    "output_router_logits": False,
    "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0,
    "router_aux_loss_coef": 0.001,
    "shared_expert_intermediate_size": 20480,
    "sliding_window": 131072,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.40.1",
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": 151936,
}


def test_real_size_recipe():
    check_real_size_recipe("qwen2-57b-a14b", QWEN2_57B_A14B)


def test_tiny_recipe_exports():
    check_tiny_recipe_exports("tiny-qwen2-moe", "qwen2_moe")
