"""Rotary position embedding for GQA heads and MLA's rope channels, forward and backward fused.

Same signature and maths as `moecore.models.rope.apply_rotary(x, cos, sin, interleaved)`: x is
[B, heads, S, D] (any strides, last dim contiguous; the output has x's layout when x is dense),
cos/sin [S, d]; the first d channels are
rotated in the half-split pairing (j with j + d/2), the rest pass through. With `interleaved` (MLA
checkpoints) the pairs are (2j, 2j+1) on input and the output is in half-split order, as the
reference de-interleaves before rotating. In the kernel, with x1 / x2 the two halves of a pair:
    out[j] = x1 cos[j] - x2 sin[j],   out[j + d/2] = x2 cos[j + d/2] + x1 sin[j + d/2]
in fp32, rounded once. Backward applies the transposed rotation to the output gradient and puts the
pair back where it came from.
"""

from __future__ import annotations

import torch

from moecore.kernels._triton import next_pow2, triton_importable, use_triton

if triton_importable():
    import triton
    import triton.language as tl

    @triton.jit
    def _rope_kernel(
        x_ptr, cos_ptr, sin_ptr, out_ptr, NH, S, D, sxb, sxh, sxs, sob, soh, sos, HALF, INTERLEAVED: tl.constexpr,
        BACKWARD: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_J: tl.constexpr, BLOCK_R: tl.constexpr,
    ):  # fmt: skip
        bh = tl.program_id(0)
        b = bh // NH
        hh = bh % NH
        rs = tl.program_id(1) * BLOCK_S + tl.arange(0, BLOCK_S)
        j = tl.arange(0, BLOCK_J)
        ms = rs < S
        mj = j < HALF
        m = ms[:, None] & mj[None, :]
        src = x_ptr + b.to(tl.int64) * sxb + hh.to(tl.int64) * sxh + rs.to(tl.int64)[:, None] * sxs
        dst = out_ptr + b.to(tl.int64) * sob + hh.to(tl.int64) * soh + rs.to(tl.int64)[:, None] * sos
        c1 = tl.load(cos_ptr + rs[:, None] * (2 * HALF) + j[None, :], mask=m, other=0.0).to(tl.float32)
        c2 = tl.load(cos_ptr + rs[:, None] * (2 * HALF) + HALF + j[None, :], mask=m, other=0.0).to(tl.float32)
        s1 = tl.load(sin_ptr + rs[:, None] * (2 * HALF) + j[None, :], mask=m, other=0.0).to(tl.float32)
        s2 = tl.load(sin_ptr + rs[:, None] * (2 * HALF) + HALF + j[None, :], mask=m, other=0.0).to(tl.float32)
        if BACKWARD:
            # gradient arrives in half-split order; send it back to the input's channel positions
            g1 = tl.load(src + j[None, :], mask=m, other=0.0).to(tl.float32)
            g2 = tl.load(src + HALF + j[None, :], mask=m, other=0.0).to(tl.float32)
            o1 = g1 * c1 + g2 * s2
            o2 = g2 * c2 - g1 * s1
            if INTERLEAVED:
                p1 = 2 * j
                p2 = 2 * j + 1
            else:
                p1 = j
                p2 = j + HALF
        else:
            if INTERLEAVED:
                x1 = tl.load(src + 2 * j[None, :], mask=m, other=0.0).to(tl.float32)
                x2 = tl.load(src + 2 * j[None, :] + 1, mask=m, other=0.0).to(tl.float32)
            else:
                x1 = tl.load(src + j[None, :], mask=m, other=0.0).to(tl.float32)
                x2 = tl.load(src + HALF + j[None, :], mask=m, other=0.0).to(tl.float32)
            o1 = x1 * c1 - x2 * s1
            o2 = x2 * c2 + x1 * s2
            p1 = j
            p2 = j + HALF
        tl.store(dst + p1[None, :], o1.to(out_ptr.dtype.element_ty), mask=m)
        tl.store(dst + p2[None, :], o2.to(out_ptr.dtype.element_ty), mask=m)
        # channels past the rotary ones pass through unchanged
        r = 2 * HALF + tl.arange(0, BLOCK_R)
        mr = ms[:, None] & (r < D)[None, :]
        v = tl.load(src + r[None, :], mask=mr, other=0.0)
        tl.store(dst + r[None, :], v, mask=mr)


def apply_rotary_reference(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool = False
) -> torch.Tensor:
    """The model's rotary (moecore.models.rope.apply_rotary), restated so the kernel has its reference here."""
    d = cos.shape[-1]
    rot, rest = (x, None) if d == x.shape[-1] else (x[..., :d], x[..., d:])
    if interleaved:
        rot = torch.cat((rot[..., 0::2], rot[..., 1::2]), dim=-1)
    x1, x2 = rot.chunk(2, dim=-1)
    rot = rot * cos + torch.cat((-x2, x1), dim=-1) * sin
    return rot if rest is None else torch.cat((rot, rest), dim=-1)


def _launch(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool, backward: bool) -> torch.Tensor:
    if x.stride(-1) != 1:
        x = x.contiguous()
    B, NH, S, D = x.shape
    half = cos.shape[-1] // 2
    # The output keeps x's memory layout when x is dense (a [B, S, heads, D] tensor seen as
    # [B, heads, S, D], as attention builds q and k): attention then reads q, k, v in one layout and
    # no transpose copies are needed around it, in forward or backward. Otherwise it is contiguous.
    out = torch.empty_like(x)
    bj = next_pow2(max(half, 1))
    br = next_pow2(max(D - 2 * half, 1))
    bs = max(1, min(64, 2048 // bj))
    grid = (B * NH, triton.cdiv(S, bs))
    _rope_kernel[grid](
        x,
        cos.contiguous(),
        sin.contiguous(),
        out,
        NH,
        S,
        D,
        x.stride(0),
        x.stride(1),
        x.stride(2),
        out.stride(0),
        out.stride(1),
        out.stride(2),
        half,
        interleaved,
        backward,
        bs,
        bj,
        br,
    )
    return out


class _Rotary(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, cos, sin, interleaved: bool):
        ctx.save_for_backward(cos, sin)
        ctx.interleaved = interleaved
        return _launch(x, cos, sin, interleaved, backward=False)

    @staticmethod
    def backward(ctx, g):
        cos, sin = ctx.saved_tensors
        return _launch(g, cos, sin, ctx.interleaved, backward=True), None, None, None


def apply_rotary(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool = False, impl: str = "auto"
) -> torch.Tensor:
    """Rotate the first cos.shape[-1] channels of x [B, heads, S, D] (module docstring); differentiable in x."""
    shape_ok = x.dim() == 4 and cos.dim() == 2 and cos.shape == sin.shape and cos.shape[0] == x.shape[2]
    if not shape_ok or cos.shape[-1] % 2 or cos.shape[-1] > x.shape[-1] or not use_triton(impl, x):
        return apply_rotary_reference(x, cos, sin, interleaved)
    return _Rotary.apply(x, cos, sin, interleaved)
