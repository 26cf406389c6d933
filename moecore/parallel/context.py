"""Context parallel (CP): the sequence layout every CP-aware module codes against, and its helpers.

Layout (load-balanced for causal attention). A sequence of length S, divisible by 2 * cp, is cut
into 2 * cp equal chunks of S / (2 * cp) tokens. CP rank r holds chunk r followed by chunk
2 * cp - 1 - r, concatenated along the sequence dimension, so its local length is S / cp:

    cp = 2, S = 8:   chunks 0..3 = [0 1] [2 3] [4 5] [6 7]
                     rank 0 holds [0 1 6 7], rank 1 holds [2 3 4 5]

Each rank then has one early and one late chunk, so the causal attention work (keys at or before
the query) is the same on every rank. Position ids stay global (`cp_local_indices`), so RoPE / YaRN
see the positions of the full sequence.

Helpers: `cp_local_indices` (global positions of a rank, in local order), `split_for_cp` (keep this
rank's tokens of a full-sequence tensor; no communication), `gather_from_cp` (all-gather the local
pieces back into the full sequence in global order; autograd-aware), `check_cp_seq_len`.
All of them are no-ops when `dims.cp == 1`.
"""

from __future__ import annotations

from typing import Any

import torch

from moecore.config import ConfigError
from moecore.parallel.comm import all_gather_dim, reduce_scatter_dim
from moecore.parallel.dims import Group


def check_cp_seq_len(seq_len: int, cp: int) -> None:
    """Refuse a sequence length that the load-balanced layout cannot split into 2 * cp equal chunks."""
    if cp > 1 and seq_len % (2 * cp):
        raise ConfigError(
            f"train.seq_length={seq_len} is not divisible by 2 * parallel.cp = {2 * cp}: context parallel cuts "
            "the sequence into 2 * cp equal chunks; use a multiple of it"
        )


def cp_chunk_ids(cp: int, rank: int) -> tuple[int, int]:
    """The two chunk indices (of 2 * cp) that CP rank `rank` holds, in local order."""
    return rank, 2 * cp - 1 - rank


def cp_local_indices(seq_len: int, cp: int, rank: int, device: torch.device | str | None = None) -> torch.Tensor:
    """Global positions (int64, length seq_len / cp) held by CP rank `rank`, in local order."""
    check_cp_seq_len(seq_len, cp)
    if not 0 <= rank < cp:
        raise ValueError(f"CP rank {rank} is invalid: must be in [0, {cp})")
    if cp == 1:
        return torch.arange(seq_len, device=device)
    c = seq_len // (2 * cp)
    a, b = cp_chunk_ids(cp, rank)
    return torch.cat((torch.arange(a * c, (a + 1) * c, device=device), torch.arange(b * c, (b + 1) * c, device=device)))


def cp_size(dims: Any) -> int:
    """The context-parallel degree of `dims` (1 without dims or without context parallelism)."""
    return getattr(dims, "cp", 1) if dims is not None else 1


def _cp(dims: Any) -> Group | None:
    """The CP group of `dims`, or None when there is no context parallelism."""
    return dims.cp_group if cp_size(dims) > 1 else None


def split_for_cp(t: torch.Tensor, dims: Any, seq_dim: int = 1) -> torch.Tensor:
    """This CP rank's tokens of a full-sequence tensor (no communication).

    Gradients flow back to the positions this rank holds only, which is right when every CP rank
    splits the same replicated tensor and the replicas' gradients are later summed over CP.
    """
    g = _cp(dims)
    if g is None:
        return t
    idx = cp_local_indices(t.shape[seq_dim], g.size, g.rank, t.device)
    return t.index_select(seq_dim, idx)


def cp_rank_major_positions(seq_len: int, cp: int, device: torch.device | str | None = None) -> torch.Tensor:
    """The global positions of the rank-major concatenation of every CP rank's tokens (what an all-gather or
    all-to-all over CP delivers): rank 0's in local order, then rank 1's, ...; full[held] = gathered."""
    return torch.cat([cp_local_indices(seq_len, cp, r, device) for r in range(cp)])


def cp_global_order(seq_len: int, cp: int, device: torch.device | str | None = None) -> torch.Tensor:
    """Permutation p with full = gathered.index_select(dim, p), where gathered is the rank-major concatenation."""
    return torch.argsort(cp_rank_major_positions(seq_len, cp, device))


def gather_from_cp_plain(t: torch.Tensor, group: Group, seq_dim: int = 1) -> torch.Tensor:
    """All-gather the local pieces of every CP rank into the full sequence, in global order (no autograd)."""
    if group.size == 1:
        return t
    gathered = all_gather_dim(t, group, seq_dim)
    return gathered.index_select(seq_dim, cp_global_order(gathered.shape[seq_dim], group.size, t.device))


class _GatherFromCP(torch.autograd.Function):
    """Forward: all-gather in global order. Backward: sum every rank's gradient, keep my positions."""

    @staticmethod
    def forward(ctx, x, group, seq_dim, grad_mode):
        ctx.group, ctx.seq_dim, ctx.grad_mode = group, seq_dim, grad_mode
        return gather_from_cp_plain(x, group, seq_dim)

    @staticmethod
    def backward(ctx, g):
        group, dim = ctx.group, ctx.seq_dim
        seq = g.shape[dim]
        # back to the rank-major order of the all-gather: gathered[j] = full[held[j]]
        g = g.index_select(dim, cp_rank_major_positions(seq, group.size, g.device))
        if ctx.grad_mode == "sum":
            return reduce_scatter_dim(g, group, dim), None, None, None
        return g.chunk(group.size, dim=dim)[group.rank].contiguous(), None, None, None


def gather_from_cp(t: torch.Tensor, dims: Any, seq_dim: int = 1, grad: str = "sum") -> torch.Tensor:
    """The full sequence in global order from every CP rank's local piece (autograd-aware).

    `grad="sum"` (default): each rank uses the gathered tensor for its own partial computation (e.g.
    its queries against all keys), so the backward sums the ranks' gradients and keeps this rank's
    positions (a reduce-scatter). `grad="replicated"`: every rank computes the same thing from it, so
    the backward only keeps this rank's positions.
    """
    if grad not in ("sum", "replicated"):
        raise ValueError(f"grad={grad!r} is invalid: allowed: sum | replicated")
    g = _cp(dims)
    if g is None:
        return t
    return _GatherFromCP.apply(t, g, seq_dim % t.dim(), grad)


def cp_position_ids(seq_len: int, dims: Any, device: torch.device | str | None = None) -> torch.Tensor:
    """Position ids [seq_len / cp] of this rank's tokens: their global positions (RoPE / YaRN of the full sequence)."""
    g = _cp(dims)
    if g is None:
        return torch.arange(seq_len, device=device)
    return cp_local_indices(seq_len, g.size, g.rank, device)


def split_batch_for_cp(batch: dict[str, torch.Tensor], dims: Any) -> dict[str, torch.Tensor]:
    """This CP rank's share of a micro-batch {input_ids, labels, loss_mask} [B, S]: the same keys, local
    [B, S / cp], plus `position_ids` [S / cp] (global positions). Other keys pass through unchanged."""
    g = _cp(dims)
    if g is None:
        return batch
    seq = batch["input_ids"].shape[1]
    check_cp_seq_len(seq, g.size)
    out = dict(batch)
    for key in ("input_ids", "labels", "loss_mask"):
        if key in batch and batch[key] is not None:
            out[key] = split_for_cp(batch[key], dims, 1)
    out["position_ids"] = cp_position_ids(seq, dims, batch["input_ids"].device)
    return out


def cp_roll_left(t: torch.Tensor, dims: Any, fill: float | int = 0) -> torch.Tensor:
    """Local view of the full sequence rolled left by one along dim 1 (t[:, i] <- t[:, i + 1]; the last
    global position becomes `fill`), for tensors without gradient (token ids, labels, masks).

    The token after the last one of chunk j is the first one of chunk j + 1, which another rank may hold:
    every rank contributes the first token of both its chunks (a one-token halo per chunk, all-gathered
    over CP, which is 2 * cp tokens per sequence) and takes those of the chunks following its own.
    """
    g = _cp(dims)
    if g is None:
        pad = t.new_full((t.shape[0], 1, *t.shape[2:]), fill)
        return torch.cat((t[:, 1:], pad), dim=1)
    cp, c = g.size, t.shape[1] // 2
    with torch.no_grad():
        heads = all_gather_dim(t[:, [0, c]].contiguous(), g, 1)  # rank-major: rank j -> chunks j, 2cp-1-j
        by_chunk = [None] * (2 * cp)
        for j in range(cp):
            by_chunk[j], by_chunk[2 * cp - 1 - j] = heads[:, 2 * j : 2 * j + 1], heads[:, 2 * j + 1 : 2 * j + 2]
        a, b = cp_chunk_ids(cp, g.rank)
        after_b = by_chunk[b + 1] if b + 1 < 2 * cp else t.new_full((t.shape[0], 1, *t.shape[2:]), fill)
        return torch.cat((t[:, 1:c], by_chunk[a + 1], t[:, c + 1 :], after_b), dim=1)


def sum_over_cp(t: torch.Tensor, dims: Any) -> torch.Tensor:
    """Sum of a tensor without gradient over the CP ranks (a new tensor)."""
    g = _cp(dims)
    if g is None:
        return t
    from moecore.parallel.comm import all_reduce_

    return all_reduce_(t.detach().clone(), g, "sum")
