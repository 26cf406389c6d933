"""QK-Clip (MuonClip, Kimi K2): bound each attention head's largest pre-softmax logit by rescaling its q/k weights.

With `optim.muon_qk_clip = tau > 0` every softmax-attention layer records, per head, the largest
logit S_h = scale * max_{b, i >= j} q_i . k_j it computed during the step (all micro-batches;
`record_max_logit`, called by the attention forward on its own heads: under tensor parallelism
each rank its heads). After the optimizer step `QKClip.apply` takes the maximum over the
data-parallel replicas (and context-parallel ranks), and for every head with S_h > tau sets
gamma_h = tau / S_h and rescales the weights producing that head's logits so that they shrink by
exactly gamma_h (Kimi K2 report, "QK-Clip"):

- multi-head attention (a key head per query head): q_h and k_h rows of q_proj / k_proj (and their
  biases) each by sqrt(gamma_h);
- grouped-query attention: a key head is shared by several query heads, so only the query head's
  rows are scaled, by gamma_h (heads of one group do not couple, as the report's rule for MLA's
  shared rotary key);
- multi-latent attention: the head-specific non-rotary query and key parts (q_proj / q_b_proj and
  kv_b_proj rows of the head's qk_nope dims) by sqrt(gamma_h), the head's rotary query part by
  gamma_h; the rotary key, shared by all heads (kv_a_proj_with_mqa), is not touched.

Heads at or below tau are unchanged. The recording costs one extra q k^T product per attention
layer in the forward (no gradient; in chunks of queries), only when the option is on. Parameters
that are FSDP2 shards are scaled on their local rows; master weights (mixed precision, the
distributed optimizer's shards) are scaled through the runtime's `master_weights_in_model`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from moecore.models.attention import Attention
from moecore.models.max_logit import head_max_logits, record_max_logit  # noqa: F401  (the recording half)
from moecore.models.mla import MLAttention


def _scale_rows(p: torch.Tensor, factor: torch.Tensor) -> None:
    """p[r] *= factor[r] for the rows this rank holds (a whole tensor, or its FSDP2 dim-0 chunk)."""
    local = p.to_local() if hasattr(p, "to_local") else p.data
    if hasattr(p, "device_mesh") and p.device_mesh.size() > 1:
        group = p.device_mesh.get_group()
        c = -(-p.shape[0] // dist.get_world_size(group))
        start = dist.get_rank(group) * c
        factor = factor[start : start + local.shape[0]]
    local.mul_(factor.to(local.dtype).view(-1, *([1] * (local.dim() - 1))))


def _rows(heads: int, per_head: int, parts: list[tuple[int, int, torch.Tensor]]) -> torch.Tensor:
    """Per-row factors of a [heads * per_head, ...] projection: rows [a, b) of head h get value[h]."""
    f = torch.ones(heads, per_head, device=parts[0][2].device)
    for a, b, value in parts:
        f[:, a:b] = value[:, None]
    return f.reshape(-1)


def _rescale(module: nn.Module, gamma: torch.Tensor) -> None:
    """Shrink every head's logits by gamma (per local head); see the module docstring for the rule."""
    if hasattr(module, "kv_b_proj"):  # multi-latent attention
        n, dn, dr, dv = module.num_heads, module.nope_dim, module.rope_dim, module.v_dim
        q = module.q_proj if module.q_lora_rank is None else module.q_b_proj
        _scale_rows(q.weight, _rows(n, dn + dr, [(0, dn, gamma.sqrt()), (dn, dn + dr, gamma)]))
        _scale_rows(module.kv_b_proj.weight, _rows(n, dn + dv, [(0, dn, gamma.sqrt())]))
        return
    d, hq, hk = module.head_dim, module.num_heads, module.num_kv_heads
    per_q = 2 * d if module.cfg.attn_output_gate else d  # per head: query channels, then gate channels
    q_gamma = gamma.sqrt() if hq == hk else gamma
    for t in (module.q_proj.weight, module.q_proj.bias):
        if t is not None:
            _scale_rows(t, _rows(hq, per_q, [(0, d, q_gamma)]))
    if hq == hk:
        for t in (module.k_proj.weight, module.k_proj.bias):
            if t is not None:
                _scale_rows(t, _rows(hk, d, [(0, d, gamma.sqrt())]))


class QKClip:
    """The attention layers of a model, their recorded max logits, and the post-step rescaling."""

    def __init__(self, model: nn.Module, tau: float, dims=None) -> None:
        self.tau, self.dims = float(tau), dims
        self.layers = [m for m in model.modules() if isinstance(m, (Attention, MLAttention))]
        self.last_max_logit = float("nan")
        self.clipped_heads = 0
        for m in self.layers:
            m.qk_max = self._empty(m)

    @staticmethod
    def _empty(m: nn.Module) -> torch.Tensor:
        device = next(m.parameters()).device
        return torch.full((m.num_heads,), float("-inf"), device=device)

    @torch.no_grad()
    def apply(self, weights_context: Callable[[], contextlib.AbstractContextManager] | None = None) -> float:
        """Rescale the heads above tau (collective over the world); returns the step's max logit."""
        if not self.layers:
            return float("nan")
        maxes = torch.stack([m.qk_max for m in self.layers])  # [layers, local heads]
        dims = self.dims
        if dims is not None and dims.dp_cp_group.size > 1:  # replicas saw other tokens
            dist.all_reduce(maxes, op=dist.ReduceOp.MAX, group=dims.dp_cp_group.pg)
        top = maxes.max().reshape(1).clone()
        if dims is not None and dims.world_group.size > 1:  # other TP heads, other pipeline stages
            dist.all_reduce(top, op=dist.ReduceOp.MAX, group=dims.world_group.pg)
        self.last_max_logit = float(top)
        over = maxes > self.tau
        self.clipped_heads = int(over.sum())
        if self.last_max_logit > self.tau:  # the same decision on every rank (the context may be collective)
            gamma = torch.where(over, self.tau / maxes.clamp(min=self.tau), torch.ones_like(maxes))
            with weights_context() if weights_context is not None else contextlib.nullcontext():
                for m, g in zip(self.layers, gamma):
                    if bool((g < 1).any()):
                        _rescale(m, g)
        for m in self.layers:
            m.qk_max = self._empty(m)
        return self.last_max_logit
