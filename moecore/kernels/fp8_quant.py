"""FP8 quantisation with current scaling: Triton kernels beside their PyTorch references.

A quantised tensor is (q, s): q in float8 (e4m3fn or e5m2), s in fp32, with x ~= q * s per group. The
scale of a group is computed from the group itself at every call (current scaling, no amax history):

    s = max(amax(|x|), AMAX_FLOOR) / fp8_max        q = saturate(x / s) rounded to nearest-even in fp8

so the group's largest magnitude lands on fp8_max (448 for e4m3, 57344 for e5m2). With `pow2` the
scale is rounded *up* to a power of two (exponent bits only; x / s is then exact before the final
rounding). DeepSeek-V3 trained with plain scales; the option exists because it makes re-scaling
between layouts exact. Groups ("granularities"):

- tensorwise:  one scale for the whole tensor                          s: []
- rowwise:     one scale per row (amax along the last dim)             s: [M, 1]
- 1x128:       one scale per row and 128 consecutive columns           s: [M, ceil(K/128)]
- 128x128:     one scale per 128 x 128 tile (weights, DeepSeek-V3)      s: [ceil(M/128), ceil(K/128)]

Two more layouts serve the expert GEMMs (moecore/kernels/fp8_grouped.py): `quantize_grouped_cols` (a
[P, C] operand quantised along each expert's rows, one scale per expert and column, written transposed for
the weight-gradient GEMM) and `quantize_weight_layouts` (expert weights [E, N, K] rowwise along K and/or
transposed to [E, K, N] along N, the two GEMM layouts of rowwise scaling); `quantize_transposed` is one group
of the first (a linear's x^T and dy^T). `swiglu_quantize` fuses the
experts' SwiGLU (* routing probabilities) with rowwise or 1x128 quantisation.

Each function takes `impl` (moecore/kernels/_triton.py): the Triton kernel on CUDA, the reference
elsewhere; both divide with IEEE round-to-nearest (`tl.div_rn`) and round to the FP8 grid in fp32 before
an exact cast, so that they agree bit for bit.
"""

from __future__ import annotations

import torch

from moecore.kernels._triton import triton_importable, use_triton
from moecore.kernels.grouped_gemm import group_bounds

FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}
AMAX_FLOOR = 1e-12  # the scale of an all-zero group: any positive value gives q = 0
BLOCK = 128

if triton_importable():
    import triton
    import triton.language as tl

    @triton.jit
    def _scale_of(amax, FMAX: tl.constexpr, POW2: tl.constexpr):
        s = tl.div_rn(tl.maximum(amax, 1e-12), FMAX)
        if POW2:  # round up to a power of two: clear the mantissa, bump the exponent when it was not zero
            bits = s.to(tl.int32, bitcast=True)
            bits = (bits + 0x7FFFFF) & -8388608  # 0xFF800000
            s = bits.to(tl.float32, bitcast=True)
        return s

    @triton.jit
    def _swiglu_tile(h_ptr, r64, cols, m, F, p, HAS_P: tl.constexpr):
        # silu(gate) * up (* the rows' routing probabilities) of a [rows, cols] tile of h = [gate | up], rounded to
        # h's dtype as the bf16 path stores it, returned in fp32
        g = tl.load(h_ptr + r64[:, None] * (2 * F) + cols[None, :], mask=m, other=0.0).to(tl.float32)
        u = tl.load(h_ptr + r64[:, None] * (2 * F) + F + cols[None, :], mask=m, other=0.0).to(tl.float32)
        a = g * tl.sigmoid(g) * u
        if HAS_P:
            a = a * p[:, None]
        return a.to(h_ptr.dtype.element_ty).to(tl.float32)

    @triton.jit
    def _to_fp8_grid(v, FMAX: tl.constexpr):
        # Round fp32 v (|v| <= FMAX) to the nearest fp8 value, ties to even, in fp32 arithmetic, so that the
        # final cast is exact (Triton's interpreter mis-rounds values that round up into the next binade).
        # ulp = 2^(exponent - mantissa bits), floored at the subnormal spacing; (v + 1.5 * 2^23 ulp) - that
        # rounds v to a multiple of ulp with the fp32 adder's round-to-nearest-even.
        if FMAX == 448.0:  # e4m3: 3 mantissa bits, subnormal spacing 2^-9
            ulp = tl.maximum(
                (v.to(tl.int32, bitcast=True) & 0x7F800000).to(tl.float32, bitcast=True) * 0.125, 0.001953125
            )
        else:  # e5m2: 2 mantissa bits, subnormal spacing 2^-16
            ulp = tl.maximum(
                (v.to(tl.int32, bitcast=True) & 0x7F800000).to(tl.float32, bitcast=True) * 0.25, 1.52587890625e-05
            )
        c = ulp * 12582912.0
        r = (tl.abs(v) + c) - c
        sign = v.to(tl.int32, bitcast=True) & -2147483648  # keep the sign bit (so -0.0 stays -0.0, as torch casts)
        return (r.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)

    @triton.jit
    def _quantized(v, s, FMAX: tl.constexpr):
        # v / s (IEEE division) saturated to +-FMAX and rounded to the fp8 grid, in fp32 (the cast after it is exact)
        return _to_fp8_grid(tl.clamp(tl.div_rn(v, s), -FMAX, FMAX), FMAX)

    @triton.jit
    def _quant_tile_kernel(
        x_ptr, q_ptr, s_ptr, R, C, stride_x, stride_xc, stride_q, s_stride_r, s_stride_c,
        BR: tl.constexpr, BC: tl.constexpr, PER_ROW: tl.constexpr, FMAX: tl.constexpr, POW2: tl.constexpr,
        TRANS_IN: tl.constexpr,
    ):  # fmt: skip
        # One program per [BR, BC] tile; PER_ROW: a scale per row of the tile (1 x BC groups), else one per tile.
        pr = tl.program_id(0)
        pc = tl.program_id(1)
        rows = pr * BR + tl.arange(0, BR)
        cols = pc * BC + tl.arange(0, BC)
        m = (rows < R)[:, None] & (cols < C)[None, :]
        r64 = rows.to(tl.int64)
        if TRANS_IN:  # x is a transposed view (rows contiguous): load [BC, BR] along them, transpose in registers
            mt = (rows < R)[None, :] & (cols < C)[:, None]
            xt = tl.load(x_ptr + r64[None, :] + cols.to(tl.int64)[:, None] * stride_xc, mask=mt, other=0.0)
            x = tl.trans(xt.to(tl.float32))
        else:
            x = tl.load(x_ptr + r64[:, None] * stride_x + cols[None, :] * stride_xc, mask=m, other=0.0).to(tl.float32)
        if PER_ROW:
            s = _scale_of(tl.max(tl.abs(x), axis=1), FMAX, POW2)
            tl.store(s_ptr + rows * s_stride_r + pc * s_stride_c, s, mask=rows < R)
            q = tl.div_rn(x, s[:, None])
        else:
            s = _scale_of(tl.max(tl.max(tl.abs(x), axis=1), axis=0), FMAX, POW2)
            tl.store(s_ptr + pr * s_stride_r + pc * s_stride_c, s)
            q = tl.div_rn(x, s)
        q = _to_fp8_grid(tl.clamp(q, -FMAX, FMAX), FMAX)
        tl.store(q_ptr + r64[:, None] * stride_q + cols[None, :], q.to(q_ptr.dtype.element_ty), mask=m)

    @triton.jit
    def _quant_rows_kernel(
        x_ptr, q_ptr, s_ptr, R, C, stride_x, stride_q,
        BR: tl.constexpr, BC: tl.constexpr, FMAX: tl.constexpr, POW2: tl.constexpr, ONE_PASS: tl.constexpr,
    ):  # fmt: skip
        # Rowwise: amax over the whole row (a loop over column chunks), then a second pass that quantises; ONE_PASS
        # (BC >= C): the rows are read once and held in registers between the two.
        rows = tl.program_id(0) * BR + tl.arange(0, BR)
        rm = rows < R
        r64 = rows.to(tl.int64)
        if ONE_PASS:
            cols = tl.arange(0, BC)
            m = rm[:, None] & (cols < C)[None, :]
            x = tl.load(x_ptr + r64[:, None] * stride_x + cols[None, :], mask=m, other=0.0).to(tl.float32)
            s = _scale_of(tl.max(tl.abs(x), axis=1), FMAX, POW2)
            tl.store(s_ptr + rows, s, mask=rm)
            q = _quantized(x, s[:, None], FMAX)
            tl.store(q_ptr + r64[:, None] * stride_q + cols[None, :], q.to(q_ptr.dtype.element_ty), mask=m)
        else:
            amax = tl.zeros((BR,), dtype=tl.float32)
            for c0 in range(0, C, BC):
                cols = c0 + tl.arange(0, BC)
                m = rm[:, None] & (cols < C)[None, :]
                x = tl.load(x_ptr + r64[:, None] * stride_x + cols[None, :], mask=m, other=0.0).to(tl.float32)
                amax = tl.maximum(amax, tl.max(tl.abs(x), axis=1))
            s = _scale_of(amax, FMAX, POW2)
            tl.store(s_ptr + rows, s, mask=rm)
            for c0 in range(0, C, BC):
                cols = c0 + tl.arange(0, BC)
                m = rm[:, None] & (cols < C)[None, :]
                x = tl.load(x_ptr + r64[:, None] * stride_x + cols[None, :], mask=m, other=0.0).to(tl.float32)
                q = _quantized(x, s[:, None], FMAX)
                tl.store(q_ptr + r64[:, None] * stride_q + cols[None, :], q.to(q_ptr.dtype.element_ty), mask=m)

    @triton.jit
    def _quant_given_scale_kernel(x_ptr, q_ptr, s_ptr, n, BLOCK_N: tl.constexpr, FMAX: tl.constexpr):
        # Tensorwise: the scale (computed by torch from amax) is read from memory: no host sync.
        offs = tl.program_id(0).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
        m = offs < n
        s = tl.load(s_ptr)
        x = tl.load(x_ptr + offs, mask=m, other=0.0).to(tl.float32)
        q = _quantized(x, s, FMAX)
        tl.store(q_ptr + offs, q.to(q_ptr.dtype.element_ty), mask=m)

    @triton.jit
    def _cols_group(bounds_ptr, e, group_rows, EQUAL: tl.constexpr):
        # (first row, rows) of group e: from bounds, or (EQUAL) groups of group_rows rows each (no bounds tensor)
        if EQUAL:
            start = e * group_rows
            n = group_rows
        else:
            start = tl.load(bounds_ptr + e)
            n = tl.load(bounds_ptr + e + 1) - start
        return start, n

    @triton.jit
    def _cols_amax_kernel(
        x_ptr, part_ptr, bounds_ptr, group_rows, C, stride_x,
        EQUAL: tl.constexpr, SPLIT: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr,
    ):  # fmt: skip
        # Program (group e, column block, chunk z): the column maxima of |x| over the z-th of SPLIT chunks of the
        # group's rows (each a multiple of BR rows; the last ones may be empty) -> part[e, z, :]
        e, z = tl.program_id(0), tl.program_id(2)
        cols = tl.program_id(1) * BC + tl.arange(0, BC)
        cm = cols < C
        start, n = _cols_group(bounds_ptr, e, group_rows, EQUAL)
        chunk = tl.cdiv(tl.cdiv(n, SPLIT), BR) * BR
        lo = start + tl.minimum(z * chunk, n)
        hi = start + tl.minimum(z * chunk + chunk, n)
        # an elementwise running max over the tiles, reduced across rows (across warps) once at the end
        acc = tl.zeros((BR, BC), dtype=tl.float32)
        for r0 in range(lo, hi, BR):
            rows = r0 + tl.arange(0, BR)
            m = (rows < hi)[:, None] & cm[None, :]
            x = tl.load(x_ptr + rows.to(tl.int64)[:, None] * stride_x + cols[None, :], mask=m, other=0.0)
            acc = tl.maximum(acc, tl.abs(x.to(tl.float32)))
        tl.store(part_ptr + (e * SPLIT + z) * C + cols, tl.max(acc, axis=0), mask=cm)

    @triton.jit
    def _cols_quant_kernel(
        x_ptr, q_ptr, s_ptr, part_ptr, bounds_ptr, dst_ptr, group_rows, C, stride_x, stride_qe, stride_qc,
        EQUAL: tl.constexpr, SPLIT: tl.constexpr, SPLIT_P2: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr,
        FMAX: tl.constexpr, POW2: tl.constexpr, PAD: tl.constexpr, ALIGNED: tl.constexpr, FUSED: tl.constexpr,
    ):  # fmt: skip
        # The group's column scales s[e, :] from the chunks' maxima part[e, :, :] (the chunk-0 program stores them;
        # FUSED, one chunk per group: from the group's rows, read here, so that _cols_amax_kernel is not launched),
        # then the group's rows divided by them, written transposed: row r of group e, column c, lands at
        # q[e * stride_qe + c * stride_qc + dst[e] + r] ([C, P] for activations: stride_qe = 0, dst = bounds or
        # the padded groups' starts; [E, C, N] for weights of N rows each: EQUAL, dst = 0). With PAD the written
        # rows run on to dst[e + 1] - dst[e] (zeros past the group's rows: the padding of a weight-gradient
        # operand). The written rows are split into SPLIT chunks of whole BR-row tiles; a tile is cast to fp8 (its
        # values are on the fp8 grid already) and transposed in registers so that the stores run along the rows.
        # ALIGNED (dst[e] and the written rows multiples of 16): 16-byte stores.
        e, z = tl.program_id(0), tl.program_id(2)
        cols = tl.program_id(1) * BC + tl.arange(0, BC)
        cm = cols < C
        start, n = _cols_group(bounds_ptr, e, group_rows, EQUAL)
        if FUSED:
            acc = tl.zeros((BR, BC), dtype=tl.float32)
            for r0 in range(start, start + n, BR):
                rows = r0 + tl.arange(0, BR)
                m = (rows < start + n)[:, None] & cm[None, :]
                x = tl.load(x_ptr + rows.to(tl.int64)[:, None] * stride_x + cols[None, :], mask=m, other=0.0)
                acc = tl.maximum(acc, tl.abs(x.to(tl.float32)))
            amax = tl.max(acc, axis=0)
        else:
            zs = tl.arange(0, SPLIT_P2)
            parts = tl.load(
                part_ptr + (e * SPLIT + zs)[:, None] * C + cols[None, :],
                mask=(zs < SPLIT)[:, None] & cm[None, :],
                other=0.0,
            )
            amax = tl.max(parts, axis=0)
        s = _scale_of(amax, FMAX, POW2)
        if z == 0:
            tl.store(s_ptr + e * C + cols, s, mask=cm)
        s = tl.where(cm, s, 1.0)
        n_w = n
        if EQUAL:
            dst0 = 0
        else:
            dst0 = tl.load(dst_ptr + e)
            if PAD:
                n_w = tl.load(dst_ptr + e + 1) - dst0
            if ALIGNED:
                dst0 = tl.multiple_of(dst0, 16)
        chunk = tl.cdiv(tl.cdiv(n_w, SPLIT), BR) * BR
        w_lo = z * chunk
        w_hi = tl.minimum(w_lo + chunk, n_w)
        if ALIGNED:
            w_hi = tl.multiple_of(w_hi, 16)
        group = q_ptr + e.to(tl.int64) * stride_qe + cols.to(tl.int64)[:, None] * stride_qc + dst0
        for i in range(0, tl.cdiv(w_hi - w_lo, BR)):
            rel = w_lo + i * BR + tl.arange(0, BR)
            m = (rel < n)[:, None] & cm[None, :]
            x = tl.load(x_ptr + (start + rel).to(tl.int64)[:, None] * stride_x + cols[None, :], mask=m, other=0.0)
            q = _quantized(x.to(tl.float32), s[None, :], FMAX)
            tl.store(
                group + rel[None, :], tl.trans(q.to(q_ptr.dtype.element_ty)), mask=(rel < w_hi)[None, :] & cm[:, None]
            )

    @triton.jit
    def _swiglu_quant_kernel(
        h_ptr, p_ptr, q_ptr, s_ptr, M, F, s_stride,
        HAS_P: tl.constexpr, ROWWISE: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr,
        FMAX: tl.constexpr, POW2: tl.constexpr, ONE_PASS: tl.constexpr,
    ):  # fmt: skip
        # a = silu(g) * u (* p) for h = [g | u], rounded to h's dtype as moecore/kernels/swiglu.py stores it,
        # then quantised (ROWWISE: a scale per row, two passes over the row, or one with the row in registers:
        # ONE_PASS, BC >= F; else 1 x BC blocks), without writing a. Rowwise: one program per BR rows; 1x128: one
        # per [BR, BC] tile.
        rows = tl.program_id(0) * BR + tl.arange(0, BR)
        rm = rows < M
        r64 = rows.to(tl.int64)
        p = tl.load(p_ptr + rows, mask=rm, other=0.0).to(tl.float32) if HAS_P else None
        if ROWWISE and ONE_PASS:
            cols = tl.arange(0, BC)
            m = rm[:, None] & (cols < F)[None, :]
            a = _swiglu_tile(h_ptr, r64, cols, m, F, p, HAS_P)
            s = _scale_of(tl.max(tl.abs(a), axis=1), FMAX, POW2)
            tl.store(s_ptr + rows, s, mask=rm)
            q = _quantized(a, s[:, None], FMAX)
            tl.store(q_ptr + r64[:, None] * F + cols[None, :], q.to(q_ptr.dtype.element_ty), mask=m)
        elif ROWWISE:
            amax = tl.zeros((BR,), dtype=tl.float32)
            for c0 in range(0, F, BC):
                cols = c0 + tl.arange(0, BC)
                m = rm[:, None] & (cols < F)[None, :]
                a = _swiglu_tile(h_ptr, r64, cols, m, F, p, HAS_P)
                amax = tl.maximum(amax, tl.max(tl.abs(a), axis=1))
            s = _scale_of(amax, FMAX, POW2)
            tl.store(s_ptr + rows, s, mask=rm)
            for c0 in range(0, F, BC):
                cols = c0 + tl.arange(0, BC)
                m = rm[:, None] & (cols < F)[None, :]
                a = _swiglu_tile(h_ptr, r64, cols, m, F, p, HAS_P)
                q = _quantized(a, s[:, None], FMAX)
                tl.store(q_ptr + r64[:, None] * F + cols[None, :], q.to(q_ptr.dtype.element_ty), mask=m)
        else:
            pc = tl.program_id(1)
            cols = pc * BC + tl.arange(0, BC)
            m = rm[:, None] & (cols < F)[None, :]
            a = _swiglu_tile(h_ptr, r64, cols, m, F, p, HAS_P)
            s = _scale_of(tl.max(tl.abs(a), axis=1), FMAX, POW2)
            tl.store(s_ptr + rows * s_stride + pc, s, mask=rm)
            q = _quantized(a, s[:, None], FMAX)
            tl.store(q_ptr + r64[:, None] * F + cols[None, :], q.to(q_ptr.dtype.element_ty), mask=m)


# ---------------------------------------------------------------- references


def scale_from_amax(amax: torch.Tensor, dtype: torch.dtype, pow2: bool = False) -> torch.Tensor:
    """s = max(amax, AMAX_FLOOR) / fp8_max in fp32; with `pow2` rounded up to a power of two (bit-exact)."""
    # Divide by a tensor on amax's device: torch's CUDA division by a Python scalar multiplies by its reciprocal
    # (not correctly rounded), where the kernels divide with round-to-nearest (tl.div_rn).
    s = amax.float().clamp(min=AMAX_FLOOR) / torch.full((), FP8_MAX[dtype], device=amax.device)
    if pow2:
        bits = s.view(torch.int32)
        s = ((bits + 0x7FFFFF) & -8388608).view(torch.float32)
    return s


def cast_to_fp8(x: torch.Tensor, s: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x / s (s broadcast over x's groups) clamped to the format's range and rounded: what every kernel stores."""
    fmax = FP8_MAX[dtype]
    return (x.float() / s).clamp(-fmax, fmax).to(dtype)


def _check_2d(x: torch.Tensor) -> None:
    if x.dim() != 2:
        raise ValueError(f"expected a 2-D tensor, got shape {tuple(x.shape)}")


def quantize_tensorwise_reference(x: torch.Tensor, dtype: torch.dtype, pow2: bool = False):
    s = scale_from_amax(x.detach().abs().amax(), dtype, pow2)
    return cast_to_fp8(x, s, dtype), s


def quantize_rowwise_reference(x: torch.Tensor, dtype: torch.dtype, pow2: bool = False):
    _check_2d(x)
    s = scale_from_amax(x.detach().abs().amax(dim=1, keepdim=True), dtype, pow2)
    return cast_to_fp8(x, s, dtype), s


def _pad_to(x: torch.Tensor, rb: int, cb: int) -> torch.Tensor:
    R, C = x.shape
    pr, pc = -R % rb, -C % cb
    return torch.nn.functional.pad(x.float(), (0, pc, 0, pr)) if pr or pc else x.float()


def quantize_1x128_reference(x: torch.Tensor, dtype: torch.dtype, pow2: bool = False):
    _check_2d(x)
    R, C = x.shape
    xp = _pad_to(x, 1, BLOCK).view(R, -1, BLOCK)
    s = scale_from_amax(xp.abs().amax(dim=2), dtype, pow2)  # [R, ceil(C/128)]
    q = cast_to_fp8(xp, s.unsqueeze(-1), dtype).view(R, -1)[:, :C]
    return q.contiguous(), s


def quantize_128x128_reference(x: torch.Tensor, dtype: torch.dtype, pow2: bool = False):
    _check_2d(x)
    R, C = x.shape
    xp = _pad_to(x, BLOCK, BLOCK)
    nr, nc = xp.shape[0] // BLOCK, xp.shape[1] // BLOCK
    tiles = xp.view(nr, BLOCK, nc, BLOCK)
    s = scale_from_amax(tiles.abs().amax(dim=(1, 3)), dtype, pow2)  # [ceil(R/128), ceil(C/128)]
    q = cast_to_fp8(tiles, s[:, None, :, None], dtype).view(nr * BLOCK, nc * BLOCK)[:R, :C]
    return q.contiguous(), s


# ---------------------------------------------------------------- public functions


def _launch_tile(x: torch.Tensor, dtype: torch.dtype, pow2: bool, per_row: bool):
    R, C = x.shape  # any strides (x.t() of a contiguous tensor is read in place)
    q = torch.empty(R, C, dtype=dtype, device=x.device)
    br = 32 if per_row else BLOCK
    if not x.is_cuda:  # the interpreter: small tiles for 1x128
        br = 16 if per_row else BLOCK
    s_rows = R if per_row else triton.cdiv(R, BLOCK)
    s = torch.empty(s_rows, triton.cdiv(C, BLOCK), dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(R, br), triton.cdiv(C, BLOCK))
    _quant_tile_kernel[grid](
        x, q, s, R, C, x.stride(0), x.stride(1), q.stride(0), s.stride(0), s.stride(1),
        BR=br, BC=BLOCK, PER_ROW=per_row, FMAX=FP8_MAX[dtype], POW2=pow2, TRANS_IN=x.stride(0) == 1 and C > 1,
        **({"num_warps": 8} if x.is_cuda and not per_row else {}),  # a whole 128 x 128 tile per program
    )  # fmt: skip
    return q, s


def quantize_tensorwise(x: torch.Tensor, dtype: torch.dtype = torch.float8_e4m3fn, pow2: bool = False, impl="auto"):
    """(q, s) with one fp32 scale s (shape []) for the whole tensor."""
    if not use_triton(impl, x):
        return quantize_tensorwise_reference(x, dtype, pow2)
    s = scale_from_amax(x.detach().abs().amax(), dtype, pow2)  # one torch reduction, kept on the device
    xc = x.contiguous()
    q = torch.empty(x.shape, dtype=dtype, device=x.device)
    n = xc.numel()
    bn = 1024
    _quant_given_scale_kernel[(triton.cdiv(n, bn),)](xc, q, s, n, BLOCK_N=bn, FMAX=FP8_MAX[dtype])
    return q, s


def quantize_rowwise(x: torch.Tensor, dtype: torch.dtype = torch.float8_e4m3fn, pow2: bool = False, impl="auto"):
    """(q [M, K], s [M, 1]): one scale per row of a 2-D tensor."""
    _check_2d(x)
    if not use_triton(impl, x):
        return quantize_rowwise_reference(x, dtype, pow2)
    R, C = x.shape
    x = x if x.stride(1) == 1 else x.contiguous()
    q = torch.empty(R, C, dtype=dtype, device=x.device)
    s = torch.empty(R, 1, dtype=torch.float32, device=x.device)
    (br, bc), one_pass, warps = _row_tiles(C, x.is_cuda)
    _quant_rows_kernel[(triton.cdiv(R, br),)](
        x, q, s, R, C, x.stride(0), q.stride(0), BR=br, BC=bc, FMAX=FP8_MAX[dtype], POW2=pow2, ONE_PASS=one_pass,
        num_warps=warps,
    )  # fmt: skip
    return q, s


# Rows of 2048 or 4096 values are quantised from registers after a single read (8 warps, 8192 values a program);
# others in two passes over 16 x 256 tiles. Measured on an H200 (benchmarks/fp8_quant_bandwidth.py, 2026-12-04, runs AQ
# and AS): one pass 1.2-1.3x faster at 2048 and 4096 columns, slower at 768 and 1536 (0.5-0.7x; their tiles are
# padded to 1024 / 2048 columns) and at 7168 (0.97x).
ONE_PASS_COLS = (2048, 4096)


def _row_tiles(cols: int, cuda: bool) -> tuple[tuple[int, int], bool, int]:
    """((rows, columns) of a program's tile, one pass?, warps) for rowwise kernels over rows of `cols` values."""
    if not cuda:  # the interpreter: small tiles, both paths tested
        return ((4, triton.next_power_of_2(cols)), True, 1) if cols <= 128 else ((16, 128), False, 1)
    if cols in ONE_PASS_COLS:
        return (8192 // cols, cols), True, 8
    return (16, 256), False, 4


def quantize_1x128(x: torch.Tensor, dtype: torch.dtype = torch.float8_e4m3fn, pow2: bool = False, impl="auto"):
    """(q [M, K], s [M, ceil(K/128)]): one scale per row and 128 columns (DeepSeek-V3's activations)."""
    _check_2d(x)
    if not use_triton(impl, x):
        return quantize_1x128_reference(x, dtype, pow2)
    return _launch_tile(x, dtype, pow2, per_row=True)


def quantize_128x128(x: torch.Tensor, dtype: torch.dtype = torch.float8_e4m3fn, pow2: bool = False, impl="auto"):
    """(q [M, K], s [ceil(M/128), ceil(K/128)]): one scale per 128 x 128 tile (DeepSeek-V3's weights)."""
    _check_2d(x)
    if not use_triton(impl, x):
        return quantize_128x128_reference(x, dtype, pow2)
    return _launch_tile(x, dtype, pow2, per_row=False)


def padded_positions(counts: torch.Tensor, padded: torch.Tensor, n_rows: int) -> torch.Tensor:
    """[n_rows]: where each row lands when consecutive groups of `counts` rows start at the starts of groups of
    `padded` rows (padded >= counts), the groups' order and the rows' order within them kept."""
    counts, padded = counts.to(torch.int64), padded.to(torch.int64)
    eid = torch.repeat_interleave(torch.arange(counts.numel(), device=counts.device), counts, output_size=n_rows)
    shift = (torch.cumsum(padded, 0) - padded) - (torch.cumsum(counts, 0) - counts)
    return torch.arange(n_rows, device=counts.device) + shift[eid]


PadTo = tuple[torch.Tensor, int]  # (rows per group once padded, their sum): where a weight-gradient operand's
# groups start when the GEMM needs aligned groups and the rows it is quantised from are not padded


def quantize_grouped_cols_reference(
    x: torch.Tensor, counts: torch.Tensor, dtype: torch.dtype, pow2: bool = False, pad_to: PadTo | None = None
):
    """(q^T [C, P], s [E, C]): x [N, C] quantised per expert (its rows: `counts`, consecutive) and column; with
    `pad_to` each expert's columns of q^T start at its padded start and the gaps are zeros (P = pad_to[1])."""
    _check_2d(x)
    N, C = x.shape
    E = counts.numel()
    eid = torch.repeat_interleave(torch.arange(E, device=x.device), counts.to(torch.int64), output_size=N)
    amax = torch.zeros(E, C, device=x.device).scatter_reduce(
        0, eid[:, None].expand(-1, C), x.detach().abs().float(), "amax"
    )
    s = scale_from_amax(amax, dtype, pow2)
    q = cast_to_fp8(x, s[eid], dtype)
    if pad_to is not None:  # index_copy on the bytes: fp8 has no CPU index_copy
        dst = padded_positions(counts, pad_to[0], N)
        q = torch.zeros(pad_to[1], C, dtype=torch.uint8, device=x.device).index_copy(0, dst, q.view(torch.uint8))
        q = q.view(dtype)
    return q.t().contiguous(), s


# The grouped column kernels' GPU tile ((rows, columns, warps) per program) and the rows a program aims to cover
# (a group's rows are split into up to 64 chunks of about that many). Measured best of 14 tiles x {256, 1024} rows
# on an H200 (docs/benchmarks.md, "FP8"): small tiles; the transposing store bounds these kernels.
COLS_TILES = ((32, 64, 4), 1024)


def _grouped_cols(
    x: torch.Tensor,
    bounds: torch.Tensor | None,
    q: torch.Tensor,
    dtype,
    pow2: bool,
    dst: torch.Tensor | None = None,
    pad: bool = False,
    groups: int = 1,
    aligned: bool = False,
):
    """Quantise x [N, C] along the rows of each group bounds[e]..bounds[e+1] (scales [E, C]) into q, transposed
    per group from dst[e] on (_cols_quant_kernel; `pad`: zeros up to dst[e+1]; `aligned`: dst's entries are
    multiples of 16, for 16-byte stores); bounds None: `groups` groups of N / groups rows, each written from 0 of
    its own slice of q (no bounds tensors to build). Groups are split into row chunks (enough programs for 8 large
    groups or 512 small ones): with several chunks, two launches (column maxima of each chunk, then the
    quantisation, whose programs reduce the chunks' maxima to the group's scales); with one (small groups), one
    launch that reads the group twice."""
    N, C = x.shape
    equal = bounds is None
    E = groups if equal else bounds.numel() - 1
    (br, bc, warps), rows_per_program = COLS_TILES if x.is_cuda else ((16, 32, 1), 16)
    split = max(1, min(64, N // max(E, 1) // rows_per_program))
    grid = (E, triton.cdiv(C, bc), split)
    fused = split == 1
    part = s = torch.empty(E, C, dtype=torch.float32, device=x.device)  # fused: part is not read
    if not fused:
        part = torch.empty(E, split, C, dtype=torch.float32, device=x.device)
    if equal:  # an unread pointer
        bounds = torch.empty(1, dtype=torch.int32, device=x.device)
    dst = bounds if dst is None else dst
    rows = N // max(E, 1)
    if not fused:
        _cols_amax_kernel[grid](
            x, part, bounds, rows, C, x.stride(0), EQUAL=equal, SPLIT=split, BR=br, BC=bc, num_warps=warps
        )
    stride_qe = q.stride(0) if q.dim() == 3 else 0
    _cols_quant_kernel[grid](
        x, q, s, part, bounds, dst, rows, C, x.stride(0), stride_qe, q.stride(-2),
        EQUAL=equal, SPLIT=split, SPLIT_P2=triton.next_power_of_2(split), BR=br, BC=bc, FMAX=FP8_MAX[dtype],
        POW2=pow2, PAD=pad, ALIGNED=(pad and aligned) or (equal and rows % 16 == 0), FUSED=fused, num_warps=warps,
    )  # fmt: skip
    return s


def quantize_grouped_cols(
    x: torch.Tensor,
    counts: torch.Tensor,
    dtype: torch.dtype = torch.float8_e4m3fn,
    pow2: bool = False,
    impl: str = "auto",
    pad_to: PadTo | None = None,
    bounds: torch.Tensor | None = None,
    pad_bounds: torch.Tensor | None = None,
    aligned: bool = False,
):
    """(q^T [C, P], s [E, C]): the operand of a grouped weight-gradient GEMM, quantised along each expert's rows
    (the contracted dim) with one scale per expert and column, stored transposed. `pad_to`: x's rows are not
    padded, q^T's groups are (zero columns after each expert's rows), so that no padded copy of x is made.
    `aligned` (with pad_to): the caller guarantees the padded counts are multiples of 16, and the kernel stores
    16 bytes at a time (the counts are on the GPU and not checked: other counts give wrong values). `bounds`,
    `pad_bounds`: group_bounds of counts and of pad_to's counts, where the caller has them. No host
    synchronisation."""
    _check_2d(x)
    if not use_triton(impl, x, counts):
        return quantize_grouped_cols_reference(x, counts, dtype, pow2, pad_to)
    N, C = x.shape
    x = x if x.stride(1) == 1 else x.contiguous()
    bounds = group_bounds(counts) if bounds is None else bounds
    dst = bounds if pad_to is None else (group_bounds(pad_to[0]) if pad_bounds is None else pad_bounds)
    q = torch.empty(C, N if pad_to is None else pad_to[1], dtype=dtype, device=x.device)
    return q, _grouped_cols(x, bounds, q, dtype, pow2, dst, pad=pad_to is not None, aligned=aligned)


def quantize_transposed(
    x: torch.Tensor, dtype: torch.dtype = torch.float8_e4m3fn, pow2: bool = False, impl: str = "auto"
) -> tuple[torch.Tensor, torch.Tensor]:
    """(q [C, N], s [C, 1]): x^T of a 2-D x [N, C] quantised rowwise (a scale per column of x), without a bf16
    transposed copy (the grouped column kernels with one group); bit for bit quantize_rowwise(x.t())."""
    _check_2d(x)
    if not use_triton(impl, x):
        return quantize_rowwise_reference(x.t(), dtype, pow2)
    N, C = x.shape
    x = x if x.stride(1) == 1 else x.contiguous()
    q = torch.empty(C, N, dtype=dtype, device=x.device)
    return q, _grouped_cols(x, None, q, dtype, pow2).view(C, 1)


Quantised = tuple[torch.Tensor, torch.Tensor]


def quantize_weight_layouts_reference(
    w: torch.Tensor, dtype: torch.dtype, pow2: bool = False, rows: bool = True, cols: bool = True
) -> tuple[Quantised | None, Quantised | None]:
    """((q [E, N, K], s [E, N, 1]) or None, (q^T [E, K, N], s^T [E, K, 1]) or None) of w [E, N, K]."""
    wf = w.detach().float()
    out_rows = out_cols = None
    if rows:
        s = scale_from_amax(wf.abs().amax(dim=2, keepdim=True), dtype, pow2)
        out_rows = (cast_to_fp8(wf, s, dtype), s)
    if cols:
        wt = wf.transpose(1, 2)
        st = scale_from_amax(wt.abs().amax(dim=2, keepdim=True), dtype, pow2)
        out_cols = (cast_to_fp8(wt, st, dtype).contiguous(), st)
    return out_rows, out_cols


def quantize_weight_layouts(
    w: torch.Tensor,
    dtype: torch.dtype = torch.float8_e4m3fn,
    pow2: bool = False,
    rows: bool = True,
    cols: bool = True,
    impl: str = "auto",
) -> tuple[Quantised | None, Quantised | None]:
    """Expert weights w [E, N, K] in the layouts of their two GEMMs: rowwise along K (`rows`: the forward's
    operand) and transposed, rowwise along N (`cols`: the input gradient's, w[e]^T [K, N] with one scale per
    column of w[e]); rowwise scales do not survive a transpose, so each is quantised from w. `rows` is the
    row kernel over [E * N, K]; `cols` the grouped column kernel with E groups of N rows, written per expert
    transposed (no bf16 transposed copy). Bit for bit the reference; no host synchronisation."""
    if w.dim() != 3:
        raise ValueError(f"expected expert weights [E, N, K], got shape {tuple(w.shape)}")
    if not (rows or cols):
        raise ValueError("quantize_weight_layouts: ask for rows, cols or both")
    if not use_triton(impl, w):
        return quantize_weight_layouts_reference(w, dtype, pow2, rows, cols)
    E, N, K = w.shape
    w2 = w.detach().reshape(E * N, K)
    out_rows = out_cols = None
    if rows:
        q, s = quantize_rowwise(w2, dtype, pow2)
        out_rows = (q.view(E, N, K), s.view(E, N, 1))
    if cols:
        qt = torch.empty(E, K, N, dtype=dtype, device=w.device)
        st = _grouped_cols(w2.contiguous(), None, qt, dtype, pow2, groups=E)
        out_cols = (qt, st.unsqueeze(-1))
    return out_rows, out_cols


def dequantize(q: torch.Tensor, s: torch.Tensor, granularity: str) -> torch.Tensor:
    """fp32 values q * s for any granularity of this module (tensorwise | rowwise | 1x128 | 128x128)."""
    x = q.float()
    R, C = x.shape[-2], x.shape[-1]
    if granularity in ("tensorwise", "rowwise"):
        return x * s
    if granularity == "1x128":
        return x * s.repeat_interleave(BLOCK, dim=-1)[..., :C]
    if granularity == "128x128":
        return x * s.repeat_interleave(BLOCK, dim=-2).repeat_interleave(BLOCK, dim=-1)[..., :R, :C]
    raise ValueError(f"granularity={granularity!r} is invalid: allowed: tensorwise | rowwise | 1x128 | 128x128")


def swiglu_quantize(
    h: torch.Tensor,
    probs: torch.Tensor | None,
    granularity: str,
    dtype: torch.dtype = torch.float8_e4m3fn,
    pow2: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The fused SwiGLU (* probs) + quantisation Triton kernel: (q [M, F], s) with `granularity` rowwise
    (s [M, 1]) or 1x128 (s [M, ceil(F/128)]) of a = silu(g) * u (* p) rounded to h's dtype, bit for bit what
    `swiglu(h, probs)` followed by `quantize_rowwise` / `quantize_1x128` gives, without storing a.
    Callers check `use_triton` first (the unfused functions are the reference)."""
    M, F2 = h.shape
    Fh = F2 // 2
    h = h.contiguous()
    q = torch.empty(M, Fh, dtype=dtype, device=h.device)
    rowwise = granularity == "rowwise"
    s = torch.empty(M, 1 if rowwise else triton.cdiv(Fh, BLOCK), dtype=torch.float32, device=h.device)
    one_pass, warps = False, 4
    if rowwise:
        (br, bc), one_pass, warps = _row_tiles(Fh, h.is_cuda)
        grid = (triton.cdiv(M, br),)
    else:
        br, bc = (32, BLOCK) if h.is_cuda else (16, BLOCK)
        grid = (triton.cdiv(M, br), triton.cdiv(Fh, bc))
    p = probs.contiguous() if probs is not None else h
    _swiglu_quant_kernel[grid](
        h, p, q, s, M, Fh, s.stride(0),
        HAS_P=probs is not None, ROWWISE=rowwise, BR=br, BC=bc, FMAX=FP8_MAX[dtype], POW2=pow2, ONE_PASS=one_pass,
        num_warps=warps if h.is_cuda else 1,
    )  # fmt: skip
    return q, s
