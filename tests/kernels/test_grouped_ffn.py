"""The fused expert FFN: the reference against a dense per-token formula, every GEMM plan against it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from moecore.kernels.grouped_ffn import GemmPlan, default_plan, expert_ffn, expert_ffn_reference, gemm_tn
from tests.kernels.conftest import expert_ffn_inputs, rel_err, setup


def test_reference_matches_per_row_formula_fp64():
    E, H, Fd, counts = 3, 8, 5, [2, 0, 3]
    x, w13, w2, c, p, _ = expert_ffn_inputs(E, H, Fd, counts, "cpu", torch.float64)
    y = expert_ffn_reference(x, w13, w2, c, p)
    expert_of_row = torch.repeat_interleave(torch.arange(E), c)
    for r in range(x.shape[0]):
        e = expert_of_row[r]
        gate, up = w13[e, :Fd] @ x[r], w13[e, Fd:] @ x[r]
        expect = w2[e] @ (F.silu(gate) * up * p[r])
        assert torch.allclose(y[r], expect)


def test_plan_rejects_unknown_gemm():
    with pytest.raises(ValueError, match="wgrad13"):
        GemmPlan(wgrad13="magic")
    with pytest.raises(ValueError, match="fwd13"):
        GemmPlan(fwd13="cutlass")


def test_plan_without_host_sync_keeps_device_only_gemms():
    plan = GemmPlan("loop", "streams", "triton", "grouped", "loop", "triton")
    assert plan.needs_host_counts
    free = plan.without_host_sync()
    assert free == GemmPlan("grouped", "grouped", "triton", "grouped", "grouped", "triton")
    assert not free.needs_host_counts


def test_default_plan_on_cuda_takes_the_measured_gemms():
    # moe.gemm_backend=torch: torch's and moecore's Triton GEMMs (QuACK's: tests/kernels/test_quack_gemm.py)
    cuda = torch.device("cuda")
    # Mixtral-like: few large experts, cuBLAS loops (and grouped dx)
    assert default_plan(8, 32768, 4096, 14336, cuda, "torch") == GemmPlan(
        "loop", "loop", "loop", "grouped", "loop", "loop"
    )
    # Qwen3-Next-like: <= 512 rows per expert, hidden 2048: Triton FC2 forward and dx
    assert default_plan(512, 163840, 2048, 512, cuda, "torch") == GemmPlan(fwd2="triton", dgrad13="triton")
    # DeepSeek-V3-like: wide experts, few rows: Triton FC1 / FC2 forward and da, the cuBLAS loop for dx
    assert default_plan(256, 65536, 7168, 2048, cuda, "torch") == GemmPlan("triton", "triton", "triton", "loop")
    # Qwen3-30B-A3B-like: ~1000 rows per expert: torch's grouped GEMM throughout
    assert default_plan(128, 131072, 2048, 768, cuda, "torch") == GemmPlan()
    assert default_plan(512, 163840, 2048, 512, torch.device("cpu")) == GemmPlan()


def test_clipped_reference_matches_per_row_formula_fp64():
    """DeepSeek-V4's clipped SwiGLU in the reference: silu(min(g, L)) * clamp(u, -L, L), written out per row."""
    E, H, Fd, counts, L = 3, 8, 5, [2, 0, 3], 0.5
    x, w13, w2, c, p, _ = expert_ffn_inputs(E, H, Fd, counts, "cpu", torch.float64)
    y = expert_ffn_reference(x, w13, w2, c, p, limit=L)
    assert not torch.allclose(y, expert_ffn_reference(x, w13, w2, c, p))  # the clip changes the result
    expert_of_row = torch.repeat_interleave(torch.arange(E), c)
    for r in range(x.shape[0]):
        e = expert_of_row[r]
        gate, up = w13[e, :Fd] @ x[r], w13[e, Fd:] @ x[r]
        expect = w2[e] @ (F.silu(torch.minimum(gate, torch.tensor(L))) * up.clamp(-L, L) * p[r])
        assert torch.allclose(y[r], expect)


@pytest.mark.parametrize("limit", [None, 0.5])
def test_loop_and_grouped_plans_match_reference_on_cpu(limit):
    # the GEMM primitives themselves run anywhere; use them through the Function with fp32 on CPU
    from moecore.kernels.grouped_ffn import _GroupedFFN

    E, H, Fd, counts = 4, 16, 8, [5, 0, 7, 4]
    x, w13, w2, c, p, dy = expert_ffn_inputs(E, H, Fd, counts, "cpu", torch.float32, seed=3)
    ref = [t.clone().requires_grad_() for t in (x, w13, w2, p)]
    expert_ffn_reference(ref[0], ref[1], ref[2], c, ref[3], limit=limit).backward(dy)
    for plan in (
        GemmPlan.uniform("loop"),
        GemmPlan.uniform("streams"),  # on CPU: the plain loop
        GemmPlan.uniform("grouped"),
        GemmPlan("loop", "grouped", "loop", "grouped", "grouped", "loop"),
    ):
        ts = [t.clone().requires_grad_() for t in (x, w13, w2, p)]
        _GroupedFFN.apply(ts[0], ts[1], ts[2], c, ts[3], plan, "torch", limit).backward(dy)
        for a, b in zip(ts, ref):
            assert rel_err(a.grad, b.grad) < 1e-5, plan


@pytest.mark.parametrize(
    "plan",
    [
        GemmPlan.uniform("grouped", "triton"),
        GemmPlan.uniform("triton"),
        GemmPlan.uniform("loop"),
        GemmPlan.uniform("grouped"),
        GemmPlan("grouped", "grouped", "grouped", "loop", "grouped", "grouped"),
        GemmPlan.uniform("loop").with_streams(),
    ],
    ids=["triton-wgrad", "triton", "loop", "grouped", "mixed", "streams"],
)
def test_function_matches_reference(backend, plan):
    if backend == "interpret" and plan.fwd13 == "grouped" and plan.wgrad13 != "triton":
        pytest.skip("covered by the CPU test above")
    dev, dt = setup(backend)
    E, H, Fd = 5, 32, 16
    counts = [7, 0, 19, 1, 13] if backend == "interpret" else [70, 0, 190, 1, 130]
    x, w13, w2, c, p, dy = expert_ffn_inputs(E, H, Fd, counts, dev, dt, seed=4)
    ref = [t.clone().requires_grad_() for t in (x, w13, w2, p)]
    expert_ffn_reference(ref[0], ref[1], ref[2], c, ref[3]).backward(dy)
    ts = [t.clone().requires_grad_() for t in (x, w13, w2, p)]
    out = expert_ffn(ts[0], ts[1], ts[2], c, ts[3], plan=plan, impl="triton")
    out.backward(dy)
    tol = 2e-2 if dt == torch.bfloat16 else 1e-5
    yr = expert_ffn_reference(x, w13, w2, c, p)
    assert rel_err(out.detach(), yr) < tol
    for a, b in zip(ts, ref):
        assert rel_err(a.grad, b.grad) < tol


def test_clipped_function_matches_reference(backend):
    """DeepSeek-V4's clipped SwiGLU through the fused Function (Triton GEMMs and SwiGLU kernel) against the
    reference with the same limit."""
    dev, dt = setup(backend)
    E, H, Fd, limit = 5, 32, 16, 1.0
    counts = [7, 0, 19, 1, 13] if backend == "interpret" else [70, 0, 190, 1, 130]
    x, w13, w2, c, p, dy = expert_ffn_inputs(E, H, Fd, counts, dev, dt, seed=4)
    h = x[:7].float() @ w13[0].float().t()
    assert 0.2 < (h.abs() > limit).float().mean() < 0.8  # the clip is exercised, not everywhere
    ref = [t.clone().requires_grad_() for t in (x, w13, w2, p)]
    expert_ffn_reference(ref[0], ref[1], ref[2], c, ref[3], limit=limit).backward(dy)
    ts = [t.clone().requires_grad_() for t in (x, w13, w2, p)]
    out = expert_ffn(ts[0], ts[1], ts[2], c, ts[3], plan=GemmPlan.uniform("triton"), impl="triton", limit=limit)
    out.backward(dy)
    tol = 2e-2 if dt == torch.bfloat16 else 1e-5
    assert rel_err(out.detach(), expert_ffn_reference(x, w13, w2, c, p, limit=limit)) < tol
    for a, b in zip(ts, ref):
        assert rel_err(a.grad, b.grad) < tol


def test_triton_wgrad_kernel_ragged_groups(backend):
    dev, dt = setup(backend)
    g = torch.Generator().manual_seed(5)
    counts = [0, 3, 17, 40, 1] if backend == "interpret" else [0, 3, 170, 400, 1, 64, 0, 129]
    E, N1, N2 = len(counts), 24, 40
    M = sum(counts)
    a = torch.randn(M, N1, generator=g).to(dev, dt)
    b = torch.randn(M, N2, generator=g).to(dev, dt)
    bounds = torch.zeros(E + 1, dtype=torch.int32, device=dev)
    bounds[1:] = torch.cumsum(torch.tensor(counts, device=dev), 0)
    out = gemm_tn(a, b, bounds, None, "triton", torch.float32)
    s = 0
    for e, n in enumerate(counts):
        ref = a[s : s + n].double().t() @ b[s : s + n].double()
        if n == 0:
            assert torch.count_nonzero(out[e]) == 0
        else:
            assert rel_err(out[e], ref) < (1e-2 if dt == torch.bfloat16 else 1e-5)
        s += n


def _oss_biases(E: int, H: int, Fd: int, dev, dt) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    return (torch.randn(E, 2 * Fd, generator=g) * 0.5).to(dev, dt), (torch.randn(E, H, generator=g) * 0.5).to(dev, dt)


def test_biased_reference_matches_gpt_oss_experts_fp64():
    """gpt-oss's experts in the reference (biases, clamped form) equal BiasedGroupedExperts' loop, which
    tests/hf/test_gpt_oss.py proves against transformers' GptOssExperts."""
    from moecore.models.biased_moe import BiasedGroupedExperts

    E, H, Fd, counts, limit, alpha = 4, 16, 8, [5, 0, 7, 4], 1.0, 1.702
    x, w13, w2, c, p, _ = expert_ffn_inputs(E, H, Fd, counts, "cpu", torch.float64, seed=3)
    b13, b2 = _oss_biases(E, H, Fd, "cpu", torch.float64)
    oss = BiasedGroupedExperts(E, H, Fd, "swiglu_clamped", alpha, limit, grouped_gemm=False).double()
    with torch.no_grad():
        for name, t in (("w13", w13), ("w2", w2), ("b13", b13), ("b2", b2)):
            getattr(oss, name).copy_(t)
    want = oss(x, c, p)
    assert oss.last_path == "loop"
    got = expert_ffn_reference(x, w13, w2, c, p, limit, alpha, b13, b2)
    assert torch.allclose(got, want)
    h = x[:5] @ w13[0].t() + b13[0]
    assert (h.abs() > limit).float().mean() > 0.2  # the clamp is exercised


@pytest.mark.parametrize("plan", [GemmPlan.uniform("triton"), GemmPlan.uniform("grouped")], ids=["triton", "grouped"])
def test_biased_clamped_function_matches_reference(backend, plan):
    """gpt-oss's experts through the fused Function (biases added per row, the clamped form in the SwiGLU kernel,
    the biases' gradients as row sums) against the reference through autograd: output and every gradient."""
    dev, dt = setup(backend)
    E, H, Fd, limit, alpha = 5, 32, 16, 1.0, 1.702
    counts = [7, 0, 19, 1, 13] if backend == "interpret" else [70, 0, 190, 1, 130]
    x, w13, w2, c, p, dy = expert_ffn_inputs(E, H, Fd, counts, dev, dt, seed=4)
    b13, b2 = _oss_biases(E, H, Fd, dev, torch.float32)  # fp32 biases, as the model keeps them
    ref = [t.clone().requires_grad_() for t in (x, w13, w2, p, b13, b2)]
    expert_ffn_reference(ref[0], ref[1], ref[2], c, ref[3], limit, alpha, ref[4], ref[5]).backward(dy)
    ts = [t.clone().requires_grad_() for t in (x, w13, w2, p, b13, b2)]
    out = expert_ffn(
        ts[0], ts[1], ts[2], c, ts[3], plan=plan, impl="triton", limit=limit, alpha=alpha, b13=ts[4], b2=ts[5]
    )
    out.backward(dy)
    tol = 2e-2 if dt == torch.bfloat16 else 1e-5
    want = expert_ffn_reference(x, w13, w2, c, p, limit, alpha, b13, b2)
    assert rel_err(out.detach(), want) < tol
    for name, a, b in zip(("x", "w13", "w2", "p", "b13", "b2"), ts, ref):
        assert rel_err(a.grad, b.grad) < tol, name
    assert ts[4].grad[1].abs().max() == 0 and ts[5].grad[1].abs().max() == 0  # the expert without rows
