"""The optimizer of `optim.name` over parameter groups with weight decay on matrices only (`groups.py`)."""

from __future__ import annotations

import torch
from torch import nn

from moecore.config import OptimConfig
from moecore.optim.groups import no_decay, param_groups

__all__ = ["build_optimizer", "no_decay", "param_groups"]


def build_optimizer(model: nn.Module, cfg: OptimConfig, orthogonalize_for=None) -> torch.optim.Optimizer:
    """The optimizer named by `optim.name` (AdamW; Muon for 2-D weights when chosen).

    `orthogonalize_for`: Muon's distributed orthogonalisation (`moecore.parallel.distributed_muon`).
    """
    groups = param_groups(model, cfg.weight_decay)
    if cfg.name == "muon":
        from moecore.optim.muon import build_muon

        return build_muon(model, cfg, orthogonalize_for)
    fused = all(p.is_cuda for g in groups for p in g["params"]) and len(groups[0]["params"]) > 0
    return torch.optim.AdamW(
        groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, weight_decay=cfg.weight_decay, fused=fused or None
    )
