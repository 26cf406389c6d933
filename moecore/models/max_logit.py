"""Per-head maximum attention logits, recorded by the attention forwards for QK-Clip (`qk_clip.py`).

A leaf of the models package: the attention modules import it, and `qk_clip.py` (which needs the attention
classes to rescale their weights) imports both.
"""

from __future__ import annotations

import torch
from torch import nn

_ELEMENTS = 1 << 24  # logits materialised at once while recording


@torch.no_grad()
def head_max_logits(q: torch.Tensor, k: torch.Tensor, scale: float, window: int | None = None) -> torch.Tensor:
    """Per query head, the largest causal (optionally windowed) logit scale * q_i . k_j; q/k are [B, heads, S, D]."""
    if k.shape[1] != q.shape[1]:
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    b, h, s, _ = q.shape
    qf, kf = q.float(), k.float()
    out = torch.full((h,), float("-inf"), device=q.device)
    step = max(1, _ELEMENTS // max(1, b * h * s))
    cols = torch.arange(s, device=q.device)[None, :]
    for i in range(0, s, step):
        logits = torch.einsum("bhqd,bhkd->bhqk", qf[:, :, i : i + step], kf) * scale
        rows = torch.arange(i, min(i + step, s), device=q.device)[:, None]
        keep = cols <= rows
        if window is not None:
            keep = keep & (cols > rows - window)
        out = torch.maximum(out, logits.masked_fill(~keep, float("-inf")).amax(dim=(0, 2, 3)))
    return out


def record_max_logit(module: nn.Module, q: torch.Tensor, k: torch.Tensor, scale: float, window=None) -> None:
    """Fold this forward's per-head max logits into `module.qk_max` (a no-op unless QK-Clip enabled it)."""
    if getattr(module, "qk_max", None) is None:
        return
    module.qk_max = torch.maximum(module.qk_max, head_max_logits(q.detach(), k.detach(), scale, window))
