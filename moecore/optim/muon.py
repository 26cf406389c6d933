"""Muon (momentum + Newton-Schulz orthogonalisation) for matrices, AdamW for everything else.

Muon (Jordan et al. 2024) replaces the update of a weight matrix by the nearest semi-orthogonal
matrix to its momentum, found with a few Newton-Schulz iterations of the quintic
X <- a X + b (X X^T) X + c (X X^T)^2 X with (a, b, c) = (3.4445, -4.7750, 2.0315), started from
the momentum scaled to unit spectral norm (bounded by its Frobenius norm). Grouped expert weights
[E, out, in] are orthogonalised per expert. Updates are scaled by 0.2 * sqrt(max(out, in)) so that
their RMS matches AdamW's and the AdamW learning rate carries over (Moonshot's "Muon is scalable",
2025); weight decay is decoupled (w <- w (1 - lr wd)). Embeddings, the output head, the router,
norms and biases use AdamW.

torch.optim.Muon (torch >= 2.9) is not used: it takes 2-D parameters only (our grouped experts
are [E, out, in]) and runs Newton-Schulz in bf16, while this one runs it in fp32, so that runs
under any parallel layout equal the one-process run to fp32 rounding. Its "match_rms_adamw"
scaling is the one used here. Under tensor, expert or fully sharded data parallel the matrices are
orthogonalised by `moecore.parallel.distributed_muon` (each once, on one rank, from the whole matrix).
"""

from __future__ import annotations

import math
from collections.abc import Callable

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


def _local(t: torch.Tensor) -> torch.Tensor:
    """The local tensor of a DTensor (FSDP2 parameters, their gradients and states); t itself otherwise."""
    return t.to_local() if hasattr(t, "to_local") else t


class Muon(torch.optim.Optimizer):
    """Muon for the given matrices (params with ndim >= 2).

    `orthogonalize(params, updates)` turns the local Nesterov updates (fp32, shaped like each local
    parameter) into scaled orthogonalised ones; None: every matrix is whole on this process. The
    distributed runs pass `moecore.parallel.distributed_muon.DistributedOrthogonalizer`, which needs
    every rank to call it every step with all its matrices (a missing gradient counts as zero there
    and the parameter is not updated, as here).
    """

    def __init__(
        self,
        params,
        lr: float,
        momentum: float = 0.95,
        weight_decay: float = 0.0,
        ns_steps: int = 5,
        orthogonalize: Callable[[list[torch.Tensor], list[torch.Tensor]], list[torch.Tensor]] | None = None,
    ):
        super().__init__(params, dict(lr=lr, momentum=momentum, weight_decay=weight_decay, ns_steps=ns_steps))
        self.orthogonalize = orthogonalize

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            params, updates, stepped = [], [], []
            for p in group["params"]:
                if p.grad is None and self.orthogonalize is None:
                    continue
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(p)
                buf = _local(state["momentum_buffer"])
                if p.grad is None:  # distributed: this rank still joins the exchange
                    params.append(p)
                    updates.append(torch.zeros_like(buf))
                    stepped.append(False)
                    continue
                g = _local(p.grad)
                buf.mul_(group["momentum"]).add_(g)
                params.append(p)
                updates.append(g.add(buf, alpha=group["momentum"]))  # Nesterov
                stepped.append(True)
            if not params:
                continue
            if self.orthogonalize is None:
                done = [
                    newton_schulz(u, group["ns_steps"]) * (0.2 * math.sqrt(max(p.shape[-2], p.shape[-1])))
                    for p, u in zip(params, updates)
                ]
            else:
                done = self.orthogonalize(params, updates)
            for p, update, ok in zip(params, done, stepped):
                if not ok:
                    continue
                w = _local(p)
                w.mul_(1 - group["lr"] * group["weight_decay"])
                w.add_(update.to(w.dtype), alpha=-group["lr"])


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


def build_muon(model: nn.Module, cfg: OptimConfig, orthogonalize_for=None) -> CombinedOptimizer:
    """Muon for hidden matrices (attention, MLP and expert weights), AdamW for the rest.

    `orthogonalize_for(named_matrices)`: builds the distributed orthogonalisation for the Muon
    matrices (moecore.parallel.distributed_muon); None: each matrix is whole on this process.
    """
    muon_named, adam_decay, adam_plain = [], [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        if no_decay(name, p):
            adam_plain.append(p)
        elif "lm_head" in name or "router" in name:
            adam_decay.append(p)
        else:
            muon_named.append((name, p))
    ortho = orthogonalize_for(muon_named) if orthogonalize_for is not None else None
    muon = Muon(
        [p for _, p in muon_named],
        lr=cfg.lr,
        momentum=cfg.muon_momentum,
        weight_decay=cfg.weight_decay,
        ns_steps=cfg.muon_ns_steps,
        orthogonalize=ortho,
    )
    adam = torch.optim.AdamW(
        [{"params": adam_decay, "weight_decay": cfg.weight_decay}, {"params": adam_plain, "weight_decay": 0.0}],
        lr=cfg.lr,
        betas=(cfg.beta1, cfg.beta2),
        eps=cfg.eps,
    )
    return CombinedOptimizer([muon, adam])
