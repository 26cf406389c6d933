"""Gated DeltaNet under context parallel (moecore/parallel/context_deltanet.py) against the full sequence.

Layer: the reference is the same `GatedDeltaNet` (same weights) run in one process on the whole sequence.
Under CP each rank feeds its two load-balanced chunks (r and 2cp-1-r); the cp group's ranks together must
give the reference's output and input gradient at their positions and, summed over CP, its weight
gradients. Sequence lengths 2 * cp * 24 (not a multiple of the kernel's chunk of 64: CP chunks of 24
tokens) and 2 * cp * 2 (chunks shorter than the conv's 3-token window: the halo reaches over several
chunks and ranks); two cases recompute the rule in backward (`core_attn`). fp32, bar 1e-5: measured
<= 6e-7 except dA_log / dt_bias (5.5e-6), which are that far from a float64 run in the single-process
reference itself (6e-6).
Rule and conv: `gated_delta_rule_cp` and `causal_conv1d_cp` in float64 against `gated_delta_rule_chunked`
and the padded conv (values and every input gradient), down to chunks of one token: the construction is
exact (measured <= 1.5e-15; bar 1e-12).
Long sequence: one forward of the layer on 32768 tokens under cp4 makes no tensor near [seq, seq] (the
largest, measured: the chunked rule's per-chunk [C, C] blocks, 2M elements against 1.07G).
cp2 runs on the two cp groups of a cp2 x dp2 layout, cp4 on all four processes, in one launch. The
one-rank identity (a group of one: the two halves of the sequence composed) runs without processes.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from moecore.config import ModelConfig, ParallelConfig
from moecore.models.linear_attention import (
    GatedDeltaNet,
    gated_delta_rule_chunked,
    gated_delta_rule_with_state,
    l2_normalize,
)
from moecore.parallel.comm import all_reduce_
from moecore.parallel.context import split_for_cp
from moecore.parallel.context_deltanet import causal_conv1d_cp, gated_delta_rule_cp
from moecore.parallel.dims import Group, ParallelDims
from moecore.parallel.launch import run_local


def _cfg(recompute: bool = False) -> ModelConfig:
    return ModelConfig(
        hidden_size=32,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=8,
        linear_value_head_dim=6,
        linear_conv_kernel_dim=4,
        linear_chunk_size=64,
        recompute_modules=["core_attn"] if recompute else [],
    )


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp(min=1e-30)).item()


def _case(dims: ParallelDims, chunk_len: int, dtype: torch.dtype, recompute: bool) -> dict[str, float]:
    """Relative errors of the CP layer against the full-sequence layer, over this rank's share."""
    cp, batch = dims.cp, 2
    seq = 2 * cp * chunk_len
    cfg = _cfg(recompute)
    torch.manual_seed(0)  # the same weights and data on every rank
    ref = GatedDeltaNet(cfg, 0).to(dtype).train()
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(batch, seq, cfg.hidden_size, generator=gen).to(dtype)
    w_out = torch.randn(batch, seq, cfg.hidden_size, generator=gen).to(dtype)  # a fixed random loss

    xr = x.clone().requires_grad_(True)
    y_ref = ref(xr)
    (y_ref * w_out).sum().backward()

    layer = GatedDeltaNet(cfg, 0, dims).to(dtype).train()
    layer.load_state_dict(ref.state_dict())
    x_loc = split_for_cp(x, dims).clone().requires_grad_(True)
    y = layer(x_loc)
    (y * split_for_cp(w_out, dims)).sum().backward()

    errs = {
        "out": _rel(y.detach(), split_for_cp(y_ref.detach(), dims)),
        "dx": _rel(x_loc.grad, split_for_cp(xr.grad, dims)),
    }
    for (name, p), (_, p_ref) in zip(layer.named_parameters(), ref.named_parameters()):
        grad = all_reduce_(p.grad.clone(), dims.cp_group)  # each rank's tokens contribute their part
        errs[f"d{name}"] = _rel(grad, p_ref.grad)
    return errs


def _rule_case(dims: ParallelDims, chunk_len: int) -> dict[str, float]:
    """float64 relative errors of `gated_delta_rule_cp` and `causal_conv1d_cp` (values and input gradients)
    against the full-sequence rule and conv: the construction itself, without the layer's fp32 q/k."""
    group, cp = dims.cp_group, dims.cp
    b, s, hk, hv, dk, dv, ch = 2, 2 * dims.cp * chunk_len, 1, 2, 8, 6, 5
    gen = torch.Generator().manual_seed(2)
    f64 = {"generator": gen, "dtype": torch.float64}
    q, k = (l2_normalize(torch.randn(b, s, hk, dk, **f64)) for _ in range(2))
    v, g, beta = torch.randn(b, s, hv, dv, **f64), -torch.rand(b, s, hv, **f64), torch.rand(b, s, hv, **f64)
    x, weight = torch.randn(b, s, ch, **f64), torch.randn(ch, 1, 4, **f64)
    w_o, w_c = torch.randn(b, s, hv, dv, **f64), torch.randn(b, s, ch, **f64)

    full = [t.clone().requires_grad_() for t in (q, k, v, g, beta, x)]
    o = gated_delta_rule_chunked(*full[:5], chunk_size=16)[0]
    c = F.conv1d(F.pad(full[5].transpose(1, 2), (3, 0)), weight, groups=ch).transpose(1, 2)
    ((o * w_o).sum() + (c * w_c).sum()).backward()

    loc = [split_for_cp(t, dims).clone().requires_grad_() for t in (q, k, v, g, beta, x)]
    o_cp = gated_delta_rule_cp(*loc[:5], chunk_size=16, group=group, rule=gated_delta_rule_with_state)
    c_cp = causal_conv1d_cp(loc[5], weight, group)
    ((o_cp * split_for_cp(w_o, dims)).sum() + (c_cp * split_for_cp(w_c, dims)).sum()).backward()
    errs = {
        "o": _rel(o_cp.detach(), split_for_cp(o.detach(), dims)),
        "conv": _rel(c_cp.detach(), split_for_cp(c.detach(), dims)),
    }
    for name, a, ref in zip(("dq", "dk", "dv", "dg", "dbeta", "dx"), loc, full):
        errs[name] = _rel(a.grad, split_for_cp(ref.grad, dims))
    assert cp == group.size
    return errs


LAYER_CASES = [(2, 24, False), (2, 2, True), (4, 24, True), (4, 2, False)]  # (cp, chunk length, recompute)
RULE_CASES = [(2, 24), (4, 24), (4, 2), (4, 1)]  # (cp, chunk length)


class _Largest(TorchDispatchMode):
    """Records the largest element count among the outputs of every operator run under it."""

    def __init__(self) -> None:
        super().__init__()
        self.numel, self.shape = 0, None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.numel() > self.numel:
                self.numel, self.shape = t.numel(), tuple(t.shape)
        return out


def _long_forward(dims: ParallelDims) -> dict:
    """One forward of the layer on a 32768-token sequence under cp4: the largest tensor any operator makes."""
    torch.manual_seed(0)
    layer = GatedDeltaNet(_cfg(), 0, dims)
    x = split_for_cp(
        torch.randn(1, LONG, layer.in_proj_qkvz.in_features, generator=torch.Generator().manual_seed(1)), dims
    )
    rec = _Largest()
    with torch.no_grad(), rec:
        y = layer(x)
    assert torch.isfinite(y).all()
    return {"numel": rec.numel, "shape": rec.shape}


LONG = 32768


def _run_all(rank: int, world: int) -> dict:
    dims = {cp: ParallelDims(ParallelConfig(cp=cp), world, rank, "cpu") for cp in (2, 4)}
    out = {("layer", *c): _case(dims[c[0]], c[1], torch.float32, c[2]) for c in LAYER_CASES}
    out.update({("rule", *c): _rule_case(dims[c[0]], c[1]) for c in RULE_CASES})
    out["long"] = _long_forward(dims[4])
    return out


@pytest.mark.distributed
def test_cp_deltanet_layer_matches_full_sequence():
    results = run_local(_run_all, 4, timeout_s=300)
    for r in results:  # 32768 tokens under cp4: no tensor anywhere near [seq, seq]
        long = r.pop("long")
        print("largest tensor of the seq-32768 cp4 forward:", long)
        assert long["numel"] * 100 < LONG * LONG, long
    for case in results[0]:
        bar = 1e-12 if case[0] == "rule" else 1e-5
        worst = {k: max(r[case][k] for r in results) for k in results[0][case]}
        print(case, " ".join(f"{k}={v:.1e}" for k, v in worst.items()))
        for name, err in worst.items():
            assert err < bar, (case, name, err)


@pytest.mark.parametrize("chunk_len", [24, 2, 1])
def test_one_rank_composition_is_the_full_rule(chunk_len):
    """With a CP group of one, the rank's two chunks are the two halves of the sequence: the second half's
    start state comes from the affine composition and the conv window from the gathered tails."""
    one = Group("cp", [0], 0, None)
    gen = torch.Generator().manual_seed(0)
    b, s, hk, hv, dk, dv = 2, 2 * chunk_len, 1, 2, 8, 6
    q, k = (l2_normalize(torch.randn(b, s, hk, dk, generator=gen, dtype=torch.float64)) for _ in range(2))
    v = torch.randn(b, s, hv, dv, generator=gen, dtype=torch.float64)
    g, beta = (
        -torch.rand(b, s, hv, generator=gen, dtype=torch.float64),
        torch.rand(b, s, hv, generator=gen, dtype=torch.float64),
    )
    ins = [t.requires_grad_() for t in (q, k, v, g, beta)]
    got = gated_delta_rule_cp(*ins, chunk_size=16, group=one, rule=gated_delta_rule_with_state)
    want = gated_delta_rule_chunked(*ins, chunk_size=16)[0]
    assert _rel(got, want) < 1e-12
    w = torch.randn(got.shape, generator=gen, dtype=torch.float64)
    for a, b_ in zip(torch.autograd.grad((got * w).sum(), ins), torch.autograd.grad((want * w).sum(), ins)):
        assert _rel(a, b_) < 1e-12
    x, weight = (
        torch.randn(b, s, 5, generator=gen, dtype=torch.float64),
        torch.randn(5, 1, 4, generator=gen, dtype=torch.float64),
    )
    want = F.conv1d(F.pad(x.transpose(1, 2), (3, 0)), weight, groups=5).transpose(1, 2)
    assert _rel(causal_conv1d_cp(x, weight, one), want) < 1e-15
