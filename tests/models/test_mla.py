"""Multi-latent attention against transformers' DeepseekV2/V3 attention modules with copied weights."""

from __future__ import annotations

import pytest
import torch

from moecore.config import ModelConfig
from moecore.models.mla import MLAttention, mla_softmax_scale

transformers = pytest.importorskip("transformers")
from transformers.models.deepseek_v2 import modeling_deepseek_v2 as hf_v2  # noqa: E402
from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hf_v3  # noqa: E402

HIDDEN, HEADS, KV_RANK, NOPE, ROPE, V = 64, 4, 16, 16, 8, 12
YARN = {
    "type": "yarn",
    "factor": 4.0,
    "original_max_position_embeddings": 32,
    "mscale": 1.0,
    "mscale_all_dim": 0.8,
    "beta_fast": 32,
    "beta_slow": 1,
}


def _configs(version: int, q_lora_rank: int | None, rope_scaling: dict | None, interleave: bool = True):
    """Our ModelConfig and the matching transformers config."""
    ours = ModelConfig(
        hidden_size=HIDDEN,
        num_attention_heads=HEADS,
        num_kv_heads=HEADS,
        attention_type="mla",
        q_lora_rank=q_lora_rank,
        kv_lora_rank=KV_RANK,
        qk_nope_head_dim=NOPE,
        qk_rope_head_dim=ROPE,
        v_head_dim=V,
        rope_theta=10000.0,
        rope_scaling=rope_scaling,
        rope_interleave=interleave,
        max_position_embeddings=128,
    )
    ours.validate()
    rope = {"rope_type": "default", "rope_theta": 10000.0}
    if rope_scaling:
        rope = {k: v for k, v in rope_scaling.items() if k != "type"} | {"rope_type": "yarn", "rope_theta": 10000.0}
    common = dict(
        hidden_size=HIDDEN,
        num_attention_heads=HEADS,
        num_key_value_heads=HEADS,
        q_lora_rank=q_lora_rank,
        kv_lora_rank=KV_RANK,
        qk_nope_head_dim=NOPE,
        qk_rope_head_dim=ROPE,
        v_head_dim=V,
        max_position_embeddings=128,
        rope_parameters=rope,
        num_hidden_layers=1,
        vocab_size=32,
    )
    if version == 2:
        hf = transformers.DeepseekV2Config(**common)
    else:
        hf = transformers.DeepseekV3Config(rope_interleave=interleave, **common)
    hf._attn_implementation = "eager"
    return ours, hf


def _pair(version: int, q_lora_rank, rope_scaling, interleave=True, seed=0):
    ours_cfg, hf_cfg = _configs(version, q_lora_rank, rope_scaling, interleave)
    mod = hf_v2 if version == 2 else hf_v3
    cls = mod.DeepseekV2Attention if version == 2 else mod.DeepseekV3Attention
    rot_cls = mod.DeepseekV2RotaryEmbedding if version == 2 else mod.DeepseekV3RotaryEmbedding
    torch.manual_seed(seed)
    ref = cls(hf_cfg, layer_idx=0)
    with torch.no_grad():
        for p in ref.parameters():  # random norms too, so that their weights are exercised
            p.copy_(torch.randn_like(p) * 0.2 + (1.0 if p.dim() == 1 else 0.0))
    ours = MLAttention(ours_cfg, layer_idx=0)
    ours.load_state_dict(ref.state_dict(), strict=True)
    return ours, ref, rot_cls(hf_cfg)


def _ref_forward(ref, rotary, x, pos):
    s = x.shape[1]
    mask = torch.full((s, s), float("-inf")).triu(1)[None, None]
    pe = rotary(x, pos[None])
    return ref(hidden_states=x, position_embeddings=pe, attention_mask=mask)[0]


CASES = [
    (3, 24, YARN, True),  # V3: q LoRA, YaRN with mscale != mscale_all_dim, interleaved rope
    (3, None, None, True),  # V3 without q LoRA
    (3, 24, YARN, False),  # V3 checkpoint with half-split rope layout
    (2, None, None, True),  # V2-Lite style: plain q_proj
    (2, 24, YARN, True),  # V2: q LoRA + YaRN
]


@pytest.mark.parametrize("version,q_lora_rank,scaling,interleave", CASES)
def test_mla_matches_transformers(version, q_lora_rank, scaling, interleave):
    ours, ref, rotary = _pair(version, q_lora_rank, scaling, interleave)
    torch.manual_seed(1)
    x = torch.randn(2, 40, HIDDEN)
    pos = torch.arange(40) + 30  # crosses original_max_position_embeddings=32, where YaRN matters
    want = _ref_forward(ref, rotary, x, pos)
    got = ours(x, pos)
    assert got.shape == (2, 40, HIDDEN)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_mla_gradients_match_transformers():
    ours, ref, rotary = _pair(3, 24, YARN)
    x = torch.randn(2, 24, HIDDEN)
    pos = torch.arange(24)
    g = torch.randn(2, 24, HIDDEN)
    (_ref_forward(ref, rotary, x, pos) * g).sum().backward()
    (ours(x, pos) * g).sum().backward()
    ref_grads = dict(ref.named_parameters())
    for name, p in ours.named_parameters():
        torch.testing.assert_close(p.grad, ref_grads[name].grad, rtol=1e-4, atol=1e-5, msg=name)


def test_softmax_scale_includes_mscale_all_dim():
    # DeepSeek-V3's shipped values: factor 40, mscale = mscale_all_dim = 1, qk head dim 192.
    v3 = {"type": "yarn", "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096}
    m = 0.1 * torch.log(torch.tensor(40.0, dtype=torch.float64)).item() + 1.0
    assert mla_softmax_scale(192, v3) == pytest.approx(192**-0.5 * m * m, rel=1e-12)
    assert mla_softmax_scale(192, None) == pytest.approx(192**-0.5, rel=1e-12)
    assert mla_softmax_scale(192, {"type": "yarn", "factor": 40}) == pytest.approx(192**-0.5, rel=1e-12)


@pytest.mark.parametrize("modules", [["mla_up_proj"], ["mla_up_proj", "core_attn"], ["core_attn"]])
def test_recompute_gives_same_gradients_and_drops_qkv(modules):
    import copy
    import gc
    import weakref

    cfg, _ = _configs(3, 24, YARN)
    torch.manual_seed(0)
    plain = MLAttention(cfg, 0)
    cfg = copy.deepcopy(cfg)
    cfg.recompute_modules = modules
    recomputed = MLAttention(cfg, 0)
    recomputed.load_state_dict(plain.state_dict())
    x = torch.randn(2, 16, HIDDEN)
    pos = torch.arange(16)
    plain.train(), recomputed.train()
    plain(x, pos).square().sum().backward()
    kept = []  # weak references to the q, k, v of the recomputed module's forward
    real = recomputed._up_project

    def watched(*args):
        out = real(*args)
        if torch.is_grad_enabled():
            kept.extend(weakref.ref(t) for t in out)
        return out

    recomputed._up_project = watched
    y = recomputed(x, pos)
    gc.collect()
    alive = sum(r() is not None for r in kept)
    y.square().sum().backward()
    assert alive == (0 if "mla_up_proj" in modules else 3)
    for (name, a), b in zip(plain.named_parameters(), recomputed.parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=0, msg=name)
