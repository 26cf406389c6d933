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

Schedule (as grouped_gemm.py's): the programs (one per SM when `persistent`, else one per output tile) walk
the output tiles GROUP_M m-tiles at a time (the operand tiles they share stay in L2), loading whole 128-deep
chunks through TMA where the operands allow (every chunk is whole: rows are padded to 128 and K is a multiple
of 128). The forward kernel finds each
m-tile's expert in `tile_expert` (one entry per BLOCK_M rows, made on the GPU: no host synchronisation).
The program count is a runtime argument, not a compile-time one: the padded row count changes with the
routing every step, and a compile-time count would recompile the kernel each time.
`BLOCK_TILES` holds the fastest tiles of `benchmarks/grouped_gemm_tiles.py --blockwise` on an H200.
"""

from __future__ import annotations

import torch

from moecore.kernels._triton import triton_importable
from moecore.kernels.grouped_gemm import TileConfig, _descriptor, _programs, _tma_ok

BLOCK = 128

BLOCK_TILES = {  # BLOCK_K is the scale block (128); BLOCK_M divides 128 for "nt"
    "nt": TileConfig(64, 128, 128, 8, 4, 4, persistent=False, tma=True),
    "tn": TileConfig(64, 128, 128, 8, 4, 4, persistent=False, tma=True),
    "tn_few_rows": TileConfig(128, 256, 128, 8, 8, 3, persistent=True, tma=True),  # < 512 rows per expert
}
INTERPRETER_BLOCK_TILES = TileConfig(32, 32, 128, 2, 4, 2, persistent=True, tma=True)

if triton_importable():
    import triton
    import triton.language as tl

    from moecore.kernels.grouped_gemm import _swizzle

    @triton.jit
    def _block_nt_kernel(
        a_ptr, sa_ptr, b_ptr, sb_ptr, c_ptr, a_desc, b_desc, tile_expert_ptr, P, N, K, num_programs,
        USE_TMA: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
        FLATTEN: tl.constexpr,
    ):  # fmt: skip
        # Tiles [BM, BN] of out; each m-tile's rows belong to one expert (rows padded to 128, BM divides 128).
        pid = tl.program_id(0)
        tiles_m = P // BM
        tiles_n = tl.cdiv(N, BN)
        kb_n = K // BK
        nb_n = N // BK  # 128-column scale blocks of each expert's B
        rk = tl.arange(0, BK)
        for tile in tl.range(pid, tiles_m * tiles_n, num_programs, flatten=FLATTEN):
            tm, tn = _swizzle(tile, tiles_m, tiles_n, GROUP_M)
            e = tl.load(tile_expert_ptr + tm)  # int32: TMA offsets; pointers below in int64
            rows = (tm * BM + tl.arange(0, BM)).to(tl.int64)
            cols = tn * BN + tl.arange(0, BN)
            mask_n = cols < N
            sa_rows = sa_ptr + rows * kb_n
            sb_cols = sb_ptr + (e.to(tl.int64) * nb_n + cols // BK) * kb_n
            acc = tl.zeros((BM, BN), dtype=tl.float32)
            for kb in range(0, kb_n):
                if USE_TMA:
                    a = a_desc.load([tm * BM, kb * BK])
                    b = b_desc.load([e * N + tn * BN, kb * BK])
                else:
                    a = tl.load(a_ptr + rows[:, None] * K + (kb * BK + rk)[None, :])
                    b_rows = b_ptr + (e.to(tl.int64) * N + cols)[:, None] * K
                    b = tl.load(b_rows + (kb * BK + rk)[None, :], mask=mask_n[:, None], other=0.0)
                part = tl.dot(a, b.T)
                sa = tl.load(sa_rows + kb)
                sb = tl.load(sb_cols + kb, mask=mask_n, other=0.0)
                acc += part * sa[:, None] * sb[None, :]
            dst = c_ptr + rows[:, None] * N + cols[None, :]
            tl.store(dst, acc.to(c_ptr.dtype.element_ty), mask=mask_n[None, :])

    @triton.jit
    def _block_tn_kernel(
        a_ptr, sa_ptr, b_ptr, sb_ptr, c_ptr, a_desc, b_desc, bounds_ptr, E, P, C1, C2, num_programs,
        USE_TMA: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
        FLATTEN: tl.constexpr,
    ):  # fmt: skip
        # out[e][BM x BN tile] = sum over the 128-row blocks of expert e of (A_blk @ B_blk^T) * sa * sb.
        pid = tl.program_id(0)
        tiles_m = tl.cdiv(C1, BM)
        tiles_n = tl.cdiv(C2, BN)
        per_e = tiles_m * tiles_n
        nkb = P // BK
        rk = tl.arange(0, BK)
        for tile in tl.range(pid, E * per_e, num_programs, flatten=FLATTEN):
            e = tile // per_e
            tm, tn = _swizzle(tile % per_e, tiles_m, tiles_n, GROUP_M)
            start = tl.load(bounds_ptr + e)
            end = tl.load(bounds_ptr + e + 1)
            r1 = tm * BM + tl.arange(0, BM)
            r2 = tn * BN + tl.arange(0, BN)
            m1 = r1 < C1
            m2 = r2 < C2
            acc = tl.zeros((BM, BN), dtype=tl.float32)
            for k0 in range(start, end, BK):
                if USE_TMA:
                    a = a_desc.load([tm * BM, k0])
                    b = b_desc.load([tn * BN, k0])
                else:
                    a = tl.load(a_ptr + r1.to(tl.int64)[:, None] * P + (k0 + rk)[None, :], mask=m1[:, None], other=0.0)
                    b = tl.load(b_ptr + r2.to(tl.int64)[:, None] * P + (k0 + rk)[None, :], mask=m2[:, None], other=0.0)
                part = tl.dot(a, b.T)
                sa = tl.load(sa_ptr + r1.to(tl.int64) * nkb + k0 // BK, mask=m1, other=0.0)
                sb = tl.load(sb_ptr + r2.to(tl.int64) * nkb + k0 // BK, mask=m2, other=0.0)
                acc += part * sa[:, None] * sb[None, :]
            dst = c_ptr + e.to(tl.int64) * C1 * C2 + r1.to(tl.int64)[:, None] * C2 + r2[None, :]
            tl.store(dst, acc.to(c_ptr.dtype.element_ty), mask=m1[:, None] & m2[None, :])


def _check(cond: bool, what: str) -> None:
    if not cond:
        raise ValueError(f"blockwise FP8 grouped GEMM: {what}")


def block_tiles(kind: str, a: torch.Tensor, rows_per_expert: int = 0) -> TileConfig:
    """The tiles of `block_gemm_nt` (kind "nt") or `block_gemm_tn` ("tn": wider ones below 512 rows per expert,
    where each output tile reduces over few rows) on a's device."""
    if not a.is_cuda:
        return INTERPRETER_BLOCK_TILES
    return BLOCK_TILES["tn_few_rows" if kind == "tn" and rows_per_expert < 512 else kind]


def block_gemm_nt(
    a: torch.Tensor,
    sa: torch.Tensor,
    b: torch.Tensor,
    sb: torch.Tensor,
    counts: torch.Tensor,
    out_dtype: torch.dtype,
    cfg: TileConfig | None = None,
) -> torch.Tensor:
    """out [P, N] with out[rows of e] = A[rows of e] @ B[e]^T (module docstring); counts: padded rows per expert."""
    P, K = a.shape
    E, N, _ = b.shape
    _check(P % BLOCK == 0 and K % BLOCK == 0 and N % BLOCK == 0, f"P={P}, K={K}, N={N} must be multiples of 128")
    cfg = cfg or block_tiles("nt", a)
    bm, bn = cfg.block_m, cfg.block_n
    _check(BLOCK % bm == 0 and cfg.block_k == BLOCK, f"tile {cfg.describe()}: BLOCK_M must divide 128, BLOCK_K be 128")
    a, b = a.contiguous(), b.contiguous()
    out = torch.empty(P, N, dtype=out_dtype, device=a.device)
    if P == 0:
        return out
    eid = torch.repeat_interleave(torch.arange(E, device=a.device), counts.to(torch.int64), output_size=P)
    tile_expert = eid[::bm].to(torch.int32).contiguous()
    tma = cfg.tma and _tma_ok(a, b)
    a_desc = _descriptor(a, [bm, BLOCK]) if tma else None
    b_desc = _descriptor(b.view(E * N, K), [bn, BLOCK]) if tma else None
    programs = _programs(a.device, (P // bm) * triton.cdiv(N, bn), cfg)
    _block_nt_kernel[(programs,)](
        a, sa.contiguous(), b, sb.contiguous(), out, a_desc, b_desc, tile_expert, P, N, K, programs,
        USE_TMA=tma, BM=bm, BN=bn, BK=BLOCK, GROUP_M=cfg.group_m, FLATTEN=cfg.flatten,
        num_warps=cfg.warps, num_stages=cfg.stages,
    )  # fmt: skip
    return out


def block_gemm_tn(
    a: torch.Tensor,
    sa: torch.Tensor,
    b: torch.Tensor,
    sb: torch.Tensor,
    counts: torch.Tensor,
    out_dtype: torch.dtype,
    cfg: TileConfig | None = None,
) -> torch.Tensor:
    """out [E, C1, C2] with out[e] = A[:, rows of e] @ B[:, rows of e]^T (module docstring); zeros for empty experts."""
    C1, P = a.shape
    C2 = b.shape[0]
    E = counts.numel()
    _check(P % BLOCK == 0 and C1 % BLOCK == 0 and C2 % BLOCK == 0, f"P={P}, C1={C1}, C2={C2} must be multiples of 128")
    cfg = cfg or block_tiles("tn", a, P // max(E, 1))
    bm, bn = cfg.block_m, cfg.block_n
    _check(cfg.block_k == BLOCK, f"tile {cfg.describe()}: BLOCK_K must be 128")
    a, b = a.contiguous(), b.contiguous()
    bounds = torch.zeros(E + 1, dtype=torch.int32, device=a.device)
    torch.cumsum(counts, 0, out=bounds[1:])
    out = torch.empty(E, C1, C2, dtype=out_dtype, device=a.device)
    tma = cfg.tma and P > 0 and _tma_ok(a, b)
    a_desc = _descriptor(a, [bm, BLOCK]) if tma else None
    b_desc = _descriptor(b, [bn, BLOCK]) if tma else None
    programs = _programs(a.device, E * triton.cdiv(C1, bm) * triton.cdiv(C2, bn), cfg)
    _block_tn_kernel[(programs,)](
        a, sa.contiguous(), b, sb.contiguous(), out, a_desc, b_desc, bounds, E, P, C1, C2, programs,
        USE_TMA=tma, BM=bm, BN=bn, BK=BLOCK, GROUP_M=cfg.group_m, FLATTEN=cfg.flatten,
        num_warps=cfg.warps, num_stages=cfg.stages,
    )  # fmt: skip
    return out
