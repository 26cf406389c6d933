"""Fused router: the reference against the router and losses it replaces, the kernel against the reference."""

from __future__ import annotations

import pytest
import torch

from moecore.kernels.router import RouterSpec, fused_router, fused_router_reference, kernel_covers
from moecore.kernels.router_gemm import router_linear, split3, split3_cols, split3_pieces, split3_reference
from moecore.moe import losses
from moecore.moe.router import scores_for_balancing, topk_routing
from tests.kernels.conftest import rel_err, setup

SPECS = {
    "softmax_renorm": RouterSpec(topk=4, need_sums=True, need_z=True),
    "softmax_no_renorm_scaled": RouterSpec(topk=3, norm_topk_prob=False, scaling_factor=2.5, need_sums=True),
    "softmax_after_topk": RouterSpec(topk=2, pre_softmax=False, need_z=True),
    "sigmoid_bias": RouterSpec(topk=4, score_function="sigmoid", scaling_factor=2.5, need_sums=True, need_z=True),
    "sigmoid_no_renorm": RouterSpec(topk=2, score_function="sigmoid", norm_topk_prob=False),
    # group-limited routing: DeepSeek-V3 (sigmoid + bias, best-two group score), DeepSeek-V2 (softmax, max)
    "sigmoid_bias_groups_top2": RouterSpec(
        topk=3,
        score_function="sigmoid",
        scaling_factor=2.5,
        need_sums=True,
        num_groups=4,
        group_topk=2,
        group_score="top2_sum",
    ),
    "softmax_groups_max": RouterSpec(topk=3, need_sums=True, need_z=True, num_groups=4, group_topk=3),
}
BIASED = ("sigmoid_bias", "sigmoid_bias_groups_top2")


def _inputs(T, E, dtype=torch.float64, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(T, E, generator=g, dtype=torch.float64) * 2
    bias = torch.randn(E, generator=g, dtype=torch.float64) * 0.1
    valid = torch.rand(T, generator=g) > 0.25
    return logits.to(device, dtype), bias.to(device, torch.float32), valid.to(device)


@pytest.mark.parametrize("name", list(SPECS))
def test_reference_matches_router_and_losses(name):
    spec = SPECS[name]
    T, E, B = 24, 12, 3
    logits, bias, valid = _inputs(T, E)
    bias = bias if name in BIASED else None
    out = fused_router_reference(logits, spec, bias, valid, segment=T // B)
    groups = dict(num_groups=spec.num_groups, group_topk=spec.group_topk, group_score=spec.group_score)
    w, idx = topk_routing(
        logits, spec.topk, spec.score_function, spec.pre_softmax, spec.norm_topk_prob, spec.scaling_factor,
        expert_bias_E=bias, **(groups if spec.grouped else {}),
    )  # fmt: skip
    assert torch.equal(out.idx_TK.sort(1).values, idx.sort(1).values)
    order = out.idx_TK.argsort(1)
    assert torch.allclose(out.weight_TK.gather(1, order), w.gather(1, idx.argsort(1)), rtol=1e-12)
    hot = torch.zeros(T, E, dtype=torch.float64).scatter_(1, idx, 1.0) * valid[:, None]
    assert torch.equal(out.counts_GE, hot.view(B, -1, E).sum(1).float())
    bal = scores_for_balancing(logits, spec.score_function) * valid[:, None]
    assert torch.allclose(out.psum_GE, bal.view(B, -1, E).sum(1))
    plain_counts = losses.topk_counts(bal, spec.topk, valid)
    assert torch.equal(out.aux_counts_GE.sum(0).double(), plain_counts)
    z_mean = losses.z_loss(logits, valid)
    assert torch.allclose(out.zsum_G.sum() / valid.sum(), z_mean)


def _loss(out, gw, gp, gz):
    loss = (out.weight_TK * gw).sum()
    if out.psum_GE.numel():
        loss = loss + (out.psum_GE * gp).sum()
    if out.zsum_G.numel():
        loss = loss + (out.zsum_G * gz).sum()
    return loss


@pytest.mark.parametrize("name", list(SPECS))
@pytest.mark.parametrize("T, E, segments", [(64, 16, 1), (48, 20, 4), (37, 8, 1)])
def test_kernel_matches_reference(backend, name, T, E, segments):
    dev, _ = setup(backend)
    spec = SPECS[name]
    if not kernel_covers(spec, E):
        pytest.skip(f"{E} experts: group-limited routing runs the reference (not a power of two)")
    logits, bias, valid = _inputs(T, E, torch.float32, dev, seed=T + E)
    bias = bias if name in BIASED else None
    seg = T // segments
    g = torch.Generator().manual_seed(7)
    gw = torch.randn(T, spec.topk, generator=g).to(dev)
    gp = torch.randn(segments, E, generator=g).to(dev)
    gz = torch.randn(segments, generator=g).to(dev)

    lr = logits.double().requires_grad_()
    ref = fused_router_reference(lr, spec, bias, valid, seg)
    _loss(ref, gw.double(), gp.double(), gz.double()).backward()
    lk = logits.clone().requires_grad_()
    out = fused_router(lk, spec, bias, valid, seg, impl="triton")
    _loss(out, gw, gp, gz).backward()

    # slots come in descending selection order from the kernel; compare per expert id
    assert torch.equal(out.idx_TK.sort(1).values, ref.idx_TK.sort(1).values)
    wk = out.weight_TK.gather(1, out.idx_TK.argsort(1))
    wr = ref.weight_TK.gather(1, ref.idx_TK.argsort(1))
    assert rel_err(wk, wr) < 1e-5
    assert torch.equal(out.counts_GE.cpu(), ref.counts_GE.cpu())
    assert torch.equal(out.aux_counts_GE.cpu(), ref.aux_counts_GE.cpu())
    if spec.need_sums:
        assert rel_err(out.psum_GE, ref.psum_GE) < 1e-5
    if spec.need_z:
        assert rel_err(out.zsum_G, ref.zsum_G) < 1e-5
    # the reference's gradient also flows through unneeded sums; drop them the same way
    if not spec.need_sums or not spec.need_z:
        lr.grad = None
        ref = fused_router_reference(lr, spec, bias, valid, seg)
        gp_r = gp.double() if spec.need_sums else torch.zeros_like(gp.double())
        gz_r = gz.double() if spec.need_z else torch.zeros_like(gz.double())
        _loss(ref, gw.double(), gp_r, gz_r).backward()
    assert rel_err(lk.grad, lr.grad) < 1e-5


@pytest.mark.parametrize("name", ["softmax_after_topk", "sigmoid_no_renorm", "sigmoid_bias"])
def test_kernel_picks_ties_by_the_smallest_expert_in_descending_order(backend, name):
    """Exact ties (integer logits, +-0.0, negatives) go to the smallest expert id, slot by slot, as a stable sort
    of the selection scores; the picked weights are the reference's."""
    dev, _ = setup(backend)
    spec = SPECS[name]
    g = torch.Generator().manual_seed(3)
    T, E = 40, 16
    logits = torch.randint(-3, 3, (T, E), generator=g).float()
    logits[::3, ::2] = -0.0
    logits[1::3] = 0.0  # whole rows of +0.0 and -0.0 ties
    logits[1::3, 5::4] = -0.0
    logits[0] = -1.0
    logits[0, [0, 2]], logits[0, [1, 3]] = -0.0, 0.0  # the top-3 are experts 0, 1, 2
    bias = (torch.randint(0, 2, (E,), generator=g).float() * 0.5) if name in BIASED else None
    out = fused_router(logits.to(dev), spec, None if bias is None else bias.to(dev), impl="triton")
    sel = (torch.sigmoid(logits) if spec.score_function == "sigmoid" else logits) + (0.0 if bias is None else bias)
    want = torch.sort(-sel, dim=1, stable=True).indices[:, : spec.topk]
    assert torch.equal(out.idx_TK.cpu(), want)
    ref = fused_router_reference(logits.double(), spec, None if bias is None else bias, None, T)
    # torch.topk may break the ties otherwise; the weights depend only on the tied values
    assert rel_err(out.weight_TK.cpu().sort(1).values, ref.weight_TK.sort(1).values.float()) < 1e-6


def test_kernel_covers_groups_only_for_power_of_two_experts():
    spec = SPECS["softmax_groups_max"]
    assert kernel_covers(spec, 256) and kernel_covers(spec, 16)
    assert not kernel_covers(spec, 160)  # DeepSeek-V2: 160 experts in 8 groups -> the reference
    assert kernel_covers(SPECS["softmax_renorm"], 160)


def test_segment_must_divide_tokens():
    with pytest.raises(ValueError, match="segment=5"):
        fused_router(torch.randn(12, 4), RouterSpec(topk=2), segment=5)


def test_router_linear_equals_autograd_through_casts():
    torch.manual_seed(0)
    x = torch.randn(9, 16, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(6, 16, requires_grad=True)
    gl = torch.randn(9, 6)
    out = router_linear(x, w, torch.float32)
    out.backward(gl)
    x2, w2 = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    ref = torch.nn.functional.linear(x2.float(), w2.float())
    ref.backward(gl)
    assert out.dtype == torch.float32 and torch.equal(out, ref)
    assert torch.equal(x.grad, x2.grad) and torch.equal(w.grad, w2.grad)
    # autocast does not lower the router's precision
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert router_linear(x, w, torch.float32).dtype == torch.float32


def test_split3_represents_fp32_values():
    torch.manual_seed(1)
    v = torch.randn(4096) * torch.logspace(-6, 6, 4096)
    parts = split3_reference(v)
    assert parts.dtype == torch.bfloat16 and parts.shape == (3, 4096)
    back = parts[0].double() + parts[1].double() + parts[2].double()
    assert ((back - v.double()).abs() / v.double().abs()).max() < 2**-22


def test_split3_cols_kernel_equals_torch_pieces(backend):
    dev, _ = setup(backend)
    torch.manual_seed(3)
    T, E = 37, 24
    g = (torch.randn(T, E) * torch.logspace(-5, 5, E)).to(dev)
    g[0, :3] = torch.tensor([0.0, -0.0, 1e-30])  # zero, negative zero, a value below bf16's normal range
    got = split3_cols(g, impl="triton").cpu()
    assert got.shape == (T, 4 * E) and got.dtype == torch.bfloat16
    if backend == "cuda":  # the same round-to-nearest-even casts as torch's: bit for bit
        hi, mid, lo = split3_reference(g.cpu())
        assert torch.equal(got, torch.cat([hi, hi, mid, lo], dim=1))
    else:  # Triton's interpreter casts fp32 to bf16 towards zero: still an exact three-piece split
        assert torch.equal(got[:, :E], got[:, E : 2 * E])
        back = got[:, E : 2 * E].double() + got[:, 2 * E : 3 * E].double() + got[:, 3 * E :].double()
        v = g.cpu().double()
        assert ((back - v).abs() <= v.abs() * 2**-22).all()


@pytest.mark.parametrize("pieces,stacked", [((0, 1, 2), True), ((0, 1, 0), True), ((2,), False), ((1, 2), False)])
def test_split3_pieces_orders_and_layouts(backend, pieces, stacked):
    dev, _ = setup(backend)
    torch.manual_seed(4)
    v = (torch.randn(9, 40) * torch.logspace(-4, 4, 40)).to(dev)
    got = split3_pieces(v, pieces, stacked, impl="triton").cpu()
    ref = split3_pieces(v.cpu(), pieces, stacked, impl="torch")
    n = len(pieces)
    assert got.shape == ((n, 9, 40) if stacked else (9, n * 40)) and got.dtype == torch.bfloat16
    if backend == "cuda":
        assert torch.equal(got, ref)
    else:  # the interpreter truncates the casts (see above): check where each piece goes, from the kernel's own pieces
        own = split3_pieces(v, (0, 1, 2), True, impl="triton").cpu()
        want = own[list(pieces)]
        assert torch.equal(got, want if stacked else want.permute(1, 0, 2).reshape(9, n * 40))
    assert torch.equal(split3(v.cpu(), impl="torch"), split3_reference(v.cpu()))
    with pytest.raises(ValueError, match="pieces"):
        split3_pieces(v, (0, 3), stacked)


def _router_problem(dev, seed=2, T=64, H=96, E=24):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g).to(dev, torch.bfloat16)
    w = (torch.randn(E, H, generator=g) * 0.05).to(dev)
    gl = torch.randn(T, E, generator=g).to(dev)
    return x, w, gl


def _grads(x, w, gl, **kw):
    x, w = x.clone().requires_grad_(), w.clone().requires_grad_()
    out = router_linear(x, w, torch.float32, **kw)
    out.backward(gl)
    return out.detach(), x.grad, w.grad


@pytest.mark.parametrize("w_dtype", [torch.float32, torch.bfloat16], ids=["fp32-w", "bf16-w"])
@pytest.mark.parametrize("dev", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_split_router_linear_matches_float64(dev, w_dtype):
    # the split-bf16 form (CPU: its maths in fp32 matmuls; CUDA: bf16 GEMMs with fp32 output) against float64
    if dev == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    x, w, gl = _router_problem(dev)
    w = w.to(w_dtype)
    out, dx, dw = _grads(x, w, gl, split=True)
    ref = x.double() @ w.double().t()
    ref_dx = gl.double() @ w.double()
    ref_dw = gl.double().t() @ x.double()
    fp32_out, fp32_dx, fp32_dw = _grads(x, w, gl, split=False)
    assert out.dtype == torch.float32 and dx.dtype == torch.bfloat16 and dw.dtype == w_dtype
    # logits and dW to fp32 accuracy: no further from float64 than the fp32 GEMM (plus one fp32 rounding)
    for got, fp32, exact in ((out, fp32_out, ref), (dw, fp32_dw, ref_dw)):
        bound = (fp32.double() - exact).abs().max().item() + 2**-23 * exact.abs().max().item()
        assert (got.double() - exact).abs().max().item() <= 2 * bound
    # dx is bf16: one bf16 rounding of float64 (2^-8 relative), plus (split) the dropped terms, which are
    # below 2^-16 of the sum of |g| |W| (the fp32 path's own sums err by less than 2^-20 of it)
    scale = gl.double().abs() @ w.double().abs()
    for got in (dx, fp32_dx):
        assert ((got.double() - ref_dx).abs() <= 2**-8 * ref_dx.abs() + 2**-16 * scale).all()


def test_split_router_linear_refuses_other_dtypes():
    x, w, _ = _router_problem("cpu")
    with pytest.raises(ValueError, match="bf16 activations and fp32 logits"):
        router_linear(x.float(), w, torch.float32, split=True)


def test_empty_batch_gives_empty_sums():
    out = fused_router(torch.randn(0, 8), RouterSpec(topk=2, need_sums=True, need_z=True))
    assert out.idx_TK.shape == (0, 2) and out.counts_GE.sum(0).shape == (8,)
    assert out.counts_GE.sum().item() == 0 and out.zsum_G.sum().item() == 0
