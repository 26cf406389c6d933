"""Triton grouped GEMMs over rows sorted by expert, scheduled on the GPU (no host synchronisation).

Legend: M rows sorted by expert, E experts, bounds [E + 1] the row offsets of each expert (int32, on the GPU).

    grouped_mm(a, b, bounds):          out[rows of e] = a[rows of e] @ B[e]       a [M, K] -> [M, N]
        B[e] = b[e]^T for b [E, N, K] (trans_b=True: forward, h = x @ w13[e]^T)
        B[e] = b[e]   for b [E, K, N] (trans_b=False: data gradient, dx = dh @ w13[e])
    grouped_wgrad(a, b, bounds):       out[e] = a[rows of e]^T @ b[rows of e]     -> [E, N1, N2]

Tile schedule. `grouped_mm` splits each expert's rows into BLOCK_M-row tiles; `tile_starts[e]` (a cumsum
of ceil(count / BLOCK_M), two small torch ops on the GPU) numbers them consecutively, and a program finds
the expert of m-tile t by a binary search over tile_starts — so the launch needs only an upper bound on the
number of tiles (ceil(M / BLOCK_M) + E), never the counts on the host. With `persistent`, one program per
SM walks the tiles with a stride of the grid size; otherwise each program takes one tile and programs past
the real count return at once. Consecutive tiles are grouped GROUP_M m-tiles at a time so that the
weight tile and the rows they share stay in L2. `grouped_wgrad` tiles each dW[e] and reduces over the
expert's rows in BLOCK_K chunks (masked at the expert's end; empty experts give zeros).

With `tma` the full tiles are loaded through Hopper's tensor-memory accelerator (host-made tensor
descriptors): rows past an expert's end that a forward tile reads belong to the next expert (finite
values, never stored); the weight-gradient kernel loads its last partial chunk with masked pointer loads.

With `flatten` (persistent only) Triton pipelines across the tile loop, so the next tile's first loads are
issued under the current tile's epilogue; `warp_specialize` asks Triton to split loads and MMAs between warp
groups (measured within 2% of `flatten` on an H200, so `GPU_TILES` does not use it).

`grouped_mm_reference` / `grouped_wgrad_reference` are loops of torch matmuls; the tests compare the
kernels with them (in Triton's interpreter on CPU, on the GPU with the benchmark's shapes).

The same forward kernel takes FP8 operands with row scales applied in its epilogue (`_launch_mm` with scales):
moecore/kernels/grouped_gemm_fp8.py, beside the FP8 weight-gradient kernel.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from moecore.kernels._triton import next_pow2, triton_importable, use_triton


@dataclass(frozen=True)
class TileConfig:
    """Launch parameters of one grouped GEMM kernel (block sizes, warps, pipeline stages, schedule)."""

    block_m: int = 128
    block_n: int = 128
    block_k: int = 64
    group_m: int = 8
    warps: int = 8
    stages: int = 3
    persistent: bool = True
    tma: bool = False
    flatten: bool = False  # (persistent) let Triton pipeline across tiles: next tile's loads under this epilogue
    warp_specialize: bool = False  # (persistent) Triton's automatic warp specialisation of the tile loop

    def describe(self) -> str:
        sched = ("P" if self.persistent else "G") + ("T" if self.tma else "")
        sched += ("F" if self.flatten else "") + ("W" if self.warp_specialize else "")
        return f"{self.block_m}x{self.block_n}x{self.block_k}w{self.warps}s{self.stages}g{self.group_m}{sched}"


if triton_importable():
    import triton
    import triton.language as tl

    @triton.jit
    def _expert_of_tile(t, tile_starts_ptr, E, SEARCH_STEPS: tl.constexpr):
        # the largest e with tile_starts[e] <= t (empty experts repeat a start: the largest is the owner)
        lo = t * 0
        hi = lo + E
        for _ in tl.static_range(SEARCH_STEPS):
            mid = (lo + hi) // 2
            right = tl.load(tile_starts_ptr + mid) <= t
            lo = tl.where(right, mid, lo)
            hi = tl.where(right, hi, mid)
        return lo

    @triton.jit
    def _tile_starts_kernel(bounds_ptr, starts_ptr, E, BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr):
        # starts[0] = 0, starts[e + 1] = sum over j <= e of ceil((bounds[j + 1] - bounds[j]) / BLOCK_M)
        e = tl.arange(0, BLOCK_E)
        inside = e < E
        lo = tl.load(bounds_ptr + e, mask=inside, other=0)
        hi = tl.load(bounds_ptr + e + 1, mask=inside, other=0)
        tiles = (hi - lo + BLOCK_M - 1) // BLOCK_M
        tl.store(starts_ptr + e + 1, tl.cumsum(tiles, 0), mask=inside)
        tl.store(starts_ptr + e, tiles * 0, mask=e == 0)

    @triton.jit
    def _group_bounds_kernel(counts_ptr, bounds_ptr, E, BLOCK_E: tl.constexpr):
        # bounds[0] = 0, bounds[e + 1] = sum over j <= e of counts[j]
        e = tl.arange(0, BLOCK_E)
        inside = e < E
        rows = tl.load(counts_ptr + e, mask=inside, other=0).to(tl.int32)
        tl.store(bounds_ptr + e + 1, tl.cumsum(rows, 0), mask=inside)
        tl.store(bounds_ptr + e, rows * 0, mask=e == 0)

    @triton.jit
    def _swizzle(tile, tiles_m, tiles_n, GROUP_M: tl.constexpr):
        # tile -> (tm, tn), walking GROUP_M m-tiles down a column of n-tiles before moving right
        in_group = GROUP_M * tiles_n
        first_m = (tile // in_group) * GROUP_M
        size = tl.minimum(tiles_m - first_m, GROUP_M)
        return first_m + (tile % in_group) % size, (tile % in_group) // size

    @triton.jit
    def _grouped_mm_kernel(
        a_ptr,
        b_ptr,
        c_ptr,
        sa_ptr,
        sb_ptr,
        a_desc,
        b_desc,
        bounds_ptr,
        tile_starts_ptr,
        E,
        N,
        K,
        stride_am,
        stride_be,
        stride_bk,
        stride_bn,
        stride_cm,
        TRANS_B: tl.constexpr,
        USE_TMA: tl.constexpr,
        EVEN_K: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        GROUP_M: tl.constexpr,
        NUM_PROGRAMS: tl.constexpr,
        SEARCH_STEPS: tl.constexpr,
        FLATTEN: tl.constexpr,
        WARP_SPECIALIZE: tl.constexpr,
        SCALED: tl.constexpr,  # FP8 a and b with row scales sa [M] and sb [E, N] (grouped_gemm_fp8.py)
        IMPRECISE_ACC: tl.constexpr,  # FP8: None (fast accumulation) or BLOCK_K (fp32 partial sums every chunk)
    ):
        pid = tl.program_id(0)
        tiles_m = tl.load(tile_starts_ptr + E)
        tiles_n = tl.cdiv(N, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        for tile in tl.range(pid, tiles_m * tiles_n, NUM_PROGRAMS, flatten=FLATTEN, warp_specialize=WARP_SPECIALIZE):
            tm, tn = _swizzle(tile, tiles_m, tiles_n, GROUP_M)
            e = _expert_of_tile(tm, tile_starts_ptr, E, SEARCH_STEPS)
            end = tl.load(bounds_ptr + e + 1)
            row0 = tl.load(bounds_ptr + e) + (tm - tl.load(tile_starts_ptr + e)) * BLOCK_M
            rm = row0 + tl.arange(0, BLOCK_M)
            rn = tn * BLOCK_N + tl.arange(0, BLOCK_N)
            mask_m = rm < end
            mask_n = rn < N
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            if USE_TMA:
                for k0 in range(0, K, BLOCK_K):
                    a = a_desc.load([row0, k0])
                    if TRANS_B:
                        b = b_desc.load([e * N + tn * BLOCK_N, k0]).T
                    else:
                        b = b_desc.load([e * K + k0, tn * BLOCK_N])
                    acc = tl.dot(a, b, acc, max_num_imprecise_acc=IMPRECISE_ACC)
            else:
                a_rows = a_ptr + rm.to(tl.int64)[:, None] * stride_am
                b_cols = b_ptr + e.to(tl.int64) * stride_be + rn[None, :] * stride_bn
                for k0 in range(0, K, BLOCK_K):
                    kk = k0 + rk
                    if EVEN_K:
                        a = tl.load(a_rows + kk[None, :], mask=mask_m[:, None], other=0.0)
                        b = tl.load(b_cols + kk[:, None] * stride_bk, mask=mask_n[None, :], other=0.0)
                    else:
                        mk = kk < K
                        a = tl.load(a_rows + kk[None, :], mask=mask_m[:, None] & mk[None, :], other=0.0)
                        b = tl.load(b_cols + kk[:, None] * stride_bk, mask=mk[:, None] & mask_n[None, :], other=0.0)
                    acc = tl.dot(a, b, acc, max_num_imprecise_acc=IMPRECISE_ACC)
            if SCALED:  # FP8 operands: the row scales of a and of b[e] (a_q = a / sa, b_q = b / sb) applied once
                sa = tl.load(sa_ptr + rm, mask=mask_m, other=0.0)
                sb = tl.load(sb_ptr + e.to(tl.int64) * N + rn, mask=mask_n, other=0.0)
                acc = acc * sa[:, None] * sb[None, :]
            c = c_ptr + rm.to(tl.int64)[:, None] * stride_cm + rn[None, :]
            tl.store(c, acc.to(c_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])

    @triton.jit
    def _grouped_wgrad_kernel(
        a_ptr,
        b_ptr,
        c_ptr,
        a_desc,
        b_desc,
        bounds_ptr,
        E,
        N1,
        N2,
        stride_a,
        stride_b,
        USE_TMA: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        GROUP_M: tl.constexpr,
        NUM_PROGRAMS: tl.constexpr,
        FLATTEN: tl.constexpr,
        WARP_SPECIALIZE: tl.constexpr,
    ):
        # c[e] = a[s:t]^T @ b[s:t] with s, t = bounds[e], bounds[e+1]; a [M, N1], b [M, N2], c [E, N1, N2]
        pid = tl.program_id(0)
        tiles_m = tl.cdiv(N1, BLOCK_M)
        tiles_n = tl.cdiv(N2, BLOCK_N)
        per_e = tiles_m * tiles_n
        rk = tl.arange(0, BLOCK_K)
        for tile in tl.range(pid, E * per_e, NUM_PROGRAMS, flatten=FLATTEN, warp_specialize=WARP_SPECIALIZE):
            e = tile // per_e
            tm, tn = _swizzle(tile % per_e, tiles_m, tiles_n, GROUP_M)
            start = tl.load(bounds_ptr + e)
            end = tl.load(bounds_ptr + e + 1)
            rm = tm * BLOCK_M + tl.arange(0, BLOCK_M)
            rn = tn * BLOCK_N + tl.arange(0, BLOCK_N)
            mm = rm < N1
            mn = rn < N2
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            tail = start
            if USE_TMA:
                full = (end - start) // BLOCK_K
                for i in range(0, full):
                    r0 = start + i * BLOCK_K
                    a = a_desc.load([r0, tm * BLOCK_M])
                    b = b_desc.load([r0, tn * BLOCK_N])
                    acc = tl.dot(a.T, b, acc)
                tail = start + full * BLOCK_K
            for k0 in range(tail, end, BLOCK_K):
                rows = k0 + rk
                mk = rows < end
                rows64 = rows.to(tl.int64)
                a = tl.load(a_ptr + rows64[:, None] * stride_a + rm[None, :], mask=mk[:, None] & mm[None, :], other=0.0)
                b = tl.load(b_ptr + rows64[:, None] * stride_b + rn[None, :], mask=mk[:, None] & mn[None, :], other=0.0)
                acc = tl.dot(a.T, b, acc)
            c = c_ptr + e.to(tl.int64) * N1 * N2 + rm.to(tl.int64)[:, None] * N2 + rn[None, :]
            tl.store(c, acc.to(c_ptr.dtype.element_ty), mask=mm[:, None] & mn[None, :])


@functools.cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _programs(device: torch.device, upper_bound: int, cfg: TileConfig) -> int:
    """Programs to launch: one per tile (upper_bound), or, persistent, one per SM whatever the problem's size —
    the kernels take the count as a compile-time constant, so a count that followed the rows (which change with
    the routing, e.g. per expert-parallel rank) would compile them again for every new count; programs past the
    last tile exit at once."""
    if not cfg.persistent:
        return max(1, upper_bound)
    return _sm_count(device.index or 0) if device.type == "cuda" else 4


def _descriptor(t: torch.Tensor, block: list[int]):
    from triton.tools.tensor_descriptor import TensorDescriptor

    return TensorDescriptor(t, list(t.shape), list(t.stride()), block)


def _tma_ok(*tensors: torch.Tensor) -> bool:
    """TMA needs 16-byte aligned base addresses and row strides, and unit stride along the row."""
    for t in tensors:
        es = t.element_size()
        if t.stride(-1) != 1 or t.data_ptr() % 16 or any((s * es) % 16 for s in t.stride()[:-1]):
            return False
    return True


GPU_TILES = {  # per GEMM kind of the expert FFN; the fastest of benchmarks/grouped_gemm_tiles.py on an H200
    "fwd13": TileConfig(128, 256, 64, 8, 8, 3, persistent=True, tma=True, flatten=True),
    "fwd2": TileConfig(128, 256, 64, 8, 8, 4, persistent=True, tma=True, flatten=True),
    "dgrad2": TileConfig(128, 256, 64, 8, 8, 3, persistent=True, tma=True),
    "dgrad13": TileConfig(128, 256, 64, 8, 8, 3, persistent=True, tma=True, flatten=True),
    "wgrad13": TileConfig(128, 256, 64, 8, 8, 3, persistent=True, tma=True),
    "wgrad2": TileConfig(128, 256, 64, 8, 8, 3, persistent=True, tma=True),
}
INTERPRETER_TILES = TileConfig(16, 32, 16, 2, 4, 2, persistent=True, tma=True)  # Triton's CPU interpreter (tests)


def tiles_for(kind: str, a: torch.Tensor) -> TileConfig:
    """The tile configuration for this GEMM kind of the expert FFN on a's device."""
    return GPU_TILES[kind] if a.is_cuda else INTERPRETER_TILES


# Experts up to which `group_bounds` and `tile_starts` run as one Triton launch (a cumsum over one block of registers).
ONE_BLOCK_MAX_EXPERTS = 4096


def group_bounds(counts: torch.Tensor, impl: str = "auto") -> torch.Tensor:
    """[E + 1] int32 on counts' device: 0, then the running sum of the rows per group (the kernels' `bounds`).

    On CUDA one Triton launch: `group_bounds_reference`'s zeros, cast and two-kernel scan cost the host three
    launches before every expert FFN's first GEMM."""
    E = counts.numel()
    if not use_triton(impl, counts) or E > ONE_BLOCK_MAX_EXPERTS or counts.is_floating_point():
        return group_bounds_reference(counts)
    bounds = torch.empty(E + 1, dtype=torch.int32, device=counts.device)
    _group_bounds_kernel[(1,)](counts.contiguous(), bounds, E, BLOCK_E=max(16, next_pow2(E)), num_warps=4)
    return bounds


def group_bounds_reference(counts: torch.Tensor) -> torch.Tensor:
    """`group_bounds` through torch operations (CPU, the tests' reference)."""
    bounds = torch.zeros(counts.numel() + 1, dtype=torch.int32, device=counts.device)
    torch.cumsum(counts, 0, out=bounds[1:])
    return bounds


def tile_starts(bounds: torch.Tensor, block_m: int, impl: str = "auto") -> torch.Tensor:
    """[E + 1] int32: the index of each expert's first m-tile of block_m rows (last entry: the total).

    On CUDA one small Triton launch (~33 us of host time on an H100): the five torch operations of
    `tile_starts_reference` cost the host 60-126 us per grouped GEMM, more than the GEMM's own launch
    (docs/benchmarks.md, "Host cost of a grouped-GEMM launch"; benchmarks/launch_overhead.py)."""
    E = bounds.numel() - 1
    if not use_triton(impl, bounds) or E > ONE_BLOCK_MAX_EXPERTS or bounds.dtype != torch.int32:
        return tile_starts_reference(bounds, block_m)
    starts = torch.empty_like(bounds)
    _tile_starts_kernel[(1,)](bounds, starts, E, BLOCK_M=block_m, BLOCK_E=max(16, next_pow2(E)), num_warps=4)
    return starts


def tile_starts_reference(bounds: torch.Tensor, block_m: int) -> torch.Tensor:
    """`tile_starts` through torch operations (CPU, the tests' reference)."""
    counts = bounds[1:] - bounds[:-1]
    starts = torch.zeros_like(bounds)
    torch.cumsum((counts + block_m - 1) // block_m, 0, out=starts[1:])
    return starts


def grouped_mm(a: torch.Tensor, b: torch.Tensor, bounds: torch.Tensor, trans_b: bool, cfg: TileConfig) -> torch.Tensor:
    """out[rows of e] = a[rows of e] @ (b[e]^T if trans_b else b[e]); a [M, K] -> [M, N] in a's dtype."""
    return _launch_mm(a, b, bounds, trans_b, cfg, a.dtype)


def _launch_mm(a, b, bounds, trans_b, cfg, out_dtype, scales=None, imprecise_acc=None) -> torch.Tensor:
    E = b.shape[0]
    M, K = a.shape
    N = b.shape[1] if trans_b else b.shape[2]
    if b.shape[2 if trans_b else 1] != K:
        raise ValueError(f"grouped_mm: a has {K} columns but b's reduction dimension is {tuple(b.shape)}")
    a = a if a.stride(-1) == 1 else a.contiguous()
    b = b.contiguous()
    out = torch.empty(M, N, dtype=out_dtype, device=a.device)
    if M == 0:
        return out
    bm, bn, bk = cfg.block_m, cfg.block_n, cfg.block_k
    starts = tile_starts(bounds, bm)
    upper = (triton.cdiv(M, bm) + E) * triton.cdiv(N, bn)
    tma = cfg.tma and K % bk == 0 and _tma_ok(a, b)
    a_desc = b_desc = None
    if tma:
        a_desc = _descriptor(a, [bm, bk])
        b2 = b.view(E * b.shape[1], b.shape[2])
        b_desc = _descriptor(b2, [bn, bk] if trans_b else [bk, bn])
    stride_bk, stride_bn = (b.stride(2), b.stride(1)) if trans_b else (b.stride(1), b.stride(2))
    sa, sb = scales if scales is not None else (out, out)  # unread unless SCALED
    programs = _programs(a.device, upper, cfg)
    _grouped_mm_kernel[(programs,)](
        a, b, out, sa, sb, a_desc, b_desc, bounds, starts, E, N, K,
        a.stride(0), b.stride(0), stride_bk, stride_bn, out.stride(0),
        TRANS_B=trans_b, USE_TMA=tma, EVEN_K=K % bk == 0,
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=cfg.group_m,
        NUM_PROGRAMS=programs, SEARCH_STEPS=max(1, E.bit_length()),
        FLATTEN=cfg.flatten, WARP_SPECIALIZE=cfg.warp_specialize,
        SCALED=scales is not None, IMPRECISE_ACC=imprecise_acc,
        num_warps=cfg.warps, num_stages=cfg.stages,
    )  # fmt: skip
    return out


def grouped_wgrad(
    a: torch.Tensor,
    b: torch.Tensor,
    bounds: torch.Tensor,
    out_dtype: torch.dtype,
    cfg: TileConfig,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """out[e] = a[rows of e]^T @ b[rows of e]; a [M, N1], b [M, N2] -> [E, N1, N2] (zeros for empty experts).

    `out`: a contiguous [E, N1, N2] tensor of out_dtype to write into (e.g. a slice of a larger gradient)."""
    E = bounds.numel() - 1
    N1, N2 = a.shape[1], b.shape[1]
    a, b = a.contiguous(), b.contiguous()
    if out is None:
        out = torch.empty(E, N1, N2, dtype=out_dtype, device=a.device)
    elif out.shape != (E, N1, N2) or out.dtype != out_dtype or not out.is_contiguous():
        raise ValueError(f"out {tuple(out.shape)} {out.dtype}: a contiguous [{E}, {N1}, {N2}] {out_dtype} is needed")
    bm, bn, bk = cfg.block_m, cfg.block_n, cfg.block_k
    tma = cfg.tma and a.shape[0] > 0 and _tma_ok(a, b)
    a_desc = _descriptor(a, [bk, bm]) if tma else None
    b_desc = _descriptor(b, [bk, bn]) if tma else None
    upper = E * triton.cdiv(N1, bm) * triton.cdiv(N2, bn)
    programs = _programs(a.device, upper, cfg)
    _grouped_wgrad_kernel[(programs,)](
        a, b, out, a_desc, b_desc, bounds, E, N1, N2, a.stride(0), b.stride(0),
        USE_TMA=tma, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=cfg.group_m, NUM_PROGRAMS=programs,
        FLATTEN=cfg.flatten, WARP_SPECIALIZE=cfg.warp_specialize, num_warps=cfg.warps, num_stages=cfg.stages,
    )  # fmt: skip
    return out


def grouped_mm_reference(a: torch.Tensor, b: torch.Tensor, bounds: torch.Tensor, trans_b: bool) -> torch.Tensor:
    """A loop of torch matmuls computing what `grouped_mm` does."""
    N = b.shape[1] if trans_b else b.shape[2]
    out = a.new_empty(a.shape[0], N)
    edges = bounds.tolist()
    for e in range(b.shape[0]):
        s, t = edges[e], edges[e + 1]
        out[s:t] = a[s:t] @ (b[e].t() if trans_b else b[e])
    return out


def grouped_wgrad_reference(a: torch.Tensor, b: torch.Tensor, bounds: torch.Tensor) -> torch.Tensor:
    """A loop of torch matmuls computing what `grouped_wgrad` does (in float64 for the comparisons)."""
    edges = bounds.tolist()
    return torch.stack(
        [a[edges[e] : edges[e + 1]].double().t() @ b[edges[e] : edges[e + 1]].double() for e in range(len(edges) - 1)]
    )
