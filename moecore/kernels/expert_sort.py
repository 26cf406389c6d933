"""Counting sort of routed expert ids: the dispatch's stable order, its inverse and the counts per expert.

Dispatch groups the N = T*K assignments by expert, keeping token order within an expert. Through torch that
is a radix sort (torch.sort: nine GPU operations with its copies and memsets), a searchsorted for the counts
and an arange + index_put for the inverse: about sixteen launches, each costing ~20 us of host time before
the first expert GEMM can start (at Qwen3-Next's shape the GPU waits on them). The counting sort here does
the same in three launches, on blocks of B assignments (block b holds assignments b*B .. b*B + B - 1):

  1. histogram   hist[b, e] = how many of block b's assignments go to expert e
  2. bases       base[b, e] = start[e] + sum_{b' < b} hist[b', e] - sum_{e' < e} hist[b, e']
                 with start[e] = sum_{e' < e} count[e'] and count[e] = sum_b hist[b, e]  (one program)
  3. place       each block sorts its pairs (e, i) as one int32 key e*B + i; the pair at sorted position p
                 goes to row base[b, e] + p

In step 3, p - sum_{e' < e} hist[b, e'] is the pair's rank among block b's assignments to e, so rows of an
expert run over the blocks in order and, within a block, in assignment order: the sort is stable and equals
`torch.sort(..., stable=True)`. Outputs: sorted_e[row] = e, order[row] = flat assignment, inv[flat] = row.
"""

from __future__ import annotations

import torch

from moecore.kernels._triton import next_pow2, triton_importable, use_triton
from moecore.kernels.permute import inverse_permutation

MAX_BLOCKS = 256  # step 2 holds a [blocks, experts-chunk] tile of the histogram in one program
MAX_BLOCK = 4096  # assignments per block sorted in registers by one program (so N <= 2^20 on the kernel path)
MAX_EXPERTS = 4096  # histogram bins of one program

if triton_importable():
    import triton
    import triton.language as tl

    @triton.jit
    def _histogram_kernel(e_ptr, hist_ptr, N, E, B: tl.constexpr, EP: tl.constexpr):
        b = tl.program_id(0)
        i = b * B + tl.arange(0, B)
        inside = i < N
        e = tl.load(e_ptr + i, mask=inside, other=0).to(tl.int32)
        h = tl.histogram(e, EP)
        bins = tl.arange(0, EP)
        h -= tl.where(bins == 0, B - tl.sum(inside.to(tl.int32)), 0)  # lanes past N were counted in bin 0
        tl.store(hist_ptr + b * E + bins, h, mask=bins < E)

    @triton.jit
    def _bases_kernel(hist_ptr, base_ptr, counts_ptr, NB, E, NBP: tl.constexpr, CE: tl.constexpr):
        blocks = tl.arange(0, NBP)
        in_blocks = blocks < NB
        before_row = tl.zeros([NBP], dtype=tl.int32)  # sum over experts of earlier chunks, per block
        start = tl.sum(before_row, 0)  # assignments to experts of earlier chunks (an int32 zero to start)
        for c in range(0, E, CE):
            cols = c + tl.arange(0, CE)
            m = in_blocks[:, None] & (cols < E)[None, :]
            at = blocks[:, None] * E + cols[None, :]
            h = tl.load(hist_ptr + at, mask=m, other=0)
            total = tl.sum(h, 0)  # count[e]
            above = tl.cumsum(h, 0) - h  # sum_{b' < b} hist[b', e]
            left = tl.cumsum(h, 1) - h + before_row[:, None]  # sum_{e' < e} hist[b, e']
            first = tl.cumsum(total, 0) - total + start  # start[e]
            tl.store(base_ptr + at, first[None, :] + above - left, mask=m)
            tl.store(counts_ptr + cols, total.to(tl.int64), mask=cols < E)
            before_row += tl.sum(h, 1)
            start += tl.sum(total, 0)

    @triton.jit
    def _place_kernel(e_ptr, base_ptr, sorted_ptr, order_ptr, inv_ptr, N, E, B: tl.constexpr):
        b = tl.program_id(0)
        pos = tl.arange(0, B)
        i = b * B + pos
        e = tl.load(e_ptr + i, mask=i < N, other=E).to(tl.int32)  # lanes past N sort last
        key = tl.sort(e * B + pos)
        e_s = key // B
        flat = b * B + key % B
        real = e_s < E
        row = tl.load(base_ptr + b * E + e_s, mask=real, other=0) + pos
        tl.store(sorted_ptr + row, e_s.to(sorted_ptr.dtype.element_ty), mask=real)
        tl.store(order_ptr + row, flat.to(tl.int64), mask=real)
        tl.store(inv_ptr + flat, row.to(tl.int64), mask=real)


def sorted_counts(sorted_e: torch.Tensor, num_experts: int) -> torch.Tensor:
    """[E] int64 occurrences of 0..E-1 in the ascending ids `sorted_e` (ids >= E, the dropped sentinel, not
    counted). A binary search per expert: no host synchronisation, where torch.bincount on CUDA reads the
    maximum back to size its output."""
    targets = torch.arange(num_experts + 1, device=sorted_e.device, dtype=sorted_e.dtype)
    bounds = torch.searchsorted(sorted_e, targets)
    return bounds[1:] - bounds[:-1]


def expert_sort_reference(
    flat_e: torch.Tensor, num_experts: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(sorted ids, stable order, [E] int64 counts, inverse order) of expert ids `flat_e` in 0..E-1, by torch ops."""
    sorted_e, order = torch.sort(flat_e, stable=True)
    return sorted_e, order, sorted_counts(sorted_e, num_experts), inverse_permutation(order)


def _block_size(n: int) -> int:
    """Assignments per block: at least 256, and few enough blocks for step 2's single program."""
    return max(256, next_pow2(-(-n // MAX_BLOCKS)))


def expert_sort_supported(flat_e: torch.Tensor, num_experts: int, impl: str = "auto") -> bool:
    """Whether `expert_sort` launches the kernels for these ids (else it runs the reference)."""
    n = flat_e.numel()
    return use_triton(impl, flat_e) and 0 < n and _block_size(n) <= MAX_BLOCK and num_experts <= MAX_EXPERTS


def expert_sort(
    flat_e: torch.Tensor, num_experts: int, impl: str = "auto"
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(sorted ids, stable order, [E] int64 counts, inverse order) of the 1-D expert ids `flat_e`, every id in
    0..num_experts-1 (dropless routing); the same tensors as `expert_sort_reference`. No host synchronisation."""
    if not expert_sort_supported(flat_e, num_experts, impl):
        return expert_sort_reference(flat_e, num_experts)
    flat_e = flat_e.contiguous()
    n, E, dev = flat_e.numel(), num_experts, flat_e.device
    B = _block_size(n)
    nb = -(-n // B)
    hist = torch.empty(nb, E, dtype=torch.int32, device=dev)
    base = torch.empty_like(hist)
    counts = torch.empty(E, dtype=torch.int64, device=dev)
    sorted_e, order = torch.empty_like(flat_e), torch.empty(n, dtype=torch.int64, device=dev)
    inv = torch.empty_like(order)
    _histogram_kernel[(nb,)](flat_e, hist, n, E, B=B, EP=next_pow2(E), num_warps=4)
    nbp = next_pow2(nb)
    _bases_kernel[(1,)](hist, base, counts, nb, E, NBP=nbp, CE=max(1, min(next_pow2(E), 8192 // nbp)), num_warps=8)
    _place_kernel[(nb,)](flat_e, base, sorted_e, order, inv, n, E, B=B, num_warps=4 if B <= 1024 else 8)
    return sorted_e, order, counts, inv
