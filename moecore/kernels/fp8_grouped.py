"""The expert FFN (w13 -> SwiGLU * prob -> w2) with its six grouped GEMMs in FP8, and the row padding it needs.

Legend: P padded routed rows (sorted by expert), E experts, H hidden, F expert FFN width; w13 [E, 2F, H],
w2 [E, H, F] as the MoE layer stores them. The GEMMs are those of moecore/kernels/grouped_ffn.py:

    h  = x_e @ w13[e]^T     da = dy_e @ w2[e]      dW2[e]  = dy_e^T @ a_e
    y  = a_e @ w2[e]^T      dx = dh_e @ w13[e]     dW13[e] = dh_e^T @ x_e

each with both operands quantised along its contracted dim (moecore/kernels/fp8_gemm.py). For the
weight gradients that dim is the expert's rows, so the scale groups of dy^T, a^T, dh^T and x^T must not
straddle two experts: each expert's rows are padded with zero rows to `Fp8Recipe.alignment` (16, the
FP8 GEMMs' alignment; 128, the block, for blockwise), and rowwise scales are per expert and column
(`fp8_quant.quantize_grouped_cols`, one Triton kernel that also writes the transposed operand).

Padding (`pad_plan`, `fp8_expert_ffn`): rows keep their order; expert e's rows move to a start that is a
multiple of the alignment, and the gaps are zero rows with probability 0. Without host counts the padded
buffer has a fixed bound of rows (N + E * (alignment - 1), rounded up) and the slack is given to the last
expert as zero rows, so nothing waits for the GPU. The router, the aux losses and the expert-load
statistics are computed before and see only the real tokens; padding rows contribute exact zeros to
every output and gradient.

Only the weight-gradient GEMMs contract over the rows, so only their operands need the experts' rows
aligned. `Fp8Recipe.padding="wgrad"` (rowwise) keeps x, h, y and their gradients unpadded: the forward and
input-gradient GEMMs run on the real rows, and the four weight-gradient operands are written into the padded
layout by the kernel that quantises them (zero columns in the gaps), so the padded bf16 copies of x and dy
and the un-padding copies of y and dx are never made. Both give the same values.

GEMM kernels (`Fp8Recipe.grouped_gemm`): torch._scaled_grouped_mm, or for rowwise our Triton grouped GEMMs
(grouped_gemm_fp8.py: the same values, bit for bit on the GPU), per GEMM under `auto` (AUTO_WIDE below). A GEMM
with an e5m2 operand (the hybrid format's gradients) always runs ours: torch's takes e4m3 only.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moecore.kernels import fp8_quant as fq
from moecore.kernels._triton import use_triton
from moecore.kernels.fp8_block_gemm import block_gemm_nt, block_gemm_tn
from moecore.kernels.fp8_gemm import E4M3, E5M2, Fp8Recipe, QOperand, mm, quant_rows
from moecore.kernels.fp8_transpose import transpose_last2
from moecore.kernels.grouped_ffn import down_bias_backward, down_bias_rows, expert_row_sums, gemm_tn, row_experts
from moecore.kernels.grouped_gemm import TileConfig, group_bounds
from moecore.kernels.grouped_gemm_fp8 import fp8_tiles, grouped_mm_scaled, grouped_wgrad_scaled
from moecore.kernels.permute import scatter_rows
from moecore.kernels.swiglu import swiglu, swiglu_backward

# ---------------------------------------------------------------- padding


def pad_plan(
    counts: torch.Tensor, n_rows: int, align: int, exact: bool, positions: bool = True
) -> tuple[torch.Tensor | None, torch.Tensor, int]:
    """(dst [N]: padded row of each routed row (None unless `positions`), padded counts [E] (multiples of
    align, sum P), P).

    `exact`: P is the sum of the rounded-up counts (reads the counts on the host); otherwise the fixed
    bound N + E * (align - 1) rounded up to `align`, with the slack added to the last expert.
    """
    counts = counts.to(torch.int64)
    E = counts.numel()
    padded = (counts + align - 1) // align * align
    if exact:
        P = int(padded.sum())
    else:
        P = -(-(n_rows + E * (align - 1)) // align) * align
        padded = padded.clone()
        padded[-1] += P - padded.sum()
    return (fq.padded_positions(counts, padded, n_rows) if positions else None), padded, P


def pad_rows(x: torch.Tensor, dst: torch.Tensor, P: int) -> torch.Tensor:
    """[N, ...] -> [P, ...] with row i at dst[i], zeros elsewhere (differentiable; keeps only dst for backward)."""
    return scatter_rows(x, dst, P)


class _Unpad(torch.autograd.Function):
    """y[dst] ([P, ...] -> [N, ...]) whose backward scatters by copy: dst holds distinct rows, so the
    gradient needs no atomic adds (autograd's index_select backward is an index_add)."""

    @staticmethod
    def forward(ctx, y: torch.Tensor, dst: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(dst)
        ctx.rows = y.shape[0]
        return y.index_select(0, dst)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (dst,) = ctx.saved_tensors
        return scatter_rows(grad.contiguous(), dst, ctx.rows), None


# ---------------------------------------------------------------- grouped operands


@dataclass
class GroupedWeight:
    """Expert weights [E, N, K] quantised along K per expert: s [E] (tensorwise), [E, N, 1] (rowwise) or
    [E, N/128, K/128] (128x128)."""

    q: torch.Tensor
    s: torch.Tensor
    gran: str

    def expert(self, e: int) -> QOperand:
        return QOperand(self.q[e], self.s[e], self.gran)


def quant_weights(w: torch.Tensor, recipe: Fp8Recipe) -> GroupedWeight:
    E, N, K = w.shape
    if recipe.scaling == "tensorwise":  # one scale per expert
        s = fq.scale_from_amax(w.detach().abs().amax(dim=(1, 2)), E4M3, recipe.pow2)
        q = (w.float() / s[:, None, None]).clamp(-fq.FP8_MAX[E4M3], fq.FP8_MAX[E4M3]).to(E4M3)
        return GroupedWeight(q, s, "tensorwise")
    op = quant_rows(w.reshape(E * N, K), recipe, E4M3, weight=True)
    return GroupedWeight(op.q.view(E, N, K), op.s.view(E, -1, op.s.shape[-1]), op.gran)


def transposed_weights(kept: GroupedWeight | None, w: torch.Tensor, recipe: Fp8Recipe) -> GroupedWeight:
    """w^T [E, K, N] along N for the input-gradient GEMM, from what the forward kept: tensorwise and 128x128
    copies transposed (their scales serve both layouts); a rowwise primary weight's own w^T (`kept` is already
    transposed); nothing (rowwise): w quantised again along N."""
    if kept is None:
        return transposed_rowwise_weights(w, recipe)
    if kept.gran == "tensorwise":
        return GroupedWeight(transpose_last2(kept.q), kept.s, "tensorwise")
    if kept.gran == "128x128":
        return GroupedWeight(transpose_last2(kept.q), kept.s.transpose(1, 2).contiguous(), "128x128")
    return kept


def transposed_rowwise_weights(w: torch.Tensor, recipe: Fp8Recipe) -> GroupedWeight:
    """w [E, N, K] -> w^T [E, K, N] quantised rowwise (along N), without a bf16 transposed copy."""
    _, (q, s) = fq.quantize_weight_layouts(w, E4M3, recipe.pow2, rows=False)
    return GroupedWeight(q, s, "rowwise")


def rowwise_weight_pair(w: torch.Tensor, recipe: Fp8Recipe) -> tuple[GroupedWeight, GroupedWeight]:
    """w [E, N, K] quantised rowwise in both layouts (forward along K, w^T along N): fp8_quant.quantize_weight_layouts."""
    (q, s), (qt, st) = fq.quantize_weight_layouts(w, E4M3, recipe.pow2)
    return GroupedWeight(q, s, "rowwise"), GroupedWeight(qt, st, "rowwise")


@dataclass
class GroupedCols:
    """A [P, C] tensor quantised along its rows within each expert's rows, stored transposed: q [C, P];
    s [] (tensorwise), [E, C] (rowwise: per expert and column) or [C, P/128] (1x128 along the rows)."""

    q: torch.Tensor
    s: torch.Tensor
    gran: str

    def expert(self, e: int, start: int, n: int) -> QOperand:
        q = self.q[:, start : start + n].contiguous()
        if self.gran == "tensorwise":
            return QOperand(q, self.s, "tensorwise")
        if self.gran == "rowwise":
            return QOperand(q, self.s[e].unsqueeze(-1).contiguous(), "rowwise")
        return QOperand(q, self.s[:, start // fq.BLOCK : (start + n) // fq.BLOCK].contiguous(), "1x128")


def quant_cols(
    x: torch.Tensor,
    counts: torch.Tensor,
    recipe: Fp8Recipe,
    dtype: torch.dtype,
    rows_q: QOperand | None = None,
    pad_to: fq.PadTo | None = None,
    bounds: tuple[torch.Tensor, torch.Tensor | None] | None = None,
) -> GroupedCols:
    """x [P, C] (experts' rows padded to the alignment) quantised along the rows of each expert; or, with
    `pad_to` (rowwise), x [N, C] unpadded, written into the padded layout (fq.quantize_grouped_cols).
    `bounds`: group_bounds of counts and of pad_to's counts where the caller has them."""
    if pad_to is not None:
        if recipe.scaling != "rowwise":
            raise ValueError("quant_cols: pad_to is for rowwise scaling only")
        b, pb = bounds if bounds is not None else (None, None)
        q, s = fq.quantize_grouped_cols(  # pad_plan's counts are multiples of recipe.alignment (16 or 128)
            x, counts, dtype, recipe.pow2, pad_to=pad_to, bounds=b, pad_bounds=pb, aligned=True
        )
        return GroupedCols(q, s, "rowwise")
    if recipe.scaling == "tensorwise":
        if rows_q is not None and rows_q.q.dtype == dtype:  # the same groups: one scale
            return GroupedCols(transpose_last2(rows_q.q), rows_q.s, "tensorwise")
        q, s = fq.quantize_tensorwise(x, dtype, recipe.pow2)
        return GroupedCols(transpose_last2(q), s, "tensorwise")
    if recipe.scaling == "blockwise":  # 128-row groups never straddle experts (rows padded to 128)
        q, s = fq.quantize_1x128(x.t(), dtype, recipe.pow2)
        return GroupedCols(q, s, "1x128")
    b = None if bounds is None else bounds[0]  # rowwise: a scale per expert and column
    q, s = fq.quantize_grouped_cols(x, counts, dtype, recipe.pow2, bounds=b)
    return GroupedCols(q, s, "rowwise")


# ---------------------------------------------------------------- grouped GEMMs


def _uses_grouped_kernel(recipe: Fp8Recipe, device: torch.device, *dtypes: torch.dtype) -> bool:
    """torch._scaled_grouped_mm on Hopper: e4m3 operands, row scales (tensorwise as constant rows), CUDA only."""
    return (
        not recipe.emulate
        and device.type == "cuda"
        and recipe.scaling in ("tensorwise", "rowwise")
        and hasattr(torch, "_scaled_grouped_mm")
        and all(d == E4M3 for d in dtypes)
    )


def _uses_block_kernel(recipe: Fp8Recipe, a: torch.Tensor, b: torch.Tensor) -> bool:
    """The Triton blockwise grouped GEMM (fp8_block_gemm.py): blockwise on CUDA (either FP8 format)."""
    return not recipe.emulate and recipe.scaling == "blockwise" and use_triton("auto", a, b)


def _device_offsets_only(recipe: Fp8Recipe, device: torch.device) -> bool:
    """Whether every expert GEMM runs from offsets on the GPU (no host counts, no exact padding): torch's grouped
    GEMM for e4m3 operands, or (rowwise) moecore's Triton grouped GEMMs, which also take the hybrid format's e5m2."""
    if _uses_grouped_kernel(recipe, device, E4M3, recipe.grad_dtype):
        return True
    probe = torch.empty(0, device=device)
    return not recipe.emulate and recipe.scaling == "rowwise" and use_triton("auto", probe)


# fp8.grouped_gemm=auto takes moecore's kernels where they measured faster than torch._scaled_grouped_mm on an H200
# (benchmarks/grouped_gemm_tiles.py --fp8; docs/benchmarks.md): the forward GEMMs in fast accumulation when a
# dimension is >= AUTO_WIDE (Mixtral- and DeepSeek-V3-sized: 1.09-1.48x), the full-accumulation GEMMs (input and
# weight gradients) when none is (Qwen3-30B-A3B- and Qwen3-Next-sized: 1.6-2.5x); torch's is faster or level in
# the other two cases (its weight-gradient GEMM by 1.1-1.3x at Mixtral's and DeepSeek-V3's shapes).
AUTO_WIDE = 4096


def _triton_tiles(recipe: Fp8Recipe, a: QOperand, b: GroupedWeight, fast: bool) -> TileConfig | None:
    """The tiles of moecore's Triton grouped GEMM (grouped_gemm_fp8.grouped_mm_scaled) for this GEMM, or None where
    torch's runs: rowwise operands where Triton runs (CUDA), under recipe.grouped_gemm (triton, or auto's rule)."""
    if recipe.emulate or not (a.gran == b.gran == "rowwise") or not use_triton("auto", a.q, b.q):
        return None
    E, N, K = b.q.shape
    if E5M2 in (a.q.dtype, b.q.dtype):  # torch's grouped GEMM takes e4m3 only: ours whatever grouped_gemm says
        return fp8_tiles(a.q, E, fast)
    if recipe.grouped_gemm == "torch" or (recipe.grouped_gemm == "auto" and fast != (max(N, K) >= AUTO_WIDE)):
        return None
    return fp8_tiles(a.q, E, fast)


def _triton_wgrad(recipe: Fp8Recipe, a: GroupedCols, b: GroupedCols) -> bool:
    """The weight-gradient GEMM in moecore's Triton kernel (grouped_gemm_fp8.grouped_wgrad_scaled): rowwise operands
    where Triton runs, under recipe.grouped_gemm triton, or auto's rule (a full-accumulation GEMM)."""
    if recipe.emulate or not (a.gran == b.gran == "rowwise") or not use_triton("auto", a.q, b.q):
        return False
    if E5M2 in (a.q.dtype, b.q.dtype):  # torch's grouped GEMM takes e4m3 only
        return True
    return recipe.grouped_gemm == "triton" or (
        recipe.grouped_gemm == "auto" and max(a.q.shape[0], b.q.shape[0]) < AUTO_WIDE
    )


def gmm_nt(
    a: QOperand,
    b: GroupedWeight,
    counts: torch.Tensor,
    host: list | None,
    recipe: Fp8Recipe,
    out_dtype,
    fast=False,
    bounds: torch.Tensor | None = None,
):
    """out[rows of e] = a[rows of e] @ b[e]^T; a [P, K], b [E, N, K] -> [P, N]. `fast`: as fp8_gemm.mm.
    `bounds`: group_bounds(counts) where the caller has it."""
    P, E, N = a.q.shape[0], b.q.shape[0], b.q.shape[1]
    cfg = _triton_tiles(recipe, a, b, fast)
    if cfg is not None:  # no alignment of the experts' rows needed
        bounds = group_bounds(counts) if bounds is None else bounds
        return grouped_mm_scaled(a.q, b.q, a.s, b.s, bounds, out_dtype, cfg, fast_accum=fast)
    if _uses_grouped_kernel(recipe, a.q.device, a.q.dtype, b.q.dtype):
        offs = (group_bounds(counts) if bounds is None else bounds)[1:]
        sa = a.s.reshape(-1).expand(P).contiguous() if a.gran == "tensorwise" else a.s.reshape(P)
        sb = b.s.reshape(E, 1).expand(E, N).contiguous() if b.gran == "tensorwise" else b.s.reshape(E, N)
        bt = b.q.transpose(-2, -1)
        return torch._scaled_grouped_mm(a.q, bt, sa, sb, offs=offs, out_dtype=out_dtype, use_fast_accum=fast)
    if _uses_block_kernel(recipe, a.q, b.q):
        return block_gemm_nt(a.q, a.s, b.q, b.s, counts, out_dtype)
    host = host if host is not None else counts.tolist()
    out = torch.zeros(P, N, dtype=out_dtype, device=a.q.device)
    start = 0
    for e, n in enumerate(host):
        if n:
            out[start : start + n] = mm(a.rows(start, n), b.expert(e), out_dtype, recipe, fast)
        start += n
    return out


def gmm_tn(
    a: GroupedCols,
    b: GroupedCols,
    counts: torch.Tensor,
    host: list | None,
    recipe: Fp8Recipe,
    out_dtype,
    bounds: torch.Tensor | None = None,
):
    """out[e] = A[rows of e]^T @ B[rows of e] -> [E, C1, C2], from A and B quantised along the rows (quant_cols).
    `bounds`: group_bounds(counts) where the caller has it."""
    E, C1, C2 = counts.numel(), a.q.shape[0], b.q.shape[0]
    if _triton_wgrad(recipe, a, b):
        cfg = fp8_tiles(a.q, E, False, wgrad=True)
        bounds = group_bounds(counts) if bounds is None else bounds
        return grouped_wgrad_scaled(a.q, b.q, a.s, b.s, bounds, out_dtype, cfg)
    if _uses_grouped_kernel(recipe, a.q.device, a.q.dtype, b.q.dtype):
        offs = (group_bounds(counts) if bounds is None else bounds)[1:]
        sa = a.s.reshape(1).expand(E * C1).contiguous() if a.gran == "tensorwise" else a.s.reshape(E * C1)
        sb = b.s.reshape(1).expand(E * C2).contiguous() if b.gran == "tensorwise" else b.s.reshape(E * C2)
        return torch._scaled_grouped_mm(a.q, b.q.t(), sa, sb, offs=offs, out_dtype=out_dtype)
    if _uses_block_kernel(recipe, a.q, b.q):
        return block_gemm_tn(a.q, a.s, b.q, b.s, counts, out_dtype)
    host = host if host is not None else counts.tolist()
    out = torch.zeros(E, C1, C2, dtype=out_dtype, device=a.q.device)
    start = 0
    for e, n in enumerate(host):
        if n:
            out[e] = mm(a.expert(e, start, n), b.expert(e, start, n), out_dtype, recipe)
        start += n
    return out


def _bf16_wgrad(
    a: torch.Tensor, b: torch.Tensor, bounds: torch.Tensor, host: list | None, backend: str
) -> torch.Tensor:
    """dW[e] = a[rows of e]^T @ b[rows of e] in a's dtype with fp32 accumulation (fp8.wgrad=bf16): on CUDA QuACK's
    grouped GEMM under backend "auto" (moe.gemm_backend; torch's where QuACK's cannot run) or torch's under "torch",
    both on device offsets; a loop of matmuls elsewhere."""
    impl = ("quack" if backend == "auto" else "grouped") if a.is_cuda else "loop"
    if impl == "loop" and host is None:
        host = (bounds[1:] - bounds[:-1]).tolist()
    with torch.autocast(a.device.type, enabled=False):
        return gemm_tn(a, b, bounds, host, impl, a.dtype)


# ---------------------------------------------------------------- the FP8 expert FFN


def _activation_quantized(
    h: torch.Tensor,
    probs: torch.Tensor | None,
    recipe: Fp8Recipe,
    limit: float | None = None,
    alpha: float | None = None,
) -> QOperand:
    """SwiGLU(h) (* probs) quantised for the w2 GEMM: one fused Triton kernel for rowwise and 1x128 (the
    activation is never stored), the two functions in turn otherwise (same values). DeepSeek-V4's clipped SwiGLU
    (`limit`) and gpt-oss's clamped one (`alpha` too) always take the two functions: the fused kernel has neither."""
    plain = limit is None and alpha is None
    if plain and recipe.scaling != "tensorwise" and use_triton("auto", h) and h.shape[0]:
        gran = "rowwise" if recipe.scaling == "rowwise" else "1x128"
        q, s = fq.swiglu_quantize(h, probs, gran, E4M3, recipe.pow2)
        return QOperand(q, s, gran)
    return quant_rows(swiglu(h, probs, limit=limit, alpha=alpha), recipe, E4M3)


class _Fp8GroupedFFN(torch.autograd.Function):
    """The six GEMMs on rows sorted by expert: x [P, H] padded per expert (counts padded), or, with `pad_to`
    (recipe.padding="wgrad"), x [N, H] unpadded with the real counts, and only the weight-gradient operands
    written padded (pad_to: their padded counts and rows). `limit`, `alpha`: the SwiGLU's clipped / clamped forms;
    `b13`, `b2`: gpt-oss's expert biases (moecore/kernels/grouped_ffn.py), with `real` [P] (padding="all") 1 on the
    real rows and 0 on the padding rows, which get no b13 (their activation stays zero)."""

    @staticmethod
    def forward(
        ctx, x, w13, w2, counts, probs, recipe: Fp8Recipe, host, pad_to=None, backend="auto", limit=None,
        alpha=None, b13=None, b2=None, real=None,
    ):  # fmt: skip
        dt = x.dtype
        # FP8 primary weights (moecore/models/fp8.py) arrive quantised (rowwise: w^T too); others are quantised here
        w13q, w2q = getattr(w13, "fp8_primary", None), getattr(w2, "fp8_primary", None)
        w13t, w2t = getattr(w13, "fp8_primary_t", None), getattr(w2, "fp8_primary_t", None)
        w13c = w13 if w13q is not None else w13.to(dt)
        w2c = w2 if w2q is not None else w2.to(dt)
        xq = quant_rows(x, recipe, E4M3)
        w13q = w13q if w13q is not None else quant_weights(w13c, recipe)
        bounds = group_bounds(counts)  # one cumsum for all the GEMMs (fewer launches: the host is often the bound)
        h = gmm_nt(xq, w13q, counts, host, recipe, dt, recipe.fprop_fast_accum, bounds)
        expert_M = None if b13 is None and b2 is None else row_experts(counts, x.shape[0])
        if b13 is not None:
            b13_rows = b13.to(dt).index_select(0, expert_M)
            h.add_(b13_rows if real is None else b13_rows * real.to(dt)[:, None])
        with torch.no_grad():
            aq = _activation_quantized(h, probs, recipe, limit, alpha)
        w2q = w2q if w2q is not None else quant_weights(w2c, recipe)
        y = gmm_nt(aq, w2q, counts, host, recipe, dt, recipe.fprop_fast_accum, bounds)
        if b2 is not None:  # padding rows: zero probability, or (probabilities at the combine) dropped by the un-pad
            y.add_(down_bias_rows(b2, expert_M, probs, dt))
        # backward reuses tensorwise / 128x128 weights transposed, and tensorwise x: saved tensors, so that
        # activation checkpointing and offloading hooks see them
        # (or the primary weights' own w^T, rowwise)
        ctx.keep_x, ctx.keep_w = xq.gran == "tensorwise", w13q.gran != "rowwise" or w13t is not None
        if w13t is not None:
            w13q, w2q = w13t, w2t
        keep = ([xq.q, xq.s] if ctx.keep_x else []) + ([w13q.q, w13q.s, w2q.q, w2q.s] if ctx.keep_w else [])
        keep += [pad_to[0]] if pad_to is not None else []  # the weight-gradient operands' padded counts
        ctx.save_for_backward(x, h, probs, counts, w13c, w2c, *keep)
        ctx.grans = (xq.gran, w13q.gran)
        ctx.recipe, ctx.host, ctx.backend, ctx.limit, ctx.alpha = recipe, host, backend, limit, alpha
        ctx.b2, ctx.expert_M = b2, expert_M
        ctx.b_dtypes = (None if b13 is None else b13.dtype, None if b2 is None else b2.dtype)
        ctx.pad_rows = None if pad_to is None else pad_to[1]
        ctx.w_dtypes = (w13.dtype, w2.dtype)
        ctx.p_dtype = None if probs is None else probs.dtype
        return y

    @staticmethod
    def backward(ctx, dy):
        x, h, probs, counts, w13c, w2c, *kept = ctx.saved_tensors
        pad_to = None if ctx.pad_rows is None else (kept.pop(), ctx.pad_rows)
        xq = QOperand(kept.pop(0), kept.pop(0), ctx.grans[0]) if ctx.keep_x else None
        w13q = GroupedWeight(kept.pop(0), kept.pop(0), ctx.grans[1]) if ctx.keep_w else None
        w2q = GroupedWeight(kept.pop(0), kept.pop(0), ctx.grans[1]) if ctx.keep_w else None
        recipe, host, gd, dt = ctx.recipe, ctx.host, ctx.recipe.grad_dtype, dy.dtype
        dy = dy.contiguous()
        dyq = quant_rows(dy, recipe, gd)
        bounds = group_bounds(counts)
        pbounds = None if pad_to is None else group_bounds(pad_to[0])
        cols_bounds = (bounds, pbounds)
        w2t = transposed_weights(w2q, w2c, recipe)
        da = gmm_nt(dyq, w2t, counts, host, recipe, dt, bounds=bounds)
        del w2t
        dh, dp, a = swiglu_backward(h, probs, da, limit=ctx.limit, alpha=ctx.alpha)
        del da, h
        db13 = db2 = None
        if ctx.b2 is not None:  # y += p * b2[e]: dp += <dy, b2[e]>, db2[e] = sum over e's rows of p * dy
            dp, db2 = down_bias_backward(dy, ctx.b2, ctx.expert_M, probs, dp, bounds)
            db2 = db2.to(ctx.b_dtypes[1])
        if ctx.b_dtypes[0] is not None:
            db13 = expert_row_sums(dh.to(dt), bounds).to(ctx.b_dtypes[0])
        ctx.b2 = ctx.expert_M = None
        dw2 = dw13 = dx = None
        wgrad_fp8 = recipe.wgrad_in_fp8(x.shape[0] // w2c.shape[0], x.shape[1], w2c.shape[2])  # rows/expert, H, F
        # the weight-gradient GEMMs' operands: padded as x was, or written padded from unpadded rows (pad_to)
        wcounts, whost, wbounds = (counts, host, bounds) if pad_to is None else (pad_to[0], None, pbounds)
        if ctx.needs_input_grad[2]:
            if wgrad_fp8:
                dy_cols = quant_cols(dy, counts, recipe, gd, rows_q=dyq, pad_to=pad_to, bounds=cols_bounds)
                a_cols = quant_cols(a, counts, recipe, E4M3, pad_to=pad_to, bounds=cols_bounds)
                dw2 = gmm_tn(dy_cols, a_cols, wcounts, whost, recipe, dt, wbounds)
            else:
                dw2 = _bf16_wgrad(dy, a, bounds, host, ctx.backend)
            dw2 = dw2.to(ctx.w_dtypes[1])
        del a
        dh = dh.to(dt)
        dhq = quant_rows(dh, recipe, gd)
        if ctx.needs_input_grad[1]:
            if wgrad_fp8:
                x_cols = quant_cols(x, counts, recipe, E4M3, rows_q=xq, pad_to=pad_to, bounds=cols_bounds)
                dh_cols = quant_cols(dh, counts, recipe, gd, rows_q=dhq, pad_to=pad_to, bounds=cols_bounds)
                dw13 = gmm_tn(dh_cols, x_cols, wcounts, whost, recipe, dt, wbounds)
            else:
                dw13 = _bf16_wgrad(dh, x, bounds, host, ctx.backend)
            dw13 = dw13.to(ctx.w_dtypes[0])
        if ctx.needs_input_grad[0]:
            dx = gmm_nt(dhq, transposed_weights(w13q, w13c, recipe), counts, host, recipe, dt, bounds=bounds)
        dprobs = dp.to(ctx.p_dtype) if dp is not None and ctx.needs_input_grad[4] else None
        return dx, dw13, dw2, None, dprobs, None, None, None, None, None, None, db13, db2, None


def fp8_expert_ffn(
    x_NH: torch.Tensor,
    w13_EFH: torch.Tensor,
    w2_EHF: torch.Tensor,
    counts_E: torch.Tensor,
    probs_N: torch.Tensor | None,
    recipe: Fp8Recipe,
    backend: str = "auto",
    limit: float | None = None,
    alpha: float | None = None,
    b13: torch.Tensor | None = None,
    b2: torch.Tensor | None = None,
) -> torch.Tensor:
    """The SwiGLU expert FFN on rows sorted by expert ([N, H] -> [N, H]) with FP8 GEMMs; rows padded per
    expert to the recipe's alignment (module docstring): on the way in and out (recipe.padding="all"), or only
    in the weight-gradient operands, as they are quantised ("wgrad"). `backend` (moe.gemm_backend): whether the
    bf16 weight-gradient GEMMs (`recipe.wgrad_in_fp8` false) may run through QuACK's grouped GEMMs. `limit`:
    DeepSeek-V4's clipped SwiGLU (moecore/kernels/swiglu.py); with `alpha` too, gpt-oss's clamped form; `b13` [E, 2F]
    / `b2` [E, H]: gpt-oss's expert biases."""
    N = x_NH.shape[0]
    if N == 0:
        return x_NH.new_zeros(0, w2_EHF.shape[1])
    grouped = _device_offsets_only(recipe, x_NH.device)
    counts = counts_E.to(x_NH.device)
    dst, padded, P = pad_plan(counts, N, recipe.alignment, exact=not grouped, positions=recipe.padding == "all")
    if recipe.padding == "wgrad":
        host = None if grouped else counts.tolist()
        x = x_NH.contiguous()
        return _Fp8GroupedFFN.apply(
            x, w13_EFH, w2_EHF, counts, probs_N, recipe, host, (padded, P), backend, limit, alpha, b13, b2
        )
    host = None if grouped else padded.tolist()
    xp = pad_rows(x_NH.contiguous(), dst, P)
    pp = None if probs_N is None else pad_rows(probs_N, dst, P)
    real = None if b13 is None else pad_rows(x_NH.new_ones(N), dst, P)  # padding rows get no up-projection bias
    y = _Fp8GroupedFFN.apply(xp, w13_EFH, w2_EHF, padded, pp, recipe, host, None, backend, limit, alpha, b13, b2, real)
    return _Unpad.apply(y, dst)
