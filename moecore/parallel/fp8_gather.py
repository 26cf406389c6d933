"""FP8 primary weights gathered as FP8 bytes by the distributed optimizer (`fp8.primary_weights=true`).

A weight that keeps one FP8 copy between steps (the tensorwise and blockwise recipes: one byte per element, with
a scale per tensor, per expert or per 128x128 tile) is all-gathered as those bytes instead of as its bf16 values:
half the bytes of a bf16 gather, a quarter of an fp32 one. Each rank holds the fp32 master shard of a flat bucket
of such weights (their own buckets: `fp8_bucket_params` picks them, and the bucket never mixes in other
parameters, so every element of a shard travels as one byte):

1. every rank takes the largest magnitude of its elements in each scale group (of their bf16 rounding, as the
   weights are quantised without the distributed optimizer; per row and 128-column block first, `RowBlocks`, so
   nothing is indexed per element), and one all-reduce (max) over the bucket's group gives every rank the whole
   groups' maxima;
2. the scales follow from them (`fp8_quant.scale_from_amax`) and each rank quantises its own elements with them;
3. the bytes are all-gathered (asynchronously, finished by the forward hooks as the bf16 gathers are), and each
   weight's FP8 tensor is a view of the gathered bucket, with the scales of step 2.

Quantising an element needs only the element and its group's scale, so this gives the bytes and scales that
quantising the whole gathered weight gives (`moecore/models/fp8.py`'s rebuild; tests compare bit for bit).
Rowwise primary weights keep two layouts (two bytes per element, as many as bf16) whose column scales need the
other layout's groups: they are gathered in bf16 and quantised after the gather.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from moecore.kernels import fp8_quant as fq

ONE_BYTE_RECIPES = ("tensorwise", "blockwise")


def fp8_bucket_params(params: list[torch.nn.Parameter]) -> set[torch.nn.Parameter]:
    """The weights of FP8 GEMMs whose recipe keeps one FP8 copy (tensorwise, blockwise; `fp8_gemm_recipe`, set by
    moecore/models/fp8.apply_fp8): they get buckets of their own, gathered as FP8 bytes when they are primary
    weights. The buckets are the same with and without primary weights, so both runs sum alike."""
    return {p for p in params if getattr(getattr(p, "fp8_gemm_recipe", None), "scaling", None) in ONE_BYTE_RECIPES}


def scale_shape(shape: torch.Size | tuple[int, ...], gran: str) -> tuple[int, ...]:
    """The shape of the scales of a weight's one-byte FP8 copy (as fp8_grouped.quant_weights / fp8_gemm.quant_rows
    give them): tensorwise [] (a linear) or [E] (experts); 128x128 [ceil(N/128), ceil(K/128)] or [E, N/128, ...]."""
    tiles_k = -(-shape[-1] // fq.BLOCK)
    if gran == "128x128":
        return (*shape[:-2], -(-shape[-2] // fq.BLOCK), tiles_k)
    return (shape[0],) if len(shape) == 3 else ()


def as_rows(x: torch.Tensor, start: int, K: int) -> tuple[torch.Tensor, int, int]:
    """Elements start.. of a weight flattened (x, 1-D) as whole rows of the weight viewed as [rows, K]: (rows [n, K]
    fp32, zero outside x — zeros change no maximum; the first row's index; x's offset in the rows flattened)."""
    if x.numel() == 0:  # none of the weight here (start may lie past its end)
        return x.new_zeros(0, K, dtype=torch.float32), 0, 0
    row_lo, skip = divmod(start, K)
    n = -(-(skip + x.numel()) // K)
    if skip == 0 and x.numel() == n * K:
        return x.float().view(n, K), row_lo, 0
    rows = torch.zeros(n * K, dtype=torch.float32, device=x.device)
    rows[skip : skip + x.numel()] = x
    return rows.view(n, K), row_lo, skip


class RowBlocks:
    """Rows row_lo.. of a weight of `shape` viewed as [rows, K] (`rows` [n, K] fp32) split into the blocks of its
    one-byte FP8 copy's scale groups: 128 columns for "128x128" (groups: 128-row tiles of [rows, K], experts stacked
    with N a multiple of 128), all K for "tensorwise" (groups: an expert of [E, N, K], or the whole tensor). Maxima
    are taken per row and block first, so nothing per element is indexed (a few bytes of transient per element)."""

    def __init__(self, rows: torch.Tensor, row_lo: int, shape: tuple[int, ...], gran: str) -> None:
        n, K = rows.shape
        self.width = fq.BLOCK if gran == "128x128" else K
        self.K, nb = K, -(-K // self.width)
        if nb * self.width != K:
            rows = torch.nn.functional.pad(rows, (0, nb * self.width - K))
        self.blocks = rows.view(n, nb, self.width)
        row = torch.arange(row_lo, row_lo + n, device=rows.device)
        if gran == "128x128":
            row_group, self.groups = row // fq.BLOCK, -(-math.prod(shape[:-1]) // fq.BLOCK) * nb
        elif len(shape) == 3:
            row_group, self.groups = row // shape[1], shape[0]
        else:
            row_group, self.groups = torch.zeros_like(row), 1
        self.gid = row_group[:, None] * nb + torch.arange(nb, device=rows.device)  # [n, nb], in scale_shape order

    def maxima(self) -> torch.Tensor:
        """fp32 [groups]: the largest |x| of each scale group among these rows (0 where none)."""
        amax = torch.zeros(self.groups, dtype=torch.float32, device=self.blocks.device)
        return amax.scatter_reduce_(0, self.gid.reshape(-1), self.blocks.abs().amax(-1).reshape(-1), "amax")

    def cast(self, s: torch.Tensor) -> torch.Tensor:
        """The rows quantised to e4m3 with the groups' scales s [groups]: [n, K]."""
        q = fq.cast_to_fp8(self.blocks, s[self.gid].unsqueeze(-1), torch.float8_e4m3fn)
        n, nb, width = q.shape
        return q.view(n, nb * width)[:, : self.K]


def quantize_shard(
    params: list[torch.nn.Parameter], lo: int, shard: torch.Tensor, group
) -> tuple[torch.Tensor, dict[torch.nn.Parameter, torch.Tensor]]:
    """This rank's elements of a flat bucket of one-byte FP8 primary weights, quantised: (uint8 [len(shard)], each
    weight's scales). `params` in bucket order, `lo` the shard's first element in the bucket, `group` the bucket's
    process group (moecore.parallel.dims.Group). Collective: one all-reduce over the group."""
    spans, off = [], 0  # (p, its offset in the bucket, this rank's first element of p, last + 1; a == e: none)
    for p in params:
        a, e = max(lo, off), min(lo + shard.numel(), off + p.numel())
        spans.append((p, off, a, max(a, e)))
        off += p.numel()
    amax, sizes, mine = [], [], []
    for p, poff, a, e in spans:
        x = shard[a - lo : e - lo].to(p.dtype)  # rounded as the rebuild rounds (empty: none of p here)
        rows, row_lo, skip = as_rows(x, a - poff, p.shape[-1])
        blocks = RowBlocks(rows, row_lo, tuple(p.shape), p.fp8_primary.gran)
        amax.append(blocks.maxima())
        sizes.append(blocks.groups)
        mine.append((blocks, skip))
    amax_all = torch.cat(amax)
    if group.size > 1:
        torch.distributed.all_reduce(amax_all, op=torch.distributed.ReduceOp.MAX, group=group.pg)
    out = torch.zeros(shard.numel(), dtype=torch.uint8, device=shard.device)  # the padding stays 0
    scales = {}
    for (p, _, a, e), part, (blocks, skip) in zip(spans, amax_all.split(sizes), mine):
        s = fq.scale_from_amax(part, torch.float8_e4m3fn, p.fp8_gemm_recipe.pow2)
        scales[p] = s
        if e > a:
            out[a - lo : e - lo] = blocks.cast(s).reshape(-1)[skip : skip + e - a].view(torch.uint8)
    return out, scales


def set_gathered(p: torch.nn.Parameter, q_bytes: torch.Tensor, scale: torch.Tensor) -> None:
    """p's FP8 primary copy from its gathered bytes (p's elements of the gathered bucket) and scales."""
    old = p.fp8_primary
    q = q_bytes.view(torch.float8_e4m3fn).view(old.q.shape)
    p.fp8_primary = dataclasses.replace(old, q=q, s=scale.view_as(old.s))
