"""Transposing FP8 tensors: `transpose_last2(q)` = q.transpose(-2, -1).contiguous(), bit for bit, as a Triton kernel.

The FP8 input-gradient GEMM needs each weight in the other layout (w^T, contracted along its rows): under the
tensorwise and 128x128 recipes the forward's quantised weight serves, its scales do not change with the
layout. torch's copy of a transposed one-byte tensor runs far below copy bandwidth on an H200 (DeepSeek-V3's
expert weights, 11.3 GB in FP8: ~10 ms per transpose); this kernel moves [BLOCK, BLOCK] tiles of bytes through
registers (reads along rows, writes along the transposed rows). The values are moved as uint8, never
converted. `transpose_last2_reference` is torch's copy; the tests compare the two.
"""

from __future__ import annotations

import torch

from moecore.kernels._triton import triton_importable, use_triton

if triton_importable():
    import triton
    import triton.language as tl

    @triton.jit
    def _transpose_kernel(x_ptr, y_ptr, R, C, BR: tl.constexpr, BC: tl.constexpr):
        # y[b] = x[b]^T for x [B, R, C] and y [B, C, R], both contiguous; one [BR, BC] tile of x[b] per program
        pr = tl.program_id(0)
        pc = tl.program_id(1)
        b = tl.program_id(2).to(tl.int64)
        rows = (pr * BR + tl.arange(0, BR)).to(tl.int64)
        cols = (pc * BC + tl.arange(0, BC)).to(tl.int64)
        m = (rows < R)[:, None] & (cols < C)[None, :]
        x = tl.load(x_ptr + b * R * C + rows[:, None] * C + cols[None, :], mask=m)
        # y[b, col, row] = x[b, row, col]: Triton coalesces the load along cols and the store along rows and
        # moves the tile between the two layouts through shared memory
        tl.store(y_ptr + b * R * C + cols[None, :] * R + rows[:, None], x, mask=m)


def transpose_last2_reference(q: torch.Tensor) -> torch.Tensor:
    return q.transpose(-2, -1).contiguous()


def transpose_last2(q: torch.Tensor, impl: str = "auto") -> torch.Tensor:
    """q [..., R, C] -> [..., C, R] contiguous, the same bytes (any one-byte dtype, e.g. FP8)."""
    if q.dim() < 2 or q.element_size() != 1 or not use_triton(impl, q):
        return transpose_last2_reference(q)
    R, C = q.shape[-2], q.shape[-1]
    B = q.numel() // max(R * C, 1)
    out = torch.empty(*q.shape[:-2], C, R, dtype=q.dtype, device=q.device)
    if q.numel() == 0:
        return out
    x = q.contiguous().view(torch.uint8)
    block = 128 if q.is_cuda else 16
    grid = (triton.cdiv(R, block), triton.cdiv(C, block), B)
    _transpose_kernel[grid](x, out.view(torch.uint8), R, C, BR=block, BC=block, num_warps=8 if q.is_cuda else 4)
    return out
