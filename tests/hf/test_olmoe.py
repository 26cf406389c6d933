"""OLMoE (olmoe) against transformers: q/k RMSNorm over the whole projection (`model.qk_norm_scope: projection`), a
softmax router with and without renormalisation, attention biases; import/export, one training step's every gradient,
a check that the logits comparison fails were the norm per head, refusals, the recipes. Tiny random models, fp32,
tolerance 1e-4 * max(1, max |reference|)."""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "OlmoeConfig"):
    pytest.skip("this transformers has no OLMoE", allow_module_level=True)
from hf_parity import (  # noqa: E402
    assert_close,
    build_hf,
    check_projection_norm_is_needed,
    check_real_size_recipe,
    check_tiny_recipe_exports,
    import_export_parity,
    tokens,
    train_step_parity,
)
from lm_parity import tiny_recipe_trains  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

from moecore.config import load_config  # noqa: E402
from moecore.hf import load_pretrained  # noqa: E402
from moecore.hf.families import olmoe as family  # noqa: E402

V = 96


def olmoe_config(**over) -> transformers.OlmoeConfig:
    fields = dict(
        vocab_size=V, hidden_size=32, intermediate_size=16, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_experts=8, num_experts_per_tok=3, max_position_embeddings=128,
    )  # fmt: skip
    return transformers.OlmoeConfig(**{**fields, **over})


def test_import_export(tmp_path):
    """q/k norms over 32 / 16 channels, 8 experts top-3 without renormalisation: logits match on import and after
    export."""
    ref = build_hf(olmoe_config())
    ours, out = import_export_parity(ref, tmp_path)
    m, e = ours.cfg.model, ours.cfg.moe
    assert (m.qk_norm, m.qk_norm_scope, m.head_dim, m.qkv_bias) == (True, "projection", None, False)
    assert (e.router_pre_softmax, e.norm_topk_prob, e.num_experts, e.router_topk) == (True, False, 8, 3)
    attn = ours.layers[0].attn  # one weight over 4 heads x 8 for q, 2 x 8 for k
    assert (tuple(attn.q_norm.weight.shape), tuple(attn.k_norm.weight.shape)) == ((32,), (16,))
    written = json.loads((out / "config.json").read_text())
    assert written["num_experts"] == 8 and "head_dim" not in written and written["norm_topk_prob"] is False


def test_import_export_options(tmp_path):
    """Renormalised top-k, q/k/v/o biases, tied embeddings, top-1; and transformers' fused 3-D expert layout on
    disk beside the Hub's per-expert tensors."""
    cfg = olmoe_config(norm_topk_prob=True, attention_bias=True, tie_word_embeddings=True, num_experts_per_tok=1)
    ours, _ = import_export_parity(build_hf(cfg), tmp_path / "tied")
    m, e = ours.cfg.model, ours.cfg.moe
    assert (m.qkv_bias, m.attn_out_bias, m.tie_embeddings, e.norm_topk_prob) == (True, True, True, True)
    ref = build_hf(olmoe_config(norm_topk_prob=True))
    import_export_parity(ref, tmp_path / "fused")
    folder = tmp_path / "fused" / "hf"
    state = {k: v.contiguous() for k, v in ref.state_dict().items()}
    assert any(k.endswith("mlp.experts.gate_up_proj") for k in state)
    save_file(state, folder / "model.safetensors", metadata={"format": "pt"})
    ids = tokens(V)
    with torch.no_grad():
        assert_close(load_pretrained(folder)(ids).logits, ref(ids).logits, "fused layout")


def test_train_step(tmp_path):
    ref = build_hf(olmoe_config(router_aux_loss_coef=0.5))
    ref.save_pretrained(tmp_path)
    train_step_parity(load_pretrained(tmp_path), ref)


def test_parity_fails_with_a_per_head_norm(tmp_path, monkeypatch):
    """The logits comparison is sensitive to the scope of the norm: normalising each head on its own fails it."""
    check_projection_norm_is_needed(build_hf(olmoe_config()), tmp_path, monkeypatch)


def test_config_refusals():
    base = olmoe_config().to_dict()
    for field, value in [("clip_qkv", 8.0), ("head_dim", 16), ("hidden_act", "gelu"), ("some_new_field", 1)]:
        with pytest.raises(ValueError, match=field):
            family.config_from_hf({**base, field: value})
    for field, value, match in [
        ("model.qk_norm_scope", "head", "model.qk_norm_scope='head' cannot be exported as olmoe"),
        ("moe.router_pre_softmax", "false", "moe.router_pre_softmax"),
        ("moe.shared_expert_intermediate_size", 64, "moe.shared_expert_intermediate_size"),
        ("model.head_dim", 64, "model.head_dim"),
    ]:
        bad = load_config("tiny-olmoe", [f"{field}={value}"])
        with pytest.raises(ValueError, match=match):
            family.config_to_hf(bad)


# allenai/OLMoE-1B-7B-0924's config.json (the fields that shape the model)
OLMOE_1B_7B = {
    "model_type": "olmoe", "vocab_size": 50304, "hidden_size": 2048, "intermediate_size": 1024,
    "num_hidden_layers": 16, "num_attention_heads": 16, "num_key_value_heads": 16, "max_position_embeddings": 4096,
    "rope_theta": 10000.0, "rms_norm_eps": 1e-5, "num_experts": 64, "num_experts_per_tok": 8,
    "norm_topk_prob": False, "router_aux_loss_coef": 0.01, "tie_word_embeddings": False, "clip_qkv": None,
    "attention_bias": False, "hidden_act": "silu",
}  # fmt: skip


def test_recipes(tmp_path):
    """The real-size recipe is OLMoE-1B-7B's config; the tiny one exports as OLMoE and trains on a CPU."""
    check_real_size_recipe("olmoe-1b-7b", OLMOE_1B_7B)
    check_tiny_recipe_exports("tiny-olmoe", "olmoe")
    tiny_recipe_trains("tiny-olmoe", tmp_path)
