"""Context parallel for gated DeltaNet (Qwen3-Next's `linear_attention` layers), exact.

Layout (moecore/parallel/context.py): the sequence is cut into 2 * cp equal chunks and CP rank r holds
chunk r followed by chunk 2cp-1-r. Two things in the layer look across chunk boundaries:

1. The causal depthwise conv1d (kernel K) reads the K-1 tokens before each position. `causal_conv1d_cp`
   gives each local chunk the K-1 pre-conv tokens that precede it in the full sequence (zeros before
   chunk 0): every rank contributes the last min(K-1, L) tokens of both its chunks (L the chunk length),
   one all-gather over CP (2 * cp * (K-1) tokens, backward: reduce-scatter, so the neighbour's
   tail gets its gradient) and each chunk takes the K-1 tokens before it from the gathered tails in
   sequence order. With L >= K-1 that is exactly the tail of the predecessor chunk; with L < K-1
   the tails are whole chunks, so the window reaches back over several of them.

2. The recurrence. In the orientation of this code (state S [Dk, Dv] per value head, o_t = S_t^T q_t):

       S_t = e^{g_t} (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T

   (the transpose of the [Dv, Dk] form S_t = S_{t-1} e^{g_t} (I - beta_t k_t k_t^T) + beta_t v_t k_t^T)
   is affine in S_{t-1}, so a chunk c of tokens maps its start state to its end state affinely,

       S_end = A_c S_start + B_c,   A_c = prod_{t in c, last first} e^{g_t} (I - beta_t k_t k_t^T)  [Dk, Dk],
                                    B_c = the end state from S_start = 0                             [Dk, Dv],

   and each output is affine in S_start too: o_t = o_t|0 + S_start^T qt_t, with o_t|0 the output from a
   zero start and qt_t = (prod_{s<=t in c} e^{g_s} (I - beta_s k_s k_s^T))^T q_t (scaled), the read-out of
   the start state. Both pieces come from the chunked rule itself (`gated_delta_rule_cp`):
     pass 1: the rule on (q, k, v) from S = 0 gives o|0 and B_c;
     pass 2: the rule on (q, k, 0) from S = I (values of width Dk) gives qt (its output) and A_c (its
             end state): with zero values the state stays A_{1..t} I and the output is A_{1..t}^T q_t.
   Each rank runs both passes for its two chunks (as two batch entries), all-gathers (A_c, B_c) of every
   chunk over CP (2 * cp * Hv * (Dk*Dk + Dk*Dv) numbers per sequence; backward: reduce-scatter, i.e.
   every rank's gradient of every chunk's (A, B) summed back to its owner), composes the start states
   in chunk order, S_0 = 0, S_{c+1} = A_c S_c + B_c, and adds S_c^T qt_t to o|0. Every step is an exact
   identity and autograd differentiates through all of it (the kernels' backward included), so outputs
   and gradients equal the single-sequence layer's up to rounding.

The correction is added in fp32 (float64 for float64 values); with bf16 values the zero-start output
has been rounded to bf16 first. The rule itself comes from the model layer
(`moecore.models.linear_attention.gated_delta_rule_with_state`: the Triton kernel on CUDA, which takes an
initial state, else the PyTorch chunked rule), so this module imports nothing from the models.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from moecore.parallel.comm import gather_from_sequence_parallel
from moecore.parallel.context import cp_chunk_ids
from moecore.parallel.dims import Group


def _chunk_owners(cp: int) -> tuple[list[int], list[int]]:
    """For each chunk c of 2*cp, in sequence order: the CP rank holding it and its local slot (0 or 1)."""
    owner = [c if c < cp else 2 * cp - 1 - c for c in range(2 * cp)]
    slot = [0 if c < cp else 1 for c in range(2 * cp)]
    return owner, slot


def _split_local(x: torch.Tensor) -> tuple[int, int]:
    """(batch, chunk length) of a local [B, 2L, ...] tensor (this rank's two chunks, concatenated)."""
    if x.shape[1] % 2:
        raise ValueError(f"local sequence length {x.shape[1]} is invalid under context parallel: must be even")
    return x.shape[0], x.shape[1] // 2


def causal_conv1d_cp(x: torch.Tensor, weight: torch.Tensor, group: Group) -> torch.Tensor:
    """Causal depthwise conv1d of the full sequence, evaluated at this rank's tokens.

    x: [B, 2L, C] (this rank's chunks r and 2cp-1-r); weight: [C, 1, K] (nn.Conv1d's, groups=C, no bias).
    Returns [B, 2L, C], equal to `F.conv1d(F.pad(full^T, (K-1, 0)), weight, groups=C)` at these positions.
    """
    b, length = _split_local(x)
    ch, kernel = x.shape[-1], weight.shape[-1]
    chunks = x.view(b, 2, length, ch)
    if kernel > 1:
        cp, halo = group.size, kernel - 1
        m = min(halo, length)
        tails = chunks[:, :, length - m :].unsqueeze(0)  # [1, B, 2, m, C]
        every = gather_from_sequence_parallel(tails, group, dim=0)  # [cp, B, 2, m, C], rank order
        owner, slot = (torch.tensor(i, device=x.device) for i in _chunk_owners(cp))
        ordered = every[owner, :, slot].transpose(0, 1).reshape(b, 2 * cp * m, ch)  # tails in sequence order
        # Left-pad with K-1 zeros: the window before chunk c is then padded[c*m : c*m + K-1] (with m = K-1
        # the tail of chunk c-1; with m = L < K-1 the K-1 tokens of the full sequence before chunk c).
        padded = F.pad(ordered, (0, 0, halo, 0))
        first, second = cp_chunk_ids(cp, group.rank)
        before = torch.stack([padded[:, c * m : c * m + halo] for c in (first, second)], dim=1)  # [B, 2, K-1, C]
        chunks = torch.cat([before, chunks], dim=2)
    y = F.conv1d(chunks.reshape(2 * b, -1, ch).transpose(1, 2), weight, groups=ch)  # [2B, C, L]
    return y.transpose(1, 2).reshape(b, 2 * length, ch)


def gated_delta_rule_cp(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    chunk_size: int = 64,
    backend: str = "auto",
    *,
    group: Group,
    rule: Callable[..., tuple[torch.Tensor, torch.Tensor]],
) -> torch.Tensor:
    """The gated delta rule of the full sequence, at this CP rank's tokens (see the module docstring).

    Arguments as `moecore.models.linear_attention.gated_delta_rule`, with the local tensors: q, k
    [B, 2L, Hk, Dk], v [B, 2L, Hv, Dv], g, beta [B, 2L, Hv], holding chunks r and 2cp-1-r of the
    sequence; `rule(q, k, v, g, beta, scale, chunk_size, backend, initial_state) -> (o, final state)` is the
    chunked rule with a start state (the model's `gated_delta_rule_with_state`). Returns o [B, 2L, Hv, Dv]
    in v's dtype.
    """
    b, length = _split_local(v)
    hv, dk, dv = v.shape[2], k.shape[-1], v.shape[-1]

    def fold(t: torch.Tensor) -> torch.Tensor:  # [B, 2L, ...] -> [2B, L, ...]: entry 2b + j is chunk slot j
        return t.reshape(2 * b, length, *t.shape[2:])

    q2, k2, v2, g2, beta2 = (fold(t) for t in (q, k, v, g, beta))
    # Pass 1: zero start state -> o|0 and B_c. Pass 2: values 0, start state I -> qt (output) and A_c.
    o0, b_c = rule(q2, k2, v2, g2, beta2, scale, chunk_size, backend, None)
    zeros = torch.zeros(
        2 * b, length, hv, dk, device=v.device, dtype=torch.float64 if v.dtype == torch.float64 else torch.float32
    )
    eye = torch.eye(dk, device=v.device, dtype=zeros.dtype).expand(2 * b, hv, dk, dk)
    qt, a_c = rule(q2, k2, zeros, g2, beta2, scale, chunk_size, backend, eye)
    work = qt.dtype
    cp = group.size
    ab = torch.cat([a_c.to(work), b_c.to(work)], dim=-1).view(1, b, 2, hv, dk, dk + dv)
    every = gather_from_sequence_parallel(ab, group, dim=0)  # [cp, B, 2, Hv, Dk, Dk + Dv]
    first, second = cp_chunk_ids(cp, group.rank)
    owner, slot = _chunk_owners(cp)
    state = v.new_zeros(b, hv, dk, dv, dtype=work)  # S_0 = 0
    starts = {}
    for c in range(second + 1):  # chunks before my later one: S_{c+1} = A_c S_c + B_c
        if c in (first, second):
            starts[c] = state
        if c < second:
            a_m, b_m = every[owner[c], :, slot[c]].split([dk, dv], dim=-1)
            state = a_m @ state + b_m
    s0 = torch.stack([starts[first], starts[second]], dim=1).reshape(2 * b, hv, dk, dv)
    o = o0.to(work) + torch.einsum("nlhk,nhkv->nlhv", qt, s0)  # o_t = o_t|0 + S_start^T qt_t
    return o.to(v.dtype).reshape(b, 2 * length, hv, dv)
