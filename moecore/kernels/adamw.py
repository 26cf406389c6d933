"""One AdamW update per parameter tensor that reads and writes each byte once, for mixed precision.

Per element, in fp32 (the maths of `torch.optim.AdamW`, decoupled weight decay):

    g  = grad * grad_scale                       (grad_scale: the gradient-clipping coefficient)
    w  = w * (1 - lr * wd)
    m  = beta1 * m + (1 - beta1) * g
    v  = beta2 * v + (1 - beta2) * g^2
    w  = w - (lr / bc1) * m / (sqrt(v) / sqrt(bc2) + eps)        bc_i = 1 - beta_i^step

Where the weights come from and go to:
- with an fp32 `master`: w is read from and written to `master`, and also written, rounded, to the
  compute `param` (bf16): the cast that would otherwise be a second pass over the weights;
- without one: w is read from and written to `param` itself (fp32 training, or pure bf16).
`grad` may be bf16 or fp32, the moments `exp_avg` / `exp_avg_sq` fp32 or bf16 (rounded to nearest
on store). Bytes moved per element with an fp32 master, fp32 moments and a bf16 gradient: read
2 + 4 + 4 + 4, write 4 + 4 + 4 + 2 = 28, against 28 + 6 for torch's fused AdamW followed by a copy
to the bf16 weights (and 4 more when the gradient must first be cast to fp32).

`adamw_step_reference` is the same update in PyTorch ops; `adamw_step` launches the Triton kernel for
CUDA tensors (or `impl="triton"` under TRITON_INTERPRET=1) and the reference elsewhere.
"""

from __future__ import annotations

import math

import torch

from moecore.kernels._triton import triton_importable, use_triton

if triton_importable():
    import triton
    import triton.language as tl

    @triton.jit
    def _adamw_kernel(
        param_ptr,
        master_ptr,
        grad_ptr,
        m_ptr,
        v_ptr,
        n,
        beta1,
        beta2,
        eps,
        decay,
        step_size,
        bc2_sqrt,
        grad_scale,
        HAS_MASTER: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        g = tl.load(grad_ptr + offs, mask=mask, other=0.0).to(tl.float32) * grad_scale
        if HAS_MASTER:
            w = tl.load(master_ptr + offs, mask=mask, other=0.0)
        else:
            w = tl.load(param_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        m = tl.load(m_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        v = tl.load(v_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        w = w * decay
        m = beta1 * m + (1.0 - beta1) * g
        v = beta2 * v + (1.0 - beta2) * g * g
        # Correctly rounded sqrt and division, as torch's: the result matches the reference to rounding.
        w = w - step_size * tl.div_rn(m, tl.div_rn(tl.sqrt_rn(v), bc2_sqrt) + eps)
        tl.store(m_ptr + offs, m.to(m_ptr.dtype.element_ty), mask=mask)
        tl.store(v_ptr + offs, v.to(v_ptr.dtype.element_ty), mask=mask)
        if HAS_MASTER:
            tl.store(master_ptr + offs, w, mask=mask)
        tl.store(param_ptr + offs, w.to(param_ptr.dtype.element_ty), mask=mask)


def _scalars(lr: float, beta1: float, beta2: float, weight_decay: float, step: int) -> tuple[float, float, float]:
    """(decay factor, step size, sqrt of the second bias correction) of update number `step` (>= 1)."""
    bc1 = 1.0 - beta1**step
    bc2 = 1.0 - beta2**step
    return 1.0 - lr * weight_decay, lr / bc1, math.sqrt(bc2)


@torch.no_grad()
def adamw_step_reference(
    param: torch.Tensor,
    master: torch.Tensor | None,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    step: int,
    grad_scale: float = 1.0,
) -> None:
    """The update of the module docstring with PyTorch ops (in place; fp32 arithmetic)."""
    decay, step_size, bc2_sqrt = _scalars(lr, beta1, beta2, weight_decay, step)
    g = grad.float() * grad_scale
    w = (master if master is not None else param).float() * decay
    m = exp_avg.float().mul_(beta1).add_(g, alpha=1.0 - beta1)
    v = exp_avg_sq.float().mul_(beta2).addcmul_(g, g, value=1.0 - beta2)
    w = w - step_size * m / (v.sqrt() / bc2_sqrt + eps)
    exp_avg.copy_(m)
    exp_avg_sq.copy_(v)
    if master is not None:
        master.copy_(w)
    param.copy_(w)


def adamw_step(
    param: torch.Tensor,
    master: torch.Tensor | None,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    step: int,
    grad_scale: float = 1.0,
    impl: str = "auto",
) -> None:
    """One AdamW update of `param` (and `master`, when given) in place; see the module docstring.

    Every tensor must hold the same number of elements and be contiguous; `master` is fp32.
    """
    tensors = [t for t in (param, master, grad, exp_avg, exp_avg_sq) if t is not None]
    if not use_triton(impl, *tensors) or not all(t.is_contiguous() for t in tensors):
        adamw_step_reference(
            param, master, grad, exp_avg, exp_avg_sq, lr=lr, beta1=beta1, beta2=beta2, eps=eps,
            weight_decay=weight_decay, step=step, grad_scale=grad_scale,
        )  # fmt: skip
        return
    n = param.numel()
    if n == 0:
        return
    decay, step_size, bc2_sqrt = _scalars(lr, beta1, beta2, weight_decay, step)
    block = 2048
    _adamw_kernel[(triton.cdiv(n, block),)](
        param, master if master is not None else param, grad, exp_avg, exp_avg_sq, n,
        beta1, beta2, eps, decay, step_size, bc2_sqrt, float(grad_scale),
        HAS_MASTER=master is not None, BLOCK=block, num_warps=8,
    )  # fmt: skip
    # in place, as the reference is: bump the version counters the kernel's writes leave alone, so that autograd
    # still detects a tensor it saved for backward being changed by the update
    torch.autograd.graph.increment_version([t for t in (param, master, exp_avg, exp_avg_sq) if t is not None])
