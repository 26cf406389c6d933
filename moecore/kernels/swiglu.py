"""SwiGLU with optional per-row routing probabilities, forward and backward, fused.

    h = [g | u]  (the first half of the last dim is the gate, the second the up projection;
                  this is the row order of `w13` = gate rows then up rows)
    out = silu(g) * u * p      (p: one routing probability per row, or 1)

Megatron-Core multiplies the routing probabilities inside the expert activation (its weighted
SwiGLU) so that the unpermute is a plain sum and the probability gradient is a row-sum over F
channels instead of H. The maths is done in fp32 and rounded once to h's dtype, in the kernel and in
the reference alike. Backward, with s = sigmoid(g) and d = dout * p:
    dg = d * u * s * (1 + g * (1 - s)),   du = d * g * s,   dp = sum_f dout * silu(g) * u

With a `limit` L (DeepSeek-V4's clipped SwiGLU, `model.activation=swiglu_clipped`) the gate and up inputs are
clipped first, g' = min(g, L) and u' = clamp(u, -L, L), and the formulas above run on g', u'; a clipped
element passes no gradient (torch.clamp's rule: an element exactly at the limit still does):
    dg = [g <= L] * d * u' * s' * (1 + g' * (1 - s')),   du = [-L <= u <= L] * d * silu(g')

With an `alpha` (gpt-oss's clamped SwiGLU, `model.activation=swiglu_clamped`; it also clips with its limit) the gate
is g * sigmoid(alpha * g) and the up term u + 1: out = g * s * (u + 1) * p with s = sigmoid(alpha * g), and
    dg = d * (u + 1) * s * (1 + alpha * g * (1 - s)),   du = d * g * s,   dp = sum_f dout * g * s * (u + 1)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from moecore.kernels._triton import next_pow2, triton_importable, use_triton

if triton_importable():
    import triton
    import triton.language as tl

    @triton.jit
    def _swiglu_fwd_kernel(
        h_ptr,
        p_ptr,
        out_ptr,
        M,
        F,
        limit,
        alpha,
        HAS_P: tl.constexpr,
        CLIP: tl.constexpr,
        OSS: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_F: tl.constexpr,
    ):
        rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        rf = tl.program_id(1) * BLOCK_F + tl.arange(0, BLOCK_F)
        mask = (rm < M)[:, None] & (rf < F)[None, :]
        row = rm.to(tl.int64)[:, None]
        g = tl.load(h_ptr + row * (2 * F) + rf[None, :], mask=mask, other=0.0).to(tl.float32)
        u = tl.load(h_ptr + row * (2 * F) + F + rf[None, :], mask=mask, other=0.0).to(tl.float32)
        if CLIP:
            g = tl.minimum(g, limit)
            u = tl.minimum(tl.maximum(u, -limit), limit)
        if OSS:  # gpt-oss: g * sigmoid(alpha * g) * (u + 1)
            a = g * tl.sigmoid(alpha * g) * (u + 1.0)
        else:
            a = g * tl.sigmoid(g) * u
        if HAS_P:
            p = tl.load(p_ptr + rm, mask=rm < M, other=0.0).to(tl.float32)
            a = a * p[:, None]
        tl.store(out_ptr + row * F + rf[None, :], a.to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _swiglu_bwd_kernel(
        h_ptr,
        p_ptr,
        do_ptr,
        dh_ptr,
        dp_ptr,
        a_ptr,
        M,
        F,
        limit,
        alpha,
        HAS_P: tl.constexpr,
        STORE_A: tl.constexpr,
        CLIP: tl.constexpr,
        OSS: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_F: tl.constexpr,
    ):
        # One program owns BLOCK_M whole rows so the probability gradient (a row sum) needs no atomics.
        rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        mrow = rm < M
        row = rm.to(tl.int64)[:, None]
        if HAS_P:
            p = tl.load(p_ptr + rm, mask=mrow, other=0.0).to(tl.float32)
        dp = tl.zeros((BLOCK_M,), dtype=tl.float32)
        for f0 in range(0, F, BLOCK_F):
            rf = f0 + tl.arange(0, BLOCK_F)
            mask = mrow[:, None] & (rf < F)[None, :]
            g = tl.load(h_ptr + row * (2 * F) + rf[None, :], mask=mask, other=0.0).to(tl.float32)
            u = tl.load(h_ptr + row * (2 * F) + F + rf[None, :], mask=mask, other=0.0).to(tl.float32)
            do = tl.load(do_ptr + row * F + rf[None, :], mask=mask, other=0.0).to(tl.float32)
            if CLIP:
                pass_g = g <= limit
                pass_u = (u >= -limit) & (u <= limit)
                g = tl.minimum(g, limit)
                u = tl.minimum(tl.maximum(u, -limit), limit)
            if OSS:  # gpt-oss: the gate's sigmoid of alpha * g, the up term u + 1
                ag = alpha * g
                u = u + 1.0
            else:
                ag = g
            s = tl.sigmoid(ag)
            silu = g * s
            if HAS_P:
                dp += tl.sum(do * silu * u, axis=1)
                d = do * p[:, None]
            else:
                d = do
            dg = d * u * s * (1.0 + ag * (1.0 - s))
            du = d * silu
            if CLIP:
                dg = tl.where(pass_g, dg, 0.0)
                du = tl.where(pass_u, du, 0.0)
            tl.store(dh_ptr + row * (2 * F) + rf[None, :], dg.to(dh_ptr.dtype.element_ty), mask=mask)
            tl.store(dh_ptr + row * (2 * F) + F + rf[None, :], du.to(dh_ptr.dtype.element_ty), mask=mask)
            if STORE_A:
                a = silu * u
                if HAS_P:
                    a = a * p[:, None]
                tl.store(a_ptr + row * F + rf[None, :], a.to(a_ptr.dtype.element_ty), mask=mask)
        if HAS_P:
            tl.store(dp_ptr + rm, dp, mask=mrow)


def _clipped(g: torch.Tensor, u: torch.Tensor, limit: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(min(g, limit), clamp(u, -limit, limit)), or (g, u) without a limit."""
    if limit is None:
        return g, u
    return g.clamp(max=limit), u.clamp(min=-limit, max=limit)


def _gate_up(g: torch.Tensor, u: torch.Tensor, alpha: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(the gate's sigmoid argument, the up term): (g, u), or gpt-oss's (alpha * g, u + 1)."""
    return (g, u) if alpha is None else (alpha * g, u + 1)


def swiglu_reference(
    h: torch.Tensor, probs: torch.Tensor | None = None, limit: float | None = None, alpha: float | None = None
) -> torch.Tensor:
    """silu(g) * u (* p) in fp32, rounded to h's dtype; h [..., 2F], probs [...] or None -> [..., F].
    `limit`: g and u clipped first; `alpha`: gpt-oss's form (module docstring)."""
    g, u = _clipped(*h.float().chunk(2, dim=-1), limit)
    ag, up = _gate_up(g, u, alpha)
    out = (F.silu(g) if alpha is None else g * torch.sigmoid(ag)) * up
    if probs is not None:
        out = out * probs.float().unsqueeze(-1)
    return out.to(h.dtype)


def swiglu_backward_reference(
    h: torch.Tensor,
    probs: torch.Tensor | None,
    dout: torch.Tensor,
    limit: float | None = None,
    alpha: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """(dh in h's dtype, dprobs fp32 or None, recomputed out) from the formulas in the module docstring."""
    g0, u0 = h.float().chunk(2, dim=-1)
    g, u = _clipped(g0, u0, limit)
    ag, u = _gate_up(g, u, alpha)
    do = dout.float()
    s = torch.sigmoid(ag)
    silu = g * s
    a = silu * u
    dp = None
    if probs is not None:
        p = probs.float().unsqueeze(-1)
        dp = (do * a).sum(-1)
        do = do * p
        a = a * p
    dg = do * u * s * (1 + ag * (1 - s))
    du = do * silu
    if limit is not None:
        dg = dg * (g0 <= limit)
        du = du * ((u0 >= -limit) & (u0 <= limit))
    return torch.cat((dg, du), dim=-1).to(h.dtype), dp, a.to(h.dtype)


def _launch_fwd(h2: torch.Tensor, p1: torch.Tensor | None, limit: float | None, alpha: float | None) -> torch.Tensor:
    M, F2 = h2.shape
    Fh = F2 // 2
    out = torch.empty(M, Fh, dtype=h2.dtype, device=h2.device)
    block_f = min(next_pow2(Fh), 1024)
    block_m = max(1, 2048 // block_f)
    grid = (triton.cdiv(M, block_m), triton.cdiv(Fh, block_f))
    lim, clip = (0.0, False) if limit is None else (float(limit), True)
    alp, oss = (1.0, False) if alpha is None else (float(alpha), True)
    p = p1 if p1 is not None else h2
    _swiglu_fwd_kernel[grid](h2, p, out, M, Fh, lim, alp, p1 is not None, clip, oss, block_m, block_f)
    return out


def _launch_bwd(
    h2: torch.Tensor,
    p1: torch.Tensor | None,
    do2: torch.Tensor,
    store_a: bool,
    limit: float | None,
    alpha: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    M, F2 = h2.shape
    Fh = F2 // 2
    dh = torch.empty_like(h2)
    dp = torch.empty(M, dtype=torch.float32, device=h2.device) if p1 is not None else None
    a = torch.empty(M, Fh, dtype=h2.dtype, device=h2.device) if store_a else None
    block_f = min(next_pow2(Fh), 256)
    block_m = max(1, 1024 // block_f)
    grid = (triton.cdiv(M, block_m),)
    _swiglu_bwd_kernel[grid](
        h2,
        p1 if p1 is not None else h2,
        do2,
        dh,
        dp if dp is not None else h2,
        a if a is not None else h2,
        M,
        Fh,
        0.0 if limit is None else float(limit),
        1.0 if alpha is None else float(alpha),
        p1 is not None,
        store_a,
        limit is not None,
        alpha is not None,
        block_m,
        block_f,
    )
    return dh, dp, a


def _flat(h: torch.Tensor, probs: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    h2 = h.reshape(-1, h.shape[-1]).contiguous()
    p1 = probs.reshape(-1).contiguous() if probs is not None else None
    return h2, p1


class _SwiGLUFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h: torch.Tensor, probs: torch.Tensor | None, limit: float | None, alpha: float | None = None):
        h2, p1 = _flat(h, probs)
        ctx.save_for_backward(h2, p1)
        ctx.h_shape, ctx.p_dtype, ctx.limit, ctx.alpha = h.shape, None if probs is None else probs.dtype, limit, alpha
        return _launch_fwd(h2, p1, limit, alpha).view(*h.shape[:-1], h.shape[-1] // 2)

    @staticmethod
    def backward(ctx, dout: torch.Tensor):
        h2, p1 = ctx.saved_tensors
        dh, dp, _ = _launch_bwd(h2, p1, dout.reshape(h2.shape[0], -1).contiguous(), False, ctx.limit, ctx.alpha)
        dprobs = None
        if dp is not None and ctx.needs_input_grad[1]:
            dprobs = dp.view(ctx.h_shape[:-1]).to(ctx.p_dtype)
        return dh.view(ctx.h_shape), dprobs, None, None


def swiglu(
    h: torch.Tensor,
    probs: torch.Tensor | None = None,
    impl: str = "auto",
    limit: float | None = None,
    alpha: float | None = None,
) -> torch.Tensor:
    """silu(g) * u (* probs) for h = [g | u] of shape [..., 2F]; probs [...] or None. Differentiable.
    `limit`: g and u clipped first (DeepSeek-V4, gpt-oss); `alpha`: gpt-oss's form (module docstring)."""
    if h.shape[-1] % 2:
        raise ValueError(f"swiglu input's last dim must be even (gate | up), got {h.shape[-1]}")
    tensors = (h,) if probs is None else (h, probs)
    if not use_triton(impl, *tensors):
        return swiglu_reference(h, probs, limit, alpha)
    return _SwiGLUFunction.apply(h, probs, limit, alpha)


def swiglu_backward(
    h: torch.Tensor,
    probs: torch.Tensor | None,
    dout: torch.Tensor,
    impl: str = "auto",
    limit: float | None = None,
    alpha: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """(dh, dprobs fp32 or None, out recomputed) for 2-D h [M, 2F]; used by the fused expert FFN."""
    tensors = (h, dout) if probs is None else (h, probs, dout)
    if not use_triton(impl, *tensors):
        return swiglu_backward_reference(h, probs, dout, limit, alpha)
    h2, p1 = _flat(h, probs)
    dh, dp, a = _launch_bwd(h2, p1, dout.reshape(h2.shape[0], -1).contiguous(), True, limit, alpha)
    return dh, dp, a
