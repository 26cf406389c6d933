"""Manifold-constrained hyper-connections (mHC, DeepSeek-V4): n residual streams instead of one.

The residual of every decoder layer is `model.hc_mult` = n streams, x [B, S, n, H]. Before a block (attention or
feed-forward) a `HyperConnection` reads all streams of a token and computes, in fp32, with x~ the token's n * H
values divided by their root mean square (no weight):

    [a_pre; a_post; a_comb] = W x~                       W = `fn` [(2 + n) n, n H]
    pre  = sigmoid(a_pre  * s_pre  + b_pre) + eps        [n]      the block's input: sum_i pre_i x_i
    post = 2 sigmoid(a_post * s_post + b_post)           [n]      how the block's output enters each stream
    comb = Sinkhorn(softmax_row(a_comb * s_comb + b_comb) + eps)  [n, n]

(`base` = [b_pre; b_post; b_comb], `scale` = [s_pre, s_post, s_comb].) Sinkhorn alternately divides the columns and
the rows of comb by their sums (+ eps), columns first, `model.hc_sinkhorn_iters` column passes and one row pass
fewer, so comb is (nearly) doubly stochastic and mixing the streams with it does not grow their norm. The block
runs on the collapsed input, and the streams become

    x'_j = post_j * block(sum_i pre_i x_i) + sum_i comb_ij x_i

After the last layer `HyperHead` collapses the streams once more with its own weights (`hc_fn` [n, n H], `hc_base`
[n], `hc_scale` [1]: pre = sigmoid(hc_fn x~ * hc_scale + hc_base) + eps) before the final norm. The embedding
enters every stream as it is. The weights follow transformers' DeepseekV4HyperConnection / DeepseekV4HyperHead
(tensor names `attn_hc` / `ffn_hc` / `hc_head`; ours are `attn_hc` / `mlp_hc` / `hc_head`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def _unit_rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x / sqrt(mean(x^2) + eps) over the last dimension (fp32 in, fp32 out)."""
    return x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps)


def _mixes(x: torch.Tensor, fn: torch.Tensor, eps: float) -> torch.Tensor:
    """fn x~ in fp32: x [B, S, n, H] flattened per token and divided by its root mean square."""
    return F.linear(_unit_rms(x.flatten(2).float(), eps), fn.float())


def _collapse(x: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    """sum_i pre_i x_i: [B, S, n, H] with pre [B, S, n] -> [B, S, H] in x's dtype."""
    return (pre.unsqueeze(-1) * x).sum(dim=2).to(x.dtype)


def expand_streams(x: torch.Tensor, n: int) -> torch.Tensor:
    """[B, S, H] -> [B, S, n, H]: the embedding in every stream."""
    return x.unsqueeze(2).expand(-1, -1, n, -1).contiguous()


class HyperConnection(nn.Module):
    """The per-token weights of one block's hyper-connection (module docstring)."""

    def __init__(self, hidden_size: int, n: int, sinkhorn_iters: int, eps: float, norm_eps: float) -> None:
        super().__init__()
        self.n, self.iters, self.eps, self.norm_eps = n, sinkhorn_iters, eps, norm_eps
        width = (2 + n) * n
        self.fn = nn.Parameter(torch.empty(width, n * hidden_size))
        self.base = nn.Parameter(torch.zeros(width))
        self.scale = nn.Parameter(torch.ones(3))

    def reset_parameters(self) -> None:
        """`fn` is drawn by the model's seeded initialisation; `base` zeros, `scale` ones."""
        nn.init.zeros_(self.base)
        nn.init.ones_(self.scale)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [B, S, n, H] -> (post [B, S, n] fp32, comb [B, S, n, n] fp32, the block's input [B, S, H])."""
        n = self.n
        mixes = _mixes(x, self.fn, self.norm_eps)
        a_pre, a_post, a_comb = mixes.split([n, n, n * n], dim=-1)
        b_pre, b_post, b_comb = self.base.float().split([n, n, n * n])
        s_pre, s_post, s_comb = self.scale.float().unbind(0)
        pre = torch.sigmoid(a_pre * s_pre + b_pre) + self.eps
        post = 2 * torch.sigmoid(a_post * s_post + b_post)
        comb = torch.softmax(a_comb.unflatten(-1, (n, n)) * s_comb + b_comb.view(n, n), dim=-1) + self.eps
        comb = comb / (comb.sum(dim=-2, keepdim=True) + self.eps)
        for _ in range(self.iters - 1):
            comb = comb / (comb.sum(dim=-1, keepdim=True) + self.eps)
            comb = comb / (comb.sum(dim=-2, keepdim=True) + self.eps)
        return post, comb, _collapse(x, pre)

    @staticmethod
    def merge(x: torch.Tensor, out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
        """The new streams x'_j = post_j * out + sum_i comb_ij x_i, in x's dtype."""
        dtype = x.dtype
        return post.to(dtype).unsqueeze(-1) * out.unsqueeze(-2) + torch.matmul(comb.to(dtype).transpose(-1, -2), x)


class HyperHead(nn.Module):
    """The final collapse of the streams, before the model's last norm (module docstring)."""

    def __init__(self, hidden_size: int, n: int, eps: float, norm_eps: float) -> None:
        super().__init__()
        self.n, self.eps, self.norm_eps = n, eps, norm_eps
        self.hc_fn = nn.Parameter(torch.empty(n, n * hidden_size))
        self.hc_base = nn.Parameter(torch.zeros(n))
        self.hc_scale = nn.Parameter(torch.ones(1))

    def reset_parameters(self) -> None:
        """`hc_fn` is drawn by the model's seeded initialisation; `hc_base` zeros, `hc_scale` ones."""
        nn.init.zeros_(self.hc_base)
        nn.init.ones_(self.hc_scale)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [B, S, n, H] -> [B, S, H]."""
        mixes = _mixes(x, self.hc_fn, self.norm_eps)
        return _collapse(x, torch.sigmoid(mixes * self.hc_scale.float() + self.hc_base.float()) + self.eps)
