"""AdamW with parameter groups: weight decay on matrices only.

Norm weights, biases, embeddings (and the output head when it is tied to them) and any 1-D
parameter are excluded from weight decay, as is customary for transformer language models.
"""

from __future__ import annotations

import torch
from torch import nn

from moecore.config import OptimConfig


def _no_decay(name: str, param: nn.Parameter) -> bool:
    return param.ndim < 2 or name.endswith(".bias") or "embed" in name or "norm" in name


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Two groups: decayed matrices and everything else. Each parameter appears once."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (no_decay if _no_decay(name, p) else decay).append(p)
    return [
        {"params": decay, "weight_decay": weight_decay, "group": "decay"},
        {"params": no_decay, "weight_decay": 0.0, "group": "no_decay"},
    ]


def build_optimizer(model: nn.Module, cfg: OptimConfig) -> torch.optim.Optimizer:
    """The optimizer named by `optim.name` (AdamW; Muon for 2-D weights when chosen)."""
    groups = param_groups(model, cfg.weight_decay)
    if cfg.name == "muon":
        from moecore.optim.muon import build_muon

        return build_muon(model, cfg)
    fused = all(p.is_cuda for g in groups for p in g["params"]) and len(groups[0]["params"]) > 0
    return torch.optim.AdamW(
        groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, weight_decay=cfg.weight_decay, fused=fused or None
    )
