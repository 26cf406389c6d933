"""The SwiGLU in QuACK's GEMM epilogues (moecore/kernels/quack_swiglu.py, `moe.swiglu_epilogue`).

On any machine: the interleaved order, the config's rules, and the minimal Function's fused path with QuACK's
launches replaced by torch stand-ins that follow QuACK's documented conventions (gated epilogue, dgated epilogue
with a per-row scale and reduction, `concat_layout`), against the unfused path. On a Hopper GPU with the `quack`
extra (marked gpu): the fused path through QuACK's kernels against the unfused one.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from moecore.config import ConfigError, MoEConfig
from moecore.kernels import quack_gemm, quack_swiglu
from moecore.kernels.grouped_ffn import GemmPlan
from moecore.kernels.quack_swiglu import deinterleave, interleave
from moecore.moe.minimal import minimal_experts
from tests.kernels.conftest import rel_err, routed_inputs


def test_interleave_pairs_gate_and_up_and_inverts():
    h = torch.arange(12.0).view(2, 6)  # gate 0..2 | up 3..5 per row
    assert interleave(h)[0].tolist() == [0, 3, 1, 4, 2, 5]
    assert torch.equal(deinterleave(interleave(h)), h)


def test_config_needs_minimal_mode_and_probabilities_at_the_combine():
    MoEConfig(num_experts=4, activation_memory="minimal", swiglu_epilogue=True).validate()
    for kw in (dict(), dict(activation_memory="minimal", apply_probs_on_input=True)):
        with pytest.raises(ConfigError, match="moe.swiglu_epilogue"):
            MoEConfig(num_experts=4, swiglu_epilogue=True, **kw).validate()


def _interleaved_rows(b: torch.Tensor) -> torch.Tensor:
    """b [E, 2F, N] with [gate; up] rows, viewed (here: copied) in the interleaved row order."""
    return interleave(b.transpose(1, 2)).transpose(1, 2)


@pytest.fixture
def stand_in_epilogues(monkeypatch) -> list:
    """QuACK's gated / dgated / concat-layout launches as torch on CPU; returns the launches' names."""
    launched = []

    def gated(A, B, preact, postact, tile, cu_seqlens_m):
        launched.append("gated")
        h = torch._grouped_mm(A, B, offs=cu_seqlens_m[1:])  # [M, 2F], [gate | up]
        g, u = h.chunk(2, dim=-1)
        preact.copy_(interleave(h))
        postact.copy_(F.silu(g) * u)

    def dgated(A, B, preact, dpreact, postact, scale, tile, cu_seqlens_m):
        launched.append("dgated")
        G = torch._grouped_mm(A, B, offs=cu_seqlens_m[1:])  # [M, F]
        g, u = deinterleave(preact).chunk(2, dim=-1)
        s, sig, D = F.silu(g) * u, torch.sigmoid(g), G * scale[:, None]
        dpreact.copy_(interleave(torch.cat((D * u * sig * (1 + g * (1 - sig)), D * F.silu(g)), dim=-1)))
        postact.copy_(s * scale[:, None])
        return (G * s).sum(-1)  # reduced before the scale

    def plain(A, B, out, tile, cu_seqlens_m=None, cu_seqlens_k=None, concat_layout=()):
        launched.append(f"gemm {concat_layout[0]}")
        if cu_seqlens_m is not None:  # concat "B": B's [gate; up] rows meet A's interleaved columns
            return out.copy_(torch._grouped_mm(A, _interleaved_rows(B), offs=cu_seqlens_m[1:]))
        res = torch._grouped_mm(A, B, offs=cu_seqlens_k[1:])  # rows in A's interleaved order; "out": back
        return out.copy_(torch.cat((res[:, 0::2], res[:, 1::2]), dim=1))

    def stand_in_time(fn, reps=3):
        fn()
        return 1.0

    monkeypatch.setattr(quack_gemm, "quack_runs", lambda *t: True)
    monkeypatch.setattr(quack_gemm, "_time_ms", stand_in_time)
    monkeypatch.setattr(quack_gemm, "_CHOICES", {})
    monkeypatch.setattr(quack_swiglu, "_launch_gated", gated)
    monkeypatch.setattr(quack_swiglu, "_launch_dgated", dgated)
    monkeypatch.setattr(quack_swiglu, "launch", plain)
    return launched


def test_minimal_experts_with_the_swiglu_epilogue_equal_the_unfused_path(stand_in_epilogues):
    x, w13, w2, idx, w, dout = routed_inputs(10, 16, 4, 2, 8, "cpu", torch.float32, seed=3)
    results = []
    for fused in (False, True):
        ts = [t.clone().requires_grad_() for t in (x, w13, w2, w)]
        out, _ = minimal_experts(ts[0], idx, ts[3], ts[1], ts[2], plan=GemmPlan(), swiglu_epilogue=fused)
        out.backward(dout)
        results.append([out.detach()] + [t.grad for t in ts])
    assert sorted(set(stand_in_epilogues)) == ["dgated", "gated", "gemm B", "gemm out"]
    for got, want in zip(results[1], results[0]):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_layer_with_swiglu_epilogue_equals_the_minimal_layer(stand_in_epilogues):
    """`moe.swiglu_epilogue=true` reaches the experts from the config (through MoELayer)."""
    from moecore.moe.layer import MoELayer

    kw = dict(num_experts=4, router_topk=2, ffn_hidden_size=8, activation_memory="minimal")
    torch.manual_seed(0)
    plain = MoELayer(MoEConfig(**kw), 16, init_std=0.2)
    fused = MoELayer(MoEConfig(swiglu_epilogue=True, **kw), 16, init_std=0.2)
    fused.load_state_dict(plain.state_dict())
    x = torch.randn(2, 5, 16)
    results = []
    for layer in (plain, fused):
        xi = x.clone().requires_grad_()
        y, aux = layer(xi)
        y.square().sum().backward()
        results.append([y.detach(), xi.grad] + [p.grad for p in layer.parameters()])
    assert "gated" in stand_in_epilogues
    for got, want in zip(results[1], results[0]):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
def test_swiglu_epilogue_through_quack_matches_the_unfused_path():
    dev = torch.device("cuda")
    if not torch.cuda.is_available() or not quack_gemm.quack_available(dev):
        pytest.skip("needs a Hopper GPU and the quack extra")
    x, w13, w2, idx, w, dout = routed_inputs(1000, 256, 8, 3, 128, dev, torch.bfloat16, seed=8, scale=0.05)
    results = []
    for fused in (False, True):
        ts = [t.clone().requires_grad_() for t in (x, w13, w2, w)]
        out, _ = minimal_experts(
            ts[0], idx, ts[3], ts[1], ts[2], plan=GemmPlan.uniform("grouped"), swiglu_epilogue=fused
        )
        out.backward(dout)
        results.append([out.detach()] + [t.grad for t in ts])
    for got, want in zip(results[1], results[0]):  # the epilogue rounds h once less: bf16 agreement
        assert rel_err(got.float(), want.float()) < 2e-2
