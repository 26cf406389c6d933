"""Muon (momentum + Newton-Schulz orthogonalisation) for matrices, AdamW for everything else.

Muon (Jordan et al. 2024) replaces the update of a weight matrix by the nearest semi-orthogonal
matrix to its momentum, found with a few Newton-Schulz iterations of the quintic
X <- a X + b (X X^T) X + c (X X^T)^2 X with (a, b, c) = (3.4445, -4.7750, 2.0315), started from
the momentum scaled to unit spectral norm (bounded by its Frobenius norm). Grouped expert weights
[E, out, in] are orthogonalised per expert. Updates are scaled by sqrt(max(1, out/in)) and by
0.2 * sqrt(max(out, in)) so that the AdamW learning rate carries over (Moonshot's "Muon is
scalable", 2025). Embeddings, the output head, norms and biases use AdamW.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from moecore.config import OptimConfig
from moecore.optim.groups import no_decay


def newton_schulz(g: torch.Tensor, steps: int = 5, eps: float = 1e-7) -> torch.Tensor:
    """Approximately orthogonalise the last two dims of g (batched over leading dims)."""
    a, b, c = 3.4445, -4.7750, 2.0315
    x = g.float()
    transposed = x.shape[-2] > x.shape[-1]
    if transposed:
        x = x.transpose(-2, -1)
    x = x / (x.norm(dim=(-2, -1), keepdim=True) + eps)
    for _ in range(steps):
        s = x @ x.transpose(-2, -1)
        x = a * x + (b * s + c * s @ s) @ x
    if transposed:
        x = x.transpose(-2, -1)
    return x.to(g.dtype)


class Muon(torch.optim.Optimizer):
    """Muon for the given matrices (params with ndim >= 2)."""

    def __init__(self, params, lr: float, momentum: float = 0.95, weight_decay: float = 0.0, ns_steps: int = 5):
        super().__init__(params, dict(lr=lr, momentum=momentum, weight_decay=weight_decay, ns_steps=ns_steps))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(p)
                buf = state["momentum_buffer"]
                buf.mul_(group["momentum"]).add_(p.grad)
                update = p.grad.add(buf, alpha=group["momentum"])  # Nesterov
                update = newton_schulz(update, group["ns_steps"])
                rows, cols = p.shape[-2], p.shape[-1]
                update = update * (0.2 * math.sqrt(max(rows, cols)))
                p.mul_(1 - group["lr"] * group["weight_decay"])
                p.add_(update, alpha=-group["lr"])


class CombinedOptimizer(torch.optim.Optimizer):
    """Steps several optimizers as one; `param_groups` is the concatenation (LR schedules reach all)."""

    def __init__(self, optimizers: list[torch.optim.Optimizer]) -> None:
        self.optimizers = optimizers
        self.defaults = {}
        self.state = {}

    @property
    def param_groups(self):
        return [g for o in self.optimizers for g in o.param_groups]

    def step(self, closure=None):
        for o in self.optimizers:
            o.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for o in self.optimizers:
            o.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict:
        return {"optimizers": [o.state_dict() for o in self.optimizers]}

    def load_state_dict(self, state: dict) -> None:
        for o, s in zip(self.optimizers, state["optimizers"]):
            o.load_state_dict(s)


def build_muon(model: nn.Module, cfg: OptimConfig) -> CombinedOptimizer:
    """Muon for hidden matrices (attention, MLP and expert weights), AdamW for the rest."""
    muon_params, adam_decay, adam_plain = [], [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        if no_decay(name, p):
            adam_plain.append(p)
        elif "lm_head" in name or "router" in name:
            adam_decay.append(p)
        else:
            muon_params.append(p)
    muon = Muon(
        muon_params, lr=cfg.lr, momentum=cfg.muon_momentum, weight_decay=cfg.weight_decay, ns_steps=cfg.muon_ns_steps
    )
    adam = torch.optim.AdamW(
        [{"params": adam_decay, "weight_decay": cfg.weight_decay}, {"params": adam_plain, "weight_decay": 0.0}],
        lr=cfg.lr,
        betas=(cfg.beta1, cfg.beta2),
        eps=cfg.eps,
    )
    return CombinedOptimizer([muon, adam])
