"""Load-balancing and router-stability losses, as pure functions of the router's outputs.

Legend: T tokens (valid ones only count), E experts, K experts per token, B sequences, S positions.
All losses are returned *without* their coefficient; MoELayer multiplies by `moe.aux_loss_coeff`
(one per balancing type) and `moe.z_loss_coeff`. Padding tokens (loss mask 0) are excluded by
zeroing their rows in `scores` and leaving them out of the counts and of T.

Conventions follow Megatron-Core (`switch_load_balancing_loss_func`, `z_loss_func`, router.py):

aux_loss (Switch Transformer, Fedus et al. 2021, eq. 4-6; GShard, Lepikhin et al. 2020):
    L = E * sum_i f_i * P_i,   f_i = c_i / (K * T),   P_i = (1/T) * sum_t p_{t,i}
  c_i: token-expert assignments to expert i in the micro-batch, p: `scores_for_balancing` (softmax
  over all experts, or sigmoid scores normalised per token). L = 1 for a perfectly uniform router.
  The counts c come from a plain top-k of those scores (no groups, no expert bias, no capacity
  drops), as in Megatron-Core; they are constants (no gradient), the gradient flows through P.
  Hugging Face's `load_balancing_loss_func` uses f_i = c_i / T, i.e. K times this value.

seq_aux_loss (DeepSeek-V2, Dai et al. 2024, sec. 3.3.1; DeepSeek-V3 eq. 17-20): the same formula
  applied to each sequence separately (T = that sequence's valid tokens), then averaged over the
  sequences that hold at least one valid token. DeepSeek writes f'_i = E c_i / (K T) and
  L = sum_i f'_i P_i, which is the same number. Without padding this equals Megatron-Core's value.

global_aux_loss (Qiu et al. 2025, "Demons in the Detail: ... Global-Batch Load Balance"): the aux
  loss with c_i replaced by the counts accumulated over every micro-batch of the current optimizer
  step so far (and over data-parallel ranks when there are several), averaged per micro-batch:
    L = E / (K T^2) * sum_i (sum_t p_{t,i}) * (C_i / n)
  where C_i is the running sum of c_i over the n micro-batches seen this step (this one included)
  and T is this micro-batch's token count. The counts reset at each optimizer step
  (MoELayer.update_expert_bias). Exactly Megatron-Core's `_apply_global_aux_loss`.

z_loss (ST-MoE, Zoph et al. 2022, eq. 5): L = (1/T) * sum_t (logsumexp_i logits_{t,i})^2.

Scaling: MoELayer returns coefficient * L per micro-batch; the model adds it to that micro-batch's
mean LM loss, so the training loop's 1/num_micro_batches applies to both, the same gradient scale as
Megatron-Core's MoEAuxLossAutoScaler without per-token loss.
"""

from __future__ import annotations

import torch


def topk_counts(scores_TE: torch.Tensor, topk: int, valid_T: torch.Tensor | None = None) -> torch.Tensor:
    """c_i: how many valid tokens have expert i among the top-k of `scores` (float [E], no gradient)."""
    with torch.no_grad():
        idx_TK = scores_TE.topk(topk, dim=-1).indices
        w = torch.ones_like(idx_TK, dtype=scores_TE.dtype)
        if valid_T is not None:
            w = w * valid_T.to(w.dtype).unsqueeze(-1)
        return torch.zeros(scores_TE.shape[-1], dtype=scores_TE.dtype, device=scores_TE.device).scatter_add_(
            0, idx_TK.reshape(-1), w.reshape(-1)
        )


def aux_loss_from_sums(
    psum_E: torch.Tensor, counts_E: torch.Tensor, num_tokens: torch.Tensor | float, topk: int
) -> torch.Tensor:
    """E / (K T^2) * sum_i P_i * c_i from the per-expert sums P_i = sum_t p_{t,i} (valid tokens) and counts c_i."""
    E = psum_E.shape[-1]
    T = torch.as_tensor(num_tokens, dtype=psum_E.dtype, device=psum_E.device).clamp(min=1.0)
    return (psum_E * counts_E.to(psum_E.dtype)).sum() * E / (topk * T * T)


def switch_aux_loss(
    scores_TE: torch.Tensor, counts_E: torch.Tensor, num_tokens: torch.Tensor | float, topk: int
) -> torch.Tensor:
    """E / (K T^2) * sum_i (sum_t p_{t,i}) * c_i; rows of padding tokens in `scores_TE` must be zero."""
    return aux_loss_from_sums(scores_TE.sum(dim=0), counts_E, num_tokens, topk)


def sequence_aux_loss(scores_BSE: torch.Tensor, topk: int, valid_BS: torch.Tensor | None = None) -> torch.Tensor:
    """Mean over sequences of the per-sequence aux loss (padding rows of `scores_BSE` must be zero)."""
    B, S, E = scores_BSE.shape
    with torch.no_grad():
        idx = scores_BSE.topk(topk, dim=-1).indices  # [B, S, K]
        w = torch.ones_like(idx, dtype=scores_BSE.dtype)
        if valid_BS is not None:
            w = w * valid_BS.to(w.dtype).unsqueeze(-1)
        counts_BE = torch.zeros(B, E, dtype=scores_BSE.dtype, device=scores_BSE.device)
        counts_BE.scatter_add_(1, idx.reshape(B, -1), w.reshape(B, -1))
        tokens_B = w[..., 0].sum(dim=1)
    return sequence_aux_loss_from_sums(scores_BSE.sum(dim=1), counts_BE, tokens_B, topk)


def sequence_aux_loss_from_sums(
    psum_BE: torch.Tensor, counts_BE: torch.Tensor, tokens_B: torch.Tensor, topk: int
) -> torch.Tensor:
    """Mean over the sequences with valid tokens of E / (K T_b^2) * sum_i P_{b,i} c_{b,i} (per-sequence sums)."""
    E = psum_BE.shape[-1]
    tokens_B = tokens_B.to(psum_BE.dtype)
    has_tokens_B = tokens_B > 0
    per_seq = (psum_BE * counts_BE.to(psum_BE.dtype)).sum(dim=1) * E / (topk * tokens_B.clamp(min=1.0) ** 2)
    n_seq = has_tokens_B.sum().clamp(min=1)
    return (per_seq * has_tokens_B).sum() / n_seq


def z_loss(logits_TE: torch.Tensor, valid_T: torch.Tensor | None = None) -> torch.Tensor:
    """Mean over valid tokens of logsumexp(logits)^2 (ST-MoE router z-loss)."""
    z2 = torch.logsumexp(logits_TE, dim=-1).square()
    if valid_T is None:
        return z2.mean()
    v = valid_T.to(z2.dtype)
    return (z2 * v).sum() / v.sum().clamp(min=1.0)
