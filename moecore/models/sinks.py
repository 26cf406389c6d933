"""Attention with sinks (gpt-oss): a learned logit per head that joins the softmax denominator only.

For query i of head h with causal (optionally windowed) scores s_ij = q_i . k_j * scale:

    p_ij = exp(s_ij) / (exp(sink_h) + sum_j' exp(s_ij'))        out_i = sum_j p_ij v_j

The sink takes probability mass and gives nothing back (its value is zero), so a head can attend to
"nothing". Writing lse_i = log sum_j exp(s_ij) for the usual log-sum-exp over the visible keys,

    out_i = softmax-attention(q, k, v)_i * Z_i / (Z_i + exp(sink_h)) = attention_i * sigmoid(lse_i - sink_h)

which is exact and differentiable in the sink, the scores and the values as long as the attention kernel
returns lse with a gradient. Three implementations of the same maths:
- `sink_attention_reference`: the scores as a [B, heads, S, S] tensor (eager PyTorch; CPU);
- `sink_attention_sdpa`: scaled_dot_product_attention with one extra key per head holding the sink. Queries
  get one more channel equal to 1, keys a 0 there, and the sink key is (0, ..., 0, sink_h / scale) with a
  zero value, placed first; the causal mask aligned to the bottom right (`causal_lower_right`) lets query t
  see the sink and keys 0..t, so flash / cuDNN kernels run it (full layers; windows need a boolean mask).
  The channel is padded to a multiple of 8 for those kernels;
- `sink_attention_flex`: torch's flex_attention (compiled) with a block mask (causal / sliding window, no [S, S]
  tensor) returning lse, then the sigmoid rescaling above (no backward on CPU).
`sink_attention` takes the reference on CPU; on CUDA the SDPA path for full layers and flex_attention for
sliding windows (which it skips block by block). tests/models/test_sinks.py checks SDPA against the
reference on CPU, and both GPU paths on a GPU. A fused Triton kernel that adds exp(sink) to the running
denominator of a flash-attention loop would avoid the padded copies of q and k.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F


def sink_attention_reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor, window: int | None, scale: float
) -> torch.Tensor:
    """q [B, Hq, S, D], k/v [B, Hkv, S, D] (Hkv divides Hq), sinks [Hq] -> [B, Hq, S, D]."""
    if k.shape[1] != q.shape[1]:
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    s = q.shape[2]
    scores = torch.matmul(q, k.transpose(-1, -2)).float() * scale
    i = torch.arange(s, device=q.device)[:, None]
    j = torch.arange(s, device=q.device)[None, :]
    visible = j <= i
    if window is not None:
        visible = visible & (j > i - window)
    scores = scores.masked_fill(~visible, float("-inf"))
    sink = sinks.float().view(1, -1, 1, 1).expand(scores.shape[0], -1, s, 1)
    logits = torch.cat((scores, sink), dim=-1)
    probs = torch.softmax(logits - logits.amax(dim=-1, keepdim=True), dim=-1)[..., :-1]
    return torch.matmul(probs.to(v.dtype), v)


@functools.lru_cache(maxsize=32)
def _block_mask(seq: int, window: int | None, device: str):
    from torch.nn.attention.flex_attention import create_block_mask

    def mask(b, h, qi, ki):
        keep = ki <= qi
        return keep if window is None else keep & (ki > qi - window)

    return create_block_mask(mask, None, None, seq, seq, device=device)


@functools.cache
def compiled_flex_attention():
    """torch's flex_attention compiled once per process (uncompiled, it runs an unfused reference that holds the
    whole score matrix)."""
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


def sink_attention_flex(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor, window: int | None, scale: float
) -> torch.Tensor:
    """Same as `sink_attention_reference` through flex_attention (CUDA): attention * sigmoid(lse - sink)."""
    from torch.nn.attention.flex_attention import AuxRequest

    mask = _block_mask(q.shape[2], window, str(q.device))
    gqa = k.shape[1] != q.shape[1]
    flex = compiled_flex_attention()
    out, aux = flex(q, k, v, block_mask=mask, scale=scale, enable_gqa=gqa, return_aux=AuxRequest(lse=True))
    gate = torch.sigmoid(aux.lse.float() - sinks.float().view(1, -1, 1))  # [B, Hq, S]
    return (out.float() * gate.unsqueeze(-1)).to(q.dtype)


def sink_attention_sdpa(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor, window: int | None, scale: float
) -> torch.Tensor:
    """Same as `sink_attention_reference` through scaled_dot_product_attention with a sink key (module doc)."""
    from torch.nn.attention.bias import causal_lower_right

    b, h, s, d = q.shape
    if k.shape[1] != h:
        rep = h // k.shape[1]
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    pad = 8  # one channel for the sink, padded so that d + pad keeps d's multiple of 8
    extra_q = torch.cat((q.new_ones(b, h, s, 1), q.new_zeros(b, h, s, pad - 1)), dim=-1)
    q1 = torch.cat((q, extra_q), dim=-1)
    k1 = torch.cat((k, k.new_zeros(b, h, s, pad)), dim=-1)
    sink_key = (sinks.to(q.dtype) / scale).view(1, h, 1, 1).expand(b, h, 1, 1)
    ks = torch.cat((q.new_zeros(b, h, 1, d), sink_key, q.new_zeros(b, h, 1, pad - 1)), dim=-1)
    k2 = torch.cat((ks, k1), dim=2)
    v2 = torch.cat((v.new_zeros(b, h, 1, v.shape[-1]), v), dim=2)
    if window is None:
        mask = causal_lower_right(s, s + 1)
    else:
        i = torch.arange(s, device=q.device)[:, None]
        j = torch.arange(s, device=q.device)[None, :]
        visible = (j <= i) & (j > i - window)
        mask = torch.cat((torch.ones(s, 1, dtype=torch.bool, device=q.device), visible), dim=1)
    return F.scaled_dot_product_attention(q1, k2, v2, attn_mask=mask, scale=scale)


def sink_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor, window: int | None, scale: float
) -> torch.Tensor:
    """Causal (optionally windowed) attention with per-head sinks: on CUDA through SDPA (full layers) or
    flex_attention (sliding windows), else the reference."""
    if q.is_cuda:
        if window is None:
            return sink_attention_sdpa(q, k, v, sinks, window, scale)
        return sink_attention_flex(q, k, v, sinks, window, scale)
    return sink_attention_reference(q, k, v, sinks, window, scale)
