"""Qwen3-MoE against transformers: per-head q/k RMSNorm, head_dim != hidden/heads, norm_topk_prob both
ways, attention bias, dense layers, sliding window, rope scaling; one training step; the convert CLI."""

from __future__ import annotations

import copy
import json

import pytest
import torch

pytest.importorskip("transformers")

from hf_parity import (  # noqa: E402
    assert_close,
    build_hf,
    check_real_size_recipe,
    check_tiny_recipe_exports,
    import_export_parity,
    tiny_config,
    tokens,
    train_step_parity,
)
from transformers import AutoModelForCausalLM, Qwen3MoeConfig  # noqa: E402

from moecore.hf import load_pretrained  # noqa: E402
from moecore.hf.convert import load_model_checkpoint, main  # noqa: E402


def qwen3_config(**over) -> Qwen3MoeConfig:
    fields = dict(
        vocab_size=96,
        intermediate_size=40,
        head_dim=16,
        num_experts=6,
        moe_intermediate_size=16,
        norm_topk_prob=True,
        max_position_embeddings=64,
    )
    return tiny_config(Qwen3MoeConfig, fields, over)


def test_import_export_defaults(tmp_path):
    hf = build_hf(qwen3_config())
    ours, out = import_export_parity(hf, tmp_path)
    m = ours.cfg.model
    assert m.qk_norm and m.head_dim == 16 and not m.qkv_bias and ours.cfg.moe.norm_topk_prob
    written = json.loads((out / "config.json").read_text())
    assert written["num_experts"] == 6 and written["head_dim"] == 16


def test_options(tmp_path):
    """No renormalisation, q/k/v/o biases, dense layers 0 and 2, a window on every layer, tied
    embeddings, linear rope scaling and head_dim == hidden/heads."""
    cfg = qwen3_config(
        num_hidden_layers=4,
        head_dim=8,
        norm_topk_prob=False,
        attention_bias=True,
        mlp_only_layers=[0, 2],
        use_sliding_window=True,
        sliding_window=6,
        tie_word_embeddings=True,
        rope_parameters={"rope_type": "linear", "rope_theta": 5000.0, "factor": 2.0},
    )
    ours, _ = import_export_parity(build_hf(cfg), tmp_path)
    m, e = ours.cfg.model, ours.cfg.moe
    assert (m.qkv_bias, m.attn_out_bias, m.sliding_window, m.tie_embeddings, m.head_dim) == (True, True, 6, True, None)
    assert not e.norm_topk_prob and [int(layer.is_moe) for layer in ours.layers] == [0, 1, 0, 1]


def test_train_step(tmp_path):
    hf = build_hf(qwen3_config(num_hidden_layers=3, mlp_only_layers=[1], router_aux_loss_coef=0.5))
    hf.save_pretrained(tmp_path)
    train_step_parity(load_pretrained(tmp_path), hf)


def test_convert_cli_round_trip(tmp_path, capsys):
    """--from-hf writes a moecore checkpoint (bf16 kept, tokenizer carried); --to-hf writes a folder transformers loads."""
    hf = build_hf(qwen3_config())
    with torch.no_grad():  # round the reference's weights to bf16 so the bf16 checkpoint holds them exactly
        for p in hf.parameters():
            p.copy_(p.bfloat16().float())
    src = tmp_path / "hf"
    copy.deepcopy(hf).to(torch.bfloat16).save_pretrained(src)
    (src / "tokenizer.json").write_text('{"version": "1.0"}')
    ckpt, back = tmp_path / "ckpt", tmp_path / "back"
    assert main(["--from-hf", str(src), str(ckpt), "--no-progress"]) == 0
    assert (ckpt / ".metadata").is_file() and (ckpt / "complete").is_file() and (ckpt / "tokenizer.json").is_file()
    model, cfg = load_model_checkpoint(ckpt)
    assert cfg.model.family == "qwen3_moe" and cfg.data.tokenizer == str(ckpt.resolve())
    assert model.embed.weight.dtype == torch.bfloat16
    assert main(["--to-hf", str(ckpt), str(back), "--dtype", "fp32", "--no-progress"]) == 0
    assert (back / "tokenizer.json").is_file()
    reloaded = AutoModelForCausalLM.from_pretrained(back, attn_implementation="eager").eval()
    assert reloaded.dtype == torch.float32
    ids = tokens(96)
    with torch.no_grad():  # bf16 weights are exact in fp32, so the fp32 logits must agree
        assert_close(reloaded(ids).logits, hf(ids).logits)
    assert main(["--to-hf", str(ckpt), str(back), "--no-progress"]) == 2
    assert "not empty" in capsys.readouterr().err


QWEN3_30B_A3B = {  # Qwen/Qwen3-30B-A3B config.json
    "architectures": ["Qwen3MoeForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "decoder_sparse_step": 1,
    "eos_token_id": 151645,
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 2048,
    "initializer_range": 0.02,
    "intermediate_size": 6144,
    "max_position_embeddings": 40960,
    "max_window_layers": 48,
    "mlp_only_layers": [],
    "model_type": "qwen3_moe",
    "moe_intermediate_size": 768,
    "norm_topk_prob": True,
    "num_attention_heads": 32,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "num_hidden_layers": 48,
    "num_key_value_heads": 4,
    "output_router_logits": False,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 1000000.0,
    "router_aux_loss_coef": 0.001,
    "sliding_window": None,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.51.0",
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": 151936,
}
QWEN3_235B_A22B = dict(  # Qwen/Qwen3-235B-A22B config.json: the 30B's fields with these sizes
    QWEN3_30B_A3B,
    hidden_size=4096,
    intermediate_size=12288,
    max_window_layers=94,
    moe_intermediate_size=1536,
    num_attention_heads=64,
    num_hidden_layers=94,
)


@pytest.mark.parametrize("recipe, hf_config", [("qwen3-30b-a3b", QWEN3_30B_A3B), ("qwen3-235b-a22b", QWEN3_235B_A22B)])
def test_real_size_recipes(recipe, hf_config):
    check_real_size_recipe(recipe, hf_config)


def test_tiny_recipe_exports():
    check_tiny_recipe_exports("tiny-qwen3-moe", "qwen3_moe")
