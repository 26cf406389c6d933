"""The whole expert FFN (w13 -> SwiGLU * prob -> w2) as one autograd Function, with a GEMM chosen per shape.

Legend: M routed rows (sorted by expert), E experts, H hidden size, F expert FFN width.
Weights as the MoE layer stores them: w13 [E, 2F, H] (gate rows then up rows), w2 [E, H, F].

    forward                               backward (dy [M, H])
    h  = x_e @ w13[e]^T        [M, 2F]    da   = dy_e @ w2[e]                [M, F]   (dgrad)
    a  = silu(g) * u * p       [M, F]     dh, dp, a = swiglu_backward(h, p, da)       (a recomputed)
    (with `limit`: DeepSeek-V4's clipped SwiGLU, g and u clipped first; with `alpha` too, gpt-oss's clamped form;
    moecore/kernels/swiglu.py)

gpt-oss's expert biases (b13 [E, 2F], b2 [E, H]) are added per row from the row's expert: h += b13[e] before the
activation, y += p * b2[e] after w2 (p = 1 without probabilities); backward adds <dy, b2[e]> to dp, and the
biases' gradients are each expert's row sums of dh and of p * dy (`expert_row_sums`: a grouped GEMM with a column
of ones, so no atomics).
    y  = a_e @ w2[e]^T         [M, H]     dW2[e]  = dy_e^T @ a_e             [E, H, F] (wgrad)
                                          dx   = dh_e @ w13[e]               [M, H]   (dgrad)
                                          dW13[e] = dh_e^T @ x_e             [E, 2F, H] (wgrad)

Only x, h and p are kept for backward (a is recomputed by the fused SwiGLU backward), less than
autograd through the separate ops would keep. Each GEMM kind runs one of:
  "grouped": torch._grouped_mm, one launch for all experts (no host sync);
  "loop":    one cuBLAS GEMM per expert on slices (needs the counts on the host: one sync);
  "streams": the loop with consecutive experts' GEMMs on two CUDA streams, so that one GEMM's last
             partial wave of tiles overlaps the next GEMM (an experiment for few large experts);
  "triton":  moecore's Triton grouped GEMMs (`grouped_gemm.py`): one launch, tiles scheduled on the GPU
             (no host sync), tile sizes per GEMM kind from `grouped_gemm.tiles_for`;
  "quack":   QuACK's warp-specialised CuTe-DSL grouped GEMMs (`quack_gemm.py`, an optional dependency, Hopper):
             one launch, no host sync; "grouped" where they cannot run (no QuACK, another GPU, odd widths).
`default_plan` picks per shape from the measurements recorded in docs/benchmarks.md. The
reference `expert_ffn_reference` is a loop over experts through plain autograd; `expert_ffn` uses
the Function where the GEMMs can run (CUDA, or `impl="triton"`) and the reference elsewhere.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from moecore.kernels import quack_gemm
from moecore.kernels._triton import use_triton
from moecore.kernels.grouped_gemm import group_bounds, grouped_mm, grouped_wgrad, tiles_for
from moecore.kernels.swiglu import swiglu, swiglu_backward, swiglu_reference

GEMM_IMPLS = ("grouped", "loop", "streams", "triton", "quack")
GEMM_BACKENDS = ("auto", "torch")  # moe.gemm_backend: auto takes QuACK's GEMMs where they run, torch never
GEMM_KINDS = ("fwd13", "fwd2", "dgrad2", "dgrad13", "wgrad2", "wgrad13")  # the GemmPlan fields, in order


@dataclass(frozen=True)
class GemmPlan:
    """Which implementation each of the six GEMMs of the expert FFN uses (see the module docstring).

    fwd13 / fwd2: h = x @ w13^T, y = a @ w2^T; dgrad2 / dgrad13: da = dy @ w2, dx = dh @ w13;
    wgrad2 / wgrad13: dW2 = dy^T a, dW13 = dh^T x. Values: grouped | loop | streams | triton | quack.
    `spread`: the layer's load spread (`quack_gemm.LoadSpread`), which QuACK's tile choices are keyed by.
    """

    fwd13: str = "grouped"
    fwd2: str = "grouped"
    dgrad2: str = "grouped"
    dgrad13: str = "grouped"
    wgrad2: str = "grouped"
    wgrad13: str = "grouped"
    spread: int = 1

    def __post_init__(self) -> None:
        for name in GEMM_KINDS:
            v = getattr(self, name)
            if v not in GEMM_IMPLS:
                raise ValueError(f"GemmPlan.{name}={v!r} is invalid: allowed: {' | '.join(GEMM_IMPLS)}")

    @classmethod
    def uniform(cls, impl: str, wgrad: str | None = None) -> GemmPlan:
        w = wgrad or impl
        return cls(impl, impl, impl, impl, w, w)

    @property
    def needs_host_counts(self) -> bool:
        return any(getattr(self, n) in ("loop", "streams") for n in GEMM_KINDS)

    def without_host_sync(self) -> GemmPlan:
        """This plan with every "loop" / "streams" GEMM run as "grouped" (device offsets only)."""
        return dataclasses.replace(
            self, **{n: "grouped" for n in GEMM_KINDS if getattr(self, n) in ("loop", "streams")}
        )

    def with_streams(self) -> GemmPlan:
        """This plan with every "loop" GEMM run as "streams"."""
        return dataclasses.replace(self, **{n: "streams" for n in GEMM_KINDS if getattr(self, n) == "loop"})

    @property
    def uses_quack(self) -> bool:
        """Whether any of the six GEMMs runs through QuACK's grouped GEMMs (the only ones keyed by `spread`)."""
        return any(getattr(self, n) == "quack" for n in GEMM_KINDS)

    def observing(self, load_spread: quack_gemm.LoadSpread | None, counts: torch.Tensor, rows: int) -> GemmPlan:
        """This plan keyed by the load spread `load_spread` holds (`LoadSpread.current`), where a GEMM runs through
        QuACK and a tracker is given; else this plan. Call `observed` with the same arguments once the GEMMs are
        launched."""
        if load_spread is None or not self.uses_quack:
            return self
        return dataclasses.replace(self, spread=load_spread.current(counts, rows))

    def observed(self, load_spread: quack_gemm.LoadSpread | None, counts: torch.Tensor, rows: int) -> None:
        """After `observing`'s GEMMs are launched: queue `counts` (summing to `rows`) for the tracker's next value
        (`LoadSpread.queue`), so its reduction and copy do not delay the first GEMM's launch."""
        if load_spread is not None and self.uses_quack:
            load_spread.queue(counts, rows)


def default_plan(
    num_experts: int, rows: int, hidden: int, ffn: int, device: torch.device, backend: str = "auto"
) -> GemmPlan:
    """The plan measured fastest for shapes like this (torch 2.11, Triton 3.6; docs/benchmarks.md).

    `backend` (moe.gemm_backend): "auto" runs every GEMM through QuACK's grouped GEMMs where they run (installed,
    a Hopper GPU) unless the experts are few and large (<= 16 experts of >= 2048 rows: there cuBLAS per expert
    is as fast); "torch" never does, and chooses among torch's and moecore's Triton GEMMs as follows (H200).

    torch._grouped_mm is within a few percent of cuBLAS wherever each expert's GEMM is small, and a
    Python loop of cuBLAS GEMMs is launch-bound there (Qwen3-30B-A3B: 260 vs 640 TFLOP/s). A loop
    wins where each expert's GEMM is large: few experts with thousands of rows (Mixtral: 680-697 vs
    645-664 TFLOP/s, except dx = dh @ w13 where grouped is faster), and the dx GEMM of wide experts
    (DeepSeek-V3: 554 vs 439 TFLOP/s at 2 * 256 * 4096 * 7168 FLOP per expert). With few rows per expert
    (<= 512) moecore's Triton grouped GEMM beats torch's on the FC2 forward and the dx GEMM (Qwen3-Next:
    380 vs 335 and 482 vs 425 TFLOP/s) and, for wide experts, on the FC1 forward and the da GEMM too
    (DeepSeek-V3: 549 vs 467, 550 vs 488); it loses wherever an expert has ~1000 rows (Qwen3-30B-A3B: 0.84-0.95x)
    and on every weight gradient (0.79-0.88x).
    """
    if backend not in GEMM_BACKENDS:
        raise ValueError(f"backend={backend!r} is invalid: allowed: {' | '.join(GEMM_BACKENDS)}")
    if device.type != "cuda":
        return GemmPlan()
    per_expert = rows / max(num_experts, 1)
    if num_experts <= 16 and per_expert >= 2048:
        return GemmPlan("loop", "loop", "loop", "grouped", "loop", "loop")
    if backend == "auto" and quack_gemm.quack_available(device):
        return GemmPlan.uniform("quack")
    big_dgrad13 = 2 * per_expert * 2 * ffn * hidden >= 12e9
    few_rows, wide = per_expert <= 512, hidden >= 4096
    return GemmPlan(
        fwd13="triton" if few_rows and wide else "grouped",
        fwd2="triton" if few_rows else "grouped",
        dgrad2="triton" if few_rows and wide else "grouped",
        dgrad13="loop" if big_dgrad13 else ("triton" if few_rows else "grouped"),
    )


# ---------------------------------------------------------------- GEMM primitives


def _per_expert(counts: list, impl: str, device: torch.device, gemm) -> None:
    """gemm(e, s, n) for every expert e with n > 0 rows starting at row s: in order on the current
    stream ("loop"), or alternating between two side streams that start after, and are waited on by,
    the current stream ("streams"; the outputs are allocated before, on the current stream)."""
    if impl != "streams" or device.type != "cuda":
        s = 0
        for e, n in enumerate(counts):
            gemm(e, s, n)
            s += n
        return
    main = torch.cuda.current_stream(device)
    side = [torch.cuda.Stream(device), torch.cuda.Stream(device)]
    for st in side:
        st.wait_stream(main)
    s = 0
    for e, n in enumerate(counts):
        with torch.cuda.stream(side[e % 2]):
            gemm(e, s, n)
        s += n
    for st in side:
        main.wait_stream(st)


def _runnable(impl: str, *operands: torch.Tensor) -> str:
    """`impl`, or "grouped" where it is "quack" and QuACK's kernels cannot take these operands."""
    return "grouped" if impl == "quack" and not quack_gemm.quack_runs(*operands) else impl


def gemm_nt(
    a: torch.Tensor,
    b: torch.Tensor,
    bounds: torch.Tensor,
    counts: list | None,
    impl: str,
    kind: str = "fwd13",
    spread: int = 1,
) -> torch.Tensor:
    """out[rows of e] = a[rows of e] @ b[e]^T; a [M, K], b [E, N, K] -> [M, N]. `spread`: see GemmPlan."""
    impl = _runnable(impl, a, b)
    if impl == "grouped":
        return torch._grouped_mm(a, b.transpose(-2, -1), offs=bounds[1:])
    if impl == "triton":
        return grouped_mm(a, b, bounds, True, tiles_for(kind, a))
    if impl == "quack":
        return quack_gemm.grouped_mm(a, b, bounds, True, kind, spread=spread)
    out = torch.empty(a.shape[0], b.shape[1], dtype=a.dtype, device=a.device)

    def gemm(e: int, s: int, n: int) -> None:
        if n:
            torch.mm(a[s : s + n], b[e].t(), out=out[s : s + n])

    _per_expert(counts, impl, a.device, gemm)
    return out


def gemm_nn(
    a: torch.Tensor,
    b: torch.Tensor,
    bounds: torch.Tensor,
    counts: list | None,
    impl: str,
    kind: str = "dgrad13",
    spread: int = 1,
) -> torch.Tensor:
    """out[rows of e] = a[rows of e] @ b[e]; a [M, N], b [E, N, K] -> [M, K]. `spread`: see GemmPlan."""
    impl = _runnable(impl, a, b)
    if impl == "grouped":
        return torch._grouped_mm(a, b, offs=bounds[1:])
    if impl == "triton":
        return grouped_mm(a, b, bounds, False, tiles_for(kind, a))
    if impl == "quack":
        return quack_gemm.grouped_mm(a, b, bounds, False, kind, spread=spread)
    out = torch.empty(a.shape[0], b.shape[2], dtype=a.dtype, device=a.device)

    def gemm(e: int, s: int, n: int) -> None:
        if n:
            torch.mm(a[s : s + n], b[e], out=out[s : s + n])

    _per_expert(counts, impl, a.device, gemm)
    return out


def gemm_tn(
    a: torch.Tensor,
    b: torch.Tensor,
    bounds: torch.Tensor,
    counts: list | None,
    impl: str,
    out_dtype: torch.dtype,
    kind: str = "wgrad13",
    out: torch.Tensor | None = None,
    spread: int = 1,
) -> torch.Tensor:
    """out[e] = a[rows of e]^T @ b[rows of e]; a [M, N1], b [M, N2] -> [E, N1, N2] (zeros for empty experts).

    `out`: a contiguous [E, N1, N2] tensor of out_dtype to fill and return (e.g. a slice of a larger gradient);
    "triton", "quack" and "loop" write into it, "grouped" copies its result there. `spread`: see GemmPlan."""
    E = bounds.numel() - 1
    N1, N2 = a.shape[1], b.shape[1]
    impl = _runnable(impl, a, b)
    if impl == "quack":
        if out is not None and out.dtype == a.dtype:
            return quack_gemm.grouped_wgrad(a, b, bounds, kind, out, spread=spread)
        res = quack_gemm.grouped_wgrad(a, b, bounds, kind, spread=spread)
        return res.to(out_dtype) if out is None else out.copy_(res)
    if impl == "grouped":
        res = torch._grouped_mm(a.t(), b, offs=bounds[1:]).to(out_dtype)
        return res if out is None else out.copy_(res)
    if impl == "triton":
        return grouped_wgrad(a, b, bounds, out_dtype, tiles_for(kind, a), out)
    direct = out is not None and out.dtype == a.dtype
    res = out if direct else torch.empty(E, N1, N2, dtype=a.dtype, device=a.device)

    def gemm(e: int, s: int, n: int) -> None:
        if n:
            torch.mm(a[s : s + n].t(), b[s : s + n], out=res[e])
        else:
            res[e].zero_()

    _per_expert(counts, impl, a.device, gemm)
    if direct:
        return res
    return res.to(out_dtype) if out is None else out.copy_(res)


# ---------------------------------------------------------------- the fused expert FFN


def _saved_tensor_hooks_active() -> bool:
    """Whether saved-tensor hooks (torch.utils.checkpoint, CPU offloading) are active right now."""
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    try:
        return top is None or top(False) is not None
    except Exception:  # a torch without this query: take the safe path
        return True


class _GroupedFFN(torch.autograd.Function):
    # x and h are kept as ctx attributes rather than saved tensors so that backward can drop them as
    # soon as they are used: the peak then holds at most one of the large [M, *] buffers besides dy.
    @staticmethod
    def forward(
        ctx, x, w13, w2, counts, probs, plan: GemmPlan, act_impl: str, limit=None, alpha=None, b13=None, b2=None
    ):
        dt = x.dtype
        w13c, w2c = w13.to(dt), w2.to(dt)
        bounds = group_bounds(counts)
        host = counts.tolist() if plan.needs_host_counts else None
        h = gemm_nt(x, w13c, bounds, host, plan.fwd13, "fwd13", plan.spread)
        expert_M = None if b13 is None and b2 is None else row_experts(counts, x.shape[0])
        if b13 is not None:
            h.add_(b13.to(dt).index_select(0, expert_M))
        with torch.no_grad():
            a = swiglu(h, probs, impl=act_impl, limit=limit, alpha=alpha)
        y = gemm_nt(a, w2c, bounds, host, plan.fwd2, "fwd2", plan.spread)
        if b2 is not None:
            y.add_(down_bias_rows(b2, expert_M, probs, dt))
        ctx.hooked = _saved_tensor_hooks_active()
        if ctx.hooked:  # activation checkpointing (or offloading) must see x and h to drop or move them
            ctx.save_for_backward(w13c, w2c, probs, bounds, x, h)
        else:
            ctx.save_for_backward(w13c, w2c, probs, bounds)
            ctx.x, ctx.h = x.detach(), h
        ctx.host, ctx.plan, ctx.act_impl, ctx.limit, ctx.alpha = host, plan, act_impl, limit, alpha
        ctx.biases = (b13 is not None, b2 is not None)
        if b13 is not None or b2 is not None:
            ctx.expert_M, ctx.b2 = expert_M, b2
            ctx.b_dtypes = (None if b13 is None else b13.dtype, None if b2 is None else b2.dtype)
        ctx.w_dtypes = (w13.dtype, w2.dtype)
        ctx.p_dtype = None if probs is None else probs.dtype
        return y

    @staticmethod
    def backward(ctx, dy):
        if ctx.hooked:
            w13c, w2c, probs, bounds, x, h = ctx.saved_tensors
        else:
            w13c, w2c, probs, bounds = ctx.saved_tensors
            x, h = ctx.x, ctx.h
            ctx.x = ctx.h = None
        plan, host = ctx.plan, ctx.host
        dy = dy.contiguous()
        da = gemm_nn(dy, w2c, bounds, host, plan.dgrad2, "dgrad2", plan.spread)
        dh, dp, a = swiglu_backward(h, probs, da, impl=ctx.act_impl, limit=ctx.limit, alpha=ctx.alpha)
        del da, h
        db13 = db2 = None
        if ctx.biases[1]:  # y += p * b2[e]: dp += <dy, b2[e]>, db2[e] = sum over e's rows of p * dy
            dp, db2 = down_bias_backward(dy, ctx.b2, ctx.expert_M, probs, dp, bounds)
            db2 = db2.to(ctx.b_dtypes[1]) if ctx.needs_input_grad[10] else None
        if ctx.biases[0] and ctx.needs_input_grad[9]:
            db13 = expert_row_sums(dh, bounds).to(ctx.b_dtypes[0])
        dw2 = (
            gemm_tn(dy, a, bounds, host, plan.wgrad2, ctx.w_dtypes[1], "wgrad2", spread=plan.spread)
            if ctx.needs_input_grad[2]
            else None
        )
        del a
        dw13 = (
            gemm_tn(dh, x, bounds, host, plan.wgrad13, ctx.w_dtypes[0], "wgrad13", spread=plan.spread)
            if ctx.needs_input_grad[1]
            else None
        )
        del x
        dx = gemm_nn(dh, w13c, bounds, host, plan.dgrad13, "dgrad13", plan.spread) if ctx.needs_input_grad[0] else None
        dprobs = dp.to(ctx.p_dtype) if dp is not None and ctx.needs_input_grad[4] else None
        return dx, dw13, dw2, None, dprobs, None, None, None, None, db13, db2


def row_experts(counts: torch.Tensor, rows: int) -> torch.Tensor:
    """int64 [rows]: the expert of each row sorted by expert (no host sync: the row count is given)."""
    return torch.repeat_interleave(torch.arange(counts.numel(), device=counts.device), counts, output_size=rows)


def down_bias_rows(
    b2: torch.Tensor, expert_M: torch.Tensor, probs: torch.Tensor | None, dt: torch.dtype
) -> torch.Tensor:
    """b2[e] of each row, times its probability when given (the probability scales the whole expert output)."""
    rows = b2.to(dt).index_select(0, expert_M)
    return rows if probs is None else rows * probs.to(dt)[:, None]


def down_bias_backward(
    dy: torch.Tensor,
    b2: torch.Tensor,
    expert_M: torch.Tensor,
    probs: torch.Tensor | None,
    dp: torch.Tensor | None,
    bounds: torch.Tensor,
) -> tuple[torch.Tensor | None, torch.Tensor]:
    """The backward of y += p * b2[e] on rows sorted by expert (`down_bias_rows`): (dp + <dy, b2[e]> per row, dp
    None staying None; db2 [E, H] fp32, each expert's row sums of p * dy)."""
    if dp is not None:
        dp = dp + (dy.float() * b2.to(dy.dtype).index_select(0, expert_M).float()).sum(-1)
    return dp, expert_row_sums(dy if probs is None else dy * probs.to(dy.dtype)[:, None], bounds)


def expert_row_sums(t: torch.Tensor, bounds: torch.Tensor) -> torch.Tensor:
    """[E, C]: the sum of each expert's rows of t [M, C] (rows sorted by expert, `bounds` [E + 1]), as the grouped
    GEMM t_e^T @ ones: fp32 accumulation, no atomics, zeros for an expert without rows."""
    ones = t.new_ones(t.shape[0], 8)  # 8 columns: the grouped GEMM's 16-byte alignment
    return torch._grouped_mm(t.t(), ones, offs=bounds[1:])[..., 0]


def expert_ffn_reference(
    x_MH: torch.Tensor,
    w13_EFH: torch.Tensor,
    w2_EHF: torch.Tensor,
    counts_E: torch.Tensor,
    probs_M: torch.Tensor | None = None,
    limit: float | None = None,
    alpha: float | None = None,
    b13: torch.Tensor | None = None,
    b2: torch.Tensor | None = None,
) -> torch.Tensor:
    """Loop over experts through plain autograd: y = (silu(g) * u * p) @ w2[e]^T with [g|u] = x @ w13[e]^T
    (g and u clipped to `limit` first when given; gpt-oss's form with `alpha`; biases as the module docstring)."""
    dt = x_MH.dtype
    outs, s = [], 0
    for e, n in enumerate(counts_E.tolist()):
        p = None if probs_M is None else probs_M[s : s + n]
        h = x_MH[s : s + n] @ w13_EFH[e].to(dt).t()
        if b13 is not None:
            h = h + b13[e].to(dt)
        y = swiglu_reference(h, p, limit, alpha) @ w2_EHF[e].to(dt).t()
        if b2 is not None:
            y = y + (b2[e].to(dt) if p is None else b2[e].to(dt) * p.to(dt)[:, None])
        outs.append(y)
        s += n
    if not outs:
        return x_MH.new_zeros(0, w2_EHF.shape[1])
    return torch.cat(outs)


def fused_expert_ffn_available(x_MH: torch.Tensor) -> bool:
    """Whether `expert_ffn` runs the fused Function for rows like these (CUDA tensors, Triton importable)."""
    return use_triton("auto", x_MH)


def expert_ffn(
    x_MH: torch.Tensor,
    w13_EFH: torch.Tensor,
    w2_EHF: torch.Tensor,
    counts_E: torch.Tensor,
    probs_M: torch.Tensor | None = None,
    plan: GemmPlan | None = None,
    impl: str = "auto",
    sync_free: bool = False,
    backend: str = "auto",
    load_spread: quack_gemm.LoadSpread | None = None,
    limit: float | None = None,
    alpha: float | None = None,
    b13: torch.Tensor | None = None,
    b2: torch.Tensor | None = None,
) -> torch.Tensor:
    """The expert FFN of the module docstring on rows already sorted by expert ([M, H] -> [M, H]).

    `limit`: DeepSeek-V4's clipped SwiGLU (g <= limit, |u| <= limit), or None for the plain one; with `alpha` also,
    gpt-oss's clamped form; `b13` [E, 2F] / `b2` [E, H]: gpt-oss's expert biases (module docstring).

    counts_E: rows per expert (sum = M); probs_M: the routing probability of each row, multiplied
    inside the activation, or None. `plan`: GEMM choice per kind (default: `default_plan`, with
    `sync_free` its GEMMs that read the counts on the host replaced by grouped ones; `backend` as there).
    `load_spread`: the layer's tracker of its load spread, which QuACK's tile choices are keyed by.
    """
    if x_MH.shape[0] == 0 or not use_triton(impl, x_MH, w13_EFH, w2_EHF):
        return expert_ffn_reference(x_MH, w13_EFH, w2_EHF, counts_E, probs_M, limit, alpha, b13, b2)
    if plan is None:
        E, M, H, F = w13_EFH.shape[0], x_MH.shape[0], x_MH.shape[1], w2_EHF.shape[2]
        plan = default_plan(E, M, H, F, x_MH.device, backend)
        if sync_free:
            plan = plan.without_host_sync()
    plan = plan.observing(load_spread, counts_E, x_MH.shape[0])
    act_impl = "triton" if impl == "triton" else "auto"
    x = x_MH.contiguous()
    y = _GroupedFFN.apply(x, w13_EFH, w2_EHF, counts_E, probs_M, plan, act_impl, limit, alpha, b13, b2)
    plan.observed(load_spread, counts_E, x_MH.shape[0])
    return y
