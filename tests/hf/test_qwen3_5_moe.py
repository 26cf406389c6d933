"""Qwen3.5-MoE against transformers: the Qwen3-Next maths with four DeltaNet input projections, every layer MoE,
multimodal RoPE fields; import / export of text checkpoints, the language model of a multimodal checkpoint, one
training step (every gradient), refusals. Tiny random models, fp32, tolerance 1e-4 * max(1, max |reference|)."""

from __future__ import annotations

import json

import pytest
import torch

from moecore.config import load_config
from moecore.hf import load_pretrained, save_pretrained
from moecore.hf.families import get_family
from moecore.hf.families import qwen3_5_moe as family

transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "Qwen3_5MoeTextConfig"):
    pytest.skip("this transformers has no Qwen3.5-MoE", allow_module_level=True)
from hf_parity import assert_close, build_hf, import_export_parity, tokens, train_step_parity  # noqa: E402

VOCAB = 97
LAYER_TYPES = ["linear_attention", "linear_attention", "full_attention", "linear_attention"]
TEXT = dict(
    vocab_size=VOCAB, hidden_size=64, num_hidden_layers=4, layer_types=LAYER_TYPES, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
    linear_value_head_dim=8, linear_conv_kernel_dim=4, num_experts=6, num_experts_per_tok=2, moe_intermediate_size=24,
    shared_expert_intermediate_size=40, max_position_embeddings=256, tie_word_embeddings=False,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
                     "mrope_section": [1, 1, 0], "mrope_interleaved": True},
)  # fmt: skip


def _text_config(**over) -> transformers.Qwen3_5MoeTextConfig:
    return transformers.Qwen3_5MoeTextConfig(**{**TEXT, **over})


def test_import_export_text_checkpoint(tmp_path):
    """Logits after import and after export (transformers loads it back as Qwen3_5MoeForCausalLM); the four DeltaNet
    projections travel through our two and back; a sequence longer than a DeltaNet chunk."""
    ref = build_hf(_text_config())
    ours, out = import_export_parity(ref, tmp_path)
    m, e = ours.cfg.model, ours.cfg.moe
    assert m.family == "qwen3_5_moe_text" and m.layer_types == LAYER_TYPES and m.partial_rotary_factor == 0.25
    assert m.norm_zero_centered and m.attn_output_gate and e.norm_topk_prob and e.shared_expert_gate
    assert all(layer.is_moe for layer in ours.layers)
    written = json.loads((out / "config.json").read_text())
    assert written["model_type"] == "qwen3_5_moe_text" and written["architectures"] == ["Qwen3_5MoeForCausalLM"]
    assert "norm_topk_prob" not in written and "decoder_sparse_step" not in written
    ids = tokens(VOCAB, seq=80, seed=4)
    with torch.no_grad():
        assert_close(ours(ids).logits, ref(ids).logits)
    # the exported projections are transformers' own tensors, bit for bit
    from safetensors.torch import load_file

    saved = {}
    for f in sorted(out.glob("*.safetensors")):
        saved.update(load_file(f))
    for name, p in ref.state_dict().items():
        if "linear_attn.in_proj" in name:
            assert torch.equal(saved[name], p), name


def test_deltanet_projection_layout_round_trips():
    """combine and split are inverse permutations of rows, and combine groups rows per key head."""
    cfg = family.config_from_hf(_text_config().to_dict())
    maps = {mp.ours: mp for mp in family.tensor_maps(cfg, None)}
    qkvz, ba = maps["layers.0.attn.in_proj_qkvz.weight"], maps["layers.0.attn.in_proj_ba.weight"]
    nk, dk, nv, dv = 2, 16, 4, 8
    qkv = torch.arange((2 * nk * dk + nv * dv) * 3, dtype=torch.float32).view(-1, 3)
    z = -torch.arange(nv * dv * 3, dtype=torch.float32).view(-1, 3) - 1
    ours = qkvz.combine([qkv, z])
    assert [torch.equal(a, b) for a, b in zip(qkvz.split(ours), [qkv, z])] == [True, True]
    head1 = ours.view(nk, -1, 3)[1]  # q, k, v, z of key head 1: rows 16.., 48.., 64 + 16.., z rows 16..
    assert torch.equal(head1[:dk], qkv[dk : 2 * dk]) and torch.equal(
        head1[dk : 2 * dk], qkv[nk * dk + dk : 2 * nk * dk]
    )
    assert torch.equal(head1[2 * dk : 2 * dk + 2 * dv], qkv[2 * nk * dk + 2 * dv :])
    assert torch.equal(head1[2 * dk + 2 * dv :], z[2 * dv :])
    b, a = torch.randn(nv, 3), torch.randn(nv, 3)
    assert [torch.equal(x, y) for x, y in zip(ba.split(ba.combine([b, a])), [b, a])] == [True, True]


def test_train_step(tmp_path):
    """LM loss, aux loss and every gradient (the combined DeltaNet projections' too) against transformers."""
    ref = build_hf(_text_config(num_hidden_layers=2, layer_types=["linear_attention", "full_attention"],
                                router_aux_loss_coef=0.3))  # fmt: skip
    ref.save_pretrained(tmp_path)
    train_step_parity(load_pretrained(tmp_path), ref)


def test_multimodal_checkpoint_imports_its_language_model(tmp_path):
    """A Qwen3_5MoeForConditionalGeneration checkpoint (text_config, model.language_model.*, model.visual.*): ours
    is its language model, with the text-only logits of transformers' multimodal model; it exports as text."""
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=4,
                  spatial_merge_size=1, temporal_patch_size=1, num_position_embeddings=16)  # fmt: skip
    config = transformers.Qwen3_5MoeConfig(text_config=TEXT, vision_config=vision)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    ref = transformers.Qwen3_5MoeForConditionalGeneration(config).eval()
    from hf_parity import randomize

    randomize(ref)
    ref.save_pretrained(tmp_path / "mm")
    names = set()
    from safetensors import safe_open

    for f in (tmp_path / "mm").glob("*.safetensors"):
        with safe_open(f, "pt") as fh:
            names |= set(fh.keys())
    assert any(n.startswith("model.visual.") for n in names) and any(
        n.startswith("model.language_model.") for n in names
    )
    with pytest.warns(UserWarning, match="vision encoder"):
        ours = load_pretrained(tmp_path / "mm")
    assert ours.cfg.model.family == "qwen3_5_moe_text"
    ids = tokens(VOCAB)
    with torch.no_grad():
        assert_close(ours(ids).logits, ref(input_ids=ids).logits)
        save_pretrained(ours, tmp_path / "text")
        back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "text", attn_implementation="eager")
        assert_close(back.eval()(ids).logits, ref(input_ids=ids).logits, "exported logits")


def test_refusals():
    cfg = family.config_from_hf(_text_config().to_dict())
    cfg.moe.norm_topk_prob = False
    with pytest.raises(ValueError, match="moe.norm_topk_prob"):
        family.config_to_hf(cfg)
    cfg = family.config_from_hf(_text_config().to_dict())
    cfg.moe.layer_freq = 2
    with pytest.raises(ValueError, match="moe.layer_freq"):
        family.config_to_hf(cfg)
    bad = _text_config().to_dict()
    bad["rope_parameters"] = {**bad["rope_parameters"], "mrope_section": "11,11,10"}
    with pytest.raises(ValueError, match="mrope_section"):
        family.config_from_hf(bad)
    with pytest.raises(ValueError, match="text_config"):
        family.config_from_hf({"model_type": "qwen3_5_moe", "text_config": None})
    with pytest.raises(ValueError, match="attn_output_gate"):
        family.config_from_hf({**_text_config().to_dict(), "attn_output_gate": False})


def test_hub_style_multimodal_config():
    """The fields a published multimodal config.json carries around and inside its text_config import."""
    text = {
        **_text_config().to_dict(),
        "attn_output_gate": True,
        "full_attention_interval": 4,
        "dtype": "bfloat16",
        "mtp_num_hidden_layers": 1,
        "mtp_use_dedicated_embeddings": False,
        "eos_token_id": 5,
        "pad_token_id": 5,
    }
    hub = {"architectures": ["Qwen3_5MoeForConditionalGeneration"], "model_type": "qwen3_5_moe", "image_token_id": 1,
           "video_token_id": 2, "vision_start_token_id": 3, "vision_end_token_id": 4, "tie_word_embeddings": False,
           "text_config": text, "vision_config": {"depth": 1}}  # fmt: skip
    cfg = family.config_from_hf(hub, available=set())  # no mtp.* tensors: imported without MTP
    assert cfg.model.family == "qwen3_5_moe_text" and cfg.model.mtp_num_layers == 0
    assert cfg.model.layer_types == LAYER_TYPES and cfg.moe.num_experts == 6


def test_the_multimodal_model_type_is_import_only():
    from moecore.hf.families import export_order, family_names

    assert get_family("qwen3_5_moe") is family and "qwen3_5_moe" not in family_names()
    assert export_order()[-1] == "qwen3_5_moe_text"
    from moecore.hf.pretrained import pick_family

    cfg = load_config("tiny-qwen3-next")
    cfg.model.family = "moecore"  # a config both could write: Qwen3-Next's layout comes first
    assert pick_family(cfg) == "qwen3_next"


# Qwen3.5-35B-A3B's language model: transformers' Qwen3_5MoeTextConfig defaults (documented there as that model's
# configuration) with the published RoPE base (10^7) and context (262,144 tokens).
QWEN3_5_35B_A3B = {
    **{k: v for k, v in transformers.Qwen3_5MoeTextConfig().to_dict().items() if k not in ("rope_parameters",)},
    "model_type": "qwen3_5_moe_text",
    "max_position_embeddings": 262144,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25,
                        "mrope_section": [11, 11, 10], "mrope_interleaved": True},
}  # fmt: skip


def test_real_size_recipe_is_the_published_model():
    from hf_parity import check_real_size_recipe

    from moecore.models.transformer import MoETransformer

    check_real_size_recipe("qwen3.5-35b-a3b", QWEN3_5_35B_A3B)
    ours = load_config("qwen3.5-35b-a3b").validate()
    assert ours.model.layer_types == ["linear_attention"] * 3 + ["full_attention"] + ours.model.layer_types[4:]
    with torch.device("meta"):
        total, _ = MoETransformer(ours).num_params()
        hf_cfg = transformers.Qwen3_5MoeTextConfig(
            **{k: v for k, v in QWEN3_5_35B_A3B.items() if k not in ("model_type", "architectures")}
        )
        hf_total = sum(p.numel() for p in transformers.Qwen3_5MoeForCausalLM(hf_cfg).parameters())
    assert total == hf_total, (total, hf_total)
    assert 34e9 < total < 36e9


def test_tiny_recipe_exports():
    from hf_parity import check_tiny_recipe_exports

    check_tiny_recipe_exports("tiny-qwen3.5-moe", "qwen3_5_moe_text")


def test_block_fp8_checkpoint_imports_dequantized(tmp_path):
    """A block-wise FP8 checkpoint (Qwen publishes Qwen3.5 so): the four DeltaNet projections are dequantized before
    they are combined, like every other weight; logits equal transformers' with its own dequantized weights."""
    try:
        from transformers.integrations.finegrained_fp8 import _dequantize_fp8_weight
    except ImportError:
        pytest.skip("this transformers has no _dequantize_fp8_weight to compare against")
    from safetensors.torch import load_file, save_file

    block = [8, 16]
    ref = build_hf(_text_config(num_hidden_layers=2, layer_types=["linear_attention", "full_attention"]))
    src = tmp_path / "fp8"
    ref.save_pretrained(src)
    tensors = load_file(src / "model.safetensors")
    params = dict(ref.named_parameters())
    quantized = [n for n, t in tensors.items() if t.dim() == 2 and "proj" in n and n in params]
    assert any("in_proj_qkv" in n for n in quantized) and any("in_proj_a" in n for n in quantized)
    for name in quantized:
        w = tensors[name]
        rows, cols = -(-w.shape[0] // block[0]), -(-w.shape[1] // block[1])
        amax = torch.nn.functional.pad(w.abs(), (0, cols * block[1] - w.shape[1], 0, rows * block[0] - w.shape[0]))
        scale = amax.view(rows, block[0], cols, block[1]).amax((1, 3)).clamp(min=1e-12) / 448.0
        full = scale.repeat_interleave(block[0], 0)[: w.shape[0]].repeat_interleave(block[1], 1)[:, : w.shape[1]]
        q = (w / full).to(torch.float8_e4m3fn)
        tensors[name], tensors[name + "_scale_inv"] = q, scale
        with torch.no_grad():
            params[name].copy_(_dequantize_fp8_weight(q, scale, block, torch.float32))
    save_file(tensors, src / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": block}
    (src / "config.json").write_text(json.dumps(config))
    ours = load_pretrained(src)
    ids = tokens(VOCAB)
    with torch.no_grad():
        assert_close(ours(ids).logits, ref(ids).logits, "logits of the dequantized import")
