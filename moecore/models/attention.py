"""Grouped-query self-attention (Mixtral, Qwen2/3-MoE, Qwen3-Next full-attention layers).

Options that change the maths, each as the Hugging Face families define it:
- `qkv_bias` / `attn_out_bias`: biases on q/k/v and on o_proj (Qwen2-MoE has the former only);
- `qk_norm`: RMSNorm on q and k before RoPE, per head (Qwen3) or, with `qk_norm_scope=projection`, over
  the whole q (k) projection, every head's channels at once (MiniMax-M2; weight num_heads * head_dim wide;
  under tensor parallel the weight is split with the heads and the mean of squares is all-reduced);
- `attn_output_gate`: q_proj emits, per head, head_dim query channels followed by head_dim gate
  channels; the attention output is multiplied by sigmoid(gate) before o_proj (Qwen3-Next);
- `partial_rotary_factor`: RoPE on the first fraction of each head's channels;
- `sliding_window`: token t attends to keys t-window+1 .. t (with `layer_types`, only on the layers
  marked sliding_attention; gpt-oss alternates sliding and full layers);
- `attn_sinks`: a learned logit per head in the softmax denominator (gpt-oss; moecore/models/sinks.py).
Attention itself runs through torch's scaled_dot_product_attention with the backend chosen by
`model.attention_backend` (see `sdpa_backends`).
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from moecore.config import ModelConfig
from moecore.models.max_logit import record_max_logit
from moecore.models.norms import RMSNorm
from moecore.models.rope import RotaryEmbedding, apply_rotary
from moecore.parallel.cp_attention import context_parallel_attention
from moecore.parallel.sharding import mark_tp_partial, set_shard
from moecore.parallel.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    sharded_rms_norm,
    tp_region_input,
    tp_size,
)

_BACKENDS = {
    "flash": [SDPBackend.FLASH_ATTENTION],
    "cudnn": [SDPBackend.CUDNN_ATTENTION],
    "efficient": [SDPBackend.EFFICIENT_ATTENTION],
    "math": [SDPBackend.MATH],
}


def sdpa_backends(name: str, device: torch.device):
    """Context manager restricting SDPA to the named backend ('auto': flash, cuDNN, efficient on GPU).

    On GPU, 'auto' excludes the math kernel so that a supported shape never silently takes the slow
    path; an unsupported shape then raises instead of running at a fraction of the speed.
    """
    if device.type != "cuda":
        return contextlib.nullcontext()
    if name == "auto":
        return sdpa_kernel([SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION])
    return sdpa_kernel(_BACKENDS[name])


def causal_mask(seq: int, window: int | None, device: torch.device) -> torch.Tensor | None:
    """Boolean [S, S] mask (True = attend) for a sliding window; None means plain causal."""
    if window is None or window >= seq:
        return None
    q = torch.arange(seq, device=device)[:, None]
    k = torch.arange(seq, device=device)[None, :]
    return (k <= q) & (k > q - window)


def attention_core(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    window: int | None,
    backend: str,
    scale: float | None = None,
    dropout_p: float = 0.0,
) -> torch.Tensor:
    """softmax(q k^T * scale) v with causal (optionally windowed) masking; q/k/v are [B, heads, S, D].

    k and v may have fewer heads than q (grouped-query attention); they are expanded here.
    """
    if k.shape[1] != q.shape[1]:
        rep = q.shape[1] // k.shape[1]
        k = k.repeat_interleave(rep, dim=1)
        v = v.repeat_interleave(rep, dim=1)
    mask = causal_mask(q.shape[2], window, q.device)
    with sdpa_backends(backend, q.device):
        if mask is None:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, dropout_p=dropout_p)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, dropout_p=dropout_p)


class Attention(nn.Module):
    """Multi-head attention with grouped key/value heads."""

    def __init__(self, cfg: ModelConfig, layer_idx: int, dims=None) -> None:
        super().__init__()
        self.cfg = cfg
        self.layer_idx = layer_idx
        self.dims = dims
        self.head_dim = cfg.resolved_head_dim
        # Tensor parallel: each rank computes num_heads / tp query heads and num_kv_heads / tp kv heads.
        tp = tp_size(dims)
        if cfg.kv_heads % tp:
            raise ValueError(f"parallel.tp={tp} does not divide model.num_kv_heads={cfg.kv_heads}")
        self.num_heads = cfg.num_attention_heads // tp
        self.num_kv_heads = cfg.kv_heads // tp
        h = cfg.hidden_size
        n_q, n_kv = cfg.num_attention_heads * self.head_dim, cfg.kv_heads * self.head_dim
        q_out = n_q * (2 if cfg.attn_output_gate else 1)
        self.q_proj = ColumnParallelLinear(h, q_out, cfg.qkv_bias, dims, name="model.num_attention_heads * head_dim")
        self.k_proj = ColumnParallelLinear(h, n_kv, cfg.qkv_bias, dims, name="model.num_kv_heads * head_dim")
        self.v_proj = ColumnParallelLinear(h, n_kv, cfg.qkv_bias, dims, name="model.num_kv_heads * head_dim")
        self.o_proj = RowParallelLinear(n_q, h, cfg.attn_out_bias, dims, name="model.num_attention_heads * head_dim")
        if cfg.qk_norm and cfg.qk_norm_scope == "projection":
            # One norm over all heads' channels (MiniMax-M2): this rank holds its heads' share of each weight.
            self.q_norm = RMSNorm(self.num_heads * self.head_dim, cfg.norm_eps, cfg.norm_zero_centered)
            self.k_norm = RMSNorm(self.num_kv_heads * self.head_dim, cfg.norm_eps, cfg.norm_zero_centered)
            if tp > 1:
                for norm, full in ((self.q_norm, n_q), (self.k_norm, n_kv)):
                    local = norm.weight.shape[0]
                    set_shard(norm.weight, "tensor_parallel", (full,), (dims.tp_group.rank * local,))
        elif cfg.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, cfg.norm_eps, cfg.norm_zero_centered)
            self.k_norm = RMSNorm(self.head_dim, cfg.norm_eps, cfg.norm_zero_centered)
            if tp > 1:  # each rank normalises its own heads: partial gradients over TP
                mark_tp_partial(self.q_norm)
                mark_tp_partial(self.k_norm)
        # Per-layer window: with layer_types, only sliding_attention layers use model.sliding_window.
        self.window = cfg.sliding_window
        if cfg.layer_types is not None and cfg.layer_types[layer_idx] != "sliding_attention":
            self.window = None
        self.sinks = None
        if cfg.attn_sinks:  # one logit per head: under tensor parallel, this rank's heads' block
            self.sinks = nn.Parameter(torch.zeros(self.num_heads))
            if tp > 1:
                set_shard(
                    self.sinks, "tensor_parallel", (cfg.num_attention_heads,), (dims.tp_group.rank * self.num_heads,)
                )
        rotary_dim = int(self.head_dim * cfg.partial_rotary_factor)
        self.rotary = RotaryEmbedding(rotary_dim, cfg.rope_theta, cfg.rope_scaling, cfg.max_position_embeddings)
        self.recompute_core = "core_attn" in cfg.recompute_modules

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        x = tp_region_input(x, self.dims)  # sequence-parallel shards -> full sequence
        b, s, _ = x.shape
        q = self.q_proj(x).view(b, s, self.num_heads, -1)
        gate = None
        if self.cfg.attn_output_gate:
            q, gate = q.split(self.head_dim, dim=-1)
            gate = gate.reshape(b, s, -1)
        k = self.k_proj(x).view(b, s, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(b, s, self.num_kv_heads, self.head_dim)
        if self.cfg.qk_norm:
            q, k = self._qk_norm(q, self.q_norm), self._qk_norm(k, self.k_norm)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        cos, sin = self.rotary(position_ids, q.dtype)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        record_max_logit(self, q, k, self.head_dim**-0.5, self.window)  # optim.muon_qk_clip only
        dropout = self.cfg.attention_dropout if self.training else 0.0
        if self.dims is not None and self.dims.cp > 1:  # context parallel: moecore/parallel/cp_attention.py
            out = context_parallel_attention(q, k, v, self.dims, self.head_dim**-0.5, self.window, self.sinks)
            return self._project(out, gate, b, s)
        if self.sinks is not None:
            from moecore.models.sinks import sink_attention

            sargs = (q, k, v, self.sinks, self.window, self.head_dim**-0.5)
            if self.recompute_core and self.training:
                out = torch.utils.checkpoint.checkpoint(sink_attention, *sargs, use_reentrant=False)
            else:
                out = sink_attention(*sargs)
            return self._project(out, gate, b, s)
        args = (q, k, v, self.window, self.cfg.attention_backend)
        if self.recompute_core and self.training:
            # checkpoint restores the RNG state, so recomputed dropout masks equal the original ones
            out = torch.utils.checkpoint.checkpoint(attention_core, *args, None, dropout, use_reentrant=False)
        else:
            out = attention_core(*args, dropout_p=dropout)
        return self._project(out, gate, b, s)

    def _qk_norm(self, x: torch.Tensor, norm: RMSNorm) -> torch.Tensor:
        """x [B, S, heads, D] normalised per head, or over all heads' channels (`qk_norm_scope=projection`)."""
        if self.cfg.qk_norm_scope == "head":
            return norm(x)
        flat = x.flatten(2)
        if tp_size(self.dims) == 1:
            return norm(flat).view_as(x)
        return sharded_rms_norm(flat, norm.weight, norm.eps, norm.zero_centered, self.dims).view_as(x)

    def _project(self, out: torch.Tensor, gate: torch.Tensor | None, b: int, s: int) -> torch.Tensor:
        """[B, heads, S, D] attention output -> (gated) o_proj output [B, S, H]."""
        out = out.transpose(1, 2).reshape(b, s, -1)
        if gate is not None:
            out = out * torch.sigmoid(gate)
        return self.o_proj(out)
