"""FP8 primary weights gathered as FP8 bytes by the distributed optimizer (`fp8.primary_weights=true`).

A weight that keeps one FP8 copy between steps (the tensorwise and blockwise recipes: one byte per element, with
a scale per tensor, per expert or per 128x128 tile) is all-gathered as those bytes instead of as its bf16 values:
half the bytes of a bf16 gather, a quarter of an fp32 one. Each rank holds the fp32 master shard of a flat bucket
of such weights (their own buckets: `fp8_bucket_params` picks them, and the bucket never mixes in other
parameters, so every element of a shard travels as one byte):

1. every rank takes the largest magnitude of its elements in each scale group (of their bf16 rounding, as the
   weights are quantised without the distributed optimizer), and one all-reduce (max) over the bucket's group
   gives every rank the whole groups' maxima;
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


def scale_groups(
    shape: torch.Size | tuple[int, ...], gran: str, start: int, end: int, device: torch.device
) -> tuple[torch.Tensor, int]:
    """(scale group of each element start..end of a weight of `shape` flattened, number of groups) for its one-byte
    FP8 copy: `gran` "128x128" (tiles of the weight viewed as [rows, K]; experts stacked, N a multiple of 128) or
    "tensorwise" (one group per expert of an [E, N, K] tensor, one for a linear's). The groups are numbered in the
    order of the copy's scale tensor (`scale_shape`)."""
    j = torch.arange(start, end, device=device)
    K = shape[-1]
    if gran == "128x128":
        tiles_k = -(-K // fq.BLOCK)
        rows = math.prod(shape) // K
        return (j // K // fq.BLOCK) * tiles_k + (j % K) // fq.BLOCK, -(-rows // fq.BLOCK) * tiles_k
    if len(shape) == 3:
        per_expert = shape[1] * K
        return j // per_expert, shape[0]
    return torch.zeros_like(j), 1


def scale_shape(shape: torch.Size | tuple[int, ...], gran: str) -> tuple[int, ...]:
    """The shape of the scales of a weight's one-byte FP8 copy (as fp8_grouped.quant_weights / fp8_gemm.quant_rows
    give them): tensorwise [] (a linear) or [E] (experts); 128x128 [ceil(N/128), ceil(K/128)] or [E, N/128, ...]."""
    tiles_k = -(-shape[-1] // fq.BLOCK)
    if gran == "128x128":
        return (*shape[:-2], -(-shape[-2] // fq.BLOCK), tiles_k)
    return (shape[0],) if len(shape) == 3 else ()


def group_maxima(x: torch.Tensor, gid: torch.Tensor, groups: int) -> torch.Tensor:
    """fp32 [groups]: the largest |x| of each scale group among x's elements (0 where none)."""
    part = torch.zeros(groups, dtype=torch.float32, device=x.device)
    return part.scatter_reduce_(0, gid, x.abs().float(), "amax")


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
        gid, groups = scale_groups(p.shape, p.fp8_primary.gran, a - poff, e - poff, shard.device)
        x = shard[a - lo : e - lo].to(p.dtype).float()  # rounded as the rebuild rounds (empty: none of p here)
        amax.append(group_maxima(x, gid, groups))
        sizes.append(groups)
        mine.append((gid, x))
    amax_all = torch.cat(amax)
    if group.size > 1:
        torch.distributed.all_reduce(amax_all, op=torch.distributed.ReduceOp.MAX, group=group.pg)
    out = torch.zeros(shard.numel(), dtype=torch.uint8, device=shard.device)  # the padding stays 0
    scales = {}
    for (p, _, a, e), part, (gid, x) in zip(spans, amax_all.split(sizes), mine):
        s = fq.scale_from_amax(part, torch.float8_e4m3fn, p.fp8_gemm_recipe.pow2)
        scales[p] = s
        if x.numel():
            out[a - lo : e - lo] = fq.cast_to_fp8(x, s[gid], torch.float8_e4m3fn).view(torch.uint8)
    return out, scales


def set_gathered(p: torch.nn.Parameter, q_bytes: torch.Tensor, scale: torch.Tensor) -> None:
    """p's FP8 primary copy from its gathered bytes (p's elements of the gathered bucket) and scales."""
    old = p.fp8_primary
    q = q_bytes.view(torch.float8_e4m3fn).view(old.q.shape)
    p.fp8_primary = dataclasses.replace(old, q=q, s=scale.view_as(old.s))
