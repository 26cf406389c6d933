"""Blockwise-scaled FP8 grouped GEMMs in Triton (DeepSeek-V3's recipe), where torch has no grouped kernel.

Operands as moecore/kernels/fp8_grouped.py holds them, each expert's rows padded to 128 so that a 128-row
tile or a 128-row scale block never straddles two experts:

- `block_gemm_nt`: out[rows of e] = A[rows of e] @ B[e]^T; A [P, K] fp8 with 1x128 scales sa [P, K/128],
  B [E, N, K] fp8 with 128x128 scales sb [E, N/128, K/128] (forward and dgrad GEMMs).
- `block_gemm_tn`: out[e] = A[:, rows of e] @ B[:, rows of e]^T; A [C1, P], B [C2, P] fp8, both with 1x128
  scales along P: sa [C1, P/128], sb [C2, P/128] (the weight-gradient GEMMs).

Accumulation follows DeepSeek-V3: each 128-deep partial product is computed by the tensor cores in fp32 and
added to the fp32 accumulator multiplied by its two scales, so no product is formed in FP8 across scale
groups. The references are the emulated loops of fp8_grouped (dequantise, fp32 matmul); tests compare.
"""

from __future__ import annotations

import torch

from moecore.kernels._triton import triton_importable

BLOCK = 128

if triton_importable():
    import triton
    import triton.language as tl

    @triton.jit
    def _block_nt_kernel(
        a_ptr, sa_ptr, b_ptr, sb_ptr, c_ptr, tile_expert_ptr, N, K,
        BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
    ):  # fmt: skip
        # One [BM, BN] tile of out; its rows belong to one expert (rows padded to 128, BM divides 128).
        pm = tl.program_id(0)
        pn = tl.program_id(1)
        e = tl.load(tile_expert_ptr + pm).to(tl.int64)
        rows = pm * BM + tl.arange(0, BM)
        cols = pn * BN + tl.arange(0, BN)
        rk = tl.arange(0, BK)
        r64 = rows.to(tl.int64)
        kb_n = K // BK
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for kb in range(0, kb_n):
            a = tl.load(a_ptr + r64[:, None] * K + (kb * BK + rk)[None, :])
            b = tl.load(b_ptr + e * N * K + cols.to(tl.int64)[:, None] * K + (kb * BK + rk)[None, :])
            part = tl.dot(a, tl.trans(b))
            sa = tl.load(sa_ptr + r64 * kb_n + kb)
            sb = tl.load(sb_ptr + e * (N // BK) * kb_n + (pn * BN // BK) * kb_n + kb)
            acc += part * sa[:, None] * sb
        tl.store(c_ptr + r64[:, None] * N + cols[None, :], acc.to(c_ptr.dtype.element_ty))

    @triton.jit
    def _block_tn_kernel(
        a_ptr, sa_ptr, b_ptr, sb_ptr, c_ptr, bounds_ptr, P, C1, C2,
        BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
    ):  # fmt: skip
        # out[e][BM x BN tile] = sum over the 128-row blocks of expert e of (A_blk @ B_blk^T) * sa * sb.
        e = tl.program_id(0)
        pm = tl.program_id(1)
        pn = tl.program_id(2)
        start = tl.load(bounds_ptr + e)
        end = tl.load(bounds_ptr + e + 1)
        r1 = (pm * BM + tl.arange(0, BM)).to(tl.int64)
        r2 = (pn * BN + tl.arange(0, BN)).to(tl.int64)
        rk = tl.arange(0, BK)
        nkb = P // BK
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for k0 in range(start, end, BK):
            a = tl.load(a_ptr + r1[:, None] * P + (k0 + rk)[None, :])
            b = tl.load(b_ptr + r2[:, None] * P + (k0 + rk)[None, :])
            part = tl.dot(a, tl.trans(b))
            sa = tl.load(sa_ptr + r1 * nkb + k0 // BK)
            sb = tl.load(sb_ptr + r2 * nkb + k0 // BK)
            acc += part * sa[:, None] * sb[None, :]
        dst = c_ptr + e.to(tl.int64) * C1 * C2 + r1[:, None] * C2 + r2[None, :]
        tl.store(dst, acc.to(c_ptr.dtype.element_ty))


def _check(cond: bool, what: str) -> None:
    if not cond:
        raise ValueError(f"blockwise FP8 grouped GEMM: {what}")


def block_gemm_nt(
    a: torch.Tensor, sa: torch.Tensor, b: torch.Tensor, sb: torch.Tensor, counts: torch.Tensor, out_dtype: torch.dtype
) -> torch.Tensor:
    """out [P, N] with out[rows of e] = A[rows of e] @ B[e]^T (module docstring); counts: padded rows per expert."""
    P, K = a.shape
    E, N, _ = b.shape
    _check(P % BLOCK == 0 and K % BLOCK == 0 and N % BLOCK == 0, f"P={P}, K={K}, N={N} must be multiples of 128")
    bm, bn = (128, 128) if a.is_cuda else (32, 32)
    eid = torch.repeat_interleave(torch.arange(E, device=a.device), counts.to(torch.int64), output_size=P)
    tile_expert = eid[::bm].to(torch.int32).contiguous()
    out = torch.empty(P, N, dtype=out_dtype, device=a.device)
    grid = (P // bm, N // bn)
    _block_nt_kernel[grid](
        a.contiguous(), sa.contiguous(), b.contiguous(), sb.contiguous(), out, tile_expert, N, K,
        BM=bm, BN=bn, BK=BLOCK, **({"num_warps": 8, "num_stages": 3} if a.is_cuda else {}),
    )  # fmt: skip
    return out


def block_gemm_tn(
    a: torch.Tensor, sa: torch.Tensor, b: torch.Tensor, sb: torch.Tensor, counts: torch.Tensor, out_dtype: torch.dtype
) -> torch.Tensor:
    """out [E, C1, C2] with out[e] = A[:, rows of e] @ B[:, rows of e]^T (module docstring); zeros for empty experts."""
    C1, P = a.shape
    C2 = b.shape[0]
    E = counts.numel()
    _check(P % BLOCK == 0 and C1 % BLOCK == 0 and C2 % BLOCK == 0, f"P={P}, C1={C1}, C2={C2} must be multiples of 128")
    bm, bn = (128, 128) if a.is_cuda else (32, 32)
    bounds = torch.zeros(E + 1, dtype=torch.int32, device=a.device)
    torch.cumsum(counts, 0, out=bounds[1:])
    out = torch.empty(E, C1, C2, dtype=out_dtype, device=a.device)
    grid = (E, C1 // bm, C2 // bn)
    _block_tn_kernel[grid](
        a.contiguous(), sa.contiguous(), b.contiguous(), sb.contiguous(), out, bounds, P, C1, C2,
        BM=bm, BN=bn, BK=BLOCK, **({"num_warps": 8, "num_stages": 3} if a.is_cuda else {}),
    )  # fmt: skip
    return out
