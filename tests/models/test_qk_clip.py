"""QK-Clip (optim.muon_qk_clip): the recorded max logits against a hand computation, and the rescaling rule.

- `head_max_logits` equals the largest causal (and windowed) q_i . k_j * scale per head computed
  element by element in float64;
- an attention layer's recorded maximum equals the one computed by hand from its weights (q/k
  projections, RoPE, the softmax scale), for GQA, MHA and MLA;
- after `QKClip.apply` with tau below some heads' maxima, a second forward on the same input gives,
  per head, exactly min(old max, tau): clipped heads land on tau (Kimi K2's gamma = tau / S_max
  split as sqrt on q and k for MHA, on q alone for GQA, sqrt on the non-rotary q/k parts and gamma
  on the rotary q part for MLA), the others do not move; MLA's shared rotary key is not touched;
- config validation, and a Trainer run that logs attn/max_logit.
"""

from __future__ import annotations

import copy

import pytest
import torch

from moecore.config import Config, ConfigError
from moecore.models.attention import Attention
from moecore.models.mla import MLAttention
from moecore.models.qk_clip import QKClip, head_max_logits
from moecore.models.rope import apply_rotary


def _hand_max(q: torch.Tensor, k: torch.Tensor, scale: float, window=None) -> torch.Tensor:
    b, h, s, _ = q.shape
    rep = h // k.shape[1]
    out = torch.full((h,), float("-inf"), dtype=torch.float64)
    for hi in range(h):
        for bi in range(b):
            for i in range(s):
                for j in range(i + 1):
                    if window is not None and j <= i - window:
                        continue
                    v = float(q[bi, hi, i].double() @ k[bi, hi // rep, j].double()) * scale
                    out[hi] = max(out[hi], v)
    return out


@pytest.mark.parametrize("window", [None, 3])
def test_head_max_logits_matches_hand_computation(window):
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 4, 7, 5, generator=g), torch.randn(2, 2, 7, 5, generator=g)
    got = head_max_logits(q, k, 0.3, window)
    torch.testing.assert_close(got.double(), _hand_max(q, k, 0.3, window), rtol=1e-6, atol=1e-6)


def _cfg(kind: str) -> Config:
    cfg = Config()
    m = cfg.model
    m.vocab_size, m.hidden_size, m.num_attention_heads, m.init_std = 64, 32, 4, 0.3
    m.num_kv_heads = 4 if kind == "mha" else 2
    if kind == "mla":
        m.attention_type, m.q_lora_rank, m.kv_lora_rank = "mla", 16, 12
        m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim = 8, 4, 6
    return cfg


def _layer(kind: str):
    torch.manual_seed(0)
    cfg = _cfg(kind)
    layer = (MLAttention if kind == "mla" else Attention)(cfg.model, 0, None)
    for p in layer.parameters():  # large weights, so that some heads' logits are far above the others'
        if p.ndim == 2:
            torch.nn.init.normal_(p, std=0.5)
    return layer


def _gqa_hand(layer: Attention, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    b, s, _ = x.shape
    d = layer.head_dim
    q = (x @ layer.q_proj.weight.T).view(b, s, layer.num_heads, d).transpose(1, 2)
    k = (x @ layer.k_proj.weight.T).view(b, s, layer.num_kv_heads, d).transpose(1, 2)
    cos, sin = layer.rotary(pos, q.dtype)
    return _hand_max(apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), d**-0.5)


@pytest.mark.parametrize("kind", ["gqa", "mha", "mla"])
def test_recorded_max_and_clip_to_tau(kind):
    layer = _layer(kind)
    x = torch.randn(2, 6, 32, generator=torch.Generator().manual_seed(1))
    pos = torch.arange(6)
    clip = QKClip(layer, tau=1.0)
    with torch.no_grad():
        layer(x, pos)
    before = layer.qk_max.clone()
    if kind != "mla":
        torch.testing.assert_close(before.double(), _gqa_hand(layer, x, pos), rtol=1e-5, atol=1e-5)
    tau = float(before.sort().values[1])  # two heads are above, the others at or below
    clip.tau = tau
    rope_key = layer.kv_a_proj_with_mqa.weight.clone() if kind == "mla" else None
    v_rows = layer.v_proj.weight.clone() if kind != "mla" else None
    assert clip.apply() == pytest.approx(float(before.max()))
    assert clip.clipped_heads == int((before > tau).sum()) >= 2
    with torch.no_grad():
        layer(x, pos)
    torch.testing.assert_close(layer.qk_max, before.clamp(max=tau), rtol=2e-5, atol=1e-5)
    if kind == "mla":
        assert torch.equal(layer.kv_a_proj_with_mqa.weight, rope_key)  # the shared rotary key is not rescaled
    else:
        assert torch.equal(layer.v_proj.weight, v_rows)


def test_mla_recorded_max_matches_hand_computation():
    layer = _layer("mla")
    x = torch.randn(1, 5, 32, generator=torch.Generator().manual_seed(2))
    pos = torch.arange(5)
    QKClip(layer, tau=1e9)
    with torch.no_grad():
        layer(x, pos)
        n, dn, dr = layer.num_heads, layer.nope_dim, layer.rope_dim
        q = layer.q_b_proj(layer.q_a_layernorm(layer.q_a_proj(x))).view(1, 5, n, dn + dr).transpose(1, 2)
        latent, kr = layer.kv_a_proj_with_mqa(x).split([layer.kv_lora_rank, dr], dim=-1)
        kv = layer.kv_b_proj(layer.kv_a_layernorm(latent)).view(1, 5, n, dn + layer.v_dim).transpose(1, 2)
        cos, sin = layer.rotary(pos, x.dtype)
        qr = apply_rotary(q[..., dn:], cos, sin, interleaved=layer.rope_interleave)
        kr = apply_rotary(kr.unsqueeze(1), cos, sin, interleaved=layer.rope_interleave).expand(-1, n, -1, -1)
        qf = torch.cat((q[..., :dn], qr), -1)
        kf = torch.cat((kv[..., :dn], kr), -1)
    torch.testing.assert_close(layer.qk_max.double(), _hand_max(qf, kf, layer.softmax_scale), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"optim.muon_qk_clip": -1.0}, "optim.muon_qk_clip"),
        ({"optim.muon_qk_clip": 100.0, "model.qk_norm": True}, "needs model.qk_norm=false"),
    ],
)
def test_config_validation(overrides, message):
    cfg = copy.deepcopy(Config())
    for key, value in overrides.items():
        section, name = key.split(".")
        setattr(getattr(cfg, section), name, value)
    with pytest.raises(ConfigError, match=message):
        cfg.validate()


def test_trainer_logs_max_logit_and_clips(tmp_path):
    from moecore.config import load_config
    from moecore.train.loop import Trainer

    args = [
        "model.hidden_size=32", "model.num_layers=2", "model.num_attention_heads=2", "model.num_kv_heads=1",
        "model.ffn_hidden_size=64", "moe.num_experts=4", "moe.ffn_hidden_size=32", "train.seq_length=32",
        "train.global_batch_size=4", "train.micro_batch_size=2", "train.steps=3", "train.eval_interval=0",
        "optim.name=muon", "optim.muon_qk_clip=0.01", f"train.run_dir={tmp_path}",
    ]  # fmt: skip
    trainer = Trainer(load_config("tiny-moe", args))
    first = trainer.train_step()
    assert first["attn/max_logit"] > 0.01  # above tau: heads were rescaled
    assert trainer.rt.qk_clip.clipped_heads > 0
    for m in trainer.rt.qk_clip.layers:
        assert torch.isinf(m.qk_max).all()  # reset for the next step
    trainer.train_step()
