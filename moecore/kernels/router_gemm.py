"""The router's linear map, logits = x @ W^T, in fp32 precision on the tensor cores.

The router keeps fp32 logits (`moe.router_dtype`): routing decisions flip on small logit differences.
Computed as an fp32 GEMM they run on the GPU's fp32 SIMT units, ~50 TFLOP/s on an H200 against ~600
for bf16 on the tensor cores; at Qwen3-Next's shape (16384 tokens, hidden 2048, 512 experts) the three
router GEMMs (logits, dx, dW) took 2.0 ms of an 11.5 ms MoE layer.

Split form. Any fp32 value v is, to its last bit in all but denormal corner cases, the sum of three bf16
numbers: hi = bf16(v), mid = bf16(v - hi), lo = bf16(v - hi - mid) (8 + 8 + 8 significant bits, fp32 has 24).
A bf16 x bf16 product is exact in fp32, and the tensor cores accumulate in fp32, so with bf16 activations x

    logits = x @ W^T = x @ W_hi^T + x @ W_mid^T + x @ W_lo^T        (one GEMM against [W_hi; W_mid; W_lo])

is the fp32 GEMM up to the order of the fp32 additions (a bf16 W, as under bf16 parameters, is its own single
piece: one GEMM of E columns). The backward splits the fp32 gradient g = dlogits:

    dW = g^T x = (g_hi + g_mid + g_lo)^T x                          (one GEMM, three E-row blocks summed)
    dx = g W  ~= g_hi W_hi + g_hi W_mid + g_mid W_hi                 (one GEMM over 3E; dx is rounded to
                                                                      bf16, the dropped terms are < 2^-16)

Each is a single bf16 GEMM with three times the FLOPs of the fp32 one, on units ten times faster. It runs on
CUDA for bf16 x and fp32 logits (where torch.mm can write fp32 from bf16 inputs); elsewhere, and for
fp64 logits, the plain cast-and-multiply path runs. `router_linear(..., split=True)` on CPU evaluates the
split form with fp32 matmuls (exact products, fp32 sums: what the tensor cores compute), for the tests.
"""

from __future__ import annotations

import functools

import torch

from moecore.kernels._triton import triton_importable, use_triton

if triton_importable():
    import triton
    import triton.language as tl

    @triton.jit
    def _piece(hi, mid, lo, P: tl.constexpr):
        if P == 0:
            r = hi
        elif P == 1:
            r = mid
        else:
            r = lo
        return r

    @triton.jit
    def _split3_kernel(
        v_ptr, out_ptr, n, C,
        P0: tl.constexpr, P1: tl.constexpr, P2: tl.constexpr, P3: tl.constexpr,
        SLOTS: tl.constexpr, STACKED: tl.constexpr, BLOCK: tl.constexpr,
    ):  # fmt: skip
        # pieces of v (hi, mid, lo = 0, 1, 2) into SLOTS slots, slot s holding piece Ps: stacked as
        # out[s] (out [SLOTS, n]) or side by side along each row (out [n / C, SLOTS * C]); one read of v
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        inside = i < n
        v = tl.load(v_ptr + i, mask=inside, other=0.0)
        hi = v.to(tl.bfloat16, fp_downcast_rounding="rtne")  # round to nearest even, as torch's casts
        r = v - hi.to(tl.float32)
        mid = r.to(tl.bfloat16, fp_downcast_rounding="rtne")
        lo = (r - mid.to(tl.float32)).to(tl.bfloat16, fp_downcast_rounding="rtne")
        if STACKED:
            dst = out_ptr + i.to(tl.int64)
            step = n
        else:
            dst = out_ptr + (i // C).to(tl.int64) * SLOTS * C + i % C
            step = C
        tl.store(dst, _piece(hi, mid, lo, P0), mask=inside)
        if SLOTS > 1:
            tl.store(dst + step, _piece(hi, mid, lo, P1), mask=inside)
        if SLOTS > 2:
            tl.store(dst + 2 * step, _piece(hi, mid, lo, P2), mask=inside)
        if SLOTS > 3:
            tl.store(dst + 3 * step, _piece(hi, mid, lo, P3), mask=inside)


def split3_reference(v: torch.Tensor) -> torch.Tensor:
    """[3, *v.shape] bf16 with hi + mid + lo = v (fp32) to fp32 precision, through torch casts."""
    v = v.float()
    hi = v.to(torch.bfloat16)
    r = v - hi.float()
    mid = r.to(torch.bfloat16)
    lo = (r - mid.float()).to(torch.bfloat16)
    return torch.stack([hi, mid, lo])


def split3_pieces(v: torch.Tensor, pieces: tuple[int, ...], stacked: bool, impl: str = "auto") -> torch.Tensor:
    """The bf16 pieces of fp32 v [R, C] (0 = hi, 1 = mid, 2 = lo; `split3_reference`), in the order `pieces`
    (one to four, repeats allowed): stacked, [len(pieces), R, C]; or side by side, [R, len(pieces) * C].
    On CUDA one Triton pass over v; the torch form costs a launch per cast, subtraction and copy."""
    if not 1 <= len(pieces) <= 4 or any(p not in (0, 1, 2) for p in pieces):
        raise ValueError(f"split3_pieces: pieces={pieces} is invalid: one to four of 0 (hi), 1 (mid), 2 (lo)")
    R, C = v.shape
    if not use_triton(impl, v):
        parts = split3_reference(v)[list(pieces)]
        return parts if stacked else parts.permute(1, 0, 2).reshape(R, len(pieces) * C)
    v = v.float().contiguous()
    shape = (len(pieces), R, C) if stacked else (R, len(pieces) * C)
    out = torch.empty(shape, dtype=torch.bfloat16, device=v.device)
    if v.numel():
        p = (*pieces, 0, 0, 0)[:4]
        block = 1024
        _split3_kernel[(triton.cdiv(v.numel(), block),)](
            v, out, v.numel(), C, *p, SLOTS=len(pieces), STACKED=stacked, BLOCK=block, num_warps=4
        )
    return out


def split3(v: torch.Tensor, impl: str = "auto") -> torch.Tensor:
    """[3, *v.shape] bf16 with hi + mid + lo = v (fp32) to fp32 precision (one pass on CUDA)."""
    rows = v.reshape(-1, v.shape[-1] if v.dim() else 1)
    return split3_pieces(rows, (0, 1, 2), stacked=True, impl=impl).view(3, *v.shape)


def split3_cols(g: torch.Tensor, impl: str = "auto") -> torch.Tensor:
    """[T, 4E] bf16 = [hi | hi | mid | lo] of g [T, E] (fp32): the backward's GEMM operands as column blocks.

    Columns E:4E are g's three pieces (dW = [hi | mid | lo]^T x, three E-row blocks summed), columns 0:3E the
    left operand of dx = [hi | hi | mid] [W_hi; W_mid; W_hi] (E:3E, [hi | mid], for a bf16 W): strided views that
    the GEMMs read in place. On CUDA one Triton pass (a read of g, a write of the pieces); the torch form
    makes ten passes over [T, E] and a transposing copy for dW's operand."""
    return split3_pieces(g, (0, 0, 1, 2), stacked=False, impl=impl)


@functools.cache
def _mm_fp32_out_supported(device_index: int) -> bool:
    """Whether torch.mm(bf16, bf16, out_dtype=fp32) runs on this GPU with this torch."""
    try:
        a = torch.zeros(16, 16, dtype=torch.bfloat16, device=f"cuda:{device_index}")
        return torch.mm(a, a, out_dtype=torch.float32).dtype == torch.float32
    except (RuntimeError, TypeError):
        return False


def split_path_applies(x: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether `router_linear` takes the split form for these inputs (module docstring)."""
    return (
        dtype == torch.float32
        and x.dtype == torch.bfloat16
        and x.is_cuda
        and _mm_fp32_out_supported(x.device.index or 0)
    )


def _mm32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b with fp32 output: bf16 inputs on the tensor cores (CUDA), fp32 matmul of the same values elsewhere."""
    if a.is_cuda:
        return torch.mm(a, b, out_dtype=torch.float32)
    return a.float() @ b.float()


def _pieces(w: torch.Tensor) -> torch.Tensor:
    """[n, *w.shape] bf16 pieces summing to w: the three of `split3` for fp32, w itself for bf16."""
    return w[None] if w.dtype == torch.bfloat16 else split3(w)


def _split_forward(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    ws = _pieces(w)
    n, E = ws.shape[0], w.shape[0]
    parts = _mm32(x, ws.reshape(n * E, -1).t())  # [T, nE]: x W_hi^T | x W_mid^T | x W_lo^T
    if n == 1:
        return parts
    return parts[:, :E] + (parts[:, E : 2 * E] + parts[:, 2 * E :])


def _split_dw(g4: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """dW from g4 = split3_cols(g): [hi | mid | lo]^T x, its three E-row blocks summed."""
    E = g4.shape[1] // 4
    parts = _mm32(g4[:, E:].t(), x)  # [3E, H]
    return parts[:E] + (parts[E : 2 * E] + parts[2 * E :])


def _split_dx(g4: torch.Tensor, w: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """dx from g4 = split3_cols(g): g_hi W_hi + g_hi W_mid + g_mid W_hi (g_hi W + g_mid W for a bf16 W)."""
    E = g4.shape[1] // 4
    if w.dtype == torch.bfloat16:
        a, b = g4[:, E : 3 * E], torch.cat([w, w], dim=0)
    else:
        a, b = g4[:, : 3 * E], split3_pieces(w, (0, 1, 0), stacked=True).view(3 * E, -1)  # [T, 3E] x [3E, H]
    if a.is_cuda and out_dtype == torch.bfloat16:  # fp32 sums rounded once by the GEMM: no fp32 [T, H] pass
        return torch.mm(a, b)
    return _mm32(a, b).to(out_dtype)


class _RouterLinearFn(torch.autograd.Function):
    """logits = x @ W^T in `dtype` (autocast off), keeping x and W in their own dtypes for backward."""

    @staticmethod
    def forward(ctx, x, weight, dtype, split):
        ctx.save_for_backward(x, weight)
        ctx.dtype, ctx.split = dtype, split
        with torch.autocast(x.device.type, enabled=False):
            if split:
                return _split_forward(x, weight)
            return torch.nn.functional.linear(x.to(dtype), weight.to(dtype))

    @staticmethod
    def backward(ctx, d_logits):
        x, weight = ctx.saved_tensors
        dx = dw = None
        g4 = split3_cols(d_logits) if ctx.split else None
        with torch.autocast(x.device.type, enabled=False):
            if ctx.needs_input_grad[0]:
                if ctx.split:
                    dx = _split_dx(g4, weight, x.dtype)
                else:
                    dx = (d_logits @ weight.to(ctx.dtype)).to(x.dtype)
            if ctx.needs_input_grad[1]:
                if ctx.split:
                    dw = _split_dw(g4, x).to(weight.dtype)
                else:
                    dw = (d_logits.t() @ x.to(ctx.dtype)).to(weight.dtype)
        return dx, dw, None, None


def router_linear(
    x_TH: torch.Tensor, weight_EH: torch.Tensor, dtype: torch.dtype, split: bool | None = None
) -> torch.Tensor:
    """Router logits in `dtype` whatever autocast is active; saves x in its own dtype (bf16 x is not
    kept as an fp32 copy, which plain autograd through `x.to(fp32)` would keep: 2x the bytes).

    `split`: the split-bf16 form of the module docstring (None: where `split_path_applies`; True on CPU
    evaluates the same split maths with fp32 matmuls, for the tests)."""
    if split is None:
        split = split_path_applies(x_TH, dtype)
    if split and (dtype != torch.float32 or x_TH.dtype != torch.bfloat16):
        raise ValueError("router_linear: the split form needs bf16 activations and fp32 logits")
    return _RouterLinearFn.apply(x_TH, weight_EH, dtype, split)
