"""Fused linear + cross-entropy: the LM head and its loss, chunked over tokens.

    loss_sum = sum_n mask[n] * (logsumexp_v(z[n, v]) - z[n, label[n]]),   z = h @ W^T

computed `chunk` rows at a time. For each chunk the logits z_c are one GEMM in h's dtype; the
cross-entropy reads them in fp32 and overwrites them in place with the logit gradient
(softmax(z_c) - onehot(label)) * mask, from which dh_c = g_c @ W and dW += g_c^T @ h_c follow at
once. So the forward already holds the gradients and never keeps more than one chunk of logits:
for a 151936-word vocabulary and 8192 tokens that is 1.2 GB of bf16 per 4096-row chunk instead of
5 GB of fp32 logits plus their gradient. Backward scales the stored gradients by the incoming one.

Numerics follow the model's unfused path (`F.linear` in h's dtype, then `.float()` and
`F.cross_entropy`): the same bf16 logits, an fp32 softmax, and the gradient rounded to h's dtype
before the two GEMMs; under autocast h and W are first cast to the autocast dtype, as `F.linear`
would. Labels < 0 (e.g. -100) count as masked. The per-chunk cross-entropy runs as
a Triton kernel on GPU (`_ce_rows_kernel`, one program per row, two passes over the vocabulary:
online max / sum of exponentials, then the gradient) and as `_ce_rows_reference` elsewhere.
"""

from __future__ import annotations

import torch

from moecore.kernels._triton import triton_importable, use_triton

if triton_importable():
    import triton
    import triton.language as tl

    @triton.jit
    def _ce_rows_kernel(z_ptr, labels_ptr, mask_ptr, loss_ptr, V, stride, BLOCK_V: tl.constexpr):
        n = tl.program_id(0)
        row = z_ptr + n.to(tl.int64) * stride
        label = tl.load(labels_ptr + n)
        w = tl.load(mask_ptr + n).to(tl.float32)
        w = tl.where(label < 0, 0.0, w)
        m = tl.full((BLOCK_V,), float("-inf"), tl.float32)
        s = tl.zeros((BLOCK_V,), tl.float32)
        for v0 in range(0, V, BLOCK_V):
            rv = v0 + tl.arange(0, BLOCK_V)
            z = tl.load(row + rv, mask=rv < V, other=float("-inf")).to(tl.float32)
            m_new = tl.maximum(m, z)
            s = s * tl.exp(m - m_new) + tl.exp(z - m_new)
            s = tl.where(m_new == float("-inf"), 0.0, s)
            m = m_new
        mx = tl.max(m, axis=0)
        lse = mx + tl.log(tl.sum(s * tl.exp(m - mx), axis=0))
        safe = tl.maximum(label, 0)
        z_label = tl.load(row + safe).to(tl.float32)
        tl.store(loss_ptr + n, (lse - z_label) * w)
        for v0 in range(0, V, BLOCK_V):
            rv = v0 + tl.arange(0, BLOCK_V)
            z = tl.load(row + rv, mask=rv < V, other=0.0).to(tl.float32)
            g = tl.exp(z - lse)
            g = tl.where(rv == label, g - 1.0, g) * w
            tl.store(row + rv, g.to(z_ptr.dtype.element_ty), mask=rv < V)


def _ce_rows_reference(z: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per-row masked loss (fp32); z [C, V] is overwritten with its gradient in z's dtype."""
    acc = torch.promote_types(z.dtype, torch.float32)
    w = torch.where(labels < 0, torch.zeros_like(mask, dtype=acc), mask.to(acc))
    zf = z.to(acc)
    lse = torch.logsumexp(zf, dim=-1)
    safe = labels.clamp(min=0)
    loss = (lse - zf.gather(1, safe[:, None]).squeeze(1)) * w
    g = torch.exp(zf - lse[:, None])
    g[torch.arange(z.shape[0], device=z.device), safe] -= 1.0
    z.copy_(g * w[:, None])
    return loss


def _ce_rows(z: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor, impl: str) -> torch.Tensor:
    if not use_triton(impl, z):
        return _ce_rows_reference(z, labels, mask)
    loss = torch.empty(z.shape[0], dtype=torch.float32, device=z.device)
    if z.shape[0]:
        block = 4096 if z.is_cuda else 64
        _ce_rows_kernel[(z.shape[0],)](
            z, labels, mask, loss, z.shape[1], z.stride(0), block, num_warps=8 if z.is_cuda else 1
        )
    return loss


def _chunked(h, weight, labels, mask, chunk: int, impl: str, need_grad: bool):
    """(loss_sum fp32, dh or None, dW or None) with the logits of one chunk alive at a time."""
    N = h.shape[0]
    loss = torch.zeros((), dtype=torch.promote_types(h.dtype, torch.float32), device=h.device)
    dh = torch.empty_like(h) if need_grad else None
    dw = None
    w = weight.to(h.dtype)
    for s in range(0, N, chunk):
        hc = h[s : s + chunk]
        z = hc @ w.t()
        loss = loss + _ce_rows(z, labels[s : s + chunk], mask[s : s + chunk], impl).sum()
        if need_grad:
            torch.mm(z, w, out=dh[s : s + chunk])
            dw = z.t() @ hc if N <= chunk else _accumulate_dw(dw, z, hc)
        del z
    return loss, dh, dw


def _accumulate_dw(dw: torch.Tensor | None, z: torch.Tensor, hc: torch.Tensor) -> torch.Tensor:
    """dw + z^T @ hc, summed in fp32 over the chunks."""
    acc = torch.promote_types(z.dtype, torch.float32)
    part = (z.t() @ hc).to(acc)
    return part if dw is None else dw.add_(part)


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, weight, labels, mask, chunk: int, impl: str):
        loss, dh, dw = _chunked(h, weight, labels, mask, chunk, impl, need_grad=True)
        ctx.dh, ctx.dw, ctx.w_dtype = dh, dw, weight.dtype
        return loss

    @staticmethod
    def backward(ctx, g):
        dh, dw = ctx.dh, ctx.dw
        ctx.dh = ctx.dw = None
        dh = dh * g.to(dh.dtype) if ctx.needs_input_grad[0] else None
        if ctx.needs_input_grad[1]:  # scaled and cast in one pass
            dw = torch.mul(dw, g.to(dw.dtype), out=torch.empty_like(dw, dtype=ctx.w_dtype))
        else:
            dw = None
        return dh, dw, None, None, None, None


def linear_cross_entropy_reference(
    h_NH: torch.Tensor, weight_VH: torch.Tensor, labels_N: torch.Tensor, mask_N: torch.Tensor | None = None
) -> torch.Tensor:
    """The unfused formula (full logits): sum_n mask[n] * CE(h[n] @ W^T in h's dtype, upcast to fp32)."""
    logits = (h_NH @ weight_VH.to(h_NH.dtype).t()).to(torch.promote_types(h_NH.dtype, torch.float32))
    ce = torch.nn.functional.cross_entropy(logits, labels_N.clamp(min=0), reduction="none")
    w = torch.ones_like(ce) if mask_N is None else mask_N.to(ce.dtype)
    return (ce * torch.where(labels_N < 0, torch.zeros_like(w), w)).sum()


def linear_cross_entropy(
    h_NH: torch.Tensor,
    weight_VH: torch.Tensor,
    labels_N: torch.Tensor,
    mask_N: torch.Tensor | None = None,
    chunk: int = 4096,
    impl: str = "auto",
) -> torch.Tensor:
    """Masked sum of token cross-entropies of the LM head h @ W^T, never holding all logits (module doc).

    h [N, H], weight [V, H], labels [N] (int, < 0 ignored), mask [N] (float weights, default 1).
    Returns an fp32 scalar, differentiable in h and weight.
    """
    if chunk < 1:
        raise ValueError(f"chunk={chunk} is invalid: must be >= 1")
    dev_type = h_NH.device.type
    if torch.is_autocast_enabled(dev_type):
        # Under autocast the unfused head (F.linear) runs in the autocast dtype; cast once here (the casts
        # are differentiable, so fp32 master weights still get their gradient) and run the chunks with
        # autocast off, so every GEMM and its `out=` buffer agree on one dtype.
        dt = torch.get_autocast_dtype(dev_type)
        with torch.autocast(dev_type, enabled=False):
            return linear_cross_entropy(h_NH.to(dt), weight_VH.to(dt), labels_N, mask_N, chunk, impl)
    acc = torch.promote_types(h_NH.dtype, torch.float32)
    mask = torch.ones(h_NH.shape[0], device=h_NH.device, dtype=acc) if mask_N is None else mask_N.to(acc)
    mask = mask.contiguous()
    labels = labels_N.contiguous()
    h = h_NH.contiguous()
    need_grad = torch.is_grad_enabled() and (h_NH.requires_grad or weight_VH.requires_grad)
    if not need_grad:
        return _chunked(h, weight_VH, labels, mask, chunk, impl, need_grad=False)[0]
    return _LinearCrossEntropy.apply(h, weight_VH, labels, mask, chunk, impl)
