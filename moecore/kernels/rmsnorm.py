"""RMSNorm forward and backward fused, with the same signature as `moecore.models.norms.rms_norm`.

    y = (x * rstd * w).to(x.dtype),   rstd = 1 / sqrt(mean(x^2) + eps),   w = weight (or 1 + weight
    when zero-centred), all in fp32 as the reference does.
Backward, with xh = x * rstd and gw = dy * w:
    dx = rstd * (gw - xh * mean(gw * xh)),   dweight = sum over rows of dy * xh
One program normalises BLOCK_R rows; the weight gradient is summed per program in fp32 and the
partial sums are added by torch (no atomics, reproducible).
"""

from __future__ import annotations

import torch

from moecore.kernels._triton import next_pow2, triton_importable, use_triton

if triton_importable():
    import triton
    import triton.language as tl

    @triton.jit
    def _rms_fwd_kernel(
        x_ptr, w_ptr, y_ptr, rstd_ptr, N, H, eps, ZERO_C: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr
    ):
        rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
        cols = tl.arange(0, BLOCK_H)
        mask = (rows < N)[:, None] & (cols < H)[None, :]
        off = rows.to(tl.int64)[:, None] * H + cols[None, :]
        x = tl.load(x_ptr + off, mask=mask, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + cols, mask=cols < H, other=0.0).to(tl.float32)
        if ZERO_C:
            w = w + 1.0
        rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / H + eps)
        y = x * rstd[:, None] * w[None, :]
        tl.store(y_ptr + off, y.to(y_ptr.dtype.element_ty), mask=mask)
        tl.store(rstd_ptr + rows, rstd, mask=rows < N)

    @triton.jit
    def _rms_bwd_kernel(
        dy_ptr,
        x_ptr,
        w_ptr,
        rstd_ptr,
        dx_ptr,
        dw_ptr,
        N,
        H,
        ZERO_C: tl.constexpr,
        BLOCK_R: tl.constexpr,
        BLOCK_H: tl.constexpr,
        ROWS_PER_PROG: tl.constexpr,
    ):
        pid = tl.program_id(0)
        cols = tl.arange(0, BLOCK_H)
        cmask = cols < H
        w = tl.load(w_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
        if ZERO_C:
            w = w + 1.0
        dw = tl.zeros((BLOCK_H,), tl.float32)
        for r0 in range(0, ROWS_PER_PROG, BLOCK_R):
            rows = pid * ROWS_PER_PROG + r0 + tl.arange(0, BLOCK_R)
            rmask = rows < N
            mask = rmask[:, None] & cmask[None, :]
            off = rows.to(tl.int64)[:, None] * H + cols[None, :]
            x = tl.load(x_ptr + off, mask=mask, other=0.0).to(tl.float32)
            dy = tl.load(dy_ptr + off, mask=mask, other=0.0).to(tl.float32)
            rstd = tl.load(rstd_ptr + rows, mask=rmask, other=0.0)
            xh = x * rstd[:, None]
            gw = dy * w[None, :]
            c = tl.sum(gw * xh, axis=1) / H
            dx = rstd[:, None] * (gw - xh * c[:, None])
            tl.store(dx_ptr + off, dx.to(dx_ptr.dtype.element_ty), mask=mask)
            dw += tl.sum(dy * xh, axis=0)
        tl.store(dw_ptr + pid.to(tl.int64) * H + cols, dw, mask=cmask)


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float, zero_centered: bool = False) -> torch.Tensor:
    """Same maths as moecore.models.norms.rms_norm (fp32 statistics and scale, output in x's dtype)."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    w = weight.float() + 1.0 if zero_centered else weight.float()
    return (h * w).to(x.dtype)


def _blocks(H: int) -> tuple[int, int]:
    bh = next_pow2(H)
    return max(1, min(16, 4096 // bh)), bh


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps: float, zero_centered: bool):
        shape = x.shape
        x2 = x.reshape(-1, shape[-1]).contiguous()
        N, H = x2.shape
        y = torch.empty_like(x2)
        rstd = torch.empty(N, dtype=torch.float32, device=x.device)
        br, bh = _blocks(H)
        if N:
            _rms_fwd_kernel[(triton.cdiv(N, br),)](
                x2, weight, y, rstd, N, H, eps, zero_centered, br, bh, num_warps=8 if bh >= 2048 else 4
            )
        ctx.save_for_backward(x2, weight, rstd)
        ctx.zero_centered, ctx.shape = zero_centered, shape
        return y.view(shape)

    @staticmethod
    def backward(ctx, dy):
        x2, weight, rstd = ctx.saved_tensors
        N, H = x2.shape
        dy2 = dy.reshape(N, H).contiguous()
        dx = torch.empty_like(x2)
        br, bh = _blocks(H)
        rows_per = br * 8
        progs = max(1, triton.cdiv(N, rows_per))
        part = torch.empty(progs, H, dtype=torch.float32, device=x2.device)
        if N:
            _rms_bwd_kernel[(progs,)](
                dy2,
                x2,
                weight,
                rstd,
                dx,
                part,
                N,
                H,
                ctx.zero_centered,
                br,
                bh,
                rows_per,
                num_warps=8 if bh >= 2048 else 4,
            )
        else:
            part.zero_()
        return dx.view(ctx.shape), part.sum(0).to(weight.dtype), None, None


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, zero_centered: bool = False, impl: str = "auto"
) -> torch.Tensor:
    """RMSNorm over the last dim (module docstring); Triton on CUDA, the reference elsewhere."""
    if not use_triton(impl, x, weight) or x.shape[-1] > 65536:
        return rms_norm_reference(x, weight, eps, zero_centered)
    return _RMSNorm.apply(x, weight, eps, zero_centered)
