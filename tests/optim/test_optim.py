"""LR schedules against their formulas, AdamW parameter groups, Muon's orthogonalisation and a Muon run."""

from __future__ import annotations

import math

import pytest
import torch

from moecore.config import Config, OptimConfig
from moecore.models.transformer import MoETransformer
from moecore.optim.adamw import build_optimizer, param_groups
from moecore.optim.muon import CombinedOptimizer, newton_schulz
from moecore.optim.schedule import lr_at


def test_warmup_then_cosine():
    cfg = OptimConfig(lr=1.0, min_lr=0.1, warmup_steps=10, schedule="cosine")
    assert lr_at(1, 110, cfg) == pytest.approx(0.1)
    assert lr_at(10, 110, cfg) == pytest.approx(1.0)
    # halfway through the decay: min + (max - min) * (1 + cos(pi/2)) / 2
    assert lr_at(60, 110, cfg) == pytest.approx(0.1 + 0.9 * 0.5)
    assert lr_at(110, 110, cfg) == pytest.approx(0.1)
    step = 35
    expected = 0.1 + 0.45 * (1 + math.cos(math.pi * (step - 10) / 100))
    assert lr_at(step, 110, cfg) == pytest.approx(expected)


def test_wsd_holds_then_decays_linearly():
    cfg = OptimConfig(lr=1.0, min_lr=0.0, warmup_steps=0, schedule="wsd", wsd_decay_fraction=0.2)
    assert [lr_at(s, 100, cfg) for s in (1, 50, 80)] == [1.0, 1.0, 1.0]
    assert lr_at(90, 100, cfg) == pytest.approx(0.5)
    assert lr_at(100, 100, cfg) == pytest.approx(0.0)


def test_linear_and_constant():
    assert lr_at(50, 100, OptimConfig(lr=2.0, warmup_steps=0, schedule="constant")) == 2.0
    cfg = OptimConfig(lr=1.0, min_lr=0.0, warmup_steps=0, schedule="linear")
    assert lr_at(25, 100, cfg) == pytest.approx(0.75)


def _tiny_model() -> MoETransformer:
    cfg = Config()
    cfg.model.vocab_size = 64
    cfg.model.hidden_size = 32
    cfg.model.num_layers = 2
    cfg.model.num_attention_heads = 2
    cfg.model.num_kv_heads = 1
    cfg.model.ffn_hidden_size = 64
    cfg.model.qkv_bias = True
    cfg.moe.num_experts = 4
    cfg.moe.ffn_hidden_size = 16
    cfg.moe.first_k_dense_replace = 1
    torch.manual_seed(0)
    return MoETransformer(cfg)


def test_param_groups_exclude_norms_biases_embeddings():
    model = _tiny_model()
    decay, no_decay = param_groups(model, 0.1)
    names = {id(p): n for n, p in model.named_parameters()}
    decay_names = {names[id(p)] for p in decay["params"]}
    no_decay_names = {names[id(p)] for p in no_decay["params"]}
    assert decay_names.isdisjoint(no_decay_names)
    assert decay_names | no_decay_names == set(names.values())
    assert all("norm" not in n and not n.endswith(".bias") and "embed" not in n for n in decay_names)
    assert "embed.weight" in no_decay_names and "layers.0.attn.q_proj.bias" in no_decay_names
    assert "layers.1.mlp.experts.w13" in decay_names and "lm_head.weight" in decay_names
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0


def test_newton_schulz_is_nearly_orthogonal():
    g = torch.randn(3, 16, 48, dtype=torch.float64)
    x = newton_schulz(g, steps=5)
    # The quintic iteration drives singular values into a band around 1 (not exactly 1, by design).
    s = torch.linalg.svdvals(x)
    assert s.min() > 0.5 and s.max() < 1.3
    # Same singular vectors as g: x is (close to) U V^T of g's SVD.
    u, _, vh = torch.linalg.svd(g, full_matrices=False)
    cos = (x * (u @ vh)).sum(dim=(-2, -1)) / (x.norm(dim=(-2, -1)) * (u @ vh).norm(dim=(-2, -1)))
    assert (cos > 0.95).all()


def test_muon_trains_and_steps_every_group():
    model = _tiny_model()
    opt = build_optimizer(model, OptimConfig(name="muon", lr=0.02, warmup_steps=0))
    assert isinstance(opt, CombinedOptimizer)
    muon_params = {id(p) for p in opt.optimizers[0].param_groups[0]["params"]}
    assert id(model.layers[1].mlp.experts.w13) in muon_params
    assert id(model.embed.weight) not in muon_params
    x = torch.randint(0, 64, (4, 16))
    losses = []
    for _ in range(15):
        opt.zero_grad()
        loss = model(x, labels=torch.roll(x, -1, 1)).loss
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.5
    state = opt.state_dict()
    assert len(state["optimizers"]) == 2


def test_muon_update_is_the_written_formula():
    """Two steps of Muon on a matrix and a grouped [E, out, in] weight, against the formula written out.

    m <- mu m + g; u = g + mu m (Nesterov); O = NS(u) per matrix (the quintic of the module docstring
    from u / ||u||_F, transposed when tall); w <- w (1 - lr wd) - lr 0.2 sqrt(max(out, in)) O.
    """
    from moecore.optim.muon import Muon

    def ns(u: torch.Tensor) -> torch.Tensor:
        x = u.double()
        tall = x.shape[0] > x.shape[1]
        x = x.T if tall else x
        x = x / (x.norm() + 1e-7)
        for _ in range(5):
            s = x @ x.T
            x = 3.4445 * x + (-4.7750 * s + 2.0315 * s @ s) @ x
        return x.T if tall else x

    g = torch.Generator().manual_seed(0)
    w2, w3 = torch.randn(12, 5, generator=g), torch.randn(3, 4, 9, generator=g)
    params = [torch.nn.Parameter(w2.clone()), torch.nn.Parameter(w3.clone())]
    lr, mu, wd = 0.05, 0.9, 0.1
    opt = Muon(params, lr=lr, momentum=mu, weight_decay=wd)
    want = [w2.double(), w3.double()]
    bufs = [torch.zeros_like(w) for w in want]
    for _ in range(2):
        grads = [torch.randn(p.shape, generator=g) for p in params]
        for p, gr in zip(params, grads):
            p.grad = gr.clone()
        opt.step()
        for i, gr in enumerate(grads):
            bufs[i] = mu * bufs[i] + gr.double()
            u = gr.double() + mu * bufs[i]
            mats = [u] if u.ndim == 2 else list(u)
            o = torch.stack([ns(m) for m in mats]).reshape(u.shape)
            scale = 0.2 * max(u.shape[-2], u.shape[-1]) ** 0.5
            want[i] = want[i] * (1 - lr * wd) - lr * scale * o
    for p, w in zip(params, want):
        torch.testing.assert_close(p.detach().double(), w, rtol=1e-5, atol=1e-6)
