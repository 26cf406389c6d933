"""gpt-oss against transformers: attention sinks on sliding and full layers, biased experts with the clamped
SwiGLU, the biased softmax-after-top-k router; import/export, one training step, the recipes, a CPU
training run; the sink attention and the biased experts against their references."""

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
from lm_parity import aux_loss_parity, lm_train_step_parity, tiny_recipe_trains  # noqa: E402
from transformers import AutoModelForCausalLM, GptOssConfig  # noqa: E402
from transformers.models.gpt_oss import modeling_gpt_oss as hf_oss  # noqa: E402

from moecore.config import load_config  # noqa: E402
from moecore.hf import load_pretrained  # noqa: E402
from moecore.hf.families import gpt_oss as family  # noqa: E402
from moecore.models.biased_moe import BiasedGroupedExperts  # noqa: E402
from moecore.models.sinks import sink_attention_reference  # noqa: E402
from moecore.models.transformer import MoETransformer  # noqa: E402

V = 96
YARN = {
    "rope_type": "yarn",
    "rope_theta": 150000.0,
    "factor": 4.0,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "truncate": False,
    "original_max_position_embeddings": 16,
}


def oss_config(**over) -> GptOssConfig:
    fields = dict(
        vocab_size=V,
        hidden_size=32,
        intermediate_size=24,
        head_dim=8,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=6,
        num_experts_per_tok=2,
        sliding_window=5,  # shorter than the test sequences: the window matters
        max_position_embeddings=128,
        rope_parameters=YARN,
        swiglu_limit=1.5,  # reached by the random pre-activations: the clamps matter
        router_aux_loss_coef=0.02,
    )
    return GptOssConfig(**{**fields, **over})


def test_sink_attention_reference_matches_transformers_eager():
    """Our reference against transformers' eager gpt-oss attention core with non-zero sinks, with and without
    a window, grouped-query heads."""
    g = torch.Generator().manual_seed(0)
    b, h, kv, s, d = 2, 4, 2, 11, 8
    q, k, v = (torch.randn(b, n, s, d, generator=g) for n in (h, kv, kv))
    sinks = torch.randn(h, generator=g) * 2

    class Mod(torch.nn.Module):
        num_key_value_groups = h // kv
        training = False

    mod = Mod()
    mod.sinks = sinks
    for window in (None, 4):
        i, j = torch.arange(s)[:, None], torch.arange(s)[None, :]
        keep = (j <= i) & ((j > i - window) if window else True)
        mask = torch.zeros(s, s).masked_fill(~keep, float("-inf"))[None, None]
        ref, _ = hf_oss.eager_attention_forward(mod, q, k, v, mask, scaling=d**-0.5)
        ours = sink_attention_reference(q, k, v, sinks, window, d**-0.5).transpose(1, 2)
        assert_close(ours, ref, f"sink attention (window={window})")


def test_biased_experts_match_transformers():
    """BiasedGroupedExperts (loop and grouped_mm paths) against GptOssExperts with the same weights."""
    cfg = oss_config()
    ref = hf_oss.GptOssExperts(cfg)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in ref.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    e, f = cfg.num_local_experts, cfg.intermediate_size
    x = torch.randn(10, cfg.hidden_size, generator=g)
    idx = torch.randint(0, e, (10, 2), generator=g)
    w = torch.rand(10, 2, generator=g)
    want = ref(x, idx, w)
    for grouped in (False, True):
        ours = BiasedGroupedExperts(
            e, cfg.hidden_size, f, "swiglu_clamped", cfg.swiglu_alpha, cfg.swiglu_limit, grouped_gemm=grouped
        )
        maps = family.expert_maps("m", "m", e, cfg.hidden_size, f)[2:]
        with torch.no_grad():
            for mp, src in zip(maps, (ref.gate_up_proj, ref.gate_up_proj_bias, ref.down_proj, ref.down_proj_bias)):
                getattr(ours, mp.ours.split(".")[-1]).copy_(src if mp.to_ours is None else mp.to_ours(src))
        order = idx.flatten().argsort(stable=True)
        counts = torch.bincount(idx.flatten(), minlength=e)
        rows = x.repeat_interleave(2, 0)[order]
        y = ours(rows, counts, None) * w.flatten()[order, None]
        got = torch.zeros_like(x).index_add(0, order // 2, y)
        assert_close(got, want, f"experts (grouped_gemm={grouped})")


def test_import_export(tmp_path):
    """Sliding and full layers (window 5 < sequence 12), sinks, biases everywhere, YaRN without truncation."""
    ref = build_hf(oss_config())
    assert ref.model.layers[0].self_attn.sinks.abs().min() > 0
    ours, out = import_export_parity(ref, tmp_path)
    m, e = ours.cfg.model, ours.cfg.moe
    assert m.layer_types == ["sliding_attention", "full_attention"] and m.sliding_window == 5
    assert m.attn_sinks and m.qkv_bias and m.attn_out_bias and m.activation == "swiglu_clamped"
    assert (e.router_pre_softmax, e.norm_topk_prob, e.ffn_hidden_size) == (False, True, 24)
    assert [layer.attn.window for layer in ours.layers] == [5, None]
    written = json.loads((out / "config.json").read_text())
    assert written["layer_types"] == ["sliding_attention", "full_attention"] and written["swiglu_limit"] == 1.5


def test_import_export_options(tmp_path):
    """Three layers full/sliding/sliding, tied embeddings, no attention biases, default RoPE, top-1."""
    cfg = oss_config(
        num_hidden_layers=3,
        layer_types=["full_attention", "sliding_attention", "sliding_attention"],
        tie_word_embeddings=True,
        attention_bias=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        num_experts_per_tok=1,
    )
    ours, _ = import_export_parity(build_hf(cfg), tmp_path)
    m = ours.cfg.model
    assert m.tie_embeddings and not m.qkv_bias and m.rope_scaling is None and ours.cfg.moe.router_topk == 1
    ids = tokens(V, seq=20, seed=6)  # longer than the window on the sliding layers
    back = AutoModelForCausalLM.from_pretrained(tmp_path / "exported", attn_implementation="eager").eval()
    with torch.no_grad():
        assert_close(ours(ids).logits, back(ids).logits)


def test_train_step(tmp_path):
    ref = build_hf(oss_config())
    ref.save_pretrained(tmp_path)
    ours = load_pretrained(tmp_path)
    lm_train_step_parity(ours, ref)
    aux_loss_parity(ours, ref)  # router logits with the router bias


@pytest.mark.parametrize("mode", ["minimal", "chunked"])
def test_train_step_low_memory_experts(tmp_path, mode):
    """The biased, clamped experts in moe.activation_memory=minimal / chunked (the biases added per row, the clamped
    form in the SwiGLU kernel, the bias gradients from the Functions' backward): one step's loss and every gradient
    against transformers, with the expert biases away from zero so that a dropped one shows."""
    ref = build_hf(oss_config())
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if name.endswith(("gate_up_proj_bias", "down_proj_bias")):
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(5)) * 0.5)
    ref.save_pretrained(tmp_path)
    ours = load_pretrained(tmp_path)
    ours.cfg.moe.activation_memory, ours.cfg.moe.activation_chunk_rows = mode, 5
    ours.cfg.validate()
    lm_train_step_parity(ours, ref)
    assert {m.experts.last_path for m in ours.moe_layers()} == {mode}


def test_refusals():
    base = oss_config().to_dict()
    for field, value in (("layer_types", ["linear_attention"] * 2), ("experts_per_token", 3)):
        with pytest.raises(ValueError, match=field):
            family.config_from_hf({**base, field: value})
    with pytest.raises(ValueError, match="quantization_config"):
        family.config_from_hf({**base, "quantization_config": {"quant_method": "fp8"}})
    cfg = load_config("tiny-gpt-oss")
    cfg.model.attn_sinks = False
    with pytest.raises(ValueError, match="model.attn_sinks"):
        family.config_to_hf(cfg)


# --------------------------------------------------------------------------------------------------
# Recipes (config.json values of openai/gpt-oss-20b and openai/gpt-oss-120b, without the MXFP4
# quantization_config of the original upload)
# --------------------------------------------------------------------------------------------------

_OSS_COMMON = {
    "architectures": ["GptOssForCausalLM"],
    "model_type": "gpt_oss",
    "attention_bias": True,
    "attention_dropout": 0.0,
    "eos_token_id": 200002,
    "experts_per_token": 4,
    "head_dim": 64,
    "hidden_act": "silu",
    "hidden_size": 2880,
    "initial_context_length": 4096,
    "initializer_range": 0.02,
    "intermediate_size": 2880,
    "max_position_embeddings": 131072,
    "num_attention_heads": 64,
    "num_experts_per_tok": 4,
    "num_key_value_heads": 8,
    "output_router_logits": False,
    "pad_token_id": 199999,
    "rms_norm_eps": 1e-05,
    "rope_scaling": {
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "factor": 32.0,
        "original_max_position_embeddings": 4096,
        "rope_type": "yarn",
        "truncate": False,
    },
    "rope_theta": 150000,
    "router_aux_loss_coef": 0.9,
    "sliding_window": 128,
    "swiglu_limit": 7.0,
    "tie_word_embeddings": False,
    "use_cache": True,
    "vocab_size": 201088,
}
GPT_OSS_20B = {
    **_OSS_COMMON,
    "num_hidden_layers": 24,
    "num_local_experts": 32,
    "layer_types": ["sliding_attention", "full_attention"] * 12,
}
GPT_OSS_120B = {
    **_OSS_COMMON,
    "num_hidden_layers": 36,
    "num_local_experts": 128,
    "layer_types": ["sliding_attention", "full_attention"] * 18,
}


@pytest.mark.parametrize(
    "recipe,hf_config,billions", [("gpt-oss-20b", GPT_OSS_20B, (20, 22)), ("gpt-oss-120b", GPT_OSS_120B, (116, 118))]
)
def test_real_size_recipes(recipe, hf_config, billions):
    check_real_size_recipe(recipe, hf_config)
    ours = load_config(recipe).validate()
    ref = family.config_from_hf(hf_config)
    for f in ("layer_types", "attn_sinks", "activation", "swiglu_alpha", "swiglu_limit", "rope_scaling"):
        assert getattr(ours.model, f) == getattr(ref.model, f), f
    with torch.device("meta"):
        total, _ = MoETransformer(ours).num_params()
        hf_cfg = {k: v for k, v in hf_config.items() if k not in ("architectures", "model_type")}
        hf_total = sum(p.numel() for p in AutoModelForCausalLM.from_config(GptOssConfig(**hf_cfg)).parameters())
    assert total == hf_total and billions[0] * 1e9 < total < billions[1] * 1e9, (total, hf_total)


def test_tiny_recipe_exports_and_trains(tmp_path):
    check_tiny_recipe_exports("tiny-gpt-oss", "gpt_oss")
    tiny_recipe_trains("tiny-gpt-oss", tmp_path, extra=("model.hidden_size=64",))


def test_mxfp4_checkpoint_imports_dequantized(tmp_path):
    """An MXFP4 checkpoint as OpenAI ships gpt-oss (expert matrices as uint8 blocks + e8m0 scales, the rest
    unquantized): our import dequantizes them to what transformers' own dequantizer gives; the logits match
    transformers' model holding those weights, and the export (unquantized) loads in transformers."""
    import json

    from safetensors.torch import load_file, save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from moecore.hf import save_pretrained

    cfg = oss_config(intermediate_size=32, swiglu_limit=7.0)
    ref = build_hf(cfg)
    e, h, f = cfg.num_local_experts, cfg.hidden_size, cfg.intermediate_size
    g = torch.Generator().manual_seed(11)
    quant = {}
    for i in range(cfg.num_hidden_layers):
        for name, rows, cols in (("gate_up_proj", 2 * f, h), ("down_proj", h, f)):
            blocks = torch.randint(0, 256, (e, rows, cols // 32, 16), generator=g, dtype=torch.uint8)
            scales = torch.randint(120, 125, (e, rows, cols // 32), generator=g, dtype=torch.uint8)
            quant[i, name] = (blocks, scales)
            dense = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)  # transformers' dequantizer
            with torch.no_grad():
                getattr(ref.model.layers[i].mlp.experts, name).copy_(dense)
    src = tmp_path / "mxfp4"
    ref.save_pretrained(src)
    tensors = load_file(src / "model.safetensors")
    for (i, name), (blocks, scales) in quant.items():
        prefix = f"model.layers.{i}.mlp.experts.{name}"
        del tensors[prefix]
        tensors[f"{prefix}_blocks"], tensors[f"{prefix}_scales"] = blocks, scales
    save_file(tensors, src / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn"]}
    (src / "config.json").write_text(json.dumps(config))

    ours = load_pretrained(src)
    ids = tokens(V, seq=12, seed=2)
    with torch.no_grad():
        assert_close(ours(ids).logits, ref(ids).logits, "logits of the dequantized import")
    out = save_pretrained(ours, tmp_path / "exported")
    assert "quantization_config" not in json.loads((out / "config.json").read_text())
    back = AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager").eval()
    with torch.no_grad():
        assert_close(back(ids).logits, ref(ids).logits, "exported logits")


def test_fp8_runs_the_biased_experts():
    """fp8.modules=[experts] on gpt-oss: apply_fp8 makes its biased, clamped experts FP8, and they run the FP8 expert
    FFN (emulated here) with their form and biases: output and every gradient within the FP8 expert bound
    (tests/kernels/test_fp8_gemm.py BOUND_EXPERTS) of the same module's grouped_mm path. (Compared per module: over
    a whole model FP8's rounding flips near-tied top-k choices of later layers at initialisation, which moves
    whole rows of the gradients.)"""
    from moecore.kernels.fp8_gemm import Fp8Recipe
    from moecore.models.fp8 import apply_fp8
    from moecore.models.transformer import MoETransformer

    cfg = load_config("tiny-gpt-oss", ["model.vocab_size=96"])
    report = apply_fp8(MoETransformer(cfg), Fp8Recipe("rowwise", emulate=True), ["experts"])
    assert report["bf16"] == [] and len(report["fp8"]) == cfg.model.num_layers
    E, H, F = 4, 128, 64
    mod = BiasedGroupedExperts(E, H, F, "swiglu_clamped", 1.702, 2.0, init_std=0.05)
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        mod.b13.normal_(0, 0.5, generator=g)
        mod.b2.normal_(0, 0.5, generator=g)
    counts = torch.tensor([9, 0, 20, 11])
    x, probs, dy = torch.randn(40, H, generator=g), torch.rand(40, generator=g), torch.randn(40, H, generator=g)
    runs = []
    for recipe in (None, Fp8Recipe("rowwise", emulate=True)):
        mod.fp8_recipe = recipe
        mod.zero_grad()
        xi, pi = x.clone().requires_grad_(), probs.clone().requires_grad_()
        y = mod(xi, counts, pi)
        y.backward(dy)
        assert mod.last_path == ("grouped_mm" if recipe is None else "fp8")
        runs.append([y.detach(), xi.grad, pi.grad] + [p.grad.clone() for p in (mod.w13, mod.w2, mod.b13, mod.b2)])
    for name, got, want in zip(("y", "x", "probs", "w13", "w2", "b13", "b2"), *reversed(runs)):
        err = ((got - want).norm() / want.norm()).item()
        assert err < 0.09, (name, err)


def test_fused_branch_wiring_matches_grouped_mm(monkeypatch):
    """The experts' GPU branch (the fused expert FFN with the biases and the clamped form; here its reference, on
    the CPU) gives the grouped_mm path's loss and gradients: the limit, alpha and both biases reach it."""
    from moecore.models import biased_moe
    from moecore.models.transformer import MoETransformer

    cfg = load_config("tiny-gpt-oss", ["model.vocab_size=96"])
    torch.manual_seed(0)
    model = MoETransformer(cfg).train()
    with torch.no_grad():  # biases away from zero, so that a dropped one shows
        for name, p in model.named_parameters():
            if name.endswith(("experts.b13", "experts.b2")):
                p.normal_(0, 0.5)
    ids = torch.randint(0, 96, (2, 17), generator=torch.Generator().manual_seed(1))
    results = []
    for fused in (False, True):
        monkeypatch.setattr(biased_moe, "fused_expert_ffn_available", lambda x, f=fused: f)
        model.zero_grad()
        out = model(ids[:, :-1], labels=ids[:, 1:])
        out.lm_loss_sum.backward()
        paths = {m.experts.last_path for m in model.moe_layers()}
        assert paths == ({"fused"} if fused else {"grouped_mm"}), paths
        results.append((out.lm_loss_sum.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    (l0, g0), (l1, g1) = results
    torch.testing.assert_close(l1, l0, rtol=1e-6, atol=0)
    for n in g0:
        torch.testing.assert_close(g1[n], g0[n], rtol=1e-5, atol=1e-6 * g0[n].abs().max().item(), msg=n)


def test_biased_experts_refuse_other_activations():
    """Biased experts are gpt-oss's (BiasedGroupedExperts: plain or clamped SwiGLU); the clipped or GeLU forms with
    biases would silently run the plain SwiGLU, so the config refuses them."""
    from moecore.config import ConfigError

    for activation in ("swiglu_clipped", "gelu"):
        with pytest.raises(ConfigError, match="model.expert_linear_bias"):
            load_config("tiny-gpt-oss", [f"model.activation={activation}"]).validate()
