"""Token dispatchers: move token copies to their experts and bring the outputs back, in phases.

Every dispatcher runs the same six phases, so an overlap schedule can interleave the
communication phases of one micro-batch with the compute of another:

    dispatch_preprocess   local: sort token copies by expert (permute), count rows per expert
    dispatch              communication: send rows to the ranks that own their experts (EP)
    dispatch_postprocess  local: order received rows by local expert -> expert input + counts
    (experts run here)
    combine_preprocess    local: undo dispatch_postprocess's reordering
    combine               communication: send expert outputs back to the tokens' ranks
    combine_postprocess   local: unpermute and weight by the routing probabilities -> [T, H]

`DispatchCtx` carries what later phases need to reverse earlier ones: the permutation, the routing
weights, the global per-expert counts [E], the rows per local expert, and `extra`, a dict where an
expert-parallel dispatcher keeps its split sizes / received counts. `LocalDispatcher` (one device,
or expert parallel size 1) does the local phases and no communication.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field

import torch

from moecore.moe.permute import PermuteCtx, SortedAssignments, permute, permute_probs, unpermute


@dataclass
class DispatchCtx:
    """State shared by the phases of one dispatch / combine round trip."""

    permute_ctx: PermuteCtx
    weight_TK: torch.Tensor  # routing weights of each token's K assignments
    tokens_per_expert: torch.Tensor  # [E] rows per expert on this rank's side of the dispatch
    local_tokens_per_expert: torch.Tensor | None = None  # [E_local] rows per local expert after dispatch
    probs_N: torch.Tensor | None = None  # per-row weights when they are applied inside the experts
    extra: dict = field(default_factory=dict)  # dispatcher-specific state (splits, received counts, ...)


class TokenDispatcher(ABC):
    """The interface every dispatcher implements; see the module docstring for the phases."""

    def __init__(self, num_experts: int, apply_probs_on_input: bool = False, dims=None) -> None:
        self.num_experts = num_experts
        self.apply_probs_on_input = apply_probs_on_input
        self.dims = dims

    @property
    def num_local_experts(self) -> int:
        return self.num_experts

    @abstractmethod
    def dispatch_preprocess(
        self,
        x_TH: torch.Tensor,
        idx_TK: torch.Tensor,
        weight_TK: torch.Tensor,
        keep_TK: torch.Tensor | None = None,
        pad_to_capacity: int | None = None,
    ) -> tuple[torch.Tensor, DispatchCtx]: ...

    @abstractmethod
    def dispatch(self, rows: torch.Tensor, ctx: DispatchCtx) -> torch.Tensor: ...

    @abstractmethod
    def dispatch_postprocess(
        self, rows: torch.Tensor, ctx: DispatchCtx
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """-> (expert input [N_local, H] sorted by local expert, rows per local expert, per-row probs or None)."""

    @abstractmethod
    def combine_preprocess(self, expert_out: torch.Tensor, ctx: DispatchCtx) -> torch.Tensor: ...

    @abstractmethod
    def combine(self, rows: torch.Tensor, ctx: DispatchCtx) -> torch.Tensor: ...

    @abstractmethod
    def combine_postprocess(self, rows: torch.Tensor, ctx: DispatchCtx) -> torch.Tensor: ...

    def token_dispatch(
        self,
        x_TH: torch.Tensor,
        idx_TK: torch.Tensor,
        weight_TK: torch.Tensor,
        keep_TK: torch.Tensor | None = None,
        pad_to_capacity: int | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, DispatchCtx]:
        """The three dispatch phases in order -> (expert input, rows per local expert, probs, ctx)."""
        rows, ctx = self.dispatch_preprocess(x_TH, idx_TK, weight_TK, keep_TK, pad_to_capacity)
        rows = self.dispatch(rows, ctx)
        expert_in, counts, probs = self.dispatch_postprocess(rows, ctx)
        return expert_in, counts, probs, ctx

    def token_combine(self, expert_out: torch.Tensor, ctx: DispatchCtx) -> torch.Tensor:
        """The three combine phases in order -> [T, H]."""
        rows = self.combine_preprocess(expert_out, ctx)
        rows = self.combine(rows, ctx)
        return self.combine_postprocess(rows, ctx)


class LocalDispatcher(TokenDispatcher):
    """All experts live on this device: permute / unpermute, no communication."""

    def dispatch_preprocess(
        self,
        x_TH: torch.Tensor,
        idx_TK: torch.Tensor,
        weight_TK: torch.Tensor,
        keep_TK: torch.Tensor | None = None,
        pad_to_capacity: int | None = None,
        presorted: SortedAssignments | None = None,
    ) -> tuple[torch.Tensor, DispatchCtx]:
        """`presorted`: the assignments' sort by expert, already done (moecore/moe/permute.py)."""
        rows, pctx = permute(x_TH, idx_TK, self.num_experts, keep_TK, pad_to_capacity, presorted)
        ctx = DispatchCtx(permute_ctx=pctx, weight_TK=weight_TK, tokens_per_expert=pctx.tokens_per_expert)
        if self.apply_probs_on_input:
            ctx.probs_N = permute_probs(weight_TK, pctx)
        return rows, ctx

    def dispatch(self, rows: torch.Tensor, ctx: DispatchCtx) -> torch.Tensor:
        return rows

    def dispatch_postprocess(
        self, rows: torch.Tensor, ctx: DispatchCtx
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        ctx.local_tokens_per_expert = ctx.tokens_per_expert
        return rows, ctx.tokens_per_expert, ctx.probs_N

    def combine_preprocess(self, expert_out: torch.Tensor, ctx: DispatchCtx) -> torch.Tensor:
        return expert_out

    def combine(self, rows: torch.Tensor, ctx: DispatchCtx) -> torch.Tensor:
        return rows

    def combine_postprocess(self, rows: torch.Tensor, ctx: DispatchCtx) -> torch.Tensor:
        weight = None if self.apply_probs_on_input else ctx.weight_TK
        return unpermute(rows, ctx.permute_ctx, weight)
