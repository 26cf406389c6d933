"""moe.activation_memory=chunked: the standard path's outputs and gradients, a saved state holding no routed row,
chunks of whole experts, deterministic sums (moecore/moe/chunked.py)."""

from __future__ import annotations

import pytest
import torch

from moecore.bench.saved_memory import moe_saved_bytes
from moecore.config import Config, ConfigError, MoEConfig, load_config
from moecore.kernels.grouped_ffn import gemm_tn
from moecore.moe.chunked import GPU_BOUND_CHUNK, chunk_plans, chunked_experts, chunked_sorted_rows, expert_chunks
from moecore.moe.experts import experts_loop
from moecore.moe.layer import MoELayer
from moecore.moe.minimal import minimal_experts


def _layers(chunk_rows: int, **kw) -> tuple[MoELayer, MoELayer]:
    torch.manual_seed(0)
    std = MoELayer(MoEConfig(**kw), 32, init_std=0.2)
    chunked = MoELayer(MoEConfig(activation_memory="chunked", activation_chunk_rows=chunk_rows, **kw), 32, init_std=0.2)
    chunked.load_state_dict(std.state_dict())
    return std, chunked


def _run(layer: MoELayer, x: torch.Tensor, mask: torch.Tensor) -> tuple:
    for p in layer.parameters():
        p.grad = None
    xi = x.clone().requires_grad_()
    y, aux = layer(xi, mask)
    (y.square().sum() + aux.loss).backward()
    return y.detach(), xi.grad, {n: p.grad for n, p in layer.named_parameters()}, aux.stats


@pytest.mark.parametrize(
    "chunk_rows, kw",
    [
        (7, dict(num_experts=8, router_topk=2, ffn_hidden_size=24)),  # many chunks, some experts above 7 rows
        (1, dict(num_experts=6, router_topk=3, ffn_hidden_size=16, apply_probs_on_input=True)),  # one expert each
        (10_000, dict(num_experts=8, router_topk=4, ffn_hidden_size=8)),  # one chunk
        (
            20,
            dict(
                num_experts=8, router_topk=4, ffn_hidden_size=8, router_score_function="sigmoid",
                router_topk_scaling_factor=2.5, shared_expert_intermediate_size=20, z_loss_coeff=1e-3,
            ),
        ),
    ],
)  # fmt: skip
def test_chunked_equals_standard(chunk_rows, kw):
    std, chunked = _layers(chunk_rows, **kw)
    x = torch.randn(3, 11, 32)
    mask = (torch.rand(3, 11) > 0.2).float()
    (y0, dx0, g0, s0), (y1, dx1, g1, s1) = _run(std, x, mask), _run(chunked, x, mask)
    assert chunked.experts.last_path == "chunked" and std.experts.last_path != "chunked"

    # fp32; the paths sum a token's rows in different orders: absolute tolerance 1e-6 of each tensor's largest entry
    def close(a, b, name):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6 * b.abs().max().item(), msg=name)

    close(y1, y0, "y")
    close(dx1, dx0, "dx")
    assert g0.keys() == g1.keys()
    for n in g0:
        close(g1[n], g0[n], n)
    torch.testing.assert_close(s1["tokens_per_expert"], s0["tokens_per_expert"])


def test_chunked_equals_standard_with_the_clipped_swiglu():
    """DeepSeek-V4's clipped SwiGLU (experts.swiglu_limit) in the chunked Function, several chunks."""
    std, chunked = _layers(7, num_experts=8, router_topk=2, ffn_hidden_size=24)
    std.experts.swiglu_limit = chunked.experts.swiglu_limit = 0.4
    x, mask = torch.randn(3, 11, 32), torch.ones(3, 11)
    (y0, dx0, g0, _), (y1, dx1, g1, _) = _run(std, x, mask), _run(chunked, x, mask)
    assert chunked.experts.last_path == "chunked"
    for a, b in [(y1, y0), (dx1, dx0)] + [(g1[n], g0[n]) for n in g0]:
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6 * b.abs().max().item())
    std.experts.swiglu_limit = None  # the clip is active: without it the output moves
    assert not torch.allclose(_run(std, x, mask)[0], y1, atol=1e-3)


def _problem(seed: int = 1, T: int = 9, H: int = 8, E: int = 5, K: int = 2, F: int = 8) -> tuple:
    torch.manual_seed(seed)
    x = torch.randn(T, H, requires_grad=True)
    w13 = torch.randn(E, 2 * F, H, requires_grad=True)
    w2 = torch.randn(E, H, F, requires_grad=True)
    idx = torch.stack([torch.randperm(E - 1)[:K] for _ in range(T)])  # the last expert gets no row
    w = torch.rand(T, K, requires_grad=True)
    return x, w13, w2, idx, w


def test_chunked_function_matches_autograd_loop():
    """Output and every gradient against autograd through a per-assignment loop, with an empty expert."""
    x, w13, w2, idx, w = _problem()
    out, counts = chunked_experts(x, idx, w, w13, w2, chunk_rows=4)
    assert counts.tolist() == torch.bincount(idx.reshape(-1), minlength=5).tolist() and counts[-1] == 0
    ref = torch.zeros_like(out)
    for t in range(x.shape[0]):
        for k in range(idx.shape[1]):
            e = idx[t, k]
            g, u = (w13[e] @ x[t]).chunk(2)
            ref = ref.index_add(0, torch.tensor([t]), (w[t, k] * (w2[e] @ (torch.nn.functional.silu(g) * u)))[None])
    dout = torch.randn_like(out)
    got = torch.autograd.grad(out, (x, w13, w2, w), dout)
    want = torch.autograd.grad(ref, (x, w13, w2, w), dout)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    assert torch.count_nonzero(got[1][-1]) == 0 and torch.count_nonzero(got[2][-1]) == 0  # the empty expert


@pytest.mark.parametrize("with_probs", [True, False])
def test_sorted_rows_match_the_per_expert_loop_and_keep_only_the_rows(with_probs):
    """The expert-parallel form (rows grouped by expert, as a dispatcher hands them over): output and every
    gradient equal autograd through the standard per-expert loop (an expert without rows included), and
    what it saves for backward is the rows and the bounds, no [N, 2F] or [N, F] activation."""
    torch.manual_seed(3)
    E, H, F = 5, 8, 12
    counts = torch.tensor([4, 0, 7, 1, 3])
    N = int(counts.sum())
    x = torch.randn(N, H, requires_grad=True)
    w13 = torch.randn(E, 2 * F, H, requires_grad=True)
    w2 = torch.randn(E, H, F, requires_grad=True)
    probs = torch.rand(N, requires_grad=True) if with_probs else None
    saved = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = chunked_sorted_rows(x, counts, probs, w13, w2, chunk_rows=5)
    ref = experts_loop(x, counts, w13, w2, "swiglu", probs)
    leaves = (x, w13, w2) + ((probs,) if with_probs else ())
    dout = torch.randn_like(out)
    got = torch.autograd.grad(out, leaves, dout)
    want = torch.autograd.grad(ref, leaves, dout)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert torch.count_nonzero(got[1][1]) == 0 and torch.count_nonzero(got[2][1]) == 0  # the expert without rows
    row_sized = [t for t in saved if t.dim() == 2 and t.shape[0] == N]
    assert [t.shape[1] for t in row_sized] == [H]  # x only: no FC1 output (2F) or activation (F) per row


def test_chunked_equals_minimal_for_every_chunk_size_and_is_deterministic():
    x, w13, w2, idx, w = _problem(seed=2, T=16, E=6, K=3)
    dout = torch.randn(16, 8)
    ref_out, _ = minimal_experts(x, idx, w, w13, w2, probs_in_act=True)
    ref = torch.autograd.grad(ref_out, (x, w13, w2, w), dout)
    for rows in (1, 5, 11, 48):
        runs = []
        for _ in range(2):
            out, _ = chunked_experts(x, idx, w, w13, w2, chunk_rows=rows, probs_in_act=True)
            runs.append((out, *torch.autograd.grad(out, (x, w13, w2, w), dout)))
        for a, b in zip(runs[0], runs[1]):
            assert torch.equal(a, b)  # the same sums in the same order
        for a, b in zip(runs[0], (ref_out, *ref)):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_expert_chunks_hold_whole_experts_within_the_row_limit():
    bounds = [0, 3, 3, 10, 12, 12, 30, 31]  # counts 3, 0, 7, 2, 0, 18, 1
    assert expert_chunks(bounds, 8) == [(0, 2), (2, 3), (3, 5), (5, 6), (6, 7)]  # empty experts 1, 4 join
    assert expert_chunks(bounds, 12) == [(0, 5), (5, 6), (6, 7)]
    assert expert_chunks(bounds, 100) == [(0, 7)]
    assert expert_chunks(bounds, 1) == expert_chunks(bounds, 8)
    assert expert_chunks([0, 0, 0, 5], 4) == [(0, 3)]  # leading empty experts join the first with rows
    assert expert_chunks([0, 0, 0], 4) == [(0, 2)]
    for limit in (1, 2, 5, 8, 19, 40):
        chunks = expert_chunks(bounds, limit)
        assert chunks[0][0] == 0 and chunks[-1][1] == 7
        assert all(a[1] == b[0] for a, b in zip(chunks, chunks[1:]))  # consecutive, every expert once
        for e0, e1 in chunks:  # within the limit, or one expert with rows (and empty ones) above it
            assert bounds[e1] - bounds[e0] <= limit or sum(bounds[e + 1] > bounds[e] for e in range(e0, e1)) == 1
    with pytest.raises(ValueError, match="max_rows=0"):
        expert_chunks(bounds, 0)


def test_chunk_plans_keep_a_given_plan_and_never_sync_the_host():
    """A given GEMM plan runs every chunk, without its per-expert loops (they need host counts); without one,
    host-bound chunks run torch's grouped GEMMs throughout, and GPU-bound ones (>= GPU_BOUND_CHUNK
    multiply-adds) keep the per-shape plan, with Triton weight gradients on CUDA only."""
    from moecore.kernels.grouped_ffn import GemmPlan

    given = GemmPlan("loop", "triton", "streams", "grouped", "loop", "triton")
    small, large = chunk_plans(given, 8, 4096, 64, 32, torch.device("cpu"))
    assert small == large == GemmPlan("grouped", "triton", "grouped", "grouped", "grouped", "triton")
    small, large = chunk_plans(None, 512, 163840, 2048, 512, torch.device("cpu"))
    assert small == GemmPlan.uniform("grouped") and not large.needs_host_counts
    assert 8192 * 2048 * 512 < GPU_BOUND_CHUNK <= 8192 * 7168 * 2048  # Qwen3-Next's chunk small, DeepSeek-V3's large


@pytest.mark.parametrize("impl", ["grouped", "loop"])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.float64])
def test_gemm_tn_writes_into_a_slice(impl, out_dtype):
    torch.manual_seed(3)
    a, b = torch.randn(10, 8), torch.randn(10, 4)
    bounds = torch.tensor([0, 4, 4, 10], dtype=torch.int32)
    full = torch.full((5, 8, 4), 7.0, dtype=out_dtype)
    got = gemm_tn(a, b, bounds, [4, 0, 6], impl, out_dtype, out=full[1:4])
    assert got.data_ptr() == full[1].data_ptr()
    want = torch.stack([a[:4].t() @ b[:4], torch.zeros(8, 4), a[4:].t() @ b[4:]]).to(out_dtype)
    torch.testing.assert_close(full[1:4], want)
    assert (full[0] == 7).all() and (full[4] == 7).all()  # nothing outside the slice


def test_saved_state_holds_no_routed_row_and_does_not_grow_with_granularity():
    """8 experts top-2 FFN 64 vs 32 experts top-8 FFN 16: nothing bigger than routing is saved (x is the input)."""
    coarse = moe_saved_bytes(8, 2, 64, hidden=128, tokens=128, mode="chunked")
    fine = moe_saved_bytes(32, 8, 16, hidden=128, tokens=128, mode="chunked")
    assert coarse["activations"] == fine["activations"] == 0
    minimal = moe_saved_bytes(8, 2, 64, hidden=128, tokens=128, mode="minimal")
    assert minimal["activations"] == 128 * 2 * 2 * 64 * 4  # what chunked does not keep: h [T*K, 2F] fp32
    assert coarse["routing"] <= minimal["routing"]


def test_config_rules_of_chunked():
    cfg = Config()
    cfg.moe.activation_memory = "chunked"
    cfg.moe.sync_free = True
    with pytest.raises(ConfigError, match="moe.activation_memory.*sync_free=false"):
        cfg.validate()
    cfg = Config()
    cfg.moe.activation_memory = "chunked"
    cfg.moe.expert_capacity_factor = 1.25
    with pytest.raises(ConfigError, match="dropless"):
        cfg.validate()
    cfg = Config()
    cfg.moe.activation_chunk_rows = 0
    with pytest.raises(ConfigError, match="moe.activation_chunk_rows"):
        cfg.validate()
    for mode, ok in (("chunked", True), ("minimal", False)):  # chunked runs behind the expert-parallel dispatch
        cfg = load_config("tiny-moe", [f"moe.activation_memory={mode}", "parallel.ep=2"])
        if ok:
            cfg.validate()
        else:
            with pytest.raises(ConfigError, match="needs parallel.ep=1"):
                cfg.validate()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_chunked_matches_standard_in_bf16_and_repeats_bit_for_bit():
    """bf16 on the GPU (fused router, default GEMM plan): within bf16 rounding of the standard path, and the
    sort-based accumulation gives the same bits twice."""
    kw = dict(num_experts=16, router_topk=4, ffn_hidden_size=64, apply_probs_on_input=True)
    torch.manual_seed(0)
    std = MoELayer(MoEConfig(**kw), 256).cuda().bfloat16()
    chunked = MoELayer(MoEConfig(activation_memory="chunked", activation_chunk_rows=300, **kw), 256).cuda().bfloat16()
    chunked.load_state_dict(std.state_dict())
    x = torch.randn(2, 512, 256, device="cuda", dtype=torch.bfloat16)
    mask = torch.ones(2, 512, device="cuda")
    (y0, dx0, g0, _), (y1, dx1, g1, _) = _run(std, x, mask), _run(chunked, x, mask)
    assert chunked.experts.last_path == "chunked"
    y2, dx2, g2, _ = _run(chunked, x, mask)
    assert torch.equal(y1, y2) and torch.equal(dx1, dx2)
    assert all(torch.equal(g1[n], g2[n]) for n in g1)
    for a, b in [(y1, y0), (dx1, dx0), *((g1[n], g0[n]) for n in g0)]:
        # bf16: the paths' GEMMs split rows differently and sum a token's rows in another order, so h, the
        # activation and the sums round differently; 1% of each tensor's largest entry
        torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=1e-2 * b.abs().max().item())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_sorted_rows_match_the_fused_expert_ffn_in_bf16():
    """The expert-parallel form on the GPU against the standard fused expert FFN (bf16, probabilities inside):
    within bf16 rounding (1% of each tensor's largest entry), and the same bits on repeat."""
    from moecore.kernels.grouped_ffn import expert_ffn

    torch.manual_seed(0)
    E, H, F = 16, 256, 128
    counts = torch.randint(0, 200, (E,), device="cuda")
    counts[3] = 0
    N = int(counts.sum())
    x = torch.randn(N, H, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w13 = (0.05 * torch.randn(E, 2 * F, H, device="cuda")).bfloat16().requires_grad_()
    w2 = (0.05 * torch.randn(E, H, F, device="cuda")).bfloat16().requires_grad_()
    probs = torch.rand(N, device="cuda", requires_grad=True)
    dout = torch.randn(N, H, device="cuda", dtype=torch.bfloat16)

    def run(fn) -> list[torch.Tensor]:
        out = fn()
        return [out.detach(), *torch.autograd.grad(out, (x, w13, w2, probs), dout)]

    got = run(lambda: chunked_sorted_rows(x, counts, probs, w13, w2, chunk_rows=300))
    again = run(lambda: chunked_sorted_rows(x, counts, probs, w13, w2, chunk_rows=300))
    want = run(lambda: expert_ffn(x, w13, w2, counts, probs))
    assert all(torch.equal(a, b) for a, b in zip(got, again))
    for a, b in zip(got, want):
        torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=1e-2 * b.float().abs().max().item())


def test_planner_counts_the_chunked_mode():
    """`moecore plan`: chunked keeps the minimal mode's routing and nothing of the experts."""
    from moecore.plan.activations import ActContext, ffn_modules
    from moecore.plan.layout import layout_of

    def moe_bytes(mode: str, *more: str) -> dict:
        over = [f"moe.activation_memory={mode}", "moe.num_experts=64", "moe.router_topk=8", "parallel.ep=1", *more]
        cfg = load_config("tiny-moe", over)
        return ffn_modules(cfg, True, layout_of(cfg, 1), ActContext(4096, 2, 2, True, 1.0))

    chunked, minimal = moe_bytes("chunked"), moe_bytes("minimal")
    assert chunked["experts"] == 0 and minimal["experts"] > 0
    assert chunked["permute"] == minimal["permute"] == 4096 * 8 * (8 + 8 + 4)
    assert chunked["router"] == minimal["router"]
    # FP8 experts run the standard path (moe/layer.py _minimal_memory)
    assert moe_bytes("chunked", "train.precision=fp8")["experts"] == moe_bytes("standard")["experts"] > 0
    # behind the expert-parallel dispatch (chunked_sorted_rows): the received rows only, the permutation as standard
    h, f = load_config("tiny-moe", []).model.hidden_size, load_config("tiny-moe", []).moe.ffn_hidden_size
    ep_chunked, ep_std = moe_bytes("chunked", "parallel.ep=2"), moe_bytes("standard", "parallel.ep=2")
    rows = ep_chunked["experts"] / (h * 2)
    assert rows == 4096 * 8  # balanced routing: an expert rank receives as many rows as its tokens send
    assert ep_std["experts"] == rows * (h * 2 + 2 * f * 2 + 4) and ep_chunked["permute"] == ep_std["permute"]
    assert moe_bytes("minimal", "parallel.ep=2")["experts"] == ep_std["experts"]  # minimal needs one expert rank


def test_planner_backward_workspace_of_the_chunked_mode():
    """The largest backward transient of a chunked MoE layer: the fp32 input-gradient accumulator and one chunk's
    buffers, far below the standard path's [N, 2H + 3F] at 8 x 4096 routed rows and 1024-row chunks."""
    from moecore.plan.activations import ActContext, layer_backward_workspace
    from moecore.plan.layout import layout_of

    def workspace(mode: str, rows: int = 1024) -> float:
        over = [f"moe.activation_memory={mode}", f"moe.activation_chunk_rows={rows}", "moe.num_experts=64",
                "moe.router_topk=8", "parallel.ep=1"]  # fmt: skip
        cfg = load_config("tiny-moe", over)
        return layer_backward_workspace(cfg, True, layout_of(cfg, 1), ActContext(4096, 2, 2, True, 1.0))

    cfg = load_config("tiny-moe", [])
    h, f = cfg.model.hidden_size, cfg.moe.ffn_hidden_size
    assert workspace("standard") == 4096 * 8 * 2 * (2 * h + 3 * f)
    assert workspace("chunked") == 4096 * h * 4 + 1024 * max(2 * (2 * h + 6 * f), 2 * (2 * f + h) + 4 * h)
    assert workspace("chunked") < workspace("standard") / 4
    assert workspace("chunked", 10**9) > workspace("chunked")  # one chunk: every routed row at once
