"""The MoE block: route -> permute -> dispatch -> experts -> combine -> unpermute, plus shared experts.

`MoELayer(cfg, hidden_size, activation, init_std, dims)` is what the transformer puts in place of the
dense MLP on MoE layers (`MoEConfig.is_moe_layer`). `forward(x [B, S, H], loss_mask [B, S] | None)`
returns `(y [B, S, H], MoELayerAux)`: `aux.loss` is the weighted sum of this layer's routing losses
for this micro-batch (add it to the objective), `aux.stats` holds detached tensors for logging:
`aux_loss`, `seq_aux_loss`, `global_aux_loss` (each unweighted, present only when its coefficient is
> 0, i.e. when it is in the objective), `z_loss` (when `moe.z_loss_coeff` is set), `tokens_per_expert` [E] (assignments that reached an expert, padding
excluded), `imbalance` (max / mean of tokens_per_expert) and `dropped_fraction` (share of the
non-padding assignments dropped by the capacity limit). Loss formulas: `moecore/moe/losses.py`.

Parameters: `router.weight` [E, H] (+ buffer `router.expert_bias` [E] fp32 with expert bias),
`experts.w13` [E, 2F, H], `experts.w2` [E, H, F], `shared_experts.{gate,up,down}_proj.weight`,
`shared_expert_gate.weight` [1, H].

Recomputation (`model.recompute_modules`, passed by the decoder layer): `recompute_act` ("moe_act")
recomputes the expert activation in backward (see moecore/moe/experts.py), `recompute_shared`
("shared_experts") checkpoints the shared expert MLP (its input is kept, its hidden activations are not).

Once per optimizer step the training loop calls `update_expert_bias()` (or `update_expert_biases(model)`
for every layer): it moves the aux-loss-free expert bias from the counts accumulated since the last
call and resets the global-batch counts of `global_aux_loss`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from moecore.config import MoEConfig
from moecore.kernels._triton import use_triton
from moecore.kernels.router import FusedRouting
from moecore.moe import expert_parallel as ep_util
from moecore.moe import losses
from moecore.moe.chunked import chunked_experts, chunked_sorted_rows
from moecore.moe.dispatch import LocalDispatcher
from moecore.moe.experts import GroupedExperts
from moecore.moe.minimal import minimal_experts
from moecore.moe.permute import SortedAssignments, capacity_keep, expert_capacity, sort_assignments
from moecore.moe.router import TopKRouter, scores_for_balancing
from moecore.nvtx import nvtx_range
from moecore.parallel import comm


@dataclass
class MoELayerAux:
    """Routing losses and statistics of one MoE layer for one micro-batch."""

    loss: torch.Tensor  # weighted sum of the enabled routing losses (scalar, differentiable)
    stats: dict = field(default_factory=dict)  # detached tensors, see the module docstring


@dataclass
class Routed:
    """Step 1 of the layer: the chosen experts [T, K], their weights [T, K], the routing losses' weighted sum
    and unweighted values, and the routed counts [E] when the fused router summed them (else None)."""

    idx_TK: torch.Tensor
    weight_TK: torch.Tensor
    loss: torch.Tensor
    stats: dict
    counts_E: torch.Tensor | None = None
    presorted: SortedAssignments | None = None  # dispatch preprocessing done with the routing (see `presort`)


def _in_backward() -> bool:
    """True while autograd runs a backward pass (e.g. activation recomputation of a checkpointed layer)."""
    task_id = getattr(torch._C, "_current_graph_task_id", None)
    return task_id is not None and task_id() != -1


class SharedExpertMLP(nn.Module):
    """The always-on expert: down(silu(gate(x)) * up(x)), or down(gelu(up(x))) for GeLU. With `clip_limit` L
    (DeepSeek-V4), the SwiGLU's gate is clipped to <= L and its up projection to [-L, L] first."""

    def __init__(self, hidden_size: int, ffn_hidden_size: int, activation: str = "swiglu", init_std: float = 0.02):
        super().__init__()
        self.activation = activation
        if activation == "swiglu":
            self.gate_proj = nn.Linear(hidden_size, ffn_hidden_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, ffn_hidden_size, bias=False)
        self.down_proj = nn.Linear(ffn_hidden_size, hidden_size, bias=False)
        for p in self.parameters():
            nn.init.normal_(p, std=init_std)
        self.clip_limit: float | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.activation == "swiglu" and self.clip_limit is not None:
            lim = self.clip_limit
            return self.down_proj(F.silu(self.gate_proj(x).clamp(max=lim)) * self.up_proj(x).clamp(-lim, lim))
        if self.activation == "swiglu":
            return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        return self.down_proj(F.gelu(self.up_proj(x), approximate="tanh"))


class MoELayer(nn.Module):
    """Top-k routed experts (+ optional shared experts) replacing the dense MLP of a decoder layer."""

    def __init__(
        self,
        cfg: MoEConfig,
        hidden_size: int,
        activation: str = "swiglu",
        init_std: float = 0.02,
        dims=None,
        recompute_act: bool = False,
        recompute_shared: bool = False,
    ) -> None:
        super().__init__()
        self.cfg = cfg
        self.dims = dims
        self.num_experts = cfg.num_experts
        self.topk = cfg.router_topk
        self.router = TopKRouter(cfg, hidden_size, init_std)
        # Expert parallel: this rank holds E / ep experts, each with F / etp FFN columns.
        e_local, f_local = ep_util.local_expert_sizes(cfg.num_experts, cfg.ffn_hidden_size, dims)
        self.experts = GroupedExperts(e_local, hidden_size, f_local, activation, init_std, cfg.grouped_gemm)
        ep_util.shard_expert_params(
            self.experts.w13, self.experts.w2, cfg.num_experts, cfg.ffn_hidden_size, activation == "swiglu", dims
        )
        self.experts.recompute_act = recompute_act
        # sync-free: GEMMs on device offsets only (the measured "loop" plans read the counts on the host)
        self.experts.sync_free = cfg.sync_free
        self.experts.gemm_backend = cfg.gemm_backend
        self.recompute_shared = recompute_shared
        self.dispatcher = ep_util.build_dispatcher(
            cfg.num_experts, cfg.apply_probs_on_input, dims, cfg.token_dispatcher_type
        )
        self.shared_experts = None
        self.shared_expert_gate = None
        if cfg.shared_expert_intermediate_size:
            self.shared_experts = SharedExpertMLP(
                hidden_size, cfg.shared_expert_intermediate_size, activation, init_std
            )
            if cfg.shared_expert_gate:
                self.shared_expert_gate = nn.Linear(hidden_size, 1, bias=False)
                nn.init.normal_(self.shared_expert_gate.weight, std=init_std)
        ep_util.mark_replicated_moe_params([self.router, self.shared_experts, self.shared_expert_gate], dims)
        self.coeffs = {t: c for t, c in zip(cfg.balancing_types, cfg.aux_loss_coeffs) if t != "none" and c > 0}
        # Global-batch counts for global_aux_loss: summed over this step's micro-batches (not saved).
        self.register_buffer("global_tokens_per_expert", torch.zeros(cfg.num_experts), persistent=False)
        self.register_buffer("global_steps", torch.zeros(()), persistent=False)
        # Averaged counts used by each forward this step, replayed when a checkpointed layer recomputes: in the
        # dict of the checkpointed call (moecore/models/recompute.py checkpoint_module), else first in, first out.
        self._global_counts_used: list[torch.Tensor] = []
        self.recompute_memo: dict | None = None
        # "auto": the fused router where its kernel launches; "torch" / "triton" force the fused path with
        # that implementation (tests: the reference on CPU, the Triton interpreter).
        self.fused_router_impl = "auto"

    # ------------------------------------------------------------------ forward
    def route(
        self,
        x: torch.Tensor,
        loss_mask: torch.Tensor | None,
        full_loss_mask: torch.Tensor | None,
        token_ids: torch.Tensor | None = None,
    ) -> Routed:
        """Step 1 on this rank's tokens x [B, S, H]: the chosen experts, their weights, the routing losses.

        `full_loss_mask`: the whole micro-batch's mask (the balancing losses see it under tensor parallel).
        `token_ids` [B, S]: the input's token ids, which a hash-routed layer (moe.num_hash_layers) routes by.
        """
        B, S, H = x.shape
        x_TH = x.reshape(B * S, H)
        valid_T = None if loss_mask is None else (loss_mask.reshape(B * S) > 0)
        with nvtx_range("moe/route"):
            if self._use_fused_router(x_TH):
                need_sums, need_z = bool(self.coeffs), bool(self.cfg.z_loss_coeff)
                segment = S if "seq_aux_loss" in self.coeffs else B * S
                r, sums = self.router.forward_fused(x_TH, valid_T, segment, need_sums, need_z, self.fused_router_impl)
                loss, stats = self._routing_losses_from_sums(sums)
                counts_GE = sums.counts_GE  # one segment: its row is the sum (no reduction launched)
                counts_E = counts_GE[0] if counts_GE.shape[0] == 1 else counts_GE.sum(0)
                return Routed(r.topk_idx_TK, r.topk_weight_TK, loss, stats, counts_E)
            r = self.router(x_TH) if token_ids is None else self.router(x_TH, token_ids.reshape(B * S))
            loss_logits, loss_valid, loss_S = ep_util.router_logits_for_losses(
                r.logits_TE, B, full_loss_mask, self.dims
            )
            loss, stats = self._routing_losses(loss_logits, loss_valid, B, loss_S)
            loss = ep_util.cp_loss_share(loss, self.dims)
            return Routed(r.topk_idx_TK, r.topk_weight_TK, loss, stats)

    def presort(self, routed: Routed) -> Routed:
        """`routed` with the dispatch preprocessing (the assignments' sort by expert) done, where the layer
        can use it: one device and dropless routing; else `routed` unchanged."""
        if type(self.dispatcher) is not LocalDispatcher or self.cfg.expert_capacity_factor is not None:
            return routed
        routed.presorted = sort_assignments(routed.idx_TK, self.num_experts)
        return routed

    def forward(
        self,
        x: torch.Tensor,
        loss_mask: torch.Tensor | None = None,
        routed: Routed | None = None,
        token_ids: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, MoELayerAux]:
        """`routed`: step 1 already done (a captured CUDA graph of the router, moecore/models/cuda_graphs.py).
        `token_ids` [B, S]: for a hash-routed layer, the ids of x's tokens."""
        full_loss_mask = loss_mask
        x, loss_mask = ep_util.moe_tokens_enter(x, loss_mask, self.dims)  # tensor parallel: this rank's tokens
        if token_ids is not None and ep_util.splits_tokens_over_tp(self.dims):  # split as the loss mask is
            token_ids = comm.split_dim(token_ids, self.dims.tp_group, 1)
        B, S, H = x.shape
        x_TH = x.reshape(B * S, H)
        valid_T = None if loss_mask is None else (loss_mask.reshape(B * S) > 0)

        # 1. route (the balancing losses see the whole micro-batch, also under tensor parallel)
        if routed is None:
            routed = self.route(x, loss_mask, full_loss_mask, token_ids)
        idx_TK, weight_TK, loss, stats = routed.idx_TK, routed.weight_TK, routed.loss, dict(routed.stats)
        routed_counts_E = routed.counts_E  # this rank's routed counts when the fused router summed them

        # 2. capacity (optional): which assignments fit
        keep_TK, pad = None, None
        cf = self.cfg.expert_capacity_factor
        if cf is not None:
            capacity = expert_capacity(B * S, self.topk, self.num_experts, cf)
            if capacity < B * S:  # an expert receives at most one copy of each token
                keep_TK = capacity_keep(idx_TK, weight_TK, self.num_experts, capacity, self.cfg.token_drop_policy)
            if self.cfg.pad_expert_input_to_capacity:
                pad = capacity

        # 3. permute + dispatch, 4. experts, 5. combine + unpermute
        if self._minimal_memory(x_TH, keep_TK, pad):  # one Function keeping x, (h) and routing (moe/minimal.py)
            with nvtx_range("moe/experts"):
                e, probs_in_act = self.experts, self.cfg.apply_probs_on_input
                if self.cfg.activation_memory == "chunked":  # x and routing only, in chunks (moe/chunked.py)
                    rows = self.cfg.activation_chunk_rows
                    y_TH, _ = chunked_experts(
                        x_TH,
                        idx_TK,
                        weight_TK,
                        e.w13,
                        e.w2,
                        rows,
                        probs_in_act,
                        routed.presorted,
                        e.gemm_plan,
                        e.gemm_backend,
                        **e.swiglu_options(),
                    )
                else:
                    y_TH, _ = minimal_experts(
                        x_TH,
                        idx_TK,
                        weight_TK,
                        e.w13,
                        e.w2,
                        probs_in_act,
                        routed.presorted,
                        e.gemm_plan,
                        e.gemm_backend,
                        self.cfg.swiglu_epilogue,
                        e.load_spread,
                        **e.swiglu_options(),
                    )
                e.last_path = self.cfg.activation_memory
        else:
            with nvtx_range("moe/dispatch"):
                if routed.presorted is not None and keep_TK is None:  # sorted already (LocalDispatcher only)
                    d = self.dispatcher
                    rows, ctx = d.dispatch_preprocess(x_TH, idx_TK, weight_TK, None, pad, routed.presorted)
                    expert_in, counts, probs = d.dispatch_postprocess(d.dispatch(rows, ctx), ctx)
                else:
                    expert_in, counts, probs, ctx = self.dispatcher.token_dispatch(
                        x_TH, idx_TK, weight_TK, keep_TK, pad
                    )
            with nvtx_range("moe/experts"):
                if self._chunked_sorted_rows(expert_in, keep_TK, pad):  # expert parallel (moe/chunked.py)
                    e = self.experts
                    rows = self.cfg.activation_chunk_rows
                    expert_out = chunked_sorted_rows(
                        expert_in, counts, probs, e.w13, e.w2, rows, e.gemm_plan, e.gemm_backend, **e.swiglu_options()
                    )
                    e.last_path = "chunked"
                else:
                    expert_out = self.experts(expert_in, counts, probs)
            with nvtx_range("moe/combine"):
                y_TH = self.dispatcher.token_combine(expert_out, ctx)

        # 6. shared experts
        if self.shared_experts is not None:
            with nvtx_range("moe/shared_experts"):
                y_TH = y_TH + self._shared_expert_output(x_TH)

        if keep_TK is not None:
            routed_counts_E = None  # capacity drops: count what was kept
        stats.update(self._load_stats(idx_TK, keep_TK, valid_T, count=self._counting(), tpe=routed_counts_E))
        return ep_util.moe_tokens_exit(y_TH.view(B, S, H), self.dims), MoELayerAux(loss=loss, stats=stats)

    def _use_fused_router(self, x_TH: torch.Tensor) -> bool:
        """The fused router kernel where it launches (CUDA + triton) and covers the options; every rank
        routes the whole micro-batch's losses itself (no tensor-parallel token split)."""
        if not self.router.fusable() or ep_util.splits_tokens_over_tp(self.dims) or getattr(self.dims, "cp", 1) > 1:
            return False
        if self.fused_router_impl != "auto":
            return True
        return use_triton("auto", x_TH)

    def _minimal_memory(self, x_TH: torch.Tensor, keep_TK: torch.Tensor | None, pad: int | None) -> bool:
        """moe.activation_memory=minimal | chunked where it runs on one device (else the standard path)."""
        mode = self.cfg.activation_memory
        return (
            mode != "standard"
            and type(self.dispatcher) is LocalDispatcher
            and self._low_memory_rows(x_TH, keep_TK, pad)
        )

    def _chunked_sorted_rows(self, rows: torch.Tensor, keep_TK: torch.Tensor | None, pad: int | None) -> bool:
        """moe.activation_memory=chunked behind a dispatcher that moves rows between ranks (expert or expert
        tensor parallel): the experts' rows arrive grouped by expert, and the chunked expert FFN runs on them."""
        return self.cfg.activation_memory == "chunked" and self._low_memory_rows(rows, keep_TK, pad)

    def _low_memory_rows(self, rows: torch.Tensor, keep_TK: torch.Tensor | None, pad: int | None) -> bool:
        """Whether the low-memory expert paths run for these rows: dropless, SwiGLU, not FP8 experts (they run
        their own Function), and torch._grouped_mm for the rows' device and dtype (not e.g. fp64 on CPU)."""
        if keep_TK is not None or pad is not None:
            return False
        e = self.experts
        ok = e.fp8_recipe is None and e.activation == "swiglu" and rows.shape[0] > 0
        return ok and e.uses_grouped_mm(rows)

    def _shared_expert_output(self, x_TH: torch.Tensor) -> torch.Tensor:
        """The shared experts' output, sigmoid-gated when moe.shared_expert_gate (Qwen2-MoE)."""
        if self.recompute_shared and self.training and torch.is_grad_enabled():
            shared = checkpoint(self.shared_experts, x_TH, use_reentrant=False)
        else:
            shared = self.shared_experts(x_TH)
        if self.shared_expert_gate is not None:
            shared = torch.sigmoid(self.shared_expert_gate(x_TH)) * shared
        return shared

    # ------------------------------------------------------------------ losses and statistics
    def _counting(self) -> bool:
        """Whether this forward is a training step whose counts should accumulate (not eval, not recompute)."""
        return self.training and torch.is_grad_enabled() and not _in_backward()

    def _routing_losses(
        self, logits_TE: torch.Tensor, valid_T: torch.Tensor | None, B: int, S: int
    ) -> tuple[torch.Tensor, dict]:
        """The balancing losses with coefficient > 0 and the z-loss if its coefficient is set: their weighted sum
        and their unweighted values (stats)."""
        K, E = self.topk, self.num_experts
        total = logits_TE.new_zeros(())
        if not self.coeffs and not self.cfg.z_loss_coeff:
            return total.float(), {}
        values: dict[str, torch.Tensor] = {}
        if self.coeffs:
            scores_TE = scores_for_balancing(logits_TE, self.cfg.router_score_function)
            if valid_T is not None:
                scores_TE = scores_TE * valid_T.to(scores_TE.dtype).unsqueeze(-1)
                num_tokens = valid_T.sum().to(scores_TE.dtype)
            else:
                num_tokens = scores_TE.new_full((), float(B * S))  # no host-to-device copy (graph capturable)
        # Only the losses in the objective are computed (each costs a top-k, a scatter and their backward:
        # launch-bound at small expert sizes); the per-expert load statistics come from _load_stats.
        if "aux_loss" in self.coeffs or "global_aux_loss" in self.coeffs:
            counts_E = losses.topk_counts(scores_TE, K, valid_T)
            if "aux_loss" in self.coeffs:
                values["aux_loss"] = losses.switch_aux_loss(scores_TE, counts_E, num_tokens, K)
            if "global_aux_loss" in self.coeffs:
                training = self.training and torch.is_grad_enabled()
                global_counts = self._global_counts(counts_E, training)
                values["global_aux_loss"] = losses.switch_aux_loss(scores_TE, global_counts, num_tokens, K)
        if "seq_aux_loss" in self.coeffs:
            values["seq_aux_loss"] = losses.sequence_aux_loss(
                scores_TE.view(B, S, E), K, None if valid_T is None else valid_T.view(B, S)
            )
        if self.cfg.z_loss_coeff:
            values["z_loss"] = losses.z_loss(logits_TE, valid_T)
        return self._weighted_total(values), {k: v.detach().float() for k, v in values.items()}

    def _routing_losses_from_sums(self, sums: FusedRouting) -> tuple[torch.Tensor, dict]:
        """`_routing_losses` from the fused router's per-segment sums (the same losses and values)."""
        K = self.topk
        total = sums.psum_GE.new_zeros(())
        if not self.coeffs and not self.cfg.z_loss_coeff:
            return total.float(), {}
        tokens_G = sums.counts_GE.sum(1) / K  # every valid token routes to exactly K experts
        num_tokens = tokens_G.sum().to(sums.psum_GE.dtype)
        psum_E, aux_counts_E = sums.psum_GE.sum(0), sums.aux_counts_GE.sum(0).to(sums.psum_GE.dtype)
        values: dict[str, torch.Tensor] = {}
        if "aux_loss" in self.coeffs:
            values["aux_loss"] = losses.aux_loss_from_sums(psum_E, aux_counts_E, num_tokens, K)
        if "global_aux_loss" in self.coeffs:
            global_counts = self._global_counts(aux_counts_E, self.training and torch.is_grad_enabled())
            values["global_aux_loss"] = losses.aux_loss_from_sums(psum_E, global_counts, num_tokens, K)
        if "seq_aux_loss" in self.coeffs:
            values["seq_aux_loss"] = losses.sequence_aux_loss_from_sums(sums.psum_GE, sums.aux_counts_GE, tokens_G, K)
        if self.cfg.z_loss_coeff:
            values["z_loss"] = sums.zsum_G.sum() / num_tokens.clamp(min=1.0)
        return self._weighted_total(values), {k: v.detach().float() for k, v in values.items()}

    def _weighted_total(self, values: dict[str, torch.Tensor]) -> torch.Tensor:
        """sum of coefficient * loss over the enabled routing losses (fp32 scalar)."""
        total = next(iter(values.values())).new_zeros(())
        for name, coeff in self.coeffs.items():
            total = total + coeff * values[name]
        if self.cfg.z_loss_coeff:
            total = total + self.cfg.z_loss_coeff * values["z_loss"]
        return total.float()

    @torch.no_grad()
    def _global_counts(self, counts_E: torch.Tensor, training: bool) -> torch.Tensor:
        """Counts for global_aux_loss: the average per micro-batch of this step's counts (see losses.py).

        `training`: a training forward with gradients (eval / no-grad forwards use this micro-batch only).
        """
        if not training:
            return counts_E
        memo = self.recompute_memo
        if _in_backward():
            # Recomputation of a checkpointed layer: reuse what the original forward used (its call's dict; or
            # FIFO order, which holds where each forward is recomputed once, in forward order).
            if memo is not None and "global_counts" in memo:
                return memo["global_counts"]
            if self._global_counts_used:
                return self._global_counts_used.pop(0)
            return counts_E
        counts = counts_E.float()
        micro_batches = 1  # how many micro-batches `counts` covers
        if "global_aux_loss" in self.coeffs and self.dims is not None:
            # only communicate when the loss is in the objective; counts_E are the whole micro-batch's
            # (the same on every TP rank), so they are summed over the data-parallel replicas only, and
            # the average below divides by every replica's micro-batch
            counts = self.dims.all_reduce_dp(counts)
            micro_batches = self.dims.dp_cp_group.size
        self.global_tokens_per_expert += counts
        self.global_steps += micro_batches
        avg = (self.global_tokens_per_expert / self.global_steps).to(counts_E.dtype)
        if "global_aux_loss" in self.coeffs:
            if memo is not None:
                memo["global_counts"] = avg
            else:
                self._global_counts_used.append(avg)
        return avg

    @torch.no_grad()
    def _load_stats(
        self,
        idx_TK: torch.Tensor,
        keep_TK: torch.Tensor | None,
        valid_T: torch.Tensor | None,
        count: bool,
        tpe: torch.Tensor | None = None,
    ) -> dict[str, torch.Tensor]:
        """tokens_per_expert / imbalance / dropped_fraction; `count`: add the counts to the expert-bias tally.

        `tpe`: this rank's routed counts of valid tokens when already known (the fused router; no drops).
        """
        assigned = None
        if tpe is None:
            w = torch.ones(idx_TK.shape, dtype=torch.float32, device=idx_TK.device)
            if valid_T is not None:
                w = w * valid_T.float().unsqueeze(-1)
            assigned = w.sum()
            if keep_TK is not None:
                w = w * keep_TK.float()
            tpe = torch.zeros(self.num_experts, device=idx_TK.device)
            tpe = tpe.scatter_add_(0, idx_TK.reshape(-1), w.reshape(-1))
        if count:
            self.router.accumulate_tokens_per_expert(tpe)
        # statistics of the whole micro-batch (this rank routed one sequence chunk under tensor parallel)
        tpe = ep_util.sum_counts_over_tp(tpe, self.dims)
        mean = tpe.mean()
        # counts are >= 0, so mean == 0 means max == 0, and the ratio is 0 without a torch.where
        stats = {"tokens_per_expert": tpe, "imbalance": tpe.max() / mean.clamp(min=1e-12)}
        if assigned is None:  # the fused router's counts: nothing dropped (a few launches fewer per forward)
            stats["dropped_fraction"] = torch.zeros_like(mean)
        else:
            assigned = ep_util.sum_counts_over_tp(assigned, self.dims)
            stats["dropped_fraction"] = torch.where(
                assigned > 0, 1.0 - tpe.sum() / assigned.clamp(min=1.0), torch.zeros_like(mean)
            )
        return stats

    # ------------------------------------------------------------------ once per optimizer step
    def _sum_over_ranks(self, t: torch.Tensor) -> torch.Tensor:
        """Sum counts over every rank that routes distinct tokens (dp x cp x tp); identity on one process."""
        return t if self.dims is None else self.dims.all_reduce_moe_counts(t)

    @torch.no_grad()
    def update_expert_bias(self) -> None:
        """Call once per optimizer step: move the expert bias (if enabled), reset the step's counts."""
        if self.router.expert_bias is not None:
            self.router.update_expert_bias(self._sum_over_ranks(self.router.local_tokens_per_expert.clone()))
        self.global_tokens_per_expert.zero_()
        self.global_steps.zero_()
        self._global_counts_used.clear()


def update_expert_biases(model: nn.Module) -> None:
    """`update_expert_bias()` on every MoELayer inside `model` (once per optimizer step)."""
    for m in model.modules():
        if isinstance(m, MoELayer):
            m.update_expert_bias()
