"""FP8 linear and FP8 expert FFN on CPU: emulated FP8 against fp32 layers (documented error bounds), the emulation
against torch's scaled GEMM on the same quantised operands, scale handling, padding and un-padding."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from moecore.kernels import fp8_quant as fq
from moecore.kernels.fp8_gemm import (
    AUTO_WGRAD_ROWS,
    AUTO_WGRAD_WIDE,
    E4M3,
    E5M2,
    SCALINGS,
    Fp8Recipe,
    fp8_linear,
    mm,
    quant_rows,
    transposed,
)
from moecore.kernels.fp8_grouped import _Fp8GroupedFFN, fp8_expert_ffn, pad_plan, pad_rows, quant_cols
from moecore.kernels.grouped_ffn import expert_ffn_reference


def _cpu_rowwise_scaled_mm() -> bool:
    """torch._scaled_mm with row scales on CPU (torch 2.13 has it; 2.11, the GPU machine's, only per-tensor)."""
    a = torch.ones(16, 16).to(E4M3)
    try:
        torch._scaled_mm(a, a.t(), torch.ones(16, 1), torch.ones(1, 16), out_dtype=torch.float32)
    except RuntimeError:
        return False
    return True


NEEDS_CPU_ROWWISE = pytest.mark.skipif(not _cpu_rowwise_scaled_mm(), reason="this torch has no CPU rowwise _scaled_mm")
# Relative (Frobenius) error of one FP8 GEMM on Gaussian data against fp32: e4m3 keeps 3 mantissa bits
# (relative rounding error up to 2^-4, about 2.7% rms), e5m2 2 bits. Measured here: linear 3.7% (e4m3),
# 5.9% (e5m2 gradients); expert FFN (two GEMMs and SwiGLU) 6.5% / 9.2%. The bounds leave ~30% headroom.
BOUND_LINEAR = {E4M3: 0.05, E5M2: 0.08}
BOUND_EXPERTS = {E4M3: 0.09, E5M2: 0.12}


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize("scaling", SCALINGS)
@pytest.mark.parametrize("grad_dtype", [E4M3, E5M2], ids=["e4m3", "hybrid"])
def test_emulated_linear_close_to_fp32(scaling, grad_dtype):
    torch.manual_seed(0)
    recipe = Fp8Recipe(scaling, grad_dtype, emulate=True)
    x = torch.randn(2, 50, 256, requires_grad=True)  # 100 tokens: padded to the recipe's alignment inside
    w = (torch.randn(384, 256) * 0.05).requires_grad_()
    b = torch.randn(384, requires_grad=True)
    y = fp8_linear(x, w, b, recipe)
    g = torch.randn_like(y)
    y.backward(g)
    xr, wr, br = (t.detach().clone().requires_grad_() for t in (x, w, b))
    yr = F.linear(xr, wr, br)
    yr.backward(g)
    assert y.shape == yr.shape
    assert rel(y, yr) < BOUND_LINEAR[E4M3]
    assert rel(x.grad, xr.grad) < BOUND_LINEAR[grad_dtype]
    assert rel(w.grad, wr.grad) < BOUND_LINEAR[grad_dtype]
    assert torch.equal(b.grad, br.grad)  # the bias stays out of FP8


@pytest.mark.parametrize("scaling", ["tensorwise", pytest.param("rowwise", marks=NEEDS_CPU_ROWWISE)])
def test_emulation_matches_torch_scaled_mm(scaling):
    """The emulated GEMM and torch._scaled_mm (which runs tensorwise / rowwise on CPU) on the same operands."""
    torch.manual_seed(1)
    x, w = torch.randn(48, 128), torch.randn(64, 128) * 0.1
    for emulate in (True, False):
        r = Fp8Recipe(scaling, emulate=emulate)
        a, b = quant_rows(x, r, E4M3), quant_rows(w, r, E4M3, weight=True)
        out = mm(a, b, torch.float32, r)
        if emulate:
            emulated = out
    assert torch.allclose(out, emulated, rtol=1e-5, atol=1e-5)
    # and the whole linear, forward and backward, through the real backend
    x.requires_grad_()
    outs = []
    for emulate in (True, False):
        xx = x.detach().clone().requires_grad_()
        ww = w.clone().requires_grad_()
        y = fp8_linear(xx, ww, None, Fp8Recipe(scaling, emulate=emulate))
        y.backward(torch.ones_like(y))
        outs.append((y, xx.grad, ww.grad))
    for t_emu, t_real in zip(*outs):
        assert torch.allclose(t_emu, t_real, rtol=1e-4, atol=1e-4)


def test_transposed_reuses_tensorwise_and_tile_scales():
    torch.manual_seed(2)
    w = torch.randn(256, 384)
    tw = quant_rows(w, Fp8Recipe("tensorwise"), E4M3, weight=True)
    t = transposed(tw, w, Fp8Recipe("tensorwise"), E4M3)
    assert torch.equal(t.q.view(torch.uint8), tw.q.t().contiguous().view(torch.uint8)) and t.s is tw.s
    bw = quant_rows(w, Fp8Recipe("blockwise"), E4M3, weight=True)
    t = transposed(bw, w, Fp8Recipe("blockwise"), E4M3)
    assert t.gran == "128x128" and t.s.shape == (3, 2)
    assert torch.equal(t.dequantize(), bw.dequantize().t())  # a 128x128 tile is the same tile transposed
    # rowwise quantises W^T again along the other axis: one scale per column of W
    rw = transposed(quant_rows(w, Fp8Recipe("rowwise"), E4M3, weight=True), w, Fp8Recipe("rowwise"), E4M3)
    assert rw.s.shape == (384, 1)
    assert torch.allclose(rw.s.squeeze(1), fq.scale_from_amax(w.abs().amax(0), E4M3))


def test_pad_plan_aligns_each_expert_and_keeps_order():
    counts = torch.tensor([5, 0, 16, 17, 1])
    n = int(counts.sum())
    dst, padded, P = pad_plan(counts, n, 16, exact=True)
    assert padded.tolist() == [16, 0, 16, 32, 16] and P == 80
    assert dst.tolist() == list(range(5)) + list(range(16, 32)) + list(range(32, 49)) + [64]
    dst2, padded2, P2 = pad_plan(counts, n, 16, exact=False)  # fixed bound, slack to the last expert
    assert P2 == -(-(n + 5 * 15) // 16) * 16 and int(padded2.sum()) == P2
    assert padded2[:-1].tolist() == padded[:-1].tolist() and torch.equal(dst2, dst)
    x = torch.randn(n, 3, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        xp = pad_rows(x, dst, P)
    # backward needs the destinations only: the routed rows themselves are not kept (the padded copy is)
    assert len(saved) == 1 and saved[0] is dst
    assert torch.equal(xp[dst], x) and int((xp.abs().sum(1) > 0).sum()) == n
    g = torch.randn(P, 3)
    xp.backward(g)
    assert torch.equal(x.grad, g[dst])


@pytest.mark.parametrize("scaling", SCALINGS)
@pytest.mark.parametrize("grad_dtype", [E4M3, E5M2], ids=["e4m3", "hybrid"])
def test_emulated_expert_ffn_close_to_fp32(scaling, grad_dtype):
    torch.manual_seed(3)
    E, H, Fh, counts = 4, 128, 256, torch.tensor([20, 0, 33, 17])
    x = torch.randn(70, H, requires_grad=True)
    w13 = (torch.randn(E, 2 * Fh, H) * 0.05).requires_grad_()
    w2 = (torch.randn(E, H, Fh) * 0.05).requires_grad_()
    p = torch.rand(70, requires_grad=True)
    y = fp8_expert_ffn(x, w13, w2, counts, p, Fp8Recipe(scaling, grad_dtype, emulate=True))
    g = torch.randn_like(y)
    y.backward(g)
    ref = [t.detach().clone().requires_grad_() for t in (x, w13, w2, p)]
    yr = expert_ffn_reference(*ref[:3], counts, ref[3])
    yr.backward(g)
    assert rel(y, yr) < BOUND_EXPERTS[E4M3]
    for got, want in zip((x, w13, w2, p), ref):
        assert rel(got.grad, want.grad) < BOUND_EXPERTS[grad_dtype]
    assert torch.equal(w13.grad[1], torch.zeros_like(w13.grad[1]))  # an expert without rows: zero gradient


def test_emulated_expert_ffn_with_the_clipped_swiglu(monkeypatch):
    """DeepSeek-V4's clipped SwiGLU through the FP8 expert FFN: the limit reaches the forward's SwiGLU and its
    backward, and the result is the clipped reference's, not the unclipped one's."""
    from moecore.kernels import fp8_grouped

    torch.manual_seed(3)
    E, H, Fh, counts, limit = 4, 128, 256, torch.tensor([20, 0, 33, 17]), 0.3
    x = torch.randn(70, H, requires_grad=True)
    w13 = (torch.randn(E, 2 * Fh, H) * 0.05).requires_grad_()
    w2 = (torch.randn(E, H, Fh) * 0.05).requires_grad_()
    p = torch.rand(70, requires_grad=True)
    assert ((x @ w13[0].t()).abs() > limit).float().mean() > 0.5  # most elements are clipped
    limits = []
    for name in ("swiglu", "swiglu_backward"):
        fn = getattr(fp8_grouped, name)
        monkeypatch.setattr(fp8_grouped, name, lambda *a, _fn=fn, **k: limits.append(k.get("limit")) or _fn(*a, **k))
    y = fp8_expert_ffn(x, w13, w2, counts, p, Fp8Recipe("rowwise", emulate=True), limit=limit)
    g = torch.randn_like(y)
    y.backward(g)
    assert limits == [limit, limit]
    errors = {}
    for clip in (limit, None):
        ref = [t.detach().clone().requires_grad_() for t in (x, w13, w2, p)]
        yr = expert_ffn_reference(*ref[:3], counts, ref[3], limit=clip)
        yr.backward(g)
        errors[clip] = [rel(y, yr)] + [rel(got.grad, want.grad) for got, want in zip((x, w13, w2, p), ref)]
    # y, dW2 and dprobs: within the FP8 bound of the clipped reference (measured 0.079, 0.074, 0.088)
    assert all(errors[limit][i] < BOUND_EXPERTS[E4M3] for i in (0, 3, 4)), errors[limit]
    # dx and dW13 flow through the clip's mask, a step function of h: where FP8's h falls on the other side of the
    # limit from fp32's, a whole element's gradient differs (measured 0.21 of the norm, with most elements
    # clipped). Against the unclipped maths every tensor is ~0.85 off, at least 3x further than the clipped one.
    assert all(c < u / 3 for c, u in zip(errors[limit], errors[None])), errors


@pytest.mark.parametrize("scaling", SCALINGS)
@pytest.mark.parametrize("padding", ["all", "wgrad"])
@pytest.mark.parametrize("with_probs", [True, False], ids=["probs", "no-probs"])
def test_emulated_expert_ffn_with_gpt_oss_biases(scaling, padding, with_probs, monkeypatch):
    """gpt-oss's experts through the FP8 expert FFN: the clamped SwiGLU and both biases, against the fp32 reference
    within the FP8 bound, every gradient (the biases' too); an expert without rows gets zero bias gradients, and the
    padding rows get no bias (so no padding row's activation enters a per-expert scale)."""
    from moecore.kernels import fp8_grouped

    if scaling != "rowwise" and padding == "wgrad":
        pytest.skip("padding only the weight-gradient operands is rowwise's")
    torch.manual_seed(3)
    E, H, Fh, counts = 4, 128, 256, torch.tensor([20, 0, 33, 17])
    x = torch.randn(70, H, requires_grad=True)
    w13 = (torch.randn(E, 2 * Fh, H) * 0.05).requires_grad_()
    w2 = (torch.randn(E, H, Fh) * 0.05).requires_grad_()
    b13 = (torch.randn(E, 2 * Fh) * 0.5).requires_grad_()
    b2 = (torch.randn(E, H) * 0.5).requires_grad_()
    p = torch.rand(70, requires_grad=True) if with_probs else None
    # a limit 2.7 standard deviations out (h ~ N(0, 0.75^2)): the clamp reaches ~0.5% of the gates and ~1% of the
    # ups; a limit that clips most of them moves dx and dW13 past the FP8 bound (the mask is a step function of h)
    form = {"limit": 2.0, "alpha": 1.702}
    leaves = [t for t in (x, w13, w2, b13, b2, p) if t is not None]
    recipe = Fp8Recipe(scaling, emulate=True, padding=padding)
    y = fp8_expert_ffn(x, w13, w2, counts, p, recipe, b13=b13, b2=b2, **form)
    g = torch.randn_like(y)
    y.backward(g)
    ref = [t.detach().clone().requires_grad_() for t in leaves]
    rx, rw13, rw2, rb13, rb2 = ref[:5]
    yr = expert_ffn_reference(rx, rw13, rw2, counts, ref[5] if with_probs else None, b13=rb13, b2=rb2, **form)
    yr.backward(g)
    assert rel(y, yr) < BOUND_EXPERTS[E4M3]
    for got, want in zip(leaves, ref):
        assert rel(got.grad, want.grad) < BOUND_EXPERTS[E4M3]
    assert b13.grad[1].abs().max() == 0 and b2.grad[1].abs().max() == 0
    if padding == "all":  # the padding rows take no bias: their FC1 output (and so their activation) stays zero
        seen = []
        real_act = fp8_grouped._activation_quantized
        monkeypatch.setattr(
            fp8_grouped, "_activation_quantized", lambda h, *a: seen.append(h.clone()) or real_act(h, *a)
        )
        fp8_expert_ffn(x, w13, w2, counts, p, recipe, b13=b13, b2=b2, **form)
        dst, _, P = pad_plan(counts, 70, recipe.alignment, exact=True)
        pads = torch.ones(P, dtype=torch.bool)
        pads[dst] = False
        assert seen[0].shape[0] == P and pads.any() and seen[0][pads].abs().max() == 0


@pytest.mark.parametrize("scaling", SCALINGS)
def test_bf16_weight_gradients(scaling):
    """fp8.wgrad=bf16: the weight gradients become plain GEMMs of the unquantised operands (a linear's dW is
    dy^T x itself; the experts' are closer to fp32 than the FP8 ones), and nothing else changes."""
    torch.manual_seed(6)
    x, w, g = torch.randn(40, 128), torch.randn(64, 128) * 0.05, torch.randn(40, 64)
    grads = {}
    for fp8_wgrad in (True, False):
        xx, ww = x.clone().requires_grad_(), w.clone().requires_grad_()
        recipe = Fp8Recipe(scaling, emulate=True, wgrad="fp8" if fp8_wgrad else "bf16")
        fp8_linear(xx, ww, None, recipe).backward(g)
        grads[fp8_wgrad] = (xx.grad, ww.grad)
    assert torch.equal(grads[True][0], grads[False][0])  # dx: the same FP8 GEMM
    assert rel(grads[False][1], g.t() @ x) < 1e-6
    assert rel(grads[True][1], g.t() @ x) > 1e-3  # the FP8 weight gradient does differ

    E, H, Fh, counts = 4, 128, 256, torch.tensor([20, 0, 33, 17])
    xs = torch.randn(70, H)
    w13, w2, p = torch.randn(E, 2 * Fh, H) * 0.05, torch.randn(E, H, Fh) * 0.05, torch.rand(70)
    gy = torch.randn(70, H)
    ref = [t.clone().requires_grad_() for t in (xs, w13, w2, p)]
    expert_ffn_reference(*ref[:3], counts, ref[3]).backward(gy)
    got = {}
    for fp8_wgrad in (True, False):
        ts = [t.clone().requires_grad_() for t in (xs, w13, w2, p)]
        recipe = Fp8Recipe(scaling, emulate=True, wgrad="fp8" if fp8_wgrad else "bf16")
        fp8_expert_ffn(*ts[:3], counts, ts[3], recipe).backward(gy)
        got[fp8_wgrad] = [t.grad for t in ts]
    for i in (0, 3):  # dx and dprobs: the same FP8 GEMMs
        assert torch.equal(got[True][i], got[False][i])
    # dW13, dW2: closer to fp32 without the second quantisation of both operands. Most of their error comes
    # from upstream (h from the FP8 forward, da from the FP8 dgrad): measured 0.81-0.89x of the FP8 wgrad's
    for i in (1, 2):
        assert rel(got[False][i], ref[i].grad) < 0.93 * rel(got[True][i], ref[i].grad)
    assert torch.equal(got[False][1][1], torch.zeros_like(got[False][1][1]))  # an expert without rows


def _linear_grads(x, w, g, wgrad: str):
    xx, ww = x.clone().requires_grad_(), w.clone().requires_grad_()
    fp8_linear(xx, ww, None, Fp8Recipe("rowwise", emulate=True, wgrad=wgrad)).backward(g)
    return xx.grad, ww.grad


def test_auto_weight_gradients_follow_the_weights_shape():
    """fp8.wgrad=auto: FP8 weight gradients for a weight with a dimension of at least AUTO_WGRAD_WIDE summed over
    at least AUTO_WGRAD_ROWS rows (tokens of a linear, mean rows per expert), bf16 ones otherwise."""
    auto = Fp8Recipe(wgrad="auto")
    assert auto.wgrad_in_fp8(AUTO_WGRAD_ROWS, 2048, 768) is False  # narrow (Qwen3-30B-A3B's experts)
    assert auto.wgrad_in_fp8(256, 7168, 2048) is False  # few rows per expert (DeepSeek-V3's)
    assert auto.wgrad_in_fp8(AUTO_WGRAD_ROWS, AUTO_WGRAD_WIDE, 512) is True
    assert Fp8Recipe(wgrad="bf16").wgrad_in_fp8(8192, 8192, 8192) is False and Fp8Recipe().wgrad_in_fp8(1, 16, 16)
    with pytest.raises(ValueError, match="wgrad="):
        Fp8Recipe(wgrad="fp16")
    torch.manual_seed(8)
    for rows, n, k, same_as in (
        (32, 64, 128, "bf16"),
        (32, 16, AUTO_WGRAD_WIDE, "bf16"),
        (AUTO_WGRAD_ROWS, 16, AUTO_WGRAD_WIDE, "fp8"),
    ):
        x, w, g = torch.randn(rows, k), torch.randn(n, k) * 0.05, torch.randn(rows, n)
        auto_grads, want = _linear_grads(x, w, g, "auto"), _linear_grads(x, w, g, same_as)
        assert all(torch.equal(a, b) for a, b in zip(auto_grads, want)), (rows, n, k)
        if same_as == "fp8":  # the two choices do differ here
            assert not torch.equal(want[1], _linear_grads(x, w, g, "bf16")[1])
    for counts, H, same_as in (
        ([9, 0, 14], 64, "bf16"),
        ([AUTO_WGRAD_ROWS, AUTO_WGRAD_ROWS + 16], AUTO_WGRAD_WIDE, "fp8"),
    ):
        counts, Fh = torch.tensor(counts), 16
        E, T = len(counts), int(counts.sum())
        ts0 = [torch.randn(T, H), torch.randn(E, 2 * Fh, H) * 0.05, torch.randn(E, H, Fh) * 0.05, torch.rand(T)]
        gy = torch.randn(T, H)
        got = {}
        for wgrad in ("auto", "bf16", "fp8"):
            ts = [t.clone().requires_grad_() for t in ts0]
            fp8_expert_ffn(*ts[:3], counts, ts[3], Fp8Recipe("rowwise", emulate=True, wgrad=wgrad)).backward(gy)
            got[wgrad] = [t.grad for t in ts]
        assert all(torch.equal(a, b) for a, b in zip(got["auto"], got[same_as])), (H, same_as)
        assert not torch.equal(got["fp8"][1], got["bf16"][1])  # the two choices do differ here


def test_expert_ffn_padding_is_invisible():
    """The fixed-bound padding (slack on the last expert) and the exact padding give the same results,
    and the per-expert scales of the rowwise weight gradient ignore the padding rows."""
    torch.manual_seed(4)
    E, H, Fh, counts = 3, 32, 32, torch.tensor([7, 16, 2])
    n = int(counts.sum())
    x = torch.randn(n, H)
    w13, w2 = torch.randn(E, 2 * Fh, H) * 0.1, torch.randn(E, H, Fh) * 0.1
    p = torch.rand(n)
    recipe = Fp8Recipe("rowwise", emulate=True)
    outs = []
    for exact in (True, False):
        xx, a13, a2 = (t.clone().requires_grad_() for t in (x, w13, w2))
        dst, padded, P = pad_plan(counts, n, 16, exact)
        y = _Fp8GroupedFFN.apply(pad_rows(xx, dst, P), a13, a2, padded, pad_rows(p, dst, P), recipe, None)
        y = y.index_select(0, dst)
        y.backward(torch.ones_like(y))
        outs.append((y, xx.grad, a13.grad, a2.grad))
    for a, b in zip(*outs):
        assert torch.equal(a, b)
    dst, padded, P = pad_plan(counts, n, 16, exact=True)
    cols = quant_cols(pad_rows(x, dst, P), padded, recipe, E4M3)
    assert cols.s.shape == (E, H)
    want = fq.scale_from_amax(torch.stack([x[:7].abs().amax(0), x[7:23].abs().amax(0), x[23:].abs().amax(0)]), E4M3)
    assert torch.equal(cols.s, want)


def _fp32_close(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Normwise agreement to fp32 rounding of short dot products (< 1e-6 relative Frobenius)."""
    return ((a.double() - b.double()).norm() / b.double().norm().clamp(min=1e-30)).item() < 1e-6


@pytest.mark.parametrize("exact", [True, False])
def test_padding_only_the_weight_gradient_operands_changes_nothing(exact):
    """padding="wgrad": unpadded rows through the forward and input-gradient GEMMs, the weight-gradient operands
    written padded as they are quantised; the results of padding every operand (exact padding and the fixed
    bound with its slack on the last expert). The FP8 operands are the same bit for bit (test_fp8_quant.py);
    the emulation's fp32 matmuls over 7 rows or 16 padded ones sum in different orders on the CPU (their
    blocking depends on the sizes and the thread count), so the results agree to fp32 rounding of dot products
    of length <= 96: about sqrt(96) * 2^-24 = 6e-7 relative (normwise; elementwise it is unbounded where sums
    cancel). Measured 5e-8 to 8e-8 with 1 and 2 threads."""
    torch.manual_seed(8)
    E, H, Fh, counts = 4, 32, 48, torch.tensor([7, 0, 16, 3])
    n = int(counts.sum())
    x, p = torch.randn(n, H), torch.rand(n)
    w13, w2 = torch.randn(E, 2 * Fh, H) * 0.1, torch.randn(E, H, Fh) * 0.1
    g = torch.randn(n, H)
    outs = []
    for padding in ("all", "wgrad"):
        recipe = Fp8Recipe("rowwise", emulate=True, padding=padding)
        ts = [t.clone().requires_grad_() for t in (x, w13, w2, p)]
        dst, padded, P = pad_plan(counts, n, 16, exact)
        if padding == "all":
            y = _Fp8GroupedFFN.apply(pad_rows(ts[0], dst, P), *ts[1:3], padded, pad_rows(ts[3], dst, P), recipe, None)
            y = y.index_select(0, dst)
        else:
            y = _Fp8GroupedFFN.apply(*ts[:3], counts, ts[3], recipe, None, (padded, P))
        y.backward(g)
        outs.append([y] + [t.grad for t in ts])
    for a, b in zip(*outs):
        assert _fp32_close(a, b)
    with pytest.raises(ValueError, match="padding"):
        Fp8Recipe("blockwise", padding="wgrad")


def test_expert_ffn_with_wgrad_padding_matches_default():
    torch.manual_seed(9)
    E, H, Fh, counts = 3, 64, 32, torch.tensor([9, 0, 21])
    x, w13, w2 = torch.randn(30, H), torch.randn(E, 2 * Fh, H) * 0.1, torch.randn(E, H, Fh) * 0.1
    res = []
    for padding in ("all", "wgrad"):
        xx, a13, a2 = (t.clone().requires_grad_() for t in (x, w13, w2))
        y = fp8_expert_ffn(xx, a13, a2, counts, None, Fp8Recipe("rowwise", emulate=True, padding=padding))
        y.backward(torch.ones_like(y))
        res.append((y, xx.grad, a13.grad, a2.grad))
    for a, b in zip(*res):  # fp32 rounding of the emulation's matmuls (previous test)
        assert _fp32_close(a, b)


@NEEDS_CPU_ROWWISE
def test_loop_backend_matches_emulation_on_cpu():
    """With emulate=False on CPU the experts run the loop of torch._scaled_mm (rowwise runs on CPU)."""
    torch.manual_seed(5)
    E, H, Fh, counts = 3, 64, 32, torch.tensor([9, 0, 21])
    x, w13, w2 = torch.randn(30, H), torch.randn(E, 2 * Fh, H) * 0.1, torch.randn(E, H, Fh) * 0.1
    res = []
    for emulate in (True, False):
        xx, a13, a2 = (t.clone().requires_grad_() for t in (x, w13, w2))
        y = fp8_expert_ffn(xx, a13, a2, counts, None, Fp8Recipe("rowwise", emulate=emulate))
        y.backward(torch.ones_like(y))
        res.append((y, xx.grad, a13.grad, a2.grad))
    for a, b in zip(*res):
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-4)


def _force_triton_on_cpu(backend: str, monkeypatch) -> torch.device:
    """CPU tensors in Triton's interpreter: use_triton("auto") takes CUDA tensors only, so force the kernels."""
    import moecore.kernels.fp8_grouped as fg

    if backend == "interpret":
        monkeypatch.setattr(fg, "use_triton", lambda impl, *ts: True)
    return torch.device("cuda" if backend == "cuda" else "cpu")


@NEEDS_CPU_ROWWISE
@pytest.mark.parametrize("fast", [False, True], ids=["fp32-acc", "fast-acc"])
def test_triton_grouped_gemm_matches_torch_scaled_gemms(backend, fast, monkeypatch):
    """fp8.grouped_gemm=triton: the forward (x @ w13[e]^T) and input-gradient (dh @ w13[e], through w13^T quantised
    along its rows) GEMMs of grouped_gemm.grouped_mm_scaled against torch's scaled GEMMs of the same FP8 values
    (torch._scaled_grouped_mm on the GPU, a loop of torch._scaled_mm on CPU): only summation orders differ (fp32
    on CPU; on the GPU the tensor cores' accumulation and the bf16 output)."""
    from moecore.kernels.fp8_grouped import gmm_nt, quant_weights, transposed_rowwise_weights

    dev = _force_triton_on_cpu(backend, monkeypatch)
    dt = torch.bfloat16 if backend == "cuda" else torch.float32
    torch.manual_seed(6)
    counts = torch.tensor([9, 0, 21, 16] if backend == "interpret" else [144, 0, 336, 256], device=dev)
    E, H, Fh, n = 4, 64, 48, int(counts.sum())
    x, dh, w13 = (
        torch.randn(n, H, device=dev),
        torch.randn(n, 2 * Fh, device=dev),
        torch.randn(E, 2 * Fh, H, device=dev),
    )
    outs = {}
    for gemm in ("torch", "triton"):
        r = Fp8Recipe("rowwise", grouped_gemm=gemm)
        fwd = gmm_nt(quant_rows(x, r, E4M3), quant_weights(w13, r), counts, None, r, dt, fast)
        dgrad = gmm_nt(quant_rows(dh, r, E4M3), transposed_rowwise_weights(w13, r), counts, None, r, dt)
        outs[gemm] = (fwd, dgrad)
    for got, want in zip(outs["triton"], outs["torch"]):
        err = ((got.double() - want.double()).norm() / want.double().norm()).item()
        assert err < (1e-6 if backend == "interpret" else 8e-3), err  # bf16 output rounding: 2^-9 rms at most
    with pytest.raises(ValueError, match="grouped_gemm"):
        Fp8Recipe("blockwise", grouped_gemm="triton")


@NEEDS_CPU_ROWWISE
@pytest.mark.parametrize("padding,kernel", [("all", "triton"), ("wgrad", "triton"), ("wgrad", "auto")])
def test_expert_ffn_with_the_triton_grouped_gemm_matches_torchs(backend, padding, kernel, monkeypatch):
    """The whole FP8 expert FFN, forward and backward, with fp8.grouped_gemm=triton against torch. The GEMMs
    agree to fp32 rounding (previous test), but an fp32 ulp in h can move one SwiGLU output across an e4m3
    rounding boundary (seen here: one of 960 values, -36 against -40), a 1/8 change of that element: so the
    bound is 1e-3 relative (Frobenius), far below FP8's own ~6% error and far above fp32 rounding."""
    dev = _force_triton_on_cpu(backend, monkeypatch)
    torch.manual_seed(6)
    E, H, Fh = 3, 64, 32
    counts = torch.tensor([9, 0, 21] if backend == "interpret" else [90, 0, 210], device=dev)
    n = int(counts.sum())
    x, w13, w2 = (
        torch.randn(n, H, device=dev),
        torch.randn(E, 2 * Fh, H, device=dev) * 0.1,
        torch.randn(E, H, Fh, device=dev) * 0.1,
    )
    p = torch.rand(n, device=dev)
    res = []
    for gemm in ("torch", kernel):
        recipe = Fp8Recipe("rowwise", padding=padding, grouped_gemm=gemm)
        ts = [t.clone().requires_grad_() for t in (x, w13, w2, p)]
        y = fp8_expert_ffn(*ts[:3], counts, ts[3], recipe)
        y.backward(torch.ones_like(y))
        res.append([y] + [t.grad for t in ts])
    for a, b in zip(*res):
        err = ((a.double() - b.double()).norm() / a.double().norm()).item()
        assert err < (1e-3 if backend == "interpret" else 1e-2), err


def _close(got: torch.Tensor, want: torch.Tensor, backend: str) -> bool:
    """CPU (the interpreter, fp32 dots): elementwise. CUDA: Hopper's FP8 tensor cores accumulate with about 14
    mantissa bits (DeepSeek-V3 report, section 3.3), so the per-block sums carry ~2^-13 relative error: the
    H200 gives 1.27e-4 relative (Frobenius) on both GEMMs here; bar 5e-4."""
    if backend == "cuda":
        return ((got.double() - want.double()).norm() / want.double().norm()).item() < 5e-4
    return torch.allclose(got, want, rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize("tiles", ["default", "pointer-loads", "wide-n"])
def test_triton_blockwise_grouped_gemms_match_emulation(backend, tiles):
    """The Triton blockwise grouped GEMMs against the emulated per-expert loop on the same FP8 operands: the
    default tiles (TMA loads, persistent), pointer loads, and tiles wider than N (masked columns)."""
    from moecore.kernels.fp8_block_gemm import block_gemm_nt, block_gemm_tn, block_tiles
    from moecore.kernels.fp8_grouped import gmm_nt, gmm_tn, quant_weights
    from moecore.kernels.grouped_gemm import TileConfig

    dev = torch.device("cuda" if backend == "cuda" else "cpu")
    t = block_tiles("nt", torch.empty(0, device=dev))
    cfg = {
        "default": None,
        "pointer-loads": TileConfig(t.block_m, t.block_n, 128, t.group_m, t.warps, t.stages, persistent=False),
        "wide-n": TileConfig(t.block_m, 256, 128, t.group_m, t.warps, t.stages, persistent=True, tma=True),
    }[tiles]
    torch.manual_seed(6)
    counts = torch.tensor([128, 0, 256], device=dev)
    P, K, N = 384, 256, 384
    emu = Fp8Recipe("blockwise", emulate=True)
    a = quant_rows(torch.randn(P, K, device=dev), emu, E4M3)
    w = quant_weights(torch.randn(3, N, K, device=dev) * 0.1, emu)
    got = block_gemm_nt(a.q, a.s, w.q, w.s, counts, torch.float32, cfg)
    want = gmm_nt(a, w, counts, None, emu, torch.float32)
    assert _close(got, want, backend)
    x, y = torch.randn(P, 128, device=dev), torch.randn(P, 384, device=dev)
    ca, cb = quant_cols(x, counts, emu, E4M3), quant_cols(y, counts, emu, E4M3)
    got = block_gemm_tn(ca.q, ca.s, cb.q, cb.s, counts, torch.float32, cfg)
    want = gmm_tn(ca, cb, counts, None, emu, torch.float32)
    assert _close(got, want, backend)
    assert torch.equal(got[1], torch.zeros_like(got[1]))


@pytest.mark.parametrize("scaling", ["rowwise", "blockwise"])
def test_e5m2_gemms_run_moecores_triton_kernels(backend, scaling, monkeypatch):
    """fp8.format=hybrid: cuBLAS rejects e5m2 operands with row or block scales, so `mm` sends such GEMMs to one
    group of moecore's Triton grouped GEMMs (`fp8_gemm.cublas_rejects`). The input-gradient shape (dy e5m2 against
    the e4m3 weight: 128x128 tiles for blockwise) and the weight-gradient shape (dy^T e5m2 against x^T e4m3, both
    along the tokens) against the emulation of the same quantised operands."""
    from moecore.kernels import fp8_gemm

    if backend == "interpret":  # CPU tensors: use_triton("auto") takes CUDA ones only
        monkeypatch.setattr(fp8_gemm, "use_triton", lambda impl, *ts: True)
    dev = torch.device("cuda" if backend == "cuda" else "cpu")
    torch.manual_seed(7)
    M, K, N = 256, 128, 384  # tokens, in, out: multiples of the 128 block
    real, emu = Fp8Recipe(scaling, E5M2), Fp8Recipe(scaling, E5M2, emulate=True)
    dy, x, w = torch.randn(M, N, device=dev), torch.randn(M, K, device=dev), torch.randn(N, K, device=dev) * 0.1
    dyq = quant_rows(dy, real, E5M2)
    wt = transposed(None, w, real, E4M3, weight=True)
    dyt, xt = transposed(dyq, dy, real, E5M2), transposed(None, x, real, E4M3)
    assert fp8_gemm.cublas_rejects(dyq, wt) and fp8_gemm.cublas_rejects(dyt, xt)
    assert not fp8_gemm.cublas_rejects(quant_rows(x, real, E4M3), quant_rows(w, real, E4M3, weight=True))
    for a, b, shape in ((dyq, wt, (M, K)), (dyt, xt, (N, K))):
        got, want = mm(a, b, torch.float32, real), mm(a, b, torch.float32, emu)
        assert got.shape == shape
        # fp32 sums in another order (the interpreter); on the GPU the FP8 tensor cores' partial sums (~2^-13)
        assert rel(got, want) < (1e-6 if backend == "interpret" else 5e-4), (shape, rel(got, want))


@NEEDS_CPU_ROWWISE
def test_hybrid_expert_ffn_runs_the_triton_grouped_gemms(backend, monkeypatch):
    """Rowwise FP8 experts in the hybrid format (e5m2 gradients): the four GEMMs with an e5m2 operand run
    moecore's Triton grouped GEMMs whatever fp8.grouped_gemm says (torch's takes e4m3 only), on offsets made on
    the GPU; forward and gradients against the emulation of the same quantisation."""
    dev = _force_triton_on_cpu(backend, monkeypatch)
    torch.manual_seed(8)
    E, H, Fh = 3, 64, 32
    counts = torch.tensor([9, 0, 21] if backend == "interpret" else [90, 0, 210], device=dev)
    n = int(counts.sum())
    x, w13, w2 = torch.randn(n, H), torch.randn(E, 2 * Fh, H) * 0.1, torch.randn(E, H, Fh) * 0.1
    p = torch.rand(n)
    res = []
    for emulate in (False, True):
        recipe = Fp8Recipe("rowwise", E5M2, emulate=emulate, padding="wgrad", grouped_gemm="torch")
        ts = [t.to(dev).requires_grad_() for t in (x, w13, w2, p)]
        y = fp8_expert_ffn(*ts[:3], counts, ts[3], recipe)
        y.backward(torch.ones_like(y))
        res.append([y] + [t.grad for t in ts])
    for a, b in zip(*res):  # as test_expert_ffn_with_the_triton_grouped_gemm_matches_torchs: FP8 rounding flips
        assert rel(a, b) < (1e-3 if backend == "interpret" else 1e-2), rel(a, b)


@pytest.mark.parametrize("scaling", ["tensorwise", "blockwise"])
def test_fp8_layers_under_activation_checkpointing(scaling):
    """Recomputed in backward (torch.utils.checkpoint), the FP8 linear and expert FFN give the same gradients:
    the FP8 copies they keep for backward are saved tensors, which the checkpoint drops and recomputes."""
    from torch.utils.checkpoint import checkpoint

    torch.manual_seed(7)
    recipe = Fp8Recipe(scaling, emulate=True)
    counts = torch.tensor([100, 28])
    x = torch.randn(128, 128)
    w, w13, w2 = torch.randn(128, 128) * 0.1, torch.randn(2, 256, 128) * 0.1, torch.randn(2, 128, 128) * 0.1

    def f(x, w, w13, w2):
        return fp8_expert_ffn(fp8_linear(x, w, None, recipe), w13, w2, counts, None, recipe)

    res = []
    for ckpt in (False, True):
        ts = [t.clone().requires_grad_() for t in (x, w, w13, w2)]
        y = checkpoint(f, *ts, use_reentrant=False) if ckpt else f(*ts)
        y.backward(torch.ones_like(y))
        res.append([y] + [t.grad for t in ts])
    for a, b in zip(*res):
        assert torch.equal(a, b)
