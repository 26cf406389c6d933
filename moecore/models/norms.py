"""RMSNorm, plain and zero-centred.

RMSNorm(x) = x / sqrt(mean(x^2) + eps) * w. The statistics are computed in fp32 and the result is
cast back to the input dtype, as the Hugging Face implementations of every supported family do.
Zero-centred RMSNorm (Qwen3-Next) stores the weight as an offset from one: the scale is (1 + w), so a
freshly initialised weight of zeros is the identity and weight decay pulls toward it.
"""

from __future__ import annotations

import torch
from torch import nn

from moecore.kernels.rmsnorm import rms_norm as fused_rms_norm


class RMSNorm(nn.Module):
    """Root-mean-square layer norm over the last dimension."""

    def __init__(self, dim: int, eps: float = 1e-6, zero_centered: bool = False) -> None:
        super().__init__()
        self.eps = eps
        self.zero_centered = zero_centered
        self.weight = nn.Parameter(torch.zeros(dim) if zero_centered else torch.ones(dim))

    def reset_parameters(self) -> None:
        nn.init.zeros_(self.weight) if self.zero_centered else nn.init.ones_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda:  # fused Triton forward + backward, same maths (moecore/kernels/rmsnorm.py)
            return fused_rms_norm(x, self.weight, self.eps, self.zero_centered)
        return rms_norm(x, self.weight, self.eps, self.zero_centered)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, zero_centered: bool = False) -> torch.Tensor:
    """Reference RMSNorm: fp32 statistics, output in x's dtype."""
    dtype = x.dtype
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    w = weight.float() + 1.0 if zero_centered else weight.float()
    return (h * w).to(dtype)
