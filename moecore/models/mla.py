"""Multi-latent attention (MLA) of DeepSeek-V2 and DeepSeek-V3.

MLA replaces the per-head keys and values of standard attention with a small latent that all heads
share, plus one rotary key that all heads share too (the "decoupled" RoPE key):

    q      = q_b_proj(RMSNorm(q_a_proj(x)))        or q_proj(x) without q LoRA   [B, S, n, dn + dr]
    c, kr  = split(kv_a_proj_with_mqa(x), [kv_lora_rank, dr])                    c: latent, kr: rope key
    k_n, v = split(kv_b_proj(RMSNorm(c)), [dn, dv]) per head                     [B, S, n, dn] / [B, S, n, dv]
    k      = [k_n, RoPE(kr) broadcast to every head],  q = [q_n, RoPE(q_r)]
    out    = o_proj(softmax(q k^T * scale + causal) v)

with dn = qk_nope_head_dim, dr = qk_rope_head_dim, dv = v_head_dim (dv may differ from dn + dr).

The checkpoints store the rotary channels of q and kr in interleaved pairs (2j, 2j+1) rotated by one
frequency (`model.rope_interleave`); rope.apply_rotary handles that layout. With YaRN the rotary cos/sin
carry the attention factor of rope.py, and the softmax scale is multiplied by mscale(factor,
mscale_all_dim)^2, as DeepSeek's reference code does. The two RMSNorms on the latents use eps=1e-6
whatever model.norm_eps says: DeepSeek's code and transformers both build them with the default eps.

Tensor parallel (`parallel.tp` > 1) splits the heads: q_proj / q_b_proj and kv_b_proj are column-parallel
(each rank computes n/tp heads' queries, keys and values from the latents), o_proj is row-parallel. The
down-projections q_a_proj and kv_a_proj_with_mqa and the latent norms are replicated: they are small, the
norm needs the whole latent, and every rank's heads read the same latent and shared rope key. The block
input is gathered once (`tp_region_input`: the sequence shards under sequence parallel), so every rank
computes the latents of the whole sequence; their gradients are partial sums over the ranks' heads and
are marked `tp_partial` (summed over TP in the gradient reduction).

Parameter names are those of transformers' DeepseekV2/V3 attention (`q_a_proj`, `kv_a_proj_with_mqa`,
...), so a checkpoint converts by renaming the `self_attn.` prefix only.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from moecore.config import ModelConfig
from moecore.models.attention import sdpa_backends
from moecore.models.max_logit import record_max_logit
from moecore.models.norms import RMSNorm
from moecore.models.recompute import recompute_output
from moecore.models.rope import RotaryEmbedding, apply_rotary
from moecore.parallel.context import gather_from_cp
from moecore.parallel.cp_attention import allgather_attention, alltoall_attention, ring_attention
from moecore.parallel.sharding import mark_tp_partial
from moecore.parallel.tensor_parallel import ColumnParallelLinear, RowParallelLinear, tp_region_input, tp_size

LATENT_NORM_EPS = 1e-6


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction 0.1 * mscale * ln(scale) + 1 (1 when the context is not extended)."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def mla_softmax_scale(qk_head_dim: int, rope_scaling: dict | None, max_position_embeddings: int = 4096) -> float:
    """1/sqrt(qk_head_dim), times mscale(factor, mscale_all_dim)^2 when a scaled RoPE sets mscale_all_dim."""
    scale = qk_head_dim**-0.5
    if not rope_scaling:
        return scale
    kind = rope_scaling.get("type", rope_scaling.get("rope_type", "default"))
    mscale_all_dim = rope_scaling.get("mscale_all_dim")
    if kind in (None, "default") or not mscale_all_dim:
        return scale
    factor = rope_scaling.get("factor")
    if factor is None:
        factor = max_position_embeddings / rope_scaling.get("original_max_position_embeddings", max_position_embeddings)
    m = yarn_mscale(float(factor), float(mscale_all_dim))
    return scale * m * m


class MLAttention(nn.Module):
    """Multi-latent causal self-attention; `forward(x [B, S, H], position_ids [S]) -> [B, S, H]`."""

    def __init__(self, cfg: ModelConfig, layer_idx: int, dims: Any = None) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.hidden_size = cfg.hidden_size
        self.dims = dims
        tp = tp_size(dims)
        if cfg.num_attention_heads % tp:
            raise ValueError(f"parallel.tp={tp} does not divide model.num_attention_heads={cfg.num_attention_heads}")
        self.num_heads = cfg.num_attention_heads // tp  # this rank's heads
        self.q_lora_rank = cfg.q_lora_rank
        self.kv_lora_rank = cfg.kv_lora_rank
        self.nope_dim = cfg.qk_nope_head_dim
        self.rope_dim = cfg.qk_rope_head_dim
        self.v_dim = cfg.v_head_dim
        self.qk_head_dim = self.nope_dim + self.rope_dim
        self.rope_interleave = cfg.rope_interleave
        self.dropout = cfg.attention_dropout
        self.backend = cfg.attention_backend
        self.recompute_up_proj = "mla_up_proj" in (cfg.recompute_modules or [])
        self.recompute_core_attn = "core_attn" in (cfg.recompute_modules or [])
        n, h = cfg.num_attention_heads, self.hidden_size  # global head count: the parallel linears split it
        heads = "model.num_attention_heads * head dim"

        if self.q_lora_rank is None:
            self.q_proj = ColumnParallelLinear(h, n * self.qk_head_dim, False, dims, name=heads)
        else:
            self.q_a_proj = nn.Linear(h, self.q_lora_rank, bias=False)
            self.q_a_layernorm = RMSNorm(self.q_lora_rank, eps=LATENT_NORM_EPS)
            self.q_b_proj = ColumnParallelLinear(self.q_lora_rank, n * self.qk_head_dim, False, dims, name=heads)
        self.kv_a_proj_with_mqa = nn.Linear(h, self.kv_lora_rank + self.rope_dim, bias=False)
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, eps=LATENT_NORM_EPS)
        self.kv_b_proj = ColumnParallelLinear(
            self.kv_lora_rank, n * (self.nope_dim + self.v_dim), False, dims, name=heads
        )
        self.o_proj = RowParallelLinear(n * self.v_dim, h, False, dims, name=heads)
        if tp > 1:  # replicated latents read by this rank's heads only: partial gradients over TP
            for name in ("q_a_proj", "q_a_layernorm", "kv_a_proj_with_mqa", "kv_a_layernorm"):
                if hasattr(self, name):
                    mark_tp_partial(getattr(self, name))

        self.rotary = RotaryEmbedding(self.rope_dim, cfg.rope_theta, cfg.rope_scaling, cfg.max_position_embeddings)
        self.softmax_scale = mla_softmax_scale(self.qk_head_dim, cfg.rope_scaling, cfg.max_position_embeddings)

    @torch.no_grad()
    def init_weights(self, std: float) -> None:
        """Normal(0, std) projections, unit latent norms."""
        for name, mod in self.named_children():
            if isinstance(mod, nn.Linear):
                nn.init.normal_(mod.weight, mean=0.0, std=std)
            elif isinstance(mod, RMSNorm):
                mod.reset_parameters()
            elif name != "rotary":
                raise RuntimeError(f"MLAttention.init_weights does not know child {name}")

    def _queries(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Per-head queries [B, n, S, dn+dr] from x, the rotary part rotated."""
        b, s, _ = x.shape
        if self.q_lora_rank is None:
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.view(b, s, self.num_heads, self.qk_head_dim).transpose(1, 2)
        q_nope, q_rope = q.split([self.nope_dim, self.rope_dim], dim=-1)
        return torch.cat((q_nope, apply_rotary(q_rope, cos, sin, interleaved=self.rope_interleave)), dim=-1)

    def _up_project(
        self, x: torch.Tensor, latent: torch.Tensor, k_rope: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Queries from x, per-head keys/values from the latent; returns q, k [B, n, S, dn+dr], v [B, n, S, dv]."""
        b, s, _ = x.shape
        q = self._queries(x, cos, sin)
        kv = self.kv_b_proj(self.kv_a_layernorm(latent)).view(b, s, self.num_heads, self.nope_dim + self.v_dim)
        k_nope, v = kv.transpose(1, 2).split([self.nope_dim, self.v_dim], dim=-1)
        # The rotary key is one "head" [B, 1, S, dr] shared by all heads.
        k_rope = apply_rotary(k_rope.unsqueeze(1), cos, sin, interleaved=self.rope_interleave)
        k = torch.cat((k_nope, k_rope.expand(-1, self.num_heads, -1, -1)), dim=-1)
        if self.backend == "flash" and self.v_dim != self.qk_head_dim:
            # Flash kernels need one head size for q, k and v: pad v with zeros (the padding of the output
            # is dropped in _core_attention). Padded here so that mla_up_proj recomputes the padded copy too.
            v = F.pad(v, (0, self.qk_head_dim - self.v_dim))
        return q, k, v

    def _core_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        dropout = self.dropout if self.training else 0.0
        out = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=True, scale=self.softmax_scale)
        return out[..., : self.v_dim]

    def _attend(self, qkv: tuple[torch.Tensor, torch.Tensor, torch.Tensor], grad: bool) -> torch.Tensor:
        q, k, v = qkv
        record_max_logit(self, q, k, self.softmax_scale)  # optim.muon_qk_clip only
        with sdpa_backends(self.backend, q.device):
            if self.recompute_core_attn and grad:
                return checkpoint(self._core_attention, q, k, v, use_reentrant=False)
            return self._core_attention(q, k, v)

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        x = tp_region_input(x, self.dims)  # tensor parallel: the whole sequence (sequence-parallel shards gathered)
        b, s, _ = x.shape
        cos, sin = self.rotary(position_ids, x.dtype)
        latent, k_rope = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, self.rope_dim], dim=-1)
        grad = self.training and torch.is_grad_enabled()
        if (
            self.dims is not None and getattr(self.dims, "cp", 1) > 1
        ):  # context parallel (moecore/parallel/cp_attention.py)
            out = self._context_parallel_attention(x, latent, k_rope, cos, sin)
        elif self.recompute_up_proj and grad:
            # q, k, v are not kept for the attention's backward: recomputed from x and the latent
            # (moecore/models/recompute.py), as Megatron-Core's mla_up_proj recomputation.
            out = recompute_output(self._up_project, (x, latent, k_rope, cos, sin), lambda qkv: self._attend(qkv, grad))
        else:
            out = self._attend(self._up_project(x, latent, k_rope, cos, sin), grad)
        return self.o_proj(out.transpose(1, 2).reshape(b, s, self.num_heads * self.v_dim))

    def _context_parallel_attention(
        self, x: torch.Tensor, latent: torch.Tensor, k_rope: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> torch.Tensor:
        """Attention of this CP rank's queries over the whole sequence: [B, n, S_local, dv].

        ring: the per-head K/V travel around the CP ring. a2a: heads exchanged for tokens (each rank attends with
        n / cp heads over the whole sequence). allgather: what is gathered is the compressed
        latent and the rotated shared rope key (kv_lora_rank + dr values per token, instead of
        n * (dn + dr + dv) for K/V); every rank then up-projects the whole sequence's K/V itself.
        """
        dims = self.dims
        if dims.cfg.cp_comm in ("ring", "a2a"):  # per-head K/V around the ring, or heads exchanged for tokens
            q, k, v = self._up_project(x, latent, k_rope, cos, sin)
            if dims.cfg.cp_comm == "ring":
                out, _ = ring_attention(q, k, v, dims.cp_group, self.softmax_scale)
            else:
                out, _ = alltoall_attention(q, k, v, dims.cp_group, self.softmax_scale, need_lse=False)
            return out[..., : self.v_dim]
        b = x.shape[0]
        q = self._queries(x, cos, sin)
        k_rope = apply_rotary(k_rope.unsqueeze(1), cos, sin, interleaved=self.rope_interleave)  # [B, 1, S_local, dr]
        latent, k_rope = gather_from_cp(latent, dims, 1), gather_from_cp(k_rope, dims, 2)  # full sequence
        full = latent.shape[1]
        kv = self.kv_b_proj(self.kv_a_layernorm(latent)).view(b, full, self.num_heads, self.nope_dim + self.v_dim)
        k_nope, v = kv.transpose(1, 2).split([self.nope_dim, self.v_dim], dim=-1)
        k = torch.cat((k_nope, k_rope.expand(-1, self.num_heads, -1, -1)), dim=-1)
        out, _ = allgather_attention(q, k, v, dims.cp_group, self.softmax_scale)
        return out
