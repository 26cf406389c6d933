"""Sort-based token permutation: group token copies by expert, and scatter expert outputs back.

Legend: T tokens, K experts per token, E experts, H hidden, N permuted rows, C expert capacity.

Each token has K assignments (t, k) -> expert idx[t, k]; assignment a = t * K + k is its flat index.
`permute` sorts the flat expert ids (stable, so within an expert tokens keep their order) and
gathers one row per assignment, so expert e's rows are contiguous; `unpermute` puts each row back
at its assignment slot of a [T, K, H] buffer and sums over K with the routing weights. Nothing
builds a dense [T, E] one-hot; memory is O(T*K*H) for the rows and O(T*K) for the indices.

Capacity (token dropping, GShard / Switch): C = ceil(T * K / E * capacity_factor) rows per expert.
`capacity_keep` names the kept assignments: policy `probs` keeps each expert's C highest-weight
assignments (ties: earlier assignment first); `position` keeps its first C in token order (token
t = b * S + s of the flattened [B, S] batch). Dropped assignments get no expert output. With
`pad_to_capacity`, every expert gets exactly C rows (zeros where it has fewer tokens), so shapes
are static.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from moecore.kernels.expert_sort import expert_sort, expert_sort_supported, sorted_counts
from moecore.kernels.permute import inverse_permutation, permute_rows, scatter_rows, unpermute_rows, weighted_sum_k


@dataclass
class PermuteCtx:
    """What `unpermute` needs to reverse `permute` (and an expert-parallel dispatcher to split rows)."""

    num_tokens: int  # T
    topk: int  # K
    # [N_kept] flat assignment t*K+k of each kept row, in permuted (expert) order; padded: all T*K, dropped last
    src_flat: torch.Tensor
    # padded: [T*K] row of each assignment in the padded buffer, num_rows (a scratch row) for dropped ones; None: row i
    dest_rows: torch.Tensor | None
    num_rows: int  # rows of the permuted buffer: N_kept, or E*C when padded to capacity
    tokens_per_expert: torch.Tensor  # [E] int64 rows per expert in the buffer (C each when padded)
    kept_per_expert: torch.Tensor  # [E] int64 real (unpadded) assignments per expert
    inv_flat: torch.Tensor | None = None  # dropless on GPU: the sorted row of each assignment (src_flat's inverse)


def expert_capacity(num_tokens: int, topk: int, num_experts: int, capacity_factor: float) -> int:
    """C = ceil(T * K / E * capacity_factor) (Megatron-Core `get_capacity` with T*K assignments)."""
    return math.ceil(num_tokens * topk / num_experts * capacity_factor)


def capacity_keep(
    idx_TK: torch.Tensor, weight_TK: torch.Tensor, num_experts: int, capacity: int, policy: str
) -> torch.Tensor:
    """Boolean [T, K]: which assignments fit in their expert's capacity under `policy` (probs | position)."""
    flat_e = idx_TK.reshape(-1)
    if policy == "probs":
        # Two stable sorts: by weight descending, then by expert -> per expert, highest weight first.
        pre = torch.argsort(-weight_TK.detach().reshape(-1), stable=True)
        order = pre[torch.argsort(flat_e[pre], stable=True)]
    elif policy == "position":
        order = torch.argsort(flat_e, stable=True)
    else:
        raise ValueError(f"moe.token_drop_policy={policy!r} is invalid: allowed: probs | position")
    sorted_e = flat_e[order]
    counts = sorted_counts(sorted_e, num_experts)
    starts = torch.cumsum(counts, 0) - counts
    rank = torch.arange(flat_e.numel(), device=flat_e.device) - starts[sorted_e]
    keep = torch.empty_like(flat_e, dtype=torch.bool)
    keep[order] = rank < capacity
    return keep.view_as(idx_TK)


@dataclass
class SortedAssignments:
    """The stable sort of the flat assignments t*K+k by expert (dropless): what `permute` starts from."""

    sorted_e: torch.Tensor  # [T*K] expert ids, ascending
    order: torch.Tensor  # [T*K] the flat assignment at each sorted position
    counts: torch.Tensor  # [E] int64 assignments per expert
    inv: torch.Tensor | None = None  # [T*K] the sorted position of each flat assignment (order's inverse), if known


def sort_expert_ids(flat_e: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(ascending ids, stable order) of the expert ids `flat_e` in 0..num_experts (num_experts: a dropped
    assignment's sentinel). On CUDA the keys are sorted as int16 where they fit: a radix sort passes over its
    keys once per 8 bits, so 2 passes instead of int64's 8 (the ids come back in flat_e's dtype)."""
    if flat_e.is_cuda and num_experts < 2**15 and flat_e.dtype != torch.int16:
        keys, order = torch.sort(flat_e.to(torch.int16), stable=True)
        return keys.to(flat_e.dtype), order
    return torch.sort(flat_e, stable=True)


def sort_assignments(idx_TK: torch.Tensor, num_experts: int) -> SortedAssignments:
    """Sort the assignments by expert on the device (dispatch preprocessing; no host synchronisation). On CUDA
    a counting sort in three launches that also gives the inverse (moecore/kernels/expert_sort.py)."""
    flat_e = idx_TK.reshape(-1)
    if expert_sort_supported(flat_e, num_experts):
        return SortedAssignments(*expert_sort(flat_e, num_experts))
    sorted_e, order = sort_expert_ids(flat_e, num_experts)
    return SortedAssignments(sorted_e, order, sorted_counts(sorted_e, num_experts))


def permute(
    x_TH: torch.Tensor,
    idx_TK: torch.Tensor,
    num_experts: int,
    keep_TK: torch.Tensor | None = None,
    pad_to_capacity: int | None = None,
    presorted: SortedAssignments | None = None,
) -> tuple[torch.Tensor, PermuteCtx]:
    """Rows of x grouped by expert: returns (permuted [N, H], ctx).

    keep_TK: assignments to keep (None: all, dropless). pad_to_capacity=C: each expert's block is
    exactly C rows (requires every expert to keep at most C assignments), zeros in the unused rows.
    Dropless or padded needs no host synchronisation; with drops and no padding, N is read back from the device.
    `presorted`: `sort_assignments(idx_TK)` already computed (dropless only; e.g. inside a captured CUDA graph).
    """
    T, K = idx_TK.shape
    inv = None
    if keep_TK is None:
        s = presorted if presorted is not None else sort_assignments(idx_TK, num_experts)
        sorted_flat, order, kept_per_expert, inv = s.sorted_e, s.order, s.counts, s.inv
    else:
        flat_e = torch.where(keep_TK.reshape(-1), idx_TK.reshape(-1), num_experts)  # dropped -> sentinel, last
        sorted_flat, order = sort_expert_ids(flat_e, num_experts)
        kept_per_expert = sorted_counts(sorted_flat, num_experts)
    if pad_to_capacity is None:
        n_kept = T * K if keep_TK is None else int(kept_per_expert.sum())  # drops, unpadded: a host sync
        src_flat = order[:n_kept]
        if keep_TK is None and x_TH.is_cuda:  # fused copy (Triton), same values; see moecore/kernels/permute.py
            inv = inverse_permutation(src_flat) if inv is None else inv
            rows = permute_rows(x_TH, src_flat, K, inv=inv)
        else:
            rows = x_TH.index_select(0, src_flat // K)
        ctx = PermuteCtx(T, K, src_flat, None, n_kept, kept_per_expert, kept_per_expert, inv)
        return rows, ctx
    # Padded: static shapes. Every assignment keeps a row index; dropped ones point at a scratch row E*C
    # past the buffer (written, then cut off), so nothing depends on how many were kept.
    C = pad_to_capacity
    starts = torch.cumsum(kept_per_expert, 0) - kept_per_expert
    starts = torch.cat([starts, starts.new_zeros(1)])  # the sentinel's start (its rows go to the scratch row)
    rank = torch.arange(T * K, device=x_TH.device) - starts[sorted_flat]
    dest_rows = torch.where(sorted_flat < num_experts, sorted_flat * C + rank, num_experts * C)
    rows = scatter_rows(x_TH.index_select(0, order // K), dest_rows, num_experts * C + 1)[: num_experts * C]
    per_expert = torch.full_like(kept_per_expert, C)
    return rows, PermuteCtx(T, K, order, dest_rows, num_experts * C, per_expert, kept_per_expert)


def permute_probs(weight_TK: torch.Tensor, ctx: PermuteCtx) -> torch.Tensor:
    """Routing weight of each permuted row ([num_rows]; 0 for padding rows)."""
    w = weight_TK.reshape(-1).index_select(0, ctx.src_flat)
    if ctx.dest_rows is None:
        return w
    return scatter_rows(w, ctx.dest_rows, ctx.num_rows + 1)[: ctx.num_rows]  # + the scratch row


def unpermute(rows_NH: torch.Tensor, ctx: PermuteCtx, weight_TK: torch.Tensor | None = None) -> torch.Tensor:
    """Inverse of `permute`: out[t] = sum_k weight[t, k] * row(t, k) ([T, H], dropped rows count 0).

    The weighted sum runs in fp32 when the rows are in a lower precision, then casts back.
    weight_TK=None: plain sum over k (the weights were applied inside the experts).
    """
    T, K, H = ctx.num_tokens, ctx.topk, rows_NH.shape[-1]
    rows = rows_NH
    if ctx.dest_rows is not None:  # padded: one row per assignment, zero for the dropped (scratch row E*C)
        kept = (ctx.dest_rows < ctx.num_rows).to(rows_NH.dtype).unsqueeze(-1)
        rows = rows_NH.index_select(0, ctx.dest_rows.clamp(max=ctx.num_rows - 1)) * kept
    if ctx.src_flat.numel() == T * K and ctx.dest_rows is None:
        # Dropless: every slot is filled, a gather by the inverse permutation is enough.
        inv = ctx.inv_flat if ctx.inv_flat is not None else inverse_permutation(ctx.src_flat)
        if rows.is_cuda:  # fused gather-sum (Triton), same maths; see moecore/kernels/permute.py
            return unpermute_rows(rows, ctx.src_flat, inv, weight_TK, T, K)
        slots = rows.index_select(0, inv)
    else:
        slots = scatter_rows(rows, ctx.src_flat, T * K)
    slots_TKH = slots.view(T, K, H)
    if weight_TK is None:
        return slots_TKH.sum(dim=1)
    return weighted_sum_k(slots_TKH, weight_TK)  # fp32 maths; backward keeps the rows in their dtype
