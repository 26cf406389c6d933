"""GLM-4.5 MoE against transformers: partial rotary, q/k norm, qkv biases, sigmoid router with correction
bias and groups, shared expert, dense first layer; import/export, one training step, the MTP layer as
GLM checkpoints store it, the recipes, and a short CPU training run of the tiny recipe."""

from __future__ import annotations

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
    tokens,
)
from lm_parity import (  # noqa: E402
    lm_train_step_parity,
    reference_mtp_losses,
    set_buffers,
    tiny_recipe_trains,
    write_mtp_layers,
)
from safetensors.torch import load_file  # noqa: E402
from transformers import AutoModelForCausalLM, Glm4MoeConfig  # noqa: E402
from transformers.modeling_layers import MtpLayer  # noqa: E402
from transformers.models.glm4_moe import modeling_glm4_moe as hf_glm  # noqa: E402

from moecore.config import load_config  # noqa: E402
from moecore.hf import load_pretrained, save_pretrained  # noqa: E402
from moecore.hf.families import glm4_moe as family  # noqa: E402
from moecore.models.transformer import MoETransformer  # noqa: E402

V = 96


def glm_config(**over) -> Glm4MoeConfig:
    fields = dict(
        vocab_size=V,
        hidden_size=32,
        intermediate_size=48,
        moe_intermediate_size=16,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        n_routed_experts=8,
        num_experts_per_tok=3,
        n_shared_experts=1,
        n_group=4,
        topk_group=2,
        routed_scaling_factor=2.5,
        first_k_dense_replace=1,
        attention_bias=True,
        use_qk_norm=True,
        max_position_embeddings=128,
        num_mtp_layers=0,
    )
    return Glm4MoeConfig(**{**fields, **over})


def build(cfg: Glm4MoeConfig):
    ref = build_hf(cfg)
    set_buffers(ref, "e_score_correction_bias", 0.1)
    return ref


def test_import_export(tmp_path):
    """Half rotary, q/k norm, qkv bias, 4 groups (2 kept) with top-3 of 8 experts: the correction bias and the
    group limit both change the selection; logits match on import and after export."""
    ref = build(glm_config())
    ours, out = import_export_parity(ref, tmp_path)
    m, e = ours.cfg.model, ours.cfg.moe
    assert (m.partial_rotary_factor, m.qk_norm, m.qkv_bias, m.attn_out_bias, m.head_dim) == (0.5, True, True, False, 16)
    assert (e.router_score_function, e.router_num_groups, e.router_group_topk, e.router_group_score) == (
        "sigmoid",
        4,
        2,
        "top2_sum",
    )
    assert (
        e.router_enable_expert_bias and e.router_topk_scaling_factor == 2.5 and e.shared_expert_intermediate_size == 16
    )
    assert [layer.is_moe for layer in ours.layers] == [False, True, True] and ours.mtp is None
    bias = ref.model.layers[1].mlp.gate.e_score_correction_bias
    torch.testing.assert_close(ours.layers[1].mlp.router.expert_bias, bias, rtol=0, atol=0)
    written = json.loads((out / "config.json").read_text())
    assert written["partial_rotary_factor"] == 0.5 and written["use_qk_norm"] and written["n_group"] == 4


def test_import_export_options(tmp_path):
    """No q/k norm, no biases, no groups, no scaling, two shared experts, a quarter of each head rotated, tied
    embeddings, no renormalisation."""
    cfg = glm_config(
        use_qk_norm=False,
        attention_bias=False,
        n_group=1,
        topk_group=1,
        routed_scaling_factor=1.0,
        n_shared_experts=2,
        tie_word_embeddings=True,
        norm_topk_prob=False,
        partial_rotary_factor=0.25,
    )
    ours, _ = import_export_parity(build(cfg), tmp_path)
    m, e = ours.cfg.model, ours.cfg.moe
    assert not m.qk_norm and not m.qkv_bias and m.tie_embeddings and m.partial_rotary_factor == 0.25
    assert e.router_num_groups is None and e.router_topk_scaling_factor is None and not e.norm_topk_prob
    assert e.shared_expert_intermediate_size == 32


def test_train_step(tmp_path):
    ref = build(glm_config())
    ref.save_pretrained(tmp_path)
    lm_train_step_parity(load_pretrained(tmp_path), ref)


def _mtp_layers(ref, count: int) -> torch.nn.ModuleList:
    mtp_cfg = ref.config.get_mtp_config()
    mtp_cfg._attn_implementation = "eager"
    torch.manual_seed(7)
    layers = torch.nn.ModuleList(
        MtpLayer(mtp_cfg, hf_glm.Glm4MoeDecoderLayer, hf_glm.Glm4MoeRMSNorm, k) for k in range(count)
    ).eval()
    from hf_parity import randomize

    randomize(layers, 2)
    set_buffers(layers, "e_score_correction_bias", 0.1, seed=9)
    return layers


def test_mtp_layers_import_export(tmp_path):
    """Two MTP layers as GLM checkpoints store them (model.layers.{L + k}): our MTP losses equal transformers'
    MtpLayers chained on the same tensors; the export gives back every tensor unchanged and loads in
    transformers (which skips the MTP layers) with the same logits."""
    ref = build(glm_config(num_mtp_layers=2))
    src = tmp_path / "hf"
    ref.save_pretrained(src)
    layers = _mtp_layers(ref, 2)
    write_mtp_layers(src, layers, ref.config.num_hidden_layers)
    ours = load_pretrained(src)
    assert ours.cfg.model.mtp_num_layers == 2
    ids = tokens(V, seq=17, seed=4)
    s = ids.shape[1] - 1
    with torch.no_grad():
        out = ours(ids[:, :s], labels=ids[:, 1:])
        assert_close(out.logits, ref(ids[:, :s]).logits)
        want = reference_mtp_losses(ref, layers, ids)
    for got, w in zip(out.mtp_losses, want):
        torch.testing.assert_close(got, w, rtol=1e-5, atol=1e-5)
    exported = save_pretrained(ours, tmp_path / "export")
    before, after = load_file(src / "model.safetensors"), load_file(exported / "model.safetensors")
    assert sorted(before) == sorted(after)
    for name, t in before.items():
        assert torch.equal(after[name], t), name
    back = AutoModelForCausalLM.from_pretrained(exported, attn_implementation="eager").eval()
    with torch.no_grad():
        assert_close(back(ids[:, :s]).logits, ref(ids[:, :s]).logits)


def test_checkpoint_without_mtp_tensors_imports_without_mtp(tmp_path):
    """transformers' save_pretrained announces num_nextn_predict_layers but writes no MTP tensors."""
    ref = build(glm_config(num_mtp_layers=1))
    ref.save_pretrained(tmp_path)
    ours = load_pretrained(tmp_path)
    assert ours.cfg.model.mtp_num_layers == 0 and ours.mtp is None


def test_refusals():
    base = glm_config().to_dict()
    for field, value in (("scoring_func", "softmax"), ("n_group", 3), ("hidden_act", "gelu")):
        with pytest.raises(ValueError, match=field):
            family.config_from_hf({**base, field: value})
    cfg = load_config("tiny-glm4-moe")
    cfg.model.attn_out_bias = True
    with pytest.raises(ValueError, match="model.attn_out_bias"):
        family.config_to_hf(cfg)
    cfg = load_config("tiny-glm4-moe")
    cfg.moe.router_score_function = "softmax"
    with pytest.raises(ValueError, match="moe.router_score_function"):
        family.config_to_hf(cfg)


# --------------------------------------------------------------------------------------------------
# Recipes (config.json values of the Hub checkpoints zai-org/GLM-4.5 and zai-org/GLM-4.5-Air)
# --------------------------------------------------------------------------------------------------

_GLM_COMMON = {
    "architectures": ["Glm4MoeForCausalLM"],
    "model_type": "glm4_moe",
    "attention_bias": True,
    "attention_dropout": 0.0,
    "pad_token_id": 151329,
    "eos_token_id": [151329, 151336, 151338],
    "head_dim": 128,
    "hidden_act": "silu",
    "partial_rotary_factor": 0.5,
    "initializer_range": 0.02,
    "max_position_embeddings": 131072,
    "norm_topk_prob": True,
    "num_attention_heads": 96,
    "n_group": 1,
    "topk_group": 1,
    "n_shared_experts": 1,
    "num_experts_per_tok": 8,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-05,
    "rope_scaling": None,
    "rope_theta": 1000000,
    "num_nextn_predict_layers": 1,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "vocab_size": 151552,
}
GLM_4_5 = {
    **_GLM_COMMON,
    "hidden_size": 5120,
    "intermediate_size": 12288,
    "moe_intermediate_size": 1536,
    "n_routed_experts": 160,
    "routed_scaling_factor": 2.5,
    "first_k_dense_replace": 3,
    "num_hidden_layers": 92,
    "use_qk_norm": True,
}
GLM_4_5_AIR = {
    **_GLM_COMMON,
    "hidden_size": 4096,
    "intermediate_size": 10944,
    "moe_intermediate_size": 1408,
    "n_routed_experts": 128,
    "routed_scaling_factor": 1.0,
    "first_k_dense_replace": 1,
    "num_hidden_layers": 46,
    "use_qk_norm": False,
}


@pytest.mark.parametrize(
    "recipe,hf_config,billions", [("glm-4.5", GLM_4_5, (350, 360)), ("glm-4.5-air", GLM_4_5_AIR, (105, 111))]
)
def test_real_size_recipes(recipe, hf_config, billions):
    """The recipes build what the Hub config.json describes, with transformers' parameter count plus the MTP layer."""
    check_real_size_recipe(recipe, hf_config)
    ours = load_config(recipe).validate()
    ref = family.config_from_hf(hf_config)
    for f in ("partial_rotary_factor", "mtp_num_layers", "head_dim"):
        assert getattr(ours.model, f) == getattr(ref.model, f), f
    with torch.device("meta"):
        model = MoETransformer(ours)
        total, _ = model.num_params()
        hf_cfg = {k: v for k, v in hf_config.items() if k not in ("architectures", "model_type")}
        hf_total = sum(p.numel() for p in AutoModelForCausalLM.from_config(Glm4MoeConfig(**hf_cfg)).parameters())
    assert total - sum(p.numel() for p in model.mtp.parameters()) == hf_total  # transformers has no MTP layer
    assert billions[0] * 1e9 < total < billions[1] * 1e9, total


def test_tiny_recipe_exports_and_trains(tmp_path):
    check_tiny_recipe_exports("tiny-glm4-moe", "glm4_moe")
    tiny_recipe_trains("tiny-glm4-moe", tmp_path, extra=("model.num_layers=2", "model.hidden_size=64"))
