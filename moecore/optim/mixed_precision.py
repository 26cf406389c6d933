"""Mixed-precision training: bf16 compute parameters, fp32 master weights, fp32 gradient sums.

With `train.precision=bf16` the model's parameters *are* bf16: every GEMM, the fused expert FFN,
the router, attention, the norms and the fused cross-entropy receive bf16 weights and bf16
activations, with no per-op casts (autocast stays on for the ops it keeps in fp32). What the
optimizer needs in higher precision lives beside the model:

- master weights (`optim.master_weights=fp32`, the default): the fp32 tensor each parameter was
  built with is kept as its master copy; the update is applied to it and the result rounded to the
  bf16 parameter (by the fused AdamW kernel in the same pass, or by one copy for other optimizers).
  `master_weights=bf16` updates the bf16 parameters in place (no master copy).
- main gradients: when the gradients of a step are sums — over micro-batches, or over ranks — each
  parameter's bf16 `.grad` is added into an fp32 `p.main_grad` as soon as autograd has produced it
  (a post-accumulate-grad hook), and `.grad` is freed. With one micro-batch on one rank there is
  nothing to sum, and the bf16 gradient (which is what the bf16 weight-gradient GEMM produced) is
  used as it is. `grad_of(p)` is the gradient the rest of the step uses, whichever holds it.

Bytes per parameter (not sharded): bf16 parameter 2 + fp32 master 4 (0 with master_weights=bf16)
+ gradient 4 (fp32 main grad) or 2 (bf16, one micro-batch on one rank) + AdamW moments 8 (fp32) or
4 (`optim.state_dtype=bf16`). docs/train.md tabulates the modes.

Checkpoints hold the master weights: `fp32_view()` lends every parameter its master tensor (and
an fp32 gradient) for the duration of a save, a load, or an optimizer that only knows fp32
parameters (Muon), so files and optimizers never see the bf16 copy.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn


def grad_of(p: torch.Tensor) -> torch.Tensor | None:
    """The gradient of `p` for this step: its fp32 main gradient when the run sums in fp32, else `.grad`."""
    g = getattr(p, "main_grad", None)
    return g if g is not None else p.grad


def set_grad(p: torch.Tensor, g: torch.Tensor) -> None:
    """Store `g` as the gradient `grad_of(p)` returns (the main gradient when `p` has one, else `.grad`)."""
    if hasattr(p, "main_grad"):  # the run sums gradients in fp32 (MixedPrecision with sum_in_fp32)
        p.main_grad = g
    else:
        p.grad = g


class MixedPrecision:
    """The bf16 parameters of a model and what the optimizer keeps for them; see the module docstring.

    `model` is built in fp32 (and loaded, if a run starts from weights); the constructor turns its
    parameters into `compute_dtype` and keeps the fp32 tensors as masters when `master_weights`.
    Buffers (RoPE tables, expert biases) keep their dtype. `sum_in_fp32` registers the hooks that add
    gradients into fp32 main gradients; register them before any other gradient hook (the data-parallel
    reduction reads the main gradients from its own hooks).
    """

    def __init__(
        self, model: nn.Module, compute_dtype: torch.dtype, master_weights: bool = True, sum_in_fp32: bool = True
    ) -> None:
        self.compute_dtype = compute_dtype
        self.params = [p for p in model.parameters()]
        self.masters: dict[torch.Tensor, torch.Tensor] = {}
        self.sum_in_fp32 = sum_in_fp32
        # Parameters whose compute copy is not a cast of the master (FP8 primary weights, moecore/models/fp8.py):
        # p -> fn(master) that rebuilds it. Their `.data` is a placeholder; the optimizer updates the master only.
        self.recast: dict[torch.Tensor, object] = {}
        self._hooks = []
        with torch.no_grad():
            for p in self.params:
                if p.dtype == compute_dtype:
                    continue
                if master_weights and p.requires_grad:
                    self.masters[p] = p.data.float()  # the fp32 tensor itself, not a copy
                p.data = p.data.to(compute_dtype)
        if sum_in_fp32:
            for p in self.params:
                if p.requires_grad:
                    p.main_grad = None
                    self._hooks.append(p.register_post_accumulate_grad_hook(self._accumulate))

    # ------------------------------------------------------------------ gradients
    @staticmethod
    @torch.no_grad()
    def _accumulate(p: torch.Tensor) -> None:
        """Add the gradient autograd just produced into the fp32 main gradient, and free it."""
        if p.main_grad is None:
            p.main_grad = p.grad.float()
        else:
            p.main_grad.add_(p.grad)
        p.grad = None

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None
            if hasattr(p, "main_grad"):
                p.main_grad = None

    # ------------------------------------------------------------------ weights
    @torch.no_grad()
    def copy_to_compute(self) -> None:
        """Round every master weight into its bf16 parameter (after an update or a load)."""
        if self.masters:
            params = [p for p in self.masters if p not in self.recast]
            torch._foreach_copy_([p.data for p in params], [self.masters[p] for p in params])
        for p, rebuild in self.recast.items():
            rebuild(self.masters[p])

    @contextlib.contextmanager
    def fp32_view(self, with_grads: bool = False) -> Iterator[None]:
        """Parameters hold their fp32 masters (and, `with_grads`, an fp32 `.grad`) inside the block.

        Whatever is written into them there (an optimizer update, a checkpoint load) is rounded back
        into the bf16 parameters on exit.
        """
        compute: dict[torch.Tensor, torch.Tensor] = {}
        lent: list[torch.Tensor] = []
        try:
            for p in self.params:
                g = grad_of(p) if with_grads else None
                master = self.masters.get(p)
                if master is not None:
                    p.grad = None
                    compute[p] = p.data
                    p.data = master
                if g is not None:
                    p.grad = g.to(p.dtype)
                    lent.append(p)
            yield
        finally:
            for p, data in compute.items():
                p.grad = None
                p.data = data
            for p in lent:
                p.grad = None
                if hasattr(p, "main_grad"):
                    p.main_grad = None
            self.copy_to_compute()


class MasterWeightOptimizer:
    """Any optimizer over fp32 parameters (Muon) driven on master weights.

    `step()` runs the inner optimizer inside `MixedPrecision.fp32_view(with_grads=True)` and rounds the
    result into the bf16 parameters; every other attribute is the inner optimizer's.
    """

    def __init__(self, inner, mp: MixedPrecision) -> None:
        self.inner = inner
        self.mp = mp

    def __getattr__(self, name: str):
        return getattr(self.inner, name)

    @property
    def optimizers(self) -> list:
        """The torch optimizers inside (what torch.distributed.checkpoint's state dicts walk)."""
        return list(getattr(self.inner, "optimizers", [self.inner]))

    @property
    def param_groups(self) -> list[dict]:
        return self.inner.param_groups

    @property
    def state(self):
        return self.inner.state

    def step(self, closure=None) -> None:
        with self.mp.fp32_view(with_grads=True):
            self.inner.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.mp.zero_grad()
        self.inner.zero_grad(set_to_none=True)

    def state_dict(self) -> dict:
        return self.inner.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.inner.load_state_dict(state)

    def master_weights_in_model(self):
        return self.mp.fp32_view()
