"""Expert parallel (EP) and expert tensor parallel (ETP): sharded expert weights and two token dispatchers.

Layout. EP rank r owns global experts [r * E_local, (r + 1) * E_local); ETP rank a holds columns
[a * F_local, (a + 1) * F_local) of each expert's FFN: its gate and up rows of `w13` and the
matching columns of `w2`, so its expert output is a partial sum that the combine reduces over ETP.
Expert weights are stored [E_local, ...], so EP shards dim 0.

Both dispatchers implement `moecore.moe.dispatch.TokenDispatcher`'s six phases.

`AllToAllDispatcher` (moe.token_dispatcher_type=alltoall), per MoE layer call:
  1. dispatch_preprocess: permute local token copies to global-expert-major order; exchange the
     per-expert row counts with the EP peers (all-to-all of counts), then all-gather them over ETP,
     so every rank knows the size of every block it will send and receive (one host sync).
  2. dispatch: all-to-all of variable-size row blocks over EP (zero-size blocks included), then an
     all-gather of the received rows over ETP.
  3. dispatch_postprocess: the received rows are ordered (ETP source, EP source, local expert);
     reorder them to local-expert-major so each local expert's rows are contiguous.
  4. combine_preprocess: undo step 3's reordering.
  5. combine: reduce-scatter over ETP (sums the F-sharded partial outputs, each source gets its
     rows back), then the reverse all-to-all over EP.
  6. combine_postprocess: unpermute and weight by the routing probabilities.

`AllGatherDispatcher` (allgather): every rank of the expert-model-parallel group (EP x ETP)
gathers all tokens with their routing, computes the copies that go to its own experts, unpermutes
them into the gathered token space (weighted), and a reduce-scatter sums the contributions of all
ranks and returns each rank its own tokens.

Autograd: every collective used here has its adjoint as backward (`moecore.parallel.comm`), so
gradients flow back to the tokens' ranks and into the sharded expert weights.
"""

from __future__ import annotations

import torch

from moecore.kernels.permute import inverse_permutation
from moecore.moe.dispatch import DispatchCtx, LocalDispatcher, TokenDispatcher
from moecore.moe.permute import permute, permute_probs, unpermute
from moecore.parallel import comm
from moecore.parallel.context import gather_from_cp, gather_from_cp_plain
from moecore.parallel.dims import ParallelDims
from moecore.parallel.sharding import set_shard


def local_expert_sizes(num_experts: int, ffn_hidden_size: int, dims: ParallelDims | None) -> tuple[int, int]:
    """(experts on this rank, FFN width per expert on this rank)."""
    if dims is None:
        return num_experts, ffn_hidden_size
    if num_experts % dims.ep:
        raise ValueError(f"parallel.ep={dims.ep} does not divide moe.num_experts={num_experts}")
    if ffn_hidden_size % dims.etp:
        raise ValueError(f"parallel.etp={dims.etp} does not divide moe.ffn_hidden_size={ffn_hidden_size}")
    return num_experts // dims.ep, ffn_hidden_size // dims.etp


def shard_expert_params(
    w13: torch.Tensor, w2: torch.Tensor, num_experts: int, ffn_hidden_size: int, gated: bool, dims: ParallelDims | None
) -> None:
    """Record where local `w13` [E_local, (2)F_local, H] and `w2` [E_local, H, F_local] sit in the global tensors."""
    if dims is None:
        set_shard(w13, "expert")
        set_shard(w2, "expert")
        return
    e_loc, f_loc = local_expert_sizes(num_experts, ffn_hidden_size, dims)
    e0, f0 = dims.ep_group.rank * e_loc, dims.etp_group.rank * f_loc
    hidden = w13.shape[-1]
    halves = 2 if gated else 1
    # w13's rows are [gate; up]: the view [E, halves, F, H] makes this rank's gate and up rows one block.
    set_shard(
        w13,
        "expert",
        global_shape=(num_experts, halves * ffn_hidden_size, hidden),
        view_shape=(num_experts, halves, ffn_hidden_size, hidden),
        local_view=(e_loc, halves, f_loc, hidden),
        offsets=(e0, 0, f0, 0),
    )
    set_shard(w2, "expert", global_shape=(num_experts, hidden, ffn_hidden_size), offsets=(e0, 0, f0))


def _chunk_reorder_index(counts_SL: torch.Tensor, n: int) -> torch.Tensor:
    """Row index that reorders blocks stored (source-major, expert-minor) into (expert-major, source-minor).

    counts_SL[s, l] = rows of local expert l from source s; buffer order is s outer, l inner; n = total rows.
    Returns idx such that buffer[idx] lists expert 0's rows of every source, then expert 1's, ...
    """
    sizes_src = counts_SL.reshape(-1)
    starts_src = torch.cumsum(sizes_src, 0) - sizes_src  # where each (s, l) block starts in the buffer
    sizes_dst = counts_SL.t().reshape(-1)  # blocks in (l, s) order
    starts_of_dst_blocks = starts_src.view_as(counts_SL).t().reshape(-1)
    dst_starts = torch.cumsum(sizes_dst, 0) - sizes_dst
    shift = torch.repeat_interleave(starts_of_dst_blocks - dst_starts, sizes_dst, output_size=n)
    return torch.arange(n, device=counts_SL.device) + shift


class AllToAllDispatcher(TokenDispatcher):
    """Dropless (or capacity-limited) all-to-all token exchange over EP, with all-gather over ETP."""

    def __init__(self, num_experts: int, apply_probs_on_input: bool = False, dims: ParallelDims | None = None) -> None:
        if dims is None:
            raise ValueError("AllToAllDispatcher needs ParallelDims")
        super().__init__(num_experts, apply_probs_on_input, dims)
        self.ep, self.etp = dims.ep_group, dims.etp_group
        self.e_local = num_experts // self.ep.size

    @property
    def num_local_experts(self) -> int:
        return self.e_local

    def dispatch_preprocess(self, x_TH, idx_TK, weight_TK, keep_TK=None, pad_to_capacity=None):
        rows, pctx = permute(x_TH, idx_TK, self.num_experts, keep_TK, pad_to_capacity)
        ctx = DispatchCtx(permute_ctx=pctx, weight_TK=weight_TK, tokens_per_expert=pctx.tokens_per_expert)
        if self.apply_probs_on_input:
            ctx.probs_N = permute_probs(weight_TK, pctx)
        # 1. Counts: send_counts[j, l] rows for expert l of EP peer j; receive recv[j, l] from peer j.
        send_counts = pctx.tokens_per_expert.to(torch.long).view(self.ep.size, self.e_local)
        recv = comm.all_to_all_single(
            send_counts.reshape(-1), self.ep, [self.e_local] * self.ep.size, [self.e_local] * self.ep.size
        )
        recv = recv.view(self.ep.size, self.e_local)
        # ETP peers gather each other's received rows: counts[a, j, l] for ETP source a.
        counts = comm.all_gather_dim(recv.unsqueeze(0), self.etp, 0)  # [etp, ep, E_local]
        host_send, host_counts = (
            torch.cat([send_counts.reshape(-1), counts.reshape(-1)]).cpu().split([send_counts.numel(), counts.numel()])
        )  # the one host synchronisation of the layer
        host_counts = host_counts.view(counts.shape)
        ctx.extra["in_splits"] = host_send.view(self.ep.size, self.e_local).sum(1).tolist()
        ctx.extra["out_splits"] = host_counts[self.etp.rank].sum(1).tolist()
        ctx.extra["etp_sizes"] = host_counts.sum((1, 2)).tolist()
        counts_SL = counts.reshape(-1, self.e_local)
        ctx.extra["order"] = _chunk_reorder_index(counts_SL, int(host_counts.sum()))
        ctx.local_tokens_per_expert = counts_SL.sum(0)
        return rows, ctx

    def _forward_exchange(self, t: torch.Tensor, ctx: DispatchCtx) -> torch.Tensor:
        t = comm.all_to_all(t, self.ep, ctx.extra["out_splits"], ctx.extra["in_splits"])
        return comm.all_gather_v(t, self.etp, ctx.extra["etp_sizes"])

    def dispatch(self, rows: torch.Tensor, ctx: DispatchCtx) -> torch.Tensor:
        # 2. Variable-size blocks to the experts' owners, then gathered over ETP.
        if ctx.probs_N is not None:
            ctx.probs_N = self._forward_exchange(ctx.probs_N.unsqueeze(-1), ctx).squeeze(-1)
        return self._forward_exchange(rows, ctx)

    def dispatch_postprocess(self, rows, ctx):
        # 3. (ETP source, EP source, local expert) -> local-expert-major.
        order = ctx.extra["order"]
        probs = ctx.probs_N.index_select(0, order) if ctx.probs_N is not None else None
        return rows.index_select(0, order), ctx.local_tokens_per_expert, probs

    def combine_preprocess(self, expert_out: torch.Tensor, ctx: DispatchCtx) -> torch.Tensor:
        # 4. Back to (ETP source, EP source, local expert) order.
        return expert_out.index_select(0, inverse_permutation(ctx.extra["order"]))

    def combine(self, rows: torch.Tensor, ctx: DispatchCtx) -> torch.Tensor:
        # 5. Sum the ETP partial outputs (each ETP source keeps its rows), then return rows over EP.
        rows = comm.reduce_scatter_v(rows, self.etp, ctx.extra["etp_sizes"])
        return comm.all_to_all(rows, self.ep, ctx.extra["in_splits"], ctx.extra["out_splits"])

    def combine_postprocess(self, rows: torch.Tensor, ctx: DispatchCtx) -> torch.Tensor:
        # 6. Unpermute, weighting by the routing probabilities unless the experts applied them.
        weight = None if self.apply_probs_on_input else ctx.weight_TK
        return unpermute(rows, ctx.permute_ctx, weight)


class AllGatherDispatcher(TokenDispatcher):
    """Every rank of the EP x ETP group sees all its tokens and keeps the copies routed to its own experts."""

    def __init__(self, num_experts: int, apply_probs_on_input: bool = False, dims: ParallelDims | None = None) -> None:
        if dims is None:
            raise ValueError("AllGatherDispatcher needs ParallelDims")
        super().__init__(num_experts, apply_probs_on_input, dims)
        self.group = dims.ep_etp_group
        self.e_local = num_experts // dims.ep
        self.first_expert = dims.ep_group.rank * self.e_local

    @property
    def num_local_experts(self) -> int:
        return self.e_local

    def dispatch_preprocess(self, x_TH, idx_TK, weight_TK, keep_TK=None, pad_to_capacity=None):
        # 1. Token counts of every member (they may differ), so the gathers below know the block sizes.
        T = x_TH.shape[0]
        sizes = comm.all_gather_dim(torch.tensor([T], device=x_TH.device), self.group, 0).cpu().tolist()
        ctx = DispatchCtx(permute_ctx=None, weight_TK=weight_TK, tokens_per_expert=None)
        ctx.extra.update(sizes=sizes, idx_TK=idx_TK, keep_TK=keep_TK, pad=pad_to_capacity)
        return x_TH, ctx

    def dispatch(self, rows: torch.Tensor, ctx: DispatchCtx) -> torch.Tensor:
        # 2. Gather tokens (autograd), routing weights (autograd) and expert ids / keep masks (plain).
        sizes = ctx.extra["sizes"]
        idx = comm.all_gather_v_plain(ctx.extra["idx_TK"], self.group, sizes)
        keep = ctx.extra["keep_TK"]
        if keep is not None:
            keep = comm.all_gather_v_plain(keep.to(torch.uint8), self.group, sizes).bool()
        ctx.extra.update(all_idx=idx, all_keep=keep, all_weight=comm.all_gather_v(ctx.weight_TK, self.group, sizes))
        return comm.all_gather_v(rows, self.group, sizes)

    def dispatch_postprocess(self, rows, ctx):
        # 3. Keep the copies routed to this rank's experts and sort them by local expert.
        idx = ctx.extra["all_idx"] - self.first_expert
        mine = (idx >= 0) & (idx < self.e_local)
        keep = mine if ctx.extra["all_keep"] is None else mine & ctx.extra["all_keep"]
        local_idx = torch.where(mine, idx, 0)
        expert_in, pctx = permute(rows, local_idx, self.e_local, keep)
        ctx.permute_ctx = pctx
        ctx.tokens_per_expert = pctx.tokens_per_expert
        ctx.local_tokens_per_expert = pctx.tokens_per_expert
        probs = permute_probs(ctx.extra["all_weight"], pctx) if self.apply_probs_on_input else None
        return expert_in, pctx.tokens_per_expert, probs

    def combine_preprocess(self, expert_out: torch.Tensor, ctx: DispatchCtx) -> torch.Tensor:
        # 4. Weighted sum over this rank's copies of each gathered token (other copies count zero).
        weight = None if self.apply_probs_on_input else ctx.extra["all_weight"]
        return unpermute(expert_out, ctx.permute_ctx, weight)

    def combine(self, rows: torch.Tensor, ctx: DispatchCtx) -> torch.Tensor:
        # 5. Sum every rank's contributions and hand each rank its own tokens.
        return comm.reduce_scatter_v(rows, self.group, ctx.extra["sizes"])

    def combine_postprocess(self, rows: torch.Tensor, ctx: DispatchCtx) -> torch.Tensor:
        return rows


def build_dispatcher(
    num_experts: int, apply_probs_on_input: bool = False, dims: ParallelDims | None = None, kind: str = "alltoall"
) -> TokenDispatcher:
    """The dispatcher for this layout: local with ep = etp = 1, else `kind` (moe.token_dispatcher_type)."""
    if dims is None or (dims.ep == 1 and dims.etp == 1):
        return LocalDispatcher(num_experts, apply_probs_on_input, dims)
    if kind == "alltoall":
        return AllToAllDispatcher(num_experts, apply_probs_on_input, dims)
    if kind == "allgather":
        return AllGatherDispatcher(num_experts, apply_probs_on_input, dims)
    raise ValueError(f"moe.token_dispatcher_type={kind!r} is invalid: allowed: allgather | alltoall")


# --------------------------------------------------------------------------------------------------
# Tokens of an MoE layer under tensor parallel
# --------------------------------------------------------------------------------------------------
#
# Inside an MoE layer every rank routes its own tokens: under sequence parallel the layer input is
# already this rank's sequence chunk; without it (x replicated over TP) the layer keeps its chunk on
# entry and all-gathers the output at the end. The router, shared experts and shared-expert gate are
# replicated with partial gradients over TP. The balancing losses must see the whole micro-batch, so
# the router logits are all-gathered along the sequence: the losses are then identical on every TP
# rank (replicated, like the LM loss), and each rank's logits receive the gradient of their own rows.


def _tp(dims: ParallelDims | None):
    return dims.tp_group if dims is not None and dims.tp > 1 else None


def moe_tokens_enter(
    x: torch.Tensor, loss_mask: torch.Tensor | None, dims: ParallelDims | None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(this rank's tokens [B, S_local, H], their loss mask [B, S_local]) for an MoE layer."""
    tp = _tp(dims)
    if tp is None:
        return x, loss_mask
    if not dims.sequence_parallel:
        x = comm.scatter_to_sequence_parallel(x, tp, dim=1)
    if loss_mask is not None:
        loss_mask = comm.split_dim(loss_mask, tp, 1)
    return x, loss_mask


def moe_tokens_exit(y: torch.Tensor, dims: ParallelDims | None) -> torch.Tensor:
    """Undo `moe_tokens_enter` on the layer output (all-gather along the sequence when x was replicated)."""
    tp = _tp(dims)
    if tp is None or dims.sequence_parallel:
        return y
    return comm.gather_from_region(y, tp, dim=1)


def splits_tokens_over_tp(dims: ParallelDims | None) -> bool:
    """True when tensor parallelism splits an MoE layer's tokens over ranks (tp > 1)."""
    return _tp(dims) is not None


def router_logits_for_losses(
    logits_TE: torch.Tensor, batch: int, full_loss_mask: torch.Tensor | None, dims: ParallelDims | None
) -> tuple[torch.Tensor, torch.Tensor | None, int]:
    """(logits of the whole micro-batch [B*S, E], its valid-token mask [B*S] or None, S) for the balancing losses."""
    tp = _tp(dims)
    E = logits_TE.shape[-1]
    if dims is not None and dims.cp > 1:
        # Context parallel: the losses are those of the whole sequences, every CP rank computing them and
        # counting 1/cp of them (`cp_loss_share`); the gradients of the gathered logits are summed over CP.
        full = logits_TE.view(batch, -1, E)
        if tp is not None:
            full = comm.gather_from_region(full, tp, dim=1)
        full = gather_from_cp(full, dims, 1, grad="sum")
        valid = None
        if full_loss_mask is not None:
            valid = gather_from_cp_plain(full_loss_mask.reshape(batch, -1), dims.cp_group, 1).reshape(-1) > 0
        return full.reshape(-1, E), valid, full.shape[1]
    if tp is None:
        valid = None if full_loss_mask is None else full_loss_mask.reshape(-1) > 0
        return logits_TE, valid, logits_TE.shape[0] // batch
    full = comm.gather_from_region(logits_TE.view(batch, -1, E), tp, dim=1)
    valid = None if full_loss_mask is None else full_loss_mask.reshape(-1) > 0
    return full.reshape(-1, E), valid, full.shape[1]


def cp_loss_share(loss: torch.Tensor, dims: ParallelDims | None) -> torch.Tensor:
    """This CP rank's share of a loss every CP rank computed over the whole sequences (loss / cp)."""
    return loss if dims is None or dims.cp == 1 else loss / dims.cp


def sum_counts_over_tp(t: torch.Tensor, dims: ParallelDims | None) -> torch.Tensor:
    """Token statistics of this rank's chunk -> of the whole micro-batch (a new tensor, no gradient)."""
    tp = _tp(dims)
    if tp is None:
        return t
    return comm.all_reduce_(t.detach().clone(), tp, "sum")


def mark_replicated_moe_params(modules: list[torch.nn.Module | None], dims: ParallelDims | None) -> None:
    """Router, shared experts and their gate see this rank's tokens only: partial gradients over TP."""
    if _tp(dims) is None:
        return
    for m in modules:
        if m is not None:
            for p in m.parameters():
                set_shard(p, "tp_partial")
