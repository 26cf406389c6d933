"""Rotary position embeddings: plain, linear-scaled and YaRN, full or partial, half-split or interleaved.

RoPE rotates pairs of channels of q and k by an angle position * inv_freq[j], with
inv_freq[j] = theta^(-2j/d) over the d rotary channels. Two pairings are in use:
- half-split (Llama, Mixtral, Qwen): channel j pairs with channel j + d/2 (`rotate_half`);
- interleaved (DeepSeek MLA checkpoints): channel 2j pairs with 2j+1. We de-interleave those
  channels to the half-split order before rotating, which gives the same q.k products.
Partial rotary (Qwen3-Next) rotates only the first d = head_dim * partial_rotary_factor channels.

YaRN (Peng et al. 2023, "YaRN: Efficient Context Window Extension") blends interpolated and
extrapolated frequencies with a linear ramp between the dimensions that complete beta_fast and
beta_slow rotations over the original context, and scales cos/sin by an attention factor
0.1 * ln(factor) + 1 (or the ratio of two such terms when mscale / mscale_all_dim are given).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from moecore.kernels.rope import apply_rotary as fused_apply_rotary


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def rope_inv_freq(
    dim: int, theta: float, scaling: dict | None, max_position_embeddings: int
) -> tuple[torch.Tensor, float]:
    """Inverse frequencies for `dim` rotary channels and the factor that scales cos/sin."""
    base = theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    inv_freq = 1.0 / base
    kind = (scaling or {}).get("type", (scaling or {}).get("rope_type", "default"))
    if kind in (None, "default"):
        return inv_freq.float(), 1.0
    factor = scaling.get("factor")
    if kind == "linear":
        return (inv_freq / factor).float(), 1.0
    if kind != "yarn":
        raise ValueError(f"model.rope_scaling.type={kind!r} is not supported; allowed: default | linear | yarn")
    orig = scaling.get("original_max_position_embeddings", max_position_embeddings)
    if factor is None:
        factor = max_position_embeddings / orig
    attention_factor = scaling.get("attention_factor")
    mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
    if attention_factor is None:
        if mscale and mscale_all_dim:
            attention_factor = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
        else:
            attention_factor = _yarn_mscale(factor)
    beta_fast = scaling.get("beta_fast") or 32
    beta_slow = scaling.get("beta_slow") or 1

    # The channel index whose wavelength completes `rotations` turns over the original context.
    def correction_dim(rotations: float) -> float:
        return dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolate = 1 - ramp  # 1: keep the original frequency, 0: interpolate by `factor`
    base32 = theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    inv = (1.0 / (factor * base32)) * (1 - extrapolate) + (1.0 / base32) * extrapolate
    return inv, float(attention_factor)


class RotaryEmbedding(nn.Module):
    """Produces (cos, sin) of shape [S, rotary_dim] for given positions (half-split layout)."""

    def __init__(
        self, rotary_dim: int, theta: float, scaling: dict | None = None, max_position_embeddings: int = 4096
    ) -> None:
        super().__init__()
        self.rotary_dim = rotary_dim
        inv_freq, self.attention_factor = rope_inv_freq(rotary_dim, theta, scaling, max_position_embeddings)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, position_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = position_ids.float()[:, None] * self.inv_freq.float()[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * self.attention_factor).to(dtype), (emb.sin() * self.attention_factor).to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def deinterleave(x: torch.Tensor) -> torch.Tensor:
    """[..., (d/2 pairs)] channels (0,1),(2,3),... -> half-split order (0,2,4,...,1,3,5,...)."""
    return torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool = False) -> torch.Tensor:
    """Rotate the first cos.shape[-1] channels of x [B, heads, S, D]; the rest pass through.

    cos/sin are [S, d]. With `interleaved`, the rotary channels are first de-interleaved (see module doc).
    """
    if x.is_cuda:  # fused Triton forward + backward, same maths (moecore/kernels/rope.py)
        return fused_apply_rotary(x, cos, sin, interleaved)
    d = cos.shape[-1]
    rot, rest = (x, None) if d == x.shape[-1] else (x[..., :d], x[..., d:])
    if interleaved:
        rot = deinterleave(rot)
    rot = rot * cos + rotate_half(rot) * sin
    return rot if rest is None else torch.cat((rot, rest), dim=-1)
