"""The routed experts of one MoE layer as one autograd Function whose saved state does not grow with top-k.

Legend: T tokens, K experts per token, E experts, H hidden, F expert FFN width, M = T*K routed rows.

`moe.activation_memory=minimal` runs gather -> FC1 -> SwiGLU -> FC2 -> weighted combine as one
Function that keeps for backward only

    x [T, H]        the layer input (the router keeps it anyway),
    h [M, 2F]       the FC1 output (M * 2F = T * 2 * K * F: fixed at fixed active parameters),
    routing         the sort order [M], its inverse [M], the per-row probability [M], the expert bounds [E+1],

where the standard path (permute -> fused expert FFN -> unpermute) also keeps the permuted input
[M, H] and the expert outputs [M, H] (for the probability gradient): two top-k copies of a hidden-
sized row, which grow with K at fixed active parameters (SonicMoE, Guo et al. 2025, makes the same
observation). Backward, with g = dOut[token of row] (a gather of the output gradient) and a = silu(gate) * up:

    da_u  = g @ w2[e]                       [M, F]  (grouped GEMM)
    dp    = sum_f da_u * a  = <dOut_t, expert_out_row>   (the probability gradient, from the SwiGLU backward)
    dh    = SwiGLU'(h) applied to p * da_u                (a * p recomputed from h on the way)
    dW2   = g^T (a * p),   dW13 = dh^T x[token of row] (x gathered again),   dx_t = sum_k (dh @ w13[e])_row

so nothing the size of [M, H] outlives the forward. Where QuACK's GEMMs serve (the `quack` extra on Hopper), the
FC1 GEMM takes x and the backward's FC2 GEMMs take dOut with the rows' tokens (`quack_gemm`'s `rows`), and dW13 is
computed transposed, dW13[e]^T = x[token of row]^T dh, so that the gathered operand is the left one: each GEMM
gathers in its loads or copies the rows first, whichever timed faster for its shape. The forward multiplies the probability where the
standard path does (`apply_probs_on_input`: inside the activation; else at the combine, in fp32), so
both paths round alike. Every step is device-side (sort, counts by `searchsorted`, grouped GEMMs on
device offsets): no host synchronisation. The six GEMMs follow the experts' GemmPlan (`default_plan` per
shape unless one is set) with its host-count loops run as torch._grouped_mm, so moecore's Triton grouped
GEMMs serve where the plan picks them. It needs `torch._grouped_mm` for the rows' device and dtype
(`experts.grouped_mm_supported`); the layer falls back to the standard path elsewhere.

gpt-oss's experts (biases b13 [E, 2F], b2 [E, H], the clamped SwiGLU) run here too: h gains b13[e] before it is
kept, each row's output p * b2[e] (moecore/kernels/grouped_ffn.py). In backward db13 is each expert's row sum of
dh, and the down bias's terms are [T, E] products with dOut rather than a gathered copy of it per routed row:
dp_row += (dOut @ b2^T)[t, e] and db2 = S^T dOut, S [T, E] holding each routed row's probability.
"""

from __future__ import annotations

import torch

from moecore.kernels import quack_gemm, quack_swiglu
from moecore.kernels.grouped_ffn import (
    GemmPlan,
    default_plan,
    down_bias_rows,
    expert_row_sums,
    gemm_nn,
    gemm_nt,
    gemm_tn,
    row_experts,
)
from moecore.kernels.grouped_gemm import group_bounds
from moecore.kernels.permute import inverse_permutation, sorted_copies, unpermute_rows
from moecore.kernels.swiglu import swiglu, swiglu_backward
from moecore.moe.permute import SortedAssignments, sort_assignments


def sort_by_expert(
    idx_TK: torch.Tensor, num_experts: int, presorted: SortedAssignments | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(order [M], inverse [M], bounds [E+1] int32) of the stable sort of the flat assignments by expert.

    Rows of expert e are order[bounds[e]:bounds[e+1]]; counts come from a binary search in the sorted
    ids, so no host synchronisation (torch.bincount reads the maximum back on CUDA).
    """
    s = presorted if presorted is not None else sort_assignments(idx_TK, num_experts)
    bounds = expert_bounds(s.counts, idx_TK.device)
    return s.order, inverse_permutation(s.order) if s.inv is None else s.inv, bounds


def expert_bounds(counts_E: torch.Tensor, device: torch.device) -> torch.Tensor:
    """int32 [E+1]: where each expert's rows start in the sorted rows (and the end), from its row counts."""
    return group_bounds(counts_E.to(device))


def row_operands(
    x_TH: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weight_TK: torch.Tensor, order_M: torch.Tensor
) -> tuple[int, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(K, w13 and w2 in x's dtype, each sorted row's token [M], each sorted row's probability [M])."""
    K = order_M.numel() // max(x_TH.shape[0], 1)
    p_M = weight_TK.reshape(-1).index_select(0, order_M)
    return K, w13.to(x_TH.dtype), w2.to(x_TH.dtype), order_M // K, p_M


def gathers_in_loads(plan: GemmPlan, x_TH: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> bool:
    """Whether the GEMMs that read gathered rows (FC1 forward, both FC2 GEMMs of the backward, dW13) run QuACK's
    kernels, which gather the rows in their loads instead of reading a gathered copy."""
    kinds = (plan.fwd13, plan.dgrad2, plan.wgrad2, plan.wgrad13)
    return all(k == "quack" for k in kinds) and quack_gemm.quack_runs(x_TH, w13, w2)


class _MinimalExperts(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx, x_TH, w13, w2, weight_TK, order_M, inv_M, bounds, probs_in_act: bool, plan: GemmPlan, limit, alpha, b13, b2
    ):
        T = x_TH.shape[0]
        K, w13c, w2c, tok_M, p_M = row_operands(x_TH, w13, w2, weight_TK, order_M)
        ctx.gather = gathers_in_loads(plan, x_TH, w13c, w2c)
        if ctx.gather:  # QuACK reads x[token of row] in the GEMM's loads
            h = quack_gemm.grouped_mm(x_TH, w13c, bounds, True, "fwd13", rows=tok_M.int(), spread=plan.spread)
        else:
            h = gemm_nt(sorted_copies(x_TH, order_M, inv_M, K), w13c, bounds, None, plan.fwd13, "fwd13", plan.spread)
        expert_M = None if b13 is None and b2 is None else row_experts(bounds[1:] - bounds[:-1], order_M.numel())
        if b13 is not None:  # h (with the bias) is what the backward's SwiGLU derivative reads
            h.add_(b13.to(h.dtype).index_select(0, expert_M))
        a = swiglu(h, p_M if probs_in_act else None, limit=limit, alpha=alpha)
        y = gemm_nt(a, w2c, bounds, None, plan.fwd2, "fwd2", plan.spread)
        del a
        if b2 is not None:  # the probability scales the whole expert output, bias included
            y.add_(down_bias_rows(b2, expert_M, p_M if probs_in_act else None, y.dtype))
        out = unpermute_rows(y, order_M, inv_M, None if probs_in_act else weight_TK, T, K)
        ctx.save_for_backward(x_TH, w13c, w2c, h, p_M, order_M, inv_M, bounds, expert_M, b2)
        ctx.K, ctx.w_dtypes, ctx.p_dtype, ctx.plan = K, (w13.dtype, w2.dtype), weight_TK.dtype, plan
        ctx.limit, ctx.alpha = limit, alpha
        ctx.b_dtypes = (None if b13 is None else b13.dtype, None if b2 is None else b2.dtype)
        return out

    @staticmethod
    def backward(ctx, d_out):
        x_TH, w13c, w2c, h, p_M, order_M, inv_M, bounds, expert_M, b2 = ctx.saved_tensors
        T, K, plan = x_TH.shape[0], ctx.K, ctx.plan
        tok_M = order_M // K
        rows = tok_M.int() if ctx.gather else None  # QuACK gathers dOut's and x's rows in its loads
        d = d_out.to(x_TH.dtype).contiguous()
        g = d if ctx.gather else sorted_copies(d, order_M, inv_M, K)  # dOut of each row's token (rows: gathered later)
        if ctx.gather:
            da_u = quack_gemm.grouped_mm(g, w2c, bounds, False, "dgrad2", rows=rows, spread=plan.spread)
        else:
            da_u = gemm_nn(g, w2c, bounds, None, plan.dgrad2, "dgrad2", plan.spread)
        # dp = <da_u, a> = <dOut_t, expert output of the row> (without its bias: added below)
        dh, dp, a_p = swiglu_backward(h, p_M, da_u, limit=ctx.limit, alpha=ctx.alpha)
        del da_u
        db13 = db2 = None
        if b2 is not None:
            dp_bias, db2 = down_bias_grads_by_token(d, b2, tok_M, expert_M, p_M)
            dp = dp + dp_bias
            db2 = db2.to(ctx.b_dtypes[1])
        if ctx.b_dtypes[0] is not None:
            db13 = expert_row_sums(dh, bounds).to(ctx.b_dtypes[0])
        del d
        dw2 = None
        if ctx.needs_input_grad[2] and ctx.gather:
            dw2 = quack_gemm.grouped_wgrad(g, a_p, bounds, "wgrad2", rows=rows, spread=plan.spread).to(ctx.w_dtypes[1])
        elif ctx.needs_input_grad[2]:
            dw2 = gemm_tn(g, a_p, bounds, None, plan.wgrad2, ctx.w_dtypes[1], "wgrad2", spread=plan.spread)
        del g, a_p
        dw13 = None
        if ctx.needs_input_grad[1] and ctx.gather:  # dW13[e]^T = x[rows of e]^T dh[rows of e], through a view
            dw13 = torch.empty(w13c.shape, dtype=x_TH.dtype, device=x_TH.device)
            dw13_t = dw13.transpose(1, 2)
            quack_gemm.grouped_wgrad(x_TH, dh, bounds, "wgrad13", out=dw13_t, rows=rows, spread=plan.spread)
            dw13 = dw13.to(ctx.w_dtypes[0])
        elif ctx.needs_input_grad[1]:
            xg = sorted_copies(x_TH, order_M, inv_M, K)
            dw13 = gemm_tn(dh, xg, bounds, None, plan.wgrad13, ctx.w_dtypes[0], "wgrad13", spread=plan.spread)
        dx = None
        if ctx.needs_input_grad[0]:
            dxg = gemm_nn(dh, w13c, bounds, None, plan.dgrad13, "dgrad13", plan.spread)
            dx = unpermute_rows(dxg, order_M, inv_M, None, T, K)  # sum over each token's K rows (fp32)
        dw = None
        if ctx.needs_input_grad[3]:
            dw = dp.index_select(0, inv_M).view(T, K).to(ctx.p_dtype)
        return dx, dw13, dw2, dw, None, None, None, None, None, None, None, db13, db2


def down_bias_grads_by_token(
    d_TH: torch.Tensor, b2_EH: torch.Tensor, tok_M: torch.Tensor, expert_M: torch.Tensor, p_M: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """gpt-oss's down bias in backward from token-order dOut (`down_bias_backward` takes rows sorted by expert),
    without a [M, H] copy of it: (dp [M], db2 [E, H]), both fp32.

    Row r (token t, expert e, probability p) adds p * b2[e] to token t's output, so its probability's gradient
    gains <dOut_t, b2[e]> = (dOut @ b2^T)[t, e] and b2[e]'s gradient is sum_r p_r dOut_t = (S^T dOut)[e] with
    S [T, E] holding each routed row's probability (top-k experts are distinct, so no two rows share a cell).
    Both are [T, E] x [E, H] products: T * H * E multiply-adds, small beside the expert GEMMs' M * H * F."""
    d = d_TH.float()
    dp = (d @ b2_EH.float().t())[tok_M, expert_M]
    S = d.new_zeros(d.shape[0], b2_EH.shape[0]).index_put_((tok_M, expert_M), p_M.float(), accumulate=True)
    return dp, S.t() @ d


class _EpilogueSwiGLUExperts(torch.autograd.Function):
    """The Function above with the SwiGLU and its backward in QuACK's GEMM epilogues (moecore/kernels/
    quack_swiglu.py): h kept in the interleaved order, the probabilities applied at the combine."""

    @staticmethod
    def forward(ctx, x_TH, w13, w2, weight_TK, order_M, inv_M, bounds, plan: GemmPlan):
        T = x_TH.shape[0]
        K, w13c, w2c, tok_M, p_M = row_operands(x_TH, w13, w2, weight_TK, order_M)
        hi, s = quack_swiglu.gated_fc1(sorted_copies(x_TH, order_M, inv_M, K), w13c, bounds)
        y = gemm_nt(s, w2c, bounds, None, plan.fwd2, "fwd2")
        del s
        out = unpermute_rows(y, order_M, inv_M, weight_TK, T, K)
        ctx.save_for_backward(x_TH, w13c, w2c, hi, p_M, order_M, inv_M, bounds)
        ctx.K, ctx.w_dtypes, ctx.p_dtype, ctx.plan = K, (w13.dtype, w2.dtype), weight_TK.dtype, plan
        return out

    @staticmethod
    def backward(ctx, d_out):
        x_TH, w13c, w2c, hi, p_M, order_M, inv_M, bounds = ctx.saved_tensors
        T, K, needs = x_TH.shape[0], ctx.K, ctx.needs_input_grad
        g = sorted_copies(d_out.to(x_TH.dtype), order_M, inv_M, K)  # dOut of each row's token
        dhi, a_p, dp = quack_swiglu.dgated_fc2(g, w2c, hi, p_M, bounds)  # dp = <dOut_t, expert output of the row>
        del hi
        dw2 = gemm_tn(g, a_p, bounds, None, ctx.plan.wgrad2, ctx.w_dtypes[1], "wgrad2") if needs[2] else None
        del g, a_p
        dw13 = None
        if needs[1]:
            dw13 = quack_swiglu.fc1_wgrad(dhi, sorted_copies(x_TH, order_M, inv_M, K), bounds).to(ctx.w_dtypes[0])
        dx = None
        if needs[0]:
            dx = unpermute_rows(quack_swiglu.fc1_dgrad(dhi, w13c, bounds), order_M, inv_M, None, T, K)
        dw = dp.index_select(0, inv_M).view(T, K).to(ctx.p_dtype) if needs[3] else None
        return dx, dw13, dw2, dw, None, None, None, None


def minimal_experts(
    x_TH: torch.Tensor,
    idx_TK: torch.Tensor,
    weight_TK: torch.Tensor,
    w13_EFH: torch.Tensor,
    w2_EHF: torch.Tensor,
    probs_in_act: bool = False,
    presorted: SortedAssignments | None = None,
    plan: GemmPlan | None = None,
    backend: str = "auto",
    swiglu_epilogue: bool = False,
    load_spread: quack_gemm.LoadSpread | None = None,
    limit: float | None = None,
    alpha: float | None = None,
    b13: torch.Tensor | None = None,
    b2: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """sum_k weight[t, k] * expert_{idx[t, k]}(x[t]) for SwiGLU experts, keeping x, h and routing for backward.

    Returns (out [T, H] in x's dtype, rows per expert [E] int64). Differentiable in x, the weights and
    weight_TK (the router's gradient path). `presorted`: `sort_assignments(idx_TK)` already computed.
    `plan`: the GEMMs' implementations (None: `default_plan` for this shape and `backend`); loops over host
    counts run as torch._grouped_mm. `swiglu_epilogue`: the SwiGLU in QuACK's GEMM epilogues where they run
    (`moe.swiglu_epilogue`; probabilities at the combine, so not with `probs_in_act`). `load_spread`: the layer's
    tracker of its load spread, which QuACK's tile choices are keyed by. `limit`: DeepSeek-V4's clipped SwiGLU
    (moecore/kernels/swiglu.py); with `alpha` too, gpt-oss's clamped form; `b13` [E, 2F] / `b2` [E, H]: gpt-oss's
    expert biases (moecore/kernels/grouped_ffn.py). QuACK's epilogues have none of these, so with any of them the
    separate SwiGLU kernel runs.
    """
    E, F2, H = w13_EFH.shape
    order, inv, bounds = sort_by_expert(idx_TK, E, presorted)
    counts = (bounds[1:] - bounds[:-1]).long()
    plan = (plan or default_plan(E, idx_TK.numel(), H, F2 // 2, x_TH.device, backend)).without_host_sync()
    plan = plan.observing(load_spread, counts, idx_TK.numel())
    x = x_TH.contiguous()
    plain = limit is None and alpha is None and b13 is None and b2 is None
    epilogue = swiglu_epilogue and plain and not probs_in_act and backend != "torch"
    if epilogue and quack_swiglu.runs(x, F2 // 2):
        out = _EpilogueSwiGLUExperts.apply(x, w13_EFH, w2_EHF, weight_TK, order, inv, bounds, plan)
    else:
        out = _MinimalExperts.apply(
            x, w13_EFH, w2_EHF, weight_TK, order, inv, bounds, probs_in_act, plan, limit, alpha, b13, b2
        )
    plan.observed(load_spread, counts, idx_TK.numel())
    return out, counts
