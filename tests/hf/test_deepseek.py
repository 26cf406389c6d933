"""DeepSeek-V2 / V3 import and export against tiny random transformers models.

Each case saves a transformers model, imports it with `moecore.hf.load_pretrained`, compares fp32
logits (max abs diff <= 1e-4 * max(1, max |logit|)), exports it with `save_pretrained`, loads the
export with transformers and compares again. V3 checkpoints also carry an MTP layer (which
transformers' DeepseekV3ForCausalLM skips): its loss is checked against transformers' MtpLayer built
from the same tensors, and the export must give back every tensor of the checkpoint unchanged.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from moecore.hf import load_pretrained, save_pretrained
from moecore.hf.families import get_family

transformers = pytest.importorskip("transformers")
from transformers.modeling_layers import MtpLayer  # noqa: E402
from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hf_v3  # noqa: E402

V, H, L, S = 128, 48, 3, 24
SHAPE = dict(
    vocab_size=V,
    hidden_size=H,
    intermediate_size=96,
    moe_intermediate_size=32,
    num_hidden_layers=L,
    num_attention_heads=4,
    num_key_value_heads=4,
    kv_lora_rank=16,
    qk_nope_head_dim=12,
    qk_rope_head_dim=8,
    v_head_dim=10,
    n_routed_experts=8,
    num_experts_per_tok=2,
    first_k_dense_replace=1,
    max_position_embeddings=256,
)
YARN = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 4.0,
    "original_max_position_embeddings": 64,
    "mscale": 1.0,
    "mscale_all_dim": 0.8,
    "beta_fast": 32,
    "beta_slow": 1,
}
DEFAULT_ROPE = {"rope_type": "default", "rope_theta": 10000.0}


def _close(ours: torch.Tensor, ref: torch.Tensor) -> None:
    tol = 1e-4 * max(1.0, ref.abs().max().item())
    err = (ours - ref).abs().max().item()
    assert err <= tol, f"max abs diff {err:.3g} > {tol:.3g}"


def _randomize(model: torch.nn.Module, seed: int) -> None:
    """Random weights everywhere (norms around 1), a non-zero score-correction bias on V3 routers."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            noise = torch.randn(p.shape, generator=g) * 0.1
            p.copy_(noise + 1.0 if p.dim() == 1 else noise)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn(b.shape, generator=g) * 0.05)


def _save_random(model_class, cfg, tmp_path):
    """A randomised transformers model of `cfg` (eager attention), saved to tmp_path/hf."""
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    ref = model_class(cfg).eval()
    _randomize(ref, 1)
    ref.save_pretrained(tmp_path / "hf")
    return ref


def _v2(tmp_path, q_lora_rank, topk_method, rope, **over):
    grouped = topk_method == "group_limited_greedy"
    cfg = transformers.DeepseekV2Config(
        **{**SHAPE, **over},
        q_lora_rank=q_lora_rank,
        n_shared_experts=2,
        topk_method=topk_method,
        n_group=4 if grouped else None,
        topk_group=2 if grouped else None,
        routed_scaling_factor=2.0,
        rope_parameters=rope,
    )
    return _save_random(transformers.DeepseekV2ForCausalLM, cfg, tmp_path)


def _v3(tmp_path, rope, mtp_layers=1, rope_interleave=True, norm_topk_prob=True):
    cfg = transformers.DeepseekV3Config(
        **SHAPE,
        q_lora_rank=24,
        n_shared_experts=1,
        n_group=4,
        topk_group=2,
        routed_scaling_factor=2.5,
        norm_topk_prob=norm_topk_prob,
        rope_interleave=rope_interleave,
        rope_parameters=rope,
        num_mtp_layers=mtp_layers,
    )
    return _save_random(transformers.DeepseekV3ForCausalLM, cfg, tmp_path)


def _add_mtp_layers(ref, folder, count: int) -> torch.nn.ModuleList:
    """Write `count` MTP layers into the checkpoint as DeepSeek stores them; return transformers' MtpLayers."""
    mtp_cfg = ref.config.get_mtp_config()
    mtp_cfg._attn_implementation = "eager"
    layers = torch.nn.ModuleList(
        MtpLayer(mtp_cfg, hf_v3.DeepseekV3DecoderLayer, hf_v3.DeepseekV3RMSNorm, k) for k in range(count)
    ).eval()
    _randomize(layers, 2)
    tensors = load_file(folder / "model.safetensors")
    for k, layer in enumerate(layers):
        prefix = f"model.layers.{L + k}"
        for name, t in layer.state_dict().items():
            name = name.replace("mtp_block.", "").replace("post_norm.", "shared_head.norm.")
            if name.endswith("experts.gate_up_proj"):  # checkpoints store one tensor per expert
                f = t.shape[1] // 2
                for j in range(t.shape[0]):
                    tensors[f"{prefix}.mlp.experts.{j}.gate_proj.weight"] = t[j, :f].clone()
                    tensors[f"{prefix}.mlp.experts.{j}.up_proj.weight"] = t[j, f:].clone()
            elif name.endswith("experts.down_proj"):
                for j in range(t.shape[0]):
                    tensors[f"{prefix}.mlp.experts.{j}.down_proj.weight"] = t[j].clone()
            else:
                tensors[f"{prefix}.{name}"] = t.clone()
        tensors[f"{prefix}.embed_tokens.weight"] = tensors["model.embed_tokens.weight"].clone()
        tensors[f"{prefix}.shared_head.head.weight"] = tensors["lm_head.weight"].clone()
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    return layers


def _reference_mtp_losses(ref, layers, tokens: torch.Tensor) -> list[torch.Tensor]:
    """Depth k on the first S-k positions (no rolling): embeddings of tokens k.., targets tokens k+1.."""
    h = ref.model(tokens[:, :S]).last_hidden_state
    losses = []
    for k, layer in enumerate(layers, start=1):
        n = S - k
        emb = ref.model.embed_tokens(tokens[:, k : k + n])
        pos = torch.arange(n)[None]
        causal = torch.full((n, n), float("-inf")).triu(1)[None, None]
        pe = ref.model.rotary_emb(emb, pos)
        h = layer(emb, h[:, :n], pe, attention_mask=causal, position_ids=pos, cache=None)
        losses.append(F.cross_entropy(ref.lm_head(h).flatten(0, 1), tokens[:, k + 1 : k + 1 + n].flatten()))
    return losses


def _roundtrip(ref, ours, tmp_path, ids) -> None:
    """Export ours, load it with transformers, compare logits with the reference."""
    out = save_pretrained(ours, tmp_path / "export")
    again = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert type(again) is type(ref)
    with torch.no_grad():
        _close(again(ids).logits, ref(ids).logits)


# Top-3 of 8 experts in 4 groups, 2 groups kept: the third expert is often outside the best two groups.
V2_CASES = {
    "lite-plain-q-greedy": (None, "greedy", DEFAULT_ROPE, {}),
    "q-lora-group-limited-yarn": (24, "group_limited_greedy", YARN, {"num_experts_per_tok": 3}),
}


@pytest.mark.parametrize("case", list(V2_CASES))
def test_deepseek_v2_import_export(tmp_path, case):
    q_lora_rank, method, rope, over = V2_CASES[case]
    ref = _v2(tmp_path, q_lora_rank, method, rope, **over)
    ours = load_pretrained(tmp_path / "hf")
    assert ours.cfg.model.q_lora_rank == q_lora_rank
    assert ours.cfg.moe.router_num_groups == (4 if method == "group_limited_greedy" else None)
    ids = torch.randint(0, V, (2, S), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        _close(ours(ids).logits, ref(ids).logits)
    _roundtrip(ref, ours, tmp_path, ids)


def test_deepseek_v3_with_mtp_import_export(tmp_path):
    ref = _v3(tmp_path, YARN, mtp_layers=1)
    layers = _add_mtp_layers(ref, tmp_path / "hf", 1)
    ours = load_pretrained(tmp_path / "hf")
    m, e = ours.cfg.model, ours.cfg.moe
    assert (m.mtp_num_layers, e.router_score_function, e.router_group_score) == (1, "sigmoid", "top2_sum")
    bias = ref.model.layers[1].mlp.gate.e_score_correction_bias
    assert bias.abs().max() > 0
    torch.testing.assert_close(ours.layers[1].mlp.router.expert_bias, bias, rtol=0, atol=0)
    tokens = torch.randint(0, V, (2, S + 1), generator=torch.Generator().manual_seed(3))
    ids = tokens[:, :S]
    out = ours(ids, labels=tokens[:, 1:])
    with torch.no_grad():
        _close(out.logits, ref(ids).logits)
        want = _reference_mtp_losses(ref, layers, tokens)
    torch.testing.assert_close(out.mtp_losses[0], want[0], rtol=1e-5, atol=1e-5)

    _roundtrip(ref, ours, tmp_path, ids)
    # MTP weights (and every other tensor) survive import + export unchanged.
    before, after = (
        load_file(tmp_path / "hf" / "model.safetensors"),
        load_file(tmp_path / "export" / "model.safetensors"),
    )
    assert sorted(before) == sorted(after)
    for name, t in before.items():
        assert torch.equal(after[name], t), name


def test_deepseek_v3_loss_and_gradients_match_transformers(tmp_path):
    ref = _v3(tmp_path, YARN, mtp_layers=0, rope_interleave=False, norm_topk_prob=False)
    ours = load_pretrained(tmp_path / "hf").train()
    ref.train()
    tokens = torch.randint(0, V, (2, S), generator=torch.Generator().manual_seed(4))
    ref_loss = ref(tokens, labels=tokens).loss  # transformers shifts the labels itself
    labels = torch.roll(tokens, -1, dims=1)
    mask = torch.ones(2, S)
    mask[:, -1] = 0
    ours_loss = ours(tokens, labels=labels, loss_mask=mask).lm_loss
    torch.testing.assert_close(ours_loss, ref_loss, rtol=1e-5, atol=1e-5)
    ref_loss.backward()
    ours_loss.backward()
    ref_params = dict(ref.named_parameters())
    maps = get_family("deepseek_v3").tensor_maps(ours.cfg, set(ref.state_dict()))
    ours_params = dict(ours.named_parameters())
    checked = 0
    for mp in maps:
        if mp.ours not in ours_params:  # buffers (expert bias)
            continue
        (name,) = mp.hf_names()
        g, want = ours_params[mp.ours].grad, ref_params[name].grad
        tol = 1e-4 * max(1.0, want.abs().max().item())
        assert (g - want).abs().max().item() <= tol, mp.ours
        checked += 1
    assert checked == len(ours_params)


def test_deepseek_v3_without_mtp_tensors_imports_without_mtp(tmp_path):
    # transformers' save_pretrained announces num_nextn_predict_layers=1 but writes no MTP tensors.
    ref = _v3(tmp_path, DEFAULT_ROPE, mtp_layers=1)
    ours = load_pretrained(tmp_path / "hf")
    assert ours.cfg.model.mtp_num_layers == 0 and ours.mtp is None
    ids = torch.randint(0, V, (2, S), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        _close(ours(ids).logits, ref(ids).logits)


def test_config_errors_name_the_field():
    fam = get_family("deepseek_v2")
    base = transformers.DeepseekV2Config(**SHAPE, q_lora_rank=None).to_dict()
    for field, value in (("norm_topk_prob", True), ("topk_method", "noaux_tc"), ("num_key_value_heads", 2)):
        bad = copy.deepcopy(base)
        bad[field] = value
        with pytest.raises(ValueError, match=field):
            fam.config_from_hf(bad)
