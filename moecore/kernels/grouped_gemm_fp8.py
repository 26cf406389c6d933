"""Triton grouped GEMMs with FP8 operands quantised rowwise: the expert FFN's GEMMs under fp8.recipe=rowwise.

Legend as in grouped_gemm.py (M rows sorted by expert, E experts, bounds [E + 1] int32 row offsets on the GPU).

    grouped_mm_scaled(a_q, b_q, sa, sb, bounds):      out[rows of e] = (sa * a_q)[rows of e] @ (sb[e] * b_q[e])^T
        forward (x @ w13[e]^T, a @ w2[e]^T) and input gradient (dy @ w2[e], dh @ w13[e] through w^T quantised
        along its rows); the forward kernel of grouped_gemm.py with the row scales applied in its epilogue
    grouped_wgrad_scaled(a_q, b_q, sa, sb, bounds):   out[e] = (sa[e] * a_q[:, cols of e]) @ (sb[e] * b_q[:, cols of e])^T
        weight gradients from the transposed operands fp8_quant.quantize_grouped_cols writes (each expert's
        columns padded to 16), scales per expert and row

Unlike torch._scaled_grouped_mm, neither needs the experts' rows aligned for the forward and input-gradient
GEMMs. Accumulation: Hopper's FP8 tensor cores keep reduced-precision partial sums; "fast" accumulation lets
them run over all of K, otherwise they are added into an fp32 accumulator every BLOCK_K (as cuBLAS does),
which is what the backward GEMMs always use. Outputs are bit-identical to torch's at the four benchmark shapes
(benchmarks/grouped_gemm_tiles.py --fp8). The references compute in float64 from the dequantised operands.
"""

from __future__ import annotations

import torch

from moecore.kernels._triton import triton_importable
from moecore.kernels.grouped_gemm import (
    INTERPRETER_TILES,
    TileConfig,
    _descriptor,
    _launch_mm,
    _programs,
    _tma_ok,
    grouped_mm_reference,
    grouped_wgrad_reference,
)

FP8_TILES = {  # the fastest of benchmarks/grouped_gemm_tiles.py --fp8 on an H200
    # forward in fast accumulation; full fp32 accumulation with many rows per expert, and with few (< 512)
    "fast": TileConfig(128, 256, 128, 8, 8, 3, persistent=True, tma=True, flatten=True),
    "full": TileConfig(256, 128, 128, 8, 8, 3, persistent=True, tma=True, flatten=True),
    "few_rows": TileConfig(64, 256, 128, 8, 8, 3, persistent=True, tma=True, flatten=True),
    "wgrad": TileConfig(128, 256, 128, 8, 8, 3, persistent=True, tma=True),
}

if triton_importable():
    import triton
    import triton.language as tl

    from moecore.kernels.grouped_gemm import _swizzle

    @triton.jit
    def _grouped_wgrad_scaled_kernel(
        a_ptr,
        b_ptr,
        c_ptr,
        sa_ptr,
        sb_ptr,
        a_desc,
        b_desc,
        c_desc,
        bounds_ptr,
        E,
        N1,
        N2,
        stride_a,
        stride_b,
        USE_TMA: tl.constexpr,
        TMA_STORE: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        GROUP_M: tl.constexpr,
        NUM_PROGRAMS: tl.constexpr,
        FLATTEN: tl.constexpr,
    ):
        # c[e] = (sa[e] * a[:, s:t]) @ (sb[e] * b[:, s:t])^T, s, t = bounds[e], bounds[e+1]: FP8 a [N1, P] and
        # b [N2, P] quantised along P within each expert's columns, scales sa [E, N1], sb [E, N2]; c [E, N1, N2]
        pid = tl.program_id(0)
        tiles_m = tl.cdiv(N1, BLOCK_M)
        tiles_n = tl.cdiv(N2, BLOCK_N)
        per_e = tiles_m * tiles_n
        rk = tl.arange(0, BLOCK_K)
        for tile in tl.range(pid, E * per_e, NUM_PROGRAMS, flatten=FLATTEN):
            e = tile // per_e
            tm, tn = _swizzle(tile % per_e, tiles_m, tiles_n, GROUP_M)
            start = tl.load(bounds_ptr + e)
            end = tl.load(bounds_ptr + e + 1)
            rm = tm * BLOCK_M + tl.arange(0, BLOCK_M)
            rn = tn * BLOCK_N + tl.arange(0, BLOCK_N)
            mm = rm < N1
            mn = rn < N2
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            if USE_TMA:  # whole BLOCK_K chunks of the expert's columns through TMA (a loop without branches, so
                # that it pipelines); a last partial chunk loads whole and its columns past the expert's end (the
                # next expert's) are zeroed in registers
                full = (end - start) // BLOCK_K
                for i in range(0, full):
                    k0 = start + i * BLOCK_K
                    a = a_desc.load([tm * BLOCK_M, k0])
                    b = b_desc.load([tn * BLOCK_N, k0])
                    acc = tl.dot(a, b.T, acc, max_num_imprecise_acc=BLOCK_K)
                k0 = start + full * BLOCK_K
                if k0 < end:
                    mk = (k0 + rk) < end
                    a = a_desc.load([tm * BLOCK_M, k0])
                    b = b_desc.load([tn * BLOCK_N, k0])
                    a = tl.where(mk[None, :], a, tl.zeros_like(a))
                    b = tl.where(mk[None, :], b, tl.zeros_like(b))
                    acc = tl.dot(a, b.T, acc, max_num_imprecise_acc=BLOCK_K)
            else:
                a_rows = a_ptr + rm.to(tl.int64)[:, None] * stride_a
                b_rows = b_ptr + rn.to(tl.int64)[:, None] * stride_b
                for k0 in range(start, end, BLOCK_K):
                    cols = k0 + rk
                    mk = cols < end
                    a = tl.load(a_rows + cols[None, :], mask=mm[:, None] & mk[None, :], other=0.0)
                    b = tl.load(b_rows + cols[None, :], mask=mn[:, None] & mk[None, :], other=0.0)
                    acc = tl.dot(a, b.T, acc, max_num_imprecise_acc=BLOCK_K)
            sa = tl.load(sa_ptr + e.to(tl.int64) * N1 + rm, mask=mm, other=0.0)
            sb = tl.load(sb_ptr + e.to(tl.int64) * N2 + rn, mask=mn, other=0.0)
            acc = acc * sa[:, None] * sb[None, :]
            if TMA_STORE:  # c viewed as [E * N1, N2], N1 a multiple of BLOCK_M: a tile never spans two experts
                c_desc.store([e * N1 + tm * BLOCK_M, tn * BLOCK_N], acc.to(c_desc.dtype))
            else:
                c = c_ptr + e.to(tl.int64) * N1 * N2 + rm.to(tl.int64)[:, None] * N2 + rn[None, :]
                tl.store(c, acc.to(c_ptr.dtype.element_ty), mask=mm[:, None] & mn[None, :])


def fp8_tiles(a: torch.Tensor, experts: int, fast_accum: bool, wgrad: bool = False) -> TileConfig:
    """The tiles of `grouped_mm_scaled` for a [M, K] over `experts` groups, or (`wgrad`) of `grouped_wgrad_scaled`
    (the fastest measured on an H200)."""
    if not a.is_cuda:
        return INTERPRETER_TILES
    if wgrad:
        return FP8_TILES["wgrad"]
    if fast_accum:
        return FP8_TILES["fast"]
    return FP8_TILES["few_rows" if a.shape[0] < 512 * experts else "full"]


def _check_fp8(fn: str, a_q: torch.Tensor, b_q: torch.Tensor) -> None:
    if a_q.dtype.itemsize != 1 or b_q.dtype.itemsize != 1:
        raise ValueError(f"{fn}: FP8 operands expected, got {a_q.dtype} and {b_q.dtype}")


def grouped_mm_scaled(
    a_q: torch.Tensor,
    b_q: torch.Tensor,
    sa: torch.Tensor,
    sb: torch.Tensor,
    bounds: torch.Tensor,
    out_dtype: torch.dtype,
    cfg: TileConfig,
    fast_accum: bool = False,
) -> torch.Tensor:
    """out[rows of e] = (sa * a_q)[rows of e] @ (sb[e] * b_q[e])^T, FP8 operands quantised rowwise along K.

    a_q [M, K] FP8 with row scales sa [M] (fp32); b_q [E, N, K] FP8 with scales sb [E, N]; -> [M, N] in
    out_dtype. The experts' rows need no alignment (tiles are masked at each expert's end). The scales are
    applied to the fp32 accumulator in the epilogue. `fast_accum`: Hopper's FP8 tensor-core accumulation over
    the whole of K (torch's use_fast_accum); otherwise its partial sums are added into an fp32 accumulator
    every BLOCK_K (what cuBLAS does without fast accumulation).
    """
    _check_fp8("grouped_mm_scaled", a_q, b_q)
    E, N = b_q.shape[0], b_q.shape[1]
    if sa.numel() != a_q.shape[0] or sb.numel() != E * N:
        raise ValueError(f"grouped_mm_scaled: scales {tuple(sa.shape)}, {tuple(sb.shape)} for {tuple(a_q.shape)}, "
                         f"{tuple(b_q.shape)}: a row scale of each")  # fmt: skip
    scales = (sa.reshape(-1).float().contiguous(), sb.reshape(-1).float().contiguous())
    return _launch_mm(a_q, b_q, bounds, True, cfg, out_dtype, scales, None if fast_accum else cfg.block_k)


def grouped_wgrad_scaled(
    a_q: torch.Tensor,
    b_q: torch.Tensor,
    sa: torch.Tensor,
    sb: torch.Tensor,
    bounds: torch.Tensor,
    out_dtype: torch.dtype,
    cfg: TileConfig,
) -> torch.Tensor:
    """out[e] = (sa[e] * a_q[:, cols of e]) @ (sb[e] * b_q[:, cols of e])^T, the FP8 weight-gradient GEMM.

    a_q [N1, P] and b_q [N2, P] FP8, quantised along P within each expert's columns bounds[e]..bounds[e+1]
    (the transposed operands that fp8_quant.quantize_grouped_cols writes), with scales sa [E, N1] and sb [E, N2];
    -> [E, N1, N2] in out_dtype (zeros for empty experts). With TMA every BLOCK_K chunk loads whole and the
    last one's columns past the expert's end are zeroed in registers; otherwise masked loads. Accumulates in
    full fp32 (Hopper's FP8 partial sums added into fp32 every BLOCK_K).
    """
    _check_fp8("grouped_wgrad_scaled", a_q, b_q)
    E = bounds.numel() - 1
    (N1, P), N2 = a_q.shape, b_q.shape[0]
    if b_q.shape[1] != P or sa.numel() != E * N1 or sb.numel() != E * N2:
        raise ValueError(f"grouped_wgrad_scaled: operands {tuple(a_q.shape)}, {tuple(b_q.shape)} and scales "
                         f"{tuple(sa.shape)}, {tuple(sb.shape)} for {E} experts do not match")  # fmt: skip
    a_q, b_q = a_q.contiguous(), b_q.contiguous()
    sa, sb = sa.reshape(-1).float().contiguous(), sb.reshape(-1).float().contiguous()
    out = torch.empty(E, N1, N2, dtype=out_dtype, device=a_q.device)
    bm, bn, bk = cfg.block_m, cfg.block_n, cfg.block_k
    tma = cfg.tma and P > 0 and _tma_ok(a_q, b_q)
    a_desc = _descriptor(a_q, [bm, bk]) if tma else None
    b_desc = _descriptor(b_q, [bn, bk]) if tma else None
    tma_store = tma and N1 % bm == 0 and E > 0 and _tma_ok(out)
    c_desc = _descriptor(out.view(E * N1, N2), [bm, bn]) if tma_store else None
    programs = _programs(a_q.device, E * triton.cdiv(N1, bm) * triton.cdiv(N2, bn), cfg)
    _grouped_wgrad_scaled_kernel[(programs,)](
        a_q, b_q, out, sa, sb, a_desc, b_desc, c_desc, bounds, E, N1, N2, a_q.stride(0), b_q.stride(0),
        USE_TMA=tma, TMA_STORE=tma_store, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=cfg.group_m, NUM_PROGRAMS=programs,
        FLATTEN=cfg.flatten, num_warps=cfg.warps, num_stages=cfg.stages,
    )  # fmt: skip
    return out


def grouped_mm_scaled_reference(
    a_q: torch.Tensor, b_q: torch.Tensor, sa: torch.Tensor, sb: torch.Tensor, bounds: torch.Tensor
) -> torch.Tensor:
    """What `grouped_mm_scaled` computes, in float64 from the dequantised operands: [M, N]."""
    E, N, _ = b_q.shape
    a = a_q.double() * sa.reshape(-1, 1).double()
    b = b_q.double() * sb.reshape(E, N, 1).double()
    return grouped_mm_reference(a, b, bounds, trans_b=True)


def grouped_wgrad_scaled_reference(
    a_q: torch.Tensor, b_q: torch.Tensor, sa: torch.Tensor, sb: torch.Tensor, bounds: torch.Tensor
) -> torch.Tensor:
    """What `grouped_wgrad_scaled` computes, in float64 from the dequantised operands: [E, N1, N2]."""
    E, P = bounds.numel() - 1, a_q.shape[1]
    counts = (bounds[1:] - bounds[:-1]).long().cpu()
    col_expert = torch.repeat_interleave(torch.arange(E), counts, output_size=P).to(a_q.device)  # [P]
    a = a_q.double() * sa.reshape(E, -1).double().t()[:, col_expert]  # [N1, P] with each column's expert scales
    b = b_q.double() * sb.reshape(E, -1).double().t()[:, col_expert]
    return grouped_wgrad_reference(a.t(), b.t(), bounds)
