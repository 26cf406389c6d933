"""MiniMax-M2 (minimax_m2) against transformers: q/k RMSNorm over the whole projection (`model.qk_norm_scope:
projection`), partial RoPE from the legacy `rotary_dim`, sigmoid router with the correction bias; import/export, one
training step's every gradient, a check that the logits comparison fails were the norm per head, refusals, the
recipes. Tiny random models, fp32, tolerance 1e-4 * max(1, max |reference|)."""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "MiniMaxM2Config"):
    pytest.skip("this transformers has no MiniMax-M2", allow_module_level=True)
from hf_parity import (  # noqa: E402
    assert_close,
    build_hf,
    check_projection_norm_is_needed,
    check_real_size_recipe,
    check_tiny_recipe_exports,
    import_export_parity,
    tokens,
)
from lm_parity import lm_train_step_parity, set_buffers, tiny_recipe_trains  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

from moecore.config import load_config  # noqa: E402
from moecore.hf import load_pretrained  # noqa: E402
from moecore.hf.families import get_family  # noqa: E402
from moecore.hf.families import minimax_m2 as family  # noqa: E402
from moecore.hf.pretrained import pick_family  # noqa: E402
from moecore.models.transformer import MoETransformer  # noqa: E402

V = 96


def m2_config(**over) -> transformers.MiniMaxM2Config:
    fields = dict(
        vocab_size=V, hidden_size=32, intermediate_size=16, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, rotary_dim=8, num_local_experts=8, num_experts_per_tok=3,
        max_position_embeddings=128,
    )  # fmt: skip
    return transformers.MiniMaxM2Config(**{**fields, **over})


def build(cfg):
    ref = build_hf(cfg)
    set_buffers(ref, "e_score_correction_bias", 0.1)  # sigmoid scores lie in (0, 1): 0.1 changes the selection
    return ref


def test_import_export(tmp_path):
    """head_dim 16 != hidden/heads, RoPE on 8 of 16 channels (legacy rotary_dim), q/k norms over 64 / 32 channels,
    8 experts top-3 chosen with the correction bias: logits match on import and after export."""
    ref = build(m2_config())
    ours, out = import_export_parity(ref, tmp_path)
    m, e = ours.cfg.model, ours.cfg.moe
    assert (m.head_dim, m.partial_rotary_factor, m.qk_norm, m.qk_norm_scope) == (16, 0.5, True, "projection")
    assert (e.router_score_function, e.router_enable_expert_bias, e.norm_topk_prob) == ("sigmoid", True, True)
    assert (
        e.router_num_groups is None and e.router_topk_scaling_factor is None and not e.shared_expert_intermediate_size
    )
    attn = ours.layers[0].attn  # one weight over 4 heads x 16 for q, 2 x 16 for k
    assert (tuple(attn.q_norm.weight.shape), tuple(attn.k_norm.weight.shape)) == ((64,), (32,))
    bias = ref.model.layers[1].mlp.e_score_correction_bias
    torch.testing.assert_close(ours.layers[1].mlp.router.expert_bias, bias, rtol=0, atol=0)
    written = json.loads((out / "config.json").read_text())
    assert written["rotary_dim"] == 8 and written["num_local_experts"] == 8 and written["head_dim"] == 16


def test_import_export_options(tmp_path):
    """Full rotary (no rotary_dim), head_dim = hidden/heads, tied embeddings, top-1, an explicit
    partial_rotary_factor in rope_parameters; and transformers' fused 3-D expert layout on disk."""
    cfg = m2_config(head_dim=8, rotary_dim=None, tie_word_embeddings=True, num_experts_per_tok=1)
    ours, _ = import_export_parity(build(cfg), tmp_path / "full")
    assert ours.cfg.model.partial_rotary_factor == 1.0 and ours.cfg.model.tie_embeddings
    cfg = m2_config(
        rotary_dim=None, rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.25}
    )
    ref = build(cfg)
    ours, _ = import_export_parity(ref, tmp_path / "quarter")
    assert ours.cfg.model.partial_rotary_factor == 0.25 and ours.cfg.model.rope_theta == 1e4
    folder = tmp_path / "quarter" / "hf"
    state = {k: v.contiguous() for k, v in ref.state_dict().items()}
    assert any(k.endswith("mlp.experts.gate_up_proj") for k in state)
    save_file(state, folder / "model.safetensors", metadata={"format": "pt"})
    ids = tokens(V)
    with torch.no_grad():
        assert_close(load_pretrained(folder)(ids).logits, ref(ids).logits, "fused layout")


def test_train_step(tmp_path):
    ref = build(m2_config())
    ref.save_pretrained(tmp_path)
    lm_train_step_parity(load_pretrained(tmp_path), ref)


def test_parity_fails_with_a_per_head_norm(tmp_path, monkeypatch):
    """The logits comparison is sensitive to the scope of the norm: normalising each head on its own fails it."""
    check_projection_norm_is_needed(build(m2_config()), tmp_path, monkeypatch)


# MiniMax's remote-code config.json fields, at the values under which transformers computes their model.
REMOTE = {
    "use_qk_norm": True, "qk_norm_type": "per_layer", "scoring_func": "sigmoid", "use_routing_bias": True,
    "shared_intermediate_size": 0, "routed_scaling_factor": 1.0, "use_grouped_topk": True, "num_expert_group": None,
    "topk_group": None, "attn_type_list": [1, 1], "layernorm_full_attention_beta": 1.0, "layernorm_mlp_beta": 1.0,
    "layernorm_linear_attention_beta": 1.0, "attn_window_size": None, "sliding_window": None, "swa_rope_theta": -1.0,
    "mlp_intermediate_size": 64, "use_mtp": True, "num_mtp_modules": 3, "mtp_transformer_layers": 1,
    "shared_moe_mode": "sigmoid", "max_model_len": None, "rope_theta": 5e6,
}  # fmt: skip


def test_config_reading_and_refusals():
    base = m2_config().to_dict()
    assert family.config_from_hf({**base, **REMOTE}).model == family.config_from_hf(base).model
    legacy = {k: v for k, v in base.items() if k != "rope_parameters"}  # a Hub config.json: rotary_dim, rope_theta
    cfg = family.config_from_hf({**legacy, "rope_theta": 5e6})
    assert cfg.model.partial_rotary_factor == 0.5 and cfg.model.rope_theta == 5e6
    sparse = family.config_from_hf({"model_type": "minimax_m2", "hidden_size": 32, "num_attention_heads": 4})
    assert sparse.model.head_dim == 128 and sparse.model.num_layers == 62  # transformers' defaults
    for field, value in [
        ("router_jitter_noise", 0.01),
        ("sliding_window", 16),
        ("qk_norm_type", "per_head"),
        ("use_qk_norm", False),
        ("scoring_func", "softmax"),
        ("use_routing_bias", False),
        ("shared_intermediate_size", 8),
        ("routed_scaling_factor", 2.0),
        ("num_expert_group", 4),
        ("attn_type_list", [0, 1]),
        ("layernorm_mlp_beta", 2.0),
        ("attn_window_size", 64),
        ("rotary_dim", 32),
        ("some_new_field", 1),
    ]:
        with pytest.raises(ValueError, match=field):
            family.config_from_hf({**base, field: value})
    with pytest.raises(ValueError, match="rotary_dim=4 disagrees with partial_rotary_factor"):
        family.config_from_hf({**legacy, "rotary_dim": 4, "partial_rotary_factor": 0.5})


def test_export_refusals_and_other_families():
    cfg = load_config("tiny-minimax-m2")
    cfg.model.vocab_size = 64
    assert get_family("minimax_m2").config_to_hf(cfg)["rotary_dim"] == 16
    cfg.model.family = "moecore"
    assert pick_family(cfg) == "minimax_m2"  # a native model with these options is written as MiniMax-M2
    for recipe, name in [
        ("tiny-qwen3-moe", "qwen3_moe"),
        ("tiny-glm4-moe", "glm4_moe"),
        ("tiny-qwen3-next", "qwen3_next"),
    ]:
        other = load_config(recipe, ["model.vocab_size=64"])
        get_family(name).config_to_hf(other)  # per-head q/k norms: exported
        other.model.qk_norm_scope = "projection"
        with pytest.raises(ValueError, match=f"model.qk_norm_scope='projection' cannot be exported as {name}"):
            get_family(name).config_to_hf(other)
    for field, value, match in [
        ("model.qk_norm_scope", "head", "model.qk_norm_scope='head' cannot be exported as minimax_m2"),
        ("moe.router_score_function", "softmax", "moe.router_score_function"),
        ("model.partial_rotary_factor", 0.3, "model.partial_rotary_factor"),
        ("moe.shared_expert_intermediate_size", 64, "moe.shared_expert_intermediate_size"),
    ]:
        bad = load_config("tiny-minimax-m2", [f"{field}={value}"])
        with pytest.raises(ValueError, match=match):
            family.config_to_hf(bad)
    with pytest.raises(ValueError, match="model.qk_norm_scope='projection'.*needs model.qk_norm=true"):
        load_config("tiny-minimax-m2", ["model.qk_norm=false"]).validate()


# transformers' MiniMaxM2Config defaults, with the legacy rotary_dim of the released checkpoints
MINIMAX_M2 = {**{k: v for k, v in transformers.MiniMaxM2Config().to_dict().items() if k != "rope_parameters"},
              "model_type": "minimax_m2", "rope_theta": 5e6, "rotary_dim": 64}  # fmt: skip


def test_real_size_recipe():
    """The recipe builds the model of transformers' defaults (230B), with transformers' parameter count."""
    check_real_size_recipe("minimax-m2", MINIMAX_M2)
    ours = load_config("minimax-m2").validate()
    ref = family.config_from_hf(MINIMAX_M2)
    for f in ("head_dim", "partial_rotary_factor"):  # beside hf_parity.MODEL_FIELDS
        assert getattr(ours.model, f) == getattr(ref.model, f), f
    assert ours.moe.router_enable_expert_bias and ours.moe.router_score_function == "sigmoid"
    with torch.device("meta"):
        total, _ = MoETransformer(ours).num_params()
        hf_total = sum(
            p.numel() for p in transformers.MiniMaxM2ForCausalLM(transformers.MiniMaxM2Config()).parameters()
        )
    assert total == hf_total and 228e9 < hf_total < 230e9


def test_tiny_recipe_exports_and_trains(tmp_path):
    check_tiny_recipe_exports("tiny-minimax-m2", "minimax_m2")
    tiny_recipe_trains("tiny-minimax-m2", tmp_path, extra=("model.num_layers=2", "model.hidden_size=64"))
