"""AdamW for mixed precision: one kernel per parameter updates the master, the moments and the bf16 weight.

`FusedAdamW` is a `torch.optim.Optimizer` over the model's (bf16) parameters, so checkpoints, the
learning-rate schedule and `torch.distributed.checkpoint`'s optimizer state dicts see the same
parameter groups and state keys (`step`, `exp_avg`, `exp_avg_sq`) as `torch.optim.AdamW`. Each
parameter's update is `moecore.kernels.adamw.adamw_step`: it reads the gradient (`grad_of(p)`: the
fp32 main gradient or the bf16 `.grad`) and the fp32 master from `MixedPrecision`, and writes the
master, the moments (fp32 or bf16, `optim.state_dtype`) and the rounded bf16 parameter in one pass.
Under FSDP2 (`mp=None`) the parameters, gradients and moments are DTensors and each rank updates its
local shards (fp32 master shards, or bf16 parameters with `optim.master_weights=bf16`).

Gradient clipping is folded into the same pass: `grad_scale` (the clipping coefficient, set by the
training runtime before `step`) multiplies the gradient inside the kernel, instead of a separate
in-place multiplication of every gradient.
"""

from __future__ import annotations

import contextlib

import torch

from moecore.kernels.adamw import adamw_step
from moecore.optim.mixed_precision import MixedPrecision, grad_of


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (FSDP2 parameters, gradients and states: the update is element-wise); else t's data.
    A shard that FSDP2 gathers as FP8 wraps its fp32 values (`hp_shard`, moecore/parallel/fsdp_fp8.py): those."""
    t = t.to_local() if hasattr(t, "to_local") else t.data
    return getattr(t, "hp_shard", t)


class FusedAdamW(torch.optim.Optimizer):
    """AdamW over `params` with master weights from `mp` (None: update the parameters themselves)."""

    def __init__(
        self,
        params,
        mp: MixedPrecision | None,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.01,
        state_dtype: torch.dtype = torch.float32,
    ) -> None:
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay})
        self.mp = mp
        self.state_dtype = state_dtype
        self.grad_scale = 1.0  # the clipping coefficient for the next step; reset by step()

    def _master(self, p: torch.Tensor) -> torch.Tensor | None:
        if self.mp is None:
            return None
        master = self.mp.masters.get(p)
        # Inside MixedPrecision.fp32_view the parameter holds the master itself: update it once.
        return None if master is None or master.data_ptr() == p.data_ptr() else master

    @torch.no_grad()
    def step(self, closure=None) -> None:
        scale, self.grad_scale = self.grad_scale, 1.0
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                g = grad_of(p)
                if g is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = torch.zeros((), dtype=torch.float32)
                    state["exp_avg"] = torch.zeros_like(
                        p, dtype=self.state_dtype, memory_format=torch.contiguous_format
                    )
                    state["exp_avg_sq"] = torch.zeros_like(
                        p, dtype=self.state_dtype, memory_format=torch.contiguous_format
                    )
                state["step"] += 1
                target, master = _local(p), self._master(p)
                if self.mp is not None and p in self.mp.recast:  # FP8 primary weight: update the master only
                    target, master = self.mp.masters[p], None
                adamw_step(
                    target, master, _local(g).contiguous(), _local(state["exp_avg"]), _local(state["exp_avg_sq"]),
                    lr=float(group["lr"]), beta1=beta1, beta2=beta2, eps=group["eps"],
                    weight_decay=group["weight_decay"], step=int(state["step"].item()), grad_scale=scale,
                )  # fmt: skip
        if self.mp is not None and self.mp.recast:  # re-quantise the FP8 primary weights from their masters
            for p, rebuild in self.mp.recast.items():
                rebuild(self.mp.masters[p])

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self.mp is not None:
            self.mp.zero_grad()
        super().zero_grad(set_to_none=True)

    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict(state_dict)
        # torch casts loaded moments to the parameter's dtype; keep them in the configured one.
        for st in self.state.values():
            for key in ("exp_avg", "exp_avg_sq"):
                if key in st:
                    st[key] = st[key].to(self.state_dtype).contiguous()
            if "step" in st:
                st["step"] = torch.as_tensor(st["step"], dtype=torch.float32).cpu()

    def master_weights_in_model(self):
        """Parameters hold their fp32 masters inside the block (checkpoint save and load)."""
        if self.mp is None:
            return contextlib.nullcontext()
        return self.mp.fp32_view()
