"""MoE blocks whose experts are not the plain SwiGLU: gpt-oss's (a router with a learned logit bias, experts with
biased projections and the clamped SwiGLU) and DeepSeek-V4's (no biases, the clipped SwiGLU, also in the shared
expert). Built on MoELayer (routing, dispatch, balancing losses, expert parallel are unchanged).

DeepSeek-V4's clipped SwiGLU (`model.activation=swiglu_clipped`, limit = model.swiglu_limit):

    a = silu(min(g, limit)) * clamp(u, -limit, limit)

Its experts have no biases, so they stay the plain GroupedExperts with `swiglu_limit` set: every expert path
(the fused expert FFN with QuACK's or Triton's GEMMs, the low-memory modes, FP8) takes the clip in its SwiGLU
kernel (moecore/kernels/swiglu.py). gpt-oss's experts, below, are BiasedGroupedExperts:

Expert e applied to a row x (our layout: `w13` [E, 2F, H] gate rows then up rows, `b13` [E, 2F] the same
order, `w2` [E, H, F], `b2` [E, H]):

    [g; u] = w13[e] @ x + b13[e]
    g = min(g, limit);  u = clamp(u, -limit, limit)
    a = (u + 1) * g * sigmoid(alpha * g)                 (alpha = model.swiglu_alpha, limit = model.swiglu_limit)
    y = w2[e] @ a + b2[e]

(transformers' GptOssExperts; its checkpoints interleave gate and up columns, moecore/hf/families/gpt_oss.py
reorders them.) Router: logits = x @ W^T + bias, then the configured top-k routing (gpt-oss: softmax over
the top-k logits).

On CUDA they run the fused expert FFN (moecore/kernels/grouped_ffn.py: QuACK's or Triton's grouped GEMMs, the
biases added per row from the row's expert, the clamped form in the SwiGLU kernel), and so do
`moe.activation_memory=minimal | chunked` (moecore/moe/minimal.py, chunked.py), `moe.sync_free` and the FP8 expert
FFN (moecore/kernels/fp8_grouped.py); elsewhere the grouped GEMMs
(`torch._grouped_mm`, the activation through autograd) where grouped_mm runs, else a loop of per-expert linears.
Expert parallel shards the biases with their experts. Expert tensor parallel splits `b13` with the FFN columns and `b2` over its hidden
columns: the down projection's output is a partial sum over the etp ranks (summed by the dispatcher), so
each etp rank adds only its own H / etp columns of `b2`, and the sum holds the whole bias once; each column's
gradient is then this rank's complete gradient of it, an expert shard like any other.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from moecore.config import Config
from moecore.kernels.fp8_grouped import fp8_expert_ffn
from moecore.kernels.grouped_ffn import expert_ffn, fused_expert_ffn_available
from moecore.moe import expert_parallel as ep_util
from moecore.moe.experts import GroupedExperts, _ContiguousGrad, activation_fn, grouped_mm_supported
from moecore.moe.layer import MoELayer
from moecore.moe.router import TopKRouter
from moecore.parallel.sharding import set_shard


def clamped_swiglu(h: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """[.., 2F] (gate half then up half) -> [.., F]: (clamp(u) + 1) * g' * sigmoid(alpha * g'), g' = min(g, limit)."""
    g, u = h.chunk(2, dim=-1)
    g = g.clamp(max=limit)
    u = u.clamp(min=-limit, max=limit)
    return (u + 1) * (g * torch.sigmoid(alpha * g))


class BiasedGroupedExperts(GroupedExperts):
    """GroupedExperts with `activation` swiglu | swiglu_clamped (gpt-oss), plus `b13` [E, 2F] and `b2` [E, H]."""

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        ffn_hidden_size: int,
        activation: str,
        alpha: float,
        limit: float,
        init_std: float = 0.02,
        grouped_gemm: bool = True,
    ) -> None:
        super().__init__(num_experts, hidden_size, ffn_hidden_size, "swiglu", init_std, grouped_gemm)
        self.kind, self.alpha, self.limit = activation, alpha, limit
        self.b13 = nn.Parameter(torch.zeros(num_experts, 2 * ffn_hidden_size))
        self.b2 = nn.Parameter(torch.zeros(num_experts, hidden_size))
        self.b2_columns: tuple[int, int] | None = None  # expert tensor parallel: the hidden columns b2 holds

    def reset_parameters(self) -> None:
        """Matrices N(0, init_std) as GroupedExperts does at construction; biases zero."""
        nn.init.zeros_(self.b13)
        nn.init.zeros_(self.b2)

    def _act(self, h: torch.Tensor, p: torch.Tensor | None) -> torch.Tensor:
        if self.kind == "swiglu_clamped":
            a = clamped_swiglu(h, self.alpha, self.limit)
        else:
            a = activation_fn(h, "swiglu")
        return a if p is None else a * p.to(a.dtype).unsqueeze(-1)

    def _down_bias(self, dtype: torch.dtype) -> torch.Tensor:
        """b2 [E, H] as this rank adds it: under expert tensor parallel its own columns, zero elsewhere."""
        b2 = self.b2.to(dtype)
        if self.b2_columns is None:
            return b2
        c0, c1 = self.b2_columns
        return F.pad(b2, (c0, self.hidden_size - c1))

    def swiglu_options(self) -> dict:
        """The clamped form (when `kind` is swiglu_clamped) and the biases, as the expert Functions take them; b2 as
        this rank adds it (`_down_bias`)."""
        clamped = self.kind == "swiglu_clamped"
        return {
            "limit": self.limit if clamped else None,
            "alpha": self.alpha if clamped else None,
            "b13": self.b13,
            "b2": self._down_bias(self.b2.dtype),
        }

    def _activate(self, h: torch.Tensor, p: torch.Tensor | None) -> torch.Tensor:
        if self.recompute_act and torch.is_grad_enabled() and h.requires_grad:
            return checkpoint(self._act, h, p, use_reentrant=False)
        return self._act(h, p)

    def forward(
        self, x_NH: torch.Tensor, tokens_per_expert: torch.Tensor, probs_N: torch.Tensor | None = None
    ) -> torch.Tensor:
        # Routing probabilities applied inside (moe.apply_probs_on_input) scale the down bias too:
        # p * (w2 a + b2) = w2 (p a) + p b2.
        n = x_NH.shape[0]
        if self.fp8_recipe is not None:  # FP8 expert FFN (moecore/kernels/fp8_grouped.py), biases added per row
            self.last_path = "fp8"
            return fp8_expert_ffn(
                x_NH, self.w13, self.w2, tokens_per_expert, probs_N, self.fp8_recipe, self.gemm_backend,
                **self.swiglu_options(),
            )  # fmt: skip
        if x_NH.is_cuda and not self.warned:
            self._warn_slow_path(x_NH)
        if fused_expert_ffn_available(x_NH) and self.uses_grouped_mm(x_NH):
            self.last_path = "fused"
            return expert_ffn(
                x_NH, self.w13, self.w2, tokens_per_expert.to(x_NH.device), probs_N, self.gemm_plan,
                sync_free=self.sync_free, backend=self.gemm_backend, load_spread=self.load_spread,
                **self.swiglu_options(),
            )  # fmt: skip
        if self.grouped_gemm and grouped_mm_supported(x_NH, self.hidden_size, self.ffn_hidden_size):
            self.last_path = "grouped_mm"
            counts = tokens_per_expert.to(x_NH.device)
            offs = torch.cumsum(counts, 0, dtype=torch.int32)
            expert_N = torch.repeat_interleave(
                torch.arange(self.num_experts, device=x_NH.device), counts, output_size=n
            )
            x = x_NH.contiguous()
            h = _ContiguousGrad.apply(torch._grouped_mm(x, self.w13.to(x.dtype).transpose(-2, -1), offs=offs))
            h = h + self.b13.to(h.dtype)[expert_N]
            a = self._activate(h, probs_N)
            y = _ContiguousGrad.apply(torch._grouped_mm(a, self.w2.to(a.dtype).transpose(-2, -1), offs=offs))
            b2 = self._down_bias(y.dtype)[expert_N]
            return y + (b2 if probs_N is None else b2 * probs_N.to(y.dtype).unsqueeze(-1))
        self.last_path = "loop"
        outs, start = [], 0
        # per-expert views made once (unbind): indexing w[e] per expert would add a full-size zero gradient each
        w13, b13, w2 = self.w13.unbind(0), self.b13.unbind(0), self.w2.unbind(0)
        b2s = self._down_bias(self.b2.dtype).unbind(0)
        for e, rows in enumerate(tokens_per_expert.tolist()):
            if rows == 0:
                continue
            seg = x_NH[start : start + rows]
            p = None if probs_N is None else probs_N[start : start + rows]
            a = self._activate(F.linear(seg, w13[e].to(seg.dtype), b13[e].to(seg.dtype)), p)
            y = F.linear(a, w2[e].to(a.dtype))
            b2 = b2s[e].to(y.dtype)
            outs.append(y + (b2 if p is None else b2 * p.to(y.dtype).unsqueeze(-1)))
            start += rows
        return torch.cat(outs, dim=0) if outs else x_NH.new_zeros(0, self.hidden_size)


class BiasedTopKRouter(TopKRouter):
    """TopKRouter whose logits carry a learned bias [E] (gpt-oss's `router.bias`)."""

    def __init__(self, cfg, hidden_size: int, init_std: float = 0.02) -> None:
        super().__init__(cfg, hidden_size, init_std)
        self.bias = nn.Parameter(torch.zeros(cfg.num_experts))

    def router_logits(self, x_TH: torch.Tensor) -> torch.Tensor:
        logits = super().router_logits(x_TH)
        return logits + self.bias.to(logits.dtype)


class BiasedMoELayer(MoELayer):
    """MoELayer with gpt-oss's router bias (`model.router_logit_bias`) and biased, clamped-SwiGLU experts, or with
    DeepSeek-V4's clipped-SwiGLU experts and shared experts (`model.activation=swiglu_clipped`)."""

    def __init__(self, cfg: Config, dims=None, recompute_act: bool = False, recompute_shared: bool = False) -> None:
        m, e = cfg.model, cfg.moe
        if dims is not None and m.expert_linear_bias and m.hidden_size % dims.etp:
            raise ValueError(f"parallel.etp={dims.etp} does not divide model.hidden_size={m.hidden_size}")
        super().__init__(e, m.hidden_size, "swiglu", m.init_std, dims, recompute_act, recompute_shared)
        if m.router_logit_bias:
            self.router = BiasedTopKRouter(e, m.hidden_size, m.init_std)
            ep_util.mark_replicated_moe_params([self.router], dims)
        if m.expert_linear_bias:
            old = self.experts
            self.experts = BiasedGroupedExperts(
                old.num_experts, old.hidden_size, old.ffn_hidden_size, m.activation,
                m.swiglu_alpha, m.swiglu_limit, m.init_std, e.grouped_gemm,
            )  # fmt: skip
            # what MoELayer set on the experts it built: recomputation, moe.sync_free, moe.gemm_backend
            for attr in ("recompute_act", "sync_free", "gemm_backend"):
                setattr(self.experts, attr, getattr(old, attr))
            ep_util.shard_expert_params(self.experts.w13, self.experts.w2, e.num_experts, e.ffn_hidden_size, True, dims)
            self._shard_biases(e.num_experts, dims)
        elif m.activation == "swiglu_clipped":  # DeepSeek-V4: the plain experts, clipped in the SwiGLU kernel
            self.experts.swiglu_limit = m.swiglu_limit
        if m.activation == "swiglu_clipped" and self.shared_experts is not None:
            self.shared_experts.clip_limit = m.swiglu_limit

    def _shard_biases(self, num_experts: int, dims) -> None:
        """b13 [E, 2F] split as w13's rows (experts over ep, FFN columns over etp); b2 [E, H] experts over ep, hidden
        columns over etp (see the module docstring)."""
        ex = self.experts
        e_loc, f_loc, h = ex.num_experts, ex.ffn_hidden_size, ex.hidden_size
        e0 = 0 if dims is None else dims.ep_group.rank * e_loc
        etp, etp_rank = (1, 0) if dims is None else (dims.etp, dims.etp_group.rank)
        f = f_loc * etp
        set_shard(
            ex.b13, "expert", global_shape=(num_experts, 2 * f), view_shape=(num_experts, 2, f),
            local_view=(e_loc, 2, f_loc), offsets=(e0, 0, etp_rank * f_loc),
        )  # fmt: skip
        if etp == 1:
            set_shard(ex.b2, "expert", global_shape=(num_experts, h), offsets=(e0, 0))
            return
        cols = h // etp
        ex.b2 = nn.Parameter(torch.zeros(e_loc, cols, device=ex.b2.device, dtype=ex.b2.dtype))
        ex.b2_columns = (etp_rank * cols, (etp_rank + 1) * cols)
        set_shard(ex.b2, "expert", global_shape=(num_experts, h), offsets=(e0, etp_rank * cols))
