"""The routed experts in chunks of whole experts, keeping for backward only the layer input and the routing.

Legend as in moecore/moe/minimal.py: T tokens, K experts per token, E experts, H hidden, F expert FFN width,
M = T*K routed rows sorted by expert, C the rows of one chunk.

`moe.activation_memory=chunked` computes what the minimal mode computes (gather -> FC1 -> SwiGLU -> FC2 ->
weighted combine, one autograd Function, the same backward formulas) with two differences:

- Nothing of the routed rows is kept for backward, not even the FC1 output h [M, 2F]: only x [T, H] and the
  routing (sort order, its inverse, per-row probability, expert bounds). The backward computes FC1 again.
  The saved state depends on T, H and K (the routing indices) only: not on the expert FFN width or the
  number of experts, and it holds no hidden- or FFN-sized row per assignment.
- Forward and backward walk the sorted rows in chunks of whole experts holding at most
  `moe.activation_chunk_rows` rows (an expert with more rows is a chunk of its own), so the largest
  transient is [C, max(H, 2F)] instead of [M, H]. The output and the input gradient are summed chunk by
  chunk into fp32 [T, H] accumulators; each chunk's weight gradients are written into their experts' slice
  of dW13 / dW2 (`gemm_tn(out=)`), so no buffer of the whole gradient is made twice.

Cost: the FC1 GEMM once more in backward (4·M·H·F FLOPs on top of the expert FFN's 18·M·H·F: +22%), the
launches once per chunk (a small chunk is host-bound: `chunk_plans` picks its GEMMs for that), and one host
synchronisation per forward (the expert bounds cut the chunks), so the mode cannot be captured in a CUDA graph
(the config refuses it with moe.sync_free and train.cuda_graphs=full). Measured in docs/benchmarks.md ("Chunked
expert memory"): 2.3x the standard layer's time at Qwen3-Next's shape, 1.5x at DeepSeek-V3's, on an H200.

Behind an expert-parallel dispatcher (`chunked_sorted_rows`) the rows arrive grouped by expert, each its own
output row: the same Function runs with the identity routing (slices instead of gathers, each row's output and
input gradient written once in the compute dtype) and keeps the received rows, which are the experts' input there.

gpt-oss's biased experts: each chunk adds b13[e] to its FC1 output (forward and the backward's FC1 again) and
p * b2[e] to its rows' output; backward takes the bias gradients as each chunk's per-expert row sums and adds
<dOut_t, b2[e]> to the probability gradient, all within the chunk's rows.

Determinism: a chunk adds its rows into the accumulator with `permute.gather_add_rows`: on GPU one program per
token sums that token's rows of the chunk in top-k order and adds them to its row (no atomics, no sort); on CPU a
serial index_add_. Chunks are added in expert order, so a token's K rows are summed in a different order from the
standard path's (top-k order): outputs match it to fp32 rounding of the sum, not bit for bit.
"""

from __future__ import annotations

import dataclasses

import torch

from moecore.kernels._triton import triton_importable
from moecore.kernels.grouped_ffn import (
    GemmPlan,
    default_plan,
    down_bias_backward,
    down_bias_rows,
    expert_row_sums,
    gemm_nn,
    gemm_nt,
    gemm_tn,
    row_experts,
)
from moecore.kernels.permute import gather_add_rows
from moecore.kernels.quack_gemm import spread_of
from moecore.kernels.swiglu import swiglu, swiglu_backward
from moecore.moe.minimal import expert_bounds, row_operands, sort_by_expert
from moecore.moe.permute import SortedAssignments


def expert_chunks(bounds: list[int], max_rows: int) -> list[tuple[int, int]]:
    """Consecutive expert ranges [e0, e1) covering every expert, each holding at most `max_rows` rows
    (bounds[e1] - bounds[e0]) unless one expert alone holds more; greedy, so there are fewest such ranges.
    An expert without rows joins the range before it (or, at the start, the one after)."""
    if max_rows < 1:
        raise ValueError(f"max_rows={max_rows} is invalid: must be >= 1")
    chunks, e0 = [], 0
    for e in range(1, len(bounds)):  # may expert e - 1 join the range [e0, e - 1)?
        adds_rows, has_rows = bounds[e] > bounds[e - 1], bounds[e - 1] > bounds[e0]
        if adds_rows and has_rows and bounds[e] - bounds[e0] > max_rows:
            chunks.append((e0, e - 1))
            e0 = e - 1
    chunks.append((e0, len(bounds) - 1))
    return chunks


# Multiply-adds (rows x H x F) of a chunk's expert FFN from which its GPU work outlasts the host's launches for it.
# Measured on an H100 with one plan for every chunk (docs/benchmarks.md, "Chunked expert memory", run BM): the host
# spent ~2-3.5 ms per chunk; a
# DeepSeek-V3 chunk of 8192 rows (1.2e11) keeps the GPU busy ~6 ms, one of 2048 rows (3.0e10) ~2 ms, a
# Qwen3-Next chunk of 8192 rows (8.6e9) ~1 ms.
GPU_BOUND_CHUNK = 2**36


def chunk_plans(
    plan: GemmPlan | None, E: int, rows: int, H: int, F: int, device: torch.device, backend: str = "auto"
) -> tuple[GemmPlan, GemmPlan]:
    """(plan for chunks below GPU_BOUND_CHUNK, plan for those above), neither with a host synchronisation.
    A given `plan` runs every chunk (without its host-synchronising GEMMs); None chooses per chunk as follows.

    Small chunks are host-bound, so every GEMM runs as torch._grouped_mm (launched from C++; a Triton launch costs
    the host more than it saves the GPU there). Large chunks keep the layer's per-shape plan, and on CUDA their weight
    gradients go through moecore's Triton kernel, which writes each chunk's dW into its experts' slice of the
    whole gradient: torch._grouped_mm has no `out=`, so its chunk results would be copied into the slices, a
    second pass over every weight gradient (45 GB read and written at DeepSeek-V3's shape) and a chunk-sized
    buffer beside the gradient, where the Triton GEMM runs at 0.8-0.9x torch's rate."""
    if plan is not None:
        return plan.without_host_sync(), plan.without_host_sync()
    plan = default_plan(E, rows, H, F, device, backend).without_host_sync()
    small = GemmPlan.uniform("grouped")
    if device.type != "cuda" or not triton_importable():
        return small, plan
    direct = {k: "triton" for k in ("wgrad13", "wgrad2") if getattr(plan, k) == "grouped"}
    return small, dataclasses.replace(plan, **direct)


def _keyed(plan: GemmPlan, host: list[int], e0: int, e1: int) -> GemmPlan:
    """`plan` with its `spread` that of experts e0..e1 (host bounds), where it runs QuACK's GEMMs."""
    if not plan.uses_quack or host[e1] == host[e0]:
        return plan
    busiest = max(host[e + 1] - host[e] for e in range(e0, e1))
    return dataclasses.replace(plan, spread=spread_of(busiest, host[e1] - host[e0], e1 - e0))


def _rows(t: torch.Tensor, tok_M: torch.Tensor | None, r0: int, r1: int) -> torch.Tensor:
    """Rows r0:r1 of the sorted order: t's rows of those tokens, or a view of t when rows are in order already."""
    return t[r0:r1] if tok_M is None else t.index_select(0, tok_M[r0:r1])


class _ChunkedExperts(torch.autograd.Function):
    """order_M None: x's rows are the sorted rows themselves (`chunked_sorted_rows`): each row's output and
    input gradient are written to its own row, in x's dtype, instead of summed into fp32 token accumulators."""

    @staticmethod
    def forward(
        ctx, x_TH, w13, w2, weight_TK, order_M, inv_M, bounds, probs_in_act, plans, chunk_rows, limit, alpha, b13, b2
    ):
        T, H = x_TH.shape
        in_order = order_M is None
        if in_order:
            K, w13c, w2c, tok_M = 1, w13.to(x_TH.dtype), w2.to(x_TH.dtype), None
            p_M = None if weight_TK is None else weight_TK.reshape(-1)
        else:
            K, w13c, w2c, tok_M, p_M = row_operands(x_TH, w13, w2, weight_TK, order_M)
        host = bounds.tolist()  # the one host synchronisation: where the chunks start and end
        chunks = expert_chunks(host, chunk_rows)
        per_row = H * w2.shape[2]  # multiply-adds of one row through one expert GEMM
        # each chunk's GEMMs (chunk_plans), for its forward and its backward, with QuACK's tiles keyed by the chunk's
        # load spread (read from the host bounds at no cost)
        gemms = [_keyed(plans[(host[e1] - host[e0]) * per_row >= GPU_BOUND_CHUNK], host, e0, e1) for e0, e1 in chunks]
        out = torch.zeros(T, H, dtype=x_TH.dtype if in_order else torch.float32, device=x_TH.device)
        for (e0, e1), plan in zip(chunks, gemms):
            r0, r1 = host[e0], host[e1]
            if r0 == r1:
                continue
            p, b = None if p_M is None else p_M[r0:r1], bounds[e0 : e1 + 1] - r0
            h = gemm_nt(_rows(x_TH, tok_M, r0, r1), w13c[e0:e1], b, None, plan.fwd13, "fwd13", plan.spread)
            expert_C = _chunk_experts(b, r1 - r0, e0, b13, b2)
            if b13 is not None:
                h.add_(b13.to(h.dtype).index_select(0, expert_C))
            a = swiglu(h, p if probs_in_act else None, limit=limit, alpha=alpha)
            del h
            y = gemm_nt(a, w2c[e0:e1], b, None, plan.fwd2, "fwd2", plan.spread)
            del a
            if b2 is not None:  # the probability scales the whole expert output, bias included
                y.add_(down_bias_rows(b2, expert_C, p if probs_in_act else None, y.dtype))
            if in_order:
                out[r0:r1] = y
            else:
                gather_add_rows(out, y, inv_M, K, r0, None if probs_in_act else p_M)
            del y
        ctx.save_for_backward(x_TH, w13c, w2c, p_M, order_M, inv_M, bounds, b13, b2)
        ctx.K, ctx.chunks, ctx.host, ctx.gemms, ctx.limit, ctx.alpha = K, chunks, host, gemms, limit, alpha
        ctx.w_dtypes, ctx.p_dtype = (w13.dtype, w2.dtype), None if weight_TK is None else weight_TK.dtype
        ctx.p_shape = None if weight_TK is None else weight_TK.shape
        return out.to(x_TH.dtype)

    @staticmethod
    def backward(ctx, d_out):
        x_TH, w13c, w2c, p_M, order_M, inv_M, bounds, b13, b2 = ctx.saved_tensors
        T, K, host = x_TH.shape[0], ctx.K, ctx.host
        in_order = order_M is None
        tok_M = None if in_order else order_M // K
        d_out = d_out.to(x_TH.dtype).contiguous()
        need_x, need_w13, need_w2, need_p = ctx.needs_input_grad[:4]
        acc = x_TH.dtype if in_order else torch.float32  # in order: each row written once, no sum
        dx = torch.zeros(T, x_TH.shape[1], dtype=acc, device=x_TH.device) if need_x else None
        dw13 = torch.empty(w13c.shape, dtype=ctx.w_dtypes[0], device=w13c.device) if need_w13 else None
        dw2 = torch.empty(w2c.shape, dtype=ctx.w_dtypes[1], device=w2c.device) if need_w2 else None
        dp = torch.zeros(p_M.shape, dtype=torch.float32, device=p_M.device) if need_p else None
        db13 = None if b13 is None else torch.zeros(b13.shape, dtype=torch.float32, device=b13.device)
        db2 = None if b2 is None else torch.zeros(b2.shape, dtype=torch.float32, device=b2.device)
        for (e0, e1), plan in zip(ctx.chunks, ctx.gemms):
            r0, r1 = host[e0], host[e1]
            if r0 == r1:  # experts without rows: zero weight gradients
                for dw in (dw13, dw2):
                    if dw is not None:
                        dw[e0:e1].zero_()
                continue
            p, b = None if p_M is None else p_M[r0:r1], bounds[e0 : e1 + 1] - r0
            xg = _rows(x_TH, tok_M, r0, r1)
            h = gemm_nt(xg, w13c[e0:e1], b, None, plan.fwd13, "fwd13", plan.spread)  # FC1 again
            expert_C = _chunk_experts(b, r1 - r0, e0, b13, b2)
            if b13 is not None:
                h.add_(b13.to(h.dtype).index_select(0, expert_C))
            g = _rows(d_out, tok_M, r0, r1)  # dOut of each row's token
            da_u = gemm_nn(g, w2c[e0:e1], b, None, plan.dgrad2, "dgrad2", plan.spread)
            # dp = <da_u, a> = <dOut_t, expert output of the row> (and <dOut_t, b2[e]> for the bias)
            dh, dp_c, a_p = swiglu_backward(h, p, da_u, limit=ctx.limit, alpha=ctx.alpha)
            del h, da_u
            if b2 is not None:
                dp_c, db2[e0:e1] = down_bias_backward(g, b2, expert_C, p, dp_c if dp is not None else None, b)
            if b13 is not None:
                db13[e0:e1] = expert_row_sums(dh, b)
            if dp is not None:
                dp[r0:r1] = dp_c
            if dw2 is not None:
                gemm_tn(g, a_p, b, None, plan.wgrad2, ctx.w_dtypes[1], "wgrad2", out=dw2[e0:e1], spread=plan.spread)
            del g, a_p
            if dw13 is not None:
                gemm_tn(dh, xg, b, None, plan.wgrad13, ctx.w_dtypes[0], "wgrad13", out=dw13[e0:e1], spread=plan.spread)
            del xg
            if dx is not None:
                dxg = gemm_nn(dh, w13c[e0:e1], b, None, plan.dgrad13, "dgrad13", plan.spread)
                if in_order:
                    dx[r0:r1] = dxg
                else:
                    gather_add_rows(dx, dxg, inv_M, K, r0)
        dw = None
        if dp is not None:
            dw = (dp if in_order else dp.index_select(0, inv_M)).view(ctx.p_shape).to(ctx.p_dtype)
        db13 = None if db13 is None else db13.to(b13.dtype)
        db2 = None if db2 is None else db2.to(b2.dtype)
        dx = None if dx is None else dx.to(x_TH.dtype)
        return dx, dw13, dw2, dw, None, None, None, None, None, None, None, None, db13, db2


def _chunk_experts(
    bounds_c: torch.Tensor, rows: int, e0: int, b13: torch.Tensor | None, b2: torch.Tensor | None
) -> torch.Tensor | None:
    """The expert of each of a chunk's rows (global ids, from e0), where the experts have biases to add."""
    if b13 is None and b2 is None:
        return None
    return row_experts(bounds_c[1:] - bounds_c[:-1], rows) + e0


def chunked_experts(
    x_TH: torch.Tensor,
    idx_TK: torch.Tensor,
    weight_TK: torch.Tensor,
    w13_EFH: torch.Tensor,
    w2_EHF: torch.Tensor,
    chunk_rows: int,
    probs_in_act: bool = False,
    presorted: SortedAssignments | None = None,
    plan: GemmPlan | None = None,
    backend: str = "auto",
    limit: float | None = None,
    alpha: float | None = None,
    b13: torch.Tensor | None = None,
    b2: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """sum_k weight[t, k] * expert_{idx[t, k]}(x[t]) for SwiGLU experts, in chunks of at most `chunk_rows`
    routed rows, keeping only x and the routing for backward (module docstring).

    Returns (out [T, H] in x's dtype, rows per expert [E] int64), as `minimal_experts` does; differentiable in
    x, the weights and weight_TK. `plan`: the GEMMs' implementations (None: `default_plan` for the layer's
    shape); loops over host counts run as torch._grouped_mm. `limit`: DeepSeek-V4's clipped SwiGLU; `alpha`,
    `b13`, `b2`: gpt-oss's clamped form and expert biases (moecore/kernels/grouped_ffn.py).
    """
    E, F2, H = w13_EFH.shape
    order, inv, bounds = sort_by_expert(idx_TK, E, presorted)
    plans = chunk_plans(plan, E, idx_TK.numel(), H, F2 // 2, x_TH.device, backend)
    x = x_TH.contiguous()
    out = _ChunkedExperts.apply(
        x, w13_EFH, w2_EHF, weight_TK, order, inv, bounds, probs_in_act, plans, chunk_rows, limit, alpha, b13, b2
    )
    return out, (bounds[1:] - bounds[:-1]).long()


def chunked_sorted_rows(
    x_NH: torch.Tensor,
    counts_E: torch.Tensor,
    probs_N: torch.Tensor | None,
    w13_EFH: torch.Tensor,
    w2_EHF: torch.Tensor,
    chunk_rows: int,
    plan: GemmPlan | None = None,
    backend: str = "auto",
    limit: float | None = None,
    alpha: float | None = None,
    b13: torch.Tensor | None = None,
    b2: torch.Tensor | None = None,
) -> torch.Tensor:
    """The expert FFN of rows already grouped by expert (`counts_E` rows each, in expert order: what an
    expert-parallel dispatch hands the experts), in chunks, keeping only x and the counts for backward.

    Under expert parallelism the rows an expert rank receives are its input, so what the chunked mode saves
    there is the FC1 output [N, 2F] and the activation [N, F] that the standard expert FFN keeps beside them.
    probs_N (or None): multiplied into the SwiGLU output (and the down bias), as the standard expert FFN does;
    `limit`, `alpha`, `b13`, `b2` as `chunked_experts`. Returns [N, H].
    """
    E, F2, H = w13_EFH.shape
    bounds = expert_bounds(counts_E, x_NH.device)
    plans = chunk_plans(plan, E, x_NH.shape[0], H, F2 // 2, x_NH.device, backend)
    x = x_NH.contiguous()
    return _ChunkedExperts.apply(
        x, w13_EFH, w2_EHF, probs_N, None, None, bounds, True, plans, chunk_rows, limit, alpha, b13, b2
    )
