"""Collectives over a `Group`, plain and autograd-aware; every one is a no-op when the group has one member.

Conventions (those of Megatron-style tensor parallelism): inside a TP group the loss is *replicated*,
i.e. every rank holds the same scalar and it counts once. The autograd functions are named by the
region they enter or leave:

| function | forward | backward |
|---|---|---|
| `copy_to_region` | identity | all-reduce |
| `reduce_from_region` | all-reduce | identity |
| `scatter_to_region(dim)` | keep my chunk of `dim` | all-gather along `dim` |
| `gather_from_region(dim)` | all-gather along `dim` | keep my chunk |
| `gather_from_sequence_parallel(dim)` | all-gather along `dim` | reduce-scatter (sum) |
| `reduce_scatter_to_sequence_parallel(dim)` | reduce-scatter (sum) | all-gather |
| `all_to_all(out_splits, in_splits)` | all-to-all along dim 0 | the reverse all-to-all |
| `all_gather_v(sizes)` | all-gather of uneven dim-0 blocks | reduce-scatter of the same blocks |
| `reduce_scatter_v(sizes)` | reduce-scatter into uneven dim-0 blocks | all-gather of the blocks |

Uneven and zero-size blocks are handled with `all_to_all_single`, which both gloo and NCCL run.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from moecore.parallel.dims import Group

_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


# --------------------------------------------------------------------------------------------------
# Plain (no autograd) collectives
# --------------------------------------------------------------------------------------------------


def all_reduce_(t: torch.Tensor, group: Group, op: str = "sum") -> torch.Tensor:
    """In-place all-reduce (`sum`, `max`, `min` or `avg`) of a tensor that needs no gradient; returns it."""
    if group.size == 1:
        return t
    ops = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN, "avg": dist.ReduceOp.SUM}
    if op not in ops:
        raise ValueError(f"op={op!r} is invalid: allowed: sum | max | min | avg")
    with torch.no_grad():
        dist.all_reduce(t, op=ops[op], group=group.pg)
        if op == "avg":
            t.div_(group.size)
    return t


def broadcast_(t: torch.Tensor, group: Group, src_index: int = 0) -> torch.Tensor:
    """In-place broadcast from the member `src_index` of the group; returns t."""
    if group.size > 1:
        dist.broadcast(t, src=group.ranks[src_index], group=group.pg)
    return t


def _gather_dim0(x: torch.Tensor, group: Group) -> torch.Tensor:
    out = x.new_empty((group.size * x.shape[0], *x.shape[1:]))
    _all_gather_single(out, x.contiguous(), group=group.pg)
    return out


def all_gather_dim(x: torch.Tensor, group: Group, dim: int = 0) -> torch.Tensor:
    """Concatenate every member's (equal-shaped) `x` along `dim`, in group-rank order."""
    if group.size == 1:
        return x
    if dim == 0:
        return _gather_dim0(x, group)
    parts = [torch.empty_like(x) for _ in range(group.size)]
    dist.all_gather(parts, x.contiguous(), group=group.pg)
    return torch.cat(parts, dim=dim)


def reduce_scatter_dim(x: torch.Tensor, group: Group, dim: int = 0) -> torch.Tensor:
    """Sum `x` over the group and keep this member's equal chunk of `dim`."""
    if group.size == 1:
        return x
    if x.shape[dim] % group.size:
        raise ValueError(
            f"reduce-scatter along dim {dim} of size {x.shape[dim]} needs a multiple of the group size {group.size}"
        )
    xt = x.movedim(dim, 0).contiguous()
    out = xt.new_empty((xt.shape[0] // group.size, *xt.shape[1:]))
    _reduce_scatter_single(out, xt, group=group.pg)
    return out.movedim(0, dim)


def split_dim(x: torch.Tensor, group: Group, dim: int) -> torch.Tensor:
    """This member's equal chunk of `dim` (no communication)."""
    if group.size == 1:
        return x
    if x.shape[dim] % group.size:
        raise ValueError(f"splitting dim {dim} of size {x.shape[dim]} needs a multiple of the group size {group.size}")
    return x.chunk(group.size, dim=dim)[group.rank].contiguous()


def all_to_all_single(x: torch.Tensor, group: Group, out_splits: list[int], in_splits: list[int]) -> torch.Tensor:
    """Send `in_splits[j]` rows of x (dim 0, in order) to member j; receive `out_splits[j]` rows from member j."""
    if group.size == 1:
        return x
    x = x.contiguous()
    out = x.new_empty((sum(out_splits), *x.shape[1:]))
    dist.all_to_all_single(
        out, x, output_split_sizes=list(out_splits), input_split_sizes=list(in_splits), group=group.pg
    )
    return out


def all_gather_v_plain(x: torch.Tensor, group: Group, sizes: list[int]) -> torch.Tensor:
    """All-gather of dim-0 blocks whose sizes differ per member (`sizes[j]` rows from member j)."""
    if group.size == 1:
        return x
    # Send my block to everyone; receive sizes[j] rows from member j.
    return all_to_all_single(x.repeat(group.size, *([1] * (x.dim() - 1))), group, sizes, [x.shape[0]] * group.size)


def reduce_scatter_v_plain(x: torch.Tensor, group: Group, sizes: list[int]) -> torch.Tensor:
    """Sum x (rows split into blocks of `sizes`) over the group; member j keeps block j (sizes[j] rows)."""
    if group.size == 1:
        return x
    mine = sizes[group.rank]
    got = all_to_all_single(x, group, [mine] * group.size, sizes)  # [size * mine, ...]: every member's copy of my block
    return got.view(group.size, mine, *x.shape[1:]).sum(0)


# --------------------------------------------------------------------------------------------------
# Autograd-aware collectives
# --------------------------------------------------------------------------------------------------


class _CopyToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, g):
        return all_reduce_(g.contiguous().clone(), ctx.group), None


class _ReduceFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return all_reduce_(x.contiguous().clone(), group)

    @staticmethod
    def backward(ctx, g):
        return g, None


class _ScatterToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return split_dim(x, group, dim)

    @staticmethod
    def backward(ctx, g):
        return all_gather_dim(g, ctx.group, ctx.dim), None, None


class _GatherFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return all_gather_dim(x, group, dim)

    @staticmethod
    def backward(ctx, g):
        return split_dim(g, ctx.group, ctx.dim), None, None


class _GatherFromSequenceParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return all_gather_dim(x, group, dim)

    @staticmethod
    def backward(ctx, g):
        return reduce_scatter_dim(g, ctx.group, ctx.dim), None, None


class _ReduceScatterToSequenceParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return reduce_scatter_dim(x, group, dim)

    @staticmethod
    def backward(ctx, g):
        return all_gather_dim(g, ctx.group, ctx.dim), None, None


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, out_splits, in_splits):
        ctx.group, ctx.out_splits, ctx.in_splits = group, out_splits, in_splits
        return all_to_all_single(x, group, out_splits, in_splits)

    @staticmethod
    def backward(ctx, g):
        return all_to_all_single(g, ctx.group, ctx.in_splits, ctx.out_splits), None, None, None


class _AllGatherV(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, sizes):
        ctx.group, ctx.sizes = group, sizes
        return all_gather_v_plain(x, group, sizes)

    @staticmethod
    def backward(ctx, g):
        return reduce_scatter_v_plain(g, ctx.group, ctx.sizes), None, None


class _ReduceScatterV(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, sizes):
        ctx.group, ctx.sizes = group, sizes
        return reduce_scatter_v_plain(x, group, sizes)

    @staticmethod
    def backward(ctx, g):
        return all_gather_v_plain(g, ctx.group, ctx.sizes), None, None


def copy_to_region(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Enter a region where each member computes a different part from the same x (grads are summed)."""
    return x if group.size == 1 else _CopyToRegion.apply(x, group)


def reduce_from_region(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Sum partial results of the members; the (replicated) gradient passes through unchanged."""
    return x if group.size == 1 else _ReduceFromRegion.apply(x, group)


def scatter_to_region(x: torch.Tensor, group: Group, dim: int = -1) -> torch.Tensor:
    """Keep this member's chunk of a replicated x; backward all-gathers the chunk gradients."""
    return x if group.size == 1 else _ScatterToRegion.apply(x, group, dim % x.dim())


def gather_from_region(x: torch.Tensor, group: Group, dim: int = -1) -> torch.Tensor:
    """Concatenate the members' chunks into a replicated tensor; backward keeps this member's chunk."""
    return x if group.size == 1 else _GatherFromRegion.apply(x, group, dim % x.dim())


def gather_from_sequence_parallel(x: torch.Tensor, group: Group, dim: int = 1) -> torch.Tensor:
    """Sequence-sharded -> full sequence, entering a TP region (backward: reduce-scatter of partial grads)."""
    return x if group.size == 1 else _GatherFromSequenceParallel.apply(x, group, dim % x.dim())


def reduce_scatter_to_sequence_parallel(x: torch.Tensor, group: Group, dim: int = 1) -> torch.Tensor:
    """Partial sums over the full sequence -> summed and sequence-sharded (backward: all-gather)."""
    return x if group.size == 1 else _ReduceScatterToSequenceParallel.apply(x, group, dim % x.dim())


def scatter_to_sequence_parallel(x: torch.Tensor, group: Group, dim: int = 1) -> torch.Tensor:
    """Replicated full sequence -> this member's sequence chunk (backward: all-gather)."""
    return scatter_to_region(x, group, dim)


def gather_from_sequence_parallel_replicated_grad(x: torch.Tensor, group: Group, dim: int = 1) -> torch.Tensor:
    """Sequence-sharded -> full sequence whose gradient is replicated (backward: keep my chunk)."""
    return gather_from_region(x, group, dim)


def all_to_all(x: torch.Tensor, group: Group, out_splits: list[int], in_splits: list[int]) -> torch.Tensor:
    """Autograd all-to-all of dim-0 blocks (uneven and zero-size allowed); backward is the reverse exchange."""
    return x if group.size == 1 else _AllToAll.apply(x, group, list(out_splits), list(in_splits))


def all_gather_v(x: torch.Tensor, group: Group, sizes: list[int]) -> torch.Tensor:
    """Autograd all-gather of uneven dim-0 blocks; backward sums each block's gradient back to its owner."""
    return x if group.size == 1 else _AllGatherV.apply(x, group, list(sizes))


def reduce_scatter_v(x: torch.Tensor, group: Group, sizes: list[int]) -> torch.Tensor:
    """Autograd reduce-scatter into uneven dim-0 blocks; backward all-gathers the block gradients."""
    return x if group.size == 1 else _ReduceScatterV.apply(x, group, list(sizes))
