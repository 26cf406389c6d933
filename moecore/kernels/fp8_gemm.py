"""FP8 GEMMs for training: operands quantised along the contraction dim, real (torch scaled mm) or emulated.

Every GEMM of a linear layer, forward and backward, is written as C = A @ B^T with A [M, K] and B [N, K]
both quantised along K (the contracted dim), so one primitive serves all three:

    forward  y  = x @ W^T        A = x   (along in)           B = W    (along in)
    dgrad    dx = dy @ W         A = dy  (along out)          B = W^T  (along out)
    wgrad    dW = dy^T @ x       A = dy^T (along tokens)      B = x^T  (along tokens)

A recipe fixes the scale groups (moecore/kernels/fp8_quant.py):
- tensorwise: one scale per tensor (per expert for expert weights). A transpose reuses the scale.
- rowwise: one scale per row of A and of B. W^T, dy^T and x^T are quantised again from the bf16 tensor
  along the other axis (a transpose changes the groups).
- blockwise: activations and gradients 1x128 (a scale per row and 128 columns), weights 128x128.
  W^T reuses W's tiles transposed (a 128x128 tile is the same tile either way); dy^T and x^T are
  quantised 1x128 along the tokens (DeepSeek-V3's 128x1 groups of the wgrad GEMM), which needs the
  token count padded to 128.
`Fp8Recipe.grad_dtype` is e4m3, or e5m2 for the hybrid format (dy, and what is quantised from it).

Backends: "scaled" calls torch._scaled_mm (tensorwise, rowwise) and torch.nn.functional.scaled_mm
with BlockWise1x128 / BlockWise128x128 (blockwise) on FP8 tensor cores (compute capability >= 8.9;
blockwise and the grouped GEMM need 9.0); "emulated" dequantises both operands (q * s in fp32) and
multiplies in fp32: the same quantised values, so the same maths up to the order of fp32 sums. The
CPU tests run the emulated backend; the GPU tests compare the two.

cuBLAS rejects e5m2 operands with row and block scales, so under the hybrid format the GEMMs with an e5m2
operand (dgrad, wgrad) run as one group of moecore's Triton grouped GEMMs (`cublas_rejects`), which take
either format.

The expert grouped GEMMs (fwd / dgrad / wgrad of `fp8_expert_ffn`) run as one
torch._scaled_grouped_mm where torch supports it on Hopper (e4m3 operands with row scales, which also
carries tensorwise as constant rows) or, rowwise, as our Triton grouped GEMMs where `Fp8Recipe.grouped_gemm`
picks them and always for e5m2 operands (grouped_gemm_fp8.py), as our Triton blockwise grouped GEMM for
blockwise (fp8_block_gemm.py), and as a loop of per-expert scaled GEMMs otherwise (CPU); docs/design.md.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from moecore.kernels import fp8_quant as fq
from moecore.kernels._triton import use_triton
from moecore.kernels.fp8_block_gemm import block_gemm_nt, block_gemm_tn
from moecore.kernels.fp8_transpose import transpose_last2
from moecore.kernels.grouped_gemm_fp8 import fp8_tiles, grouped_mm_scaled

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
SCALINGS = ("tensorwise", "rowwise", "blockwise")
# fp8.wgrad=auto: weight gradients in FP8 where a dimension of the weight is at least AUTO_WGRAD_WIDE and the
# GEMM sums over at least AUTO_WGRAD_ROWS rows per weight (per expert, on average), bf16 otherwise (Fp8Recipe.wgrad_in_fp8)
AUTO_WGRAD_WIDE = 4096
AUTO_WGRAD_ROWS = 2048


@dataclass(frozen=True)
class Fp8Recipe:
    """How FP8 GEMMs quantise: scale groups, the gradients' format, power-of-two scales, emulation.

    The defaults are the plainest behaviour (FP8 weight gradients, every row padded, torch's scaled grouped GEMM),
    for direct users of `fp8_linear` / `fp8_expert_ffn`; `train.precision=fp8` builds the recipe from the `fp8`
    config (`Fp8Recipe.from_config`), whose defaults are the measured ones (`wgrad=auto`, ...)."""

    scaling: str = "rowwise"  # tensorwise | rowwise | blockwise
    grad_dtype: torch.dtype = E4M3  # E5M2 for the hybrid format
    pow2: bool = False
    emulate: bool = False  # quantise-dequantise + fp32 matmul instead of FP8 tensor-core GEMMs
    fprop_fast_accum: bool = True  # forward GEMMs in the tensor cores' fast accumulation (backward: never)
    # "fp8", "bf16" (weight gradients as bf16 GEMMs of the unquantised operands) or "auto" (per GEMM: wgrad_in_fp8)
    wgrad: str = "fp8"
    # Which expert-GEMM operands get their experts' rows padded to `alignment` (fp8_grouped.py): "all" (the rows
    # are padded on entry, every GEMM runs on padded rows) or "wgrad" (rowwise only: only the weight-gradient
    # operands, whose contracted dim is the rows, are written padded, by the kernel that quantises them)
    padding: str = "all"
    # The expert forward and input-gradient GEMMs: torch._scaled_grouped_mm ("torch"), moecore's Triton grouped
    # GEMM with row scales in its epilogue ("triton", rowwise on CUDA: kernels/grouped_gemm_fp8.py), or
    # per GEMM the one measured faster ("auto", rowwise: fp8_grouped.AUTO_WIDE)
    grouped_gemm: str = "torch"

    def __post_init__(self) -> None:
        if self.wgrad not in ("fp8", "bf16", "auto"):
            raise ValueError(f"wgrad={self.wgrad!r} is invalid: allowed: fp8 | bf16 | auto")
        if self.scaling not in SCALINGS:
            raise ValueError(f"scaling={self.scaling!r} is invalid: allowed: {' | '.join(SCALINGS)}")
        if self.padding not in ("all", "wgrad") or (self.padding == "wgrad" and self.scaling != "rowwise"):
            raise ValueError(f"padding={self.padding!r} is invalid: 'all', or 'wgrad' with rowwise scaling")
        if self.grouped_gemm not in ("torch", "triton", "auto") or (
            self.grouped_gemm != "torch" and self.scaling != "rowwise"
        ):
            raise ValueError(
                f"grouped_gemm={self.grouped_gemm!r} is invalid: 'torch', or 'triton' | 'auto' with rowwise scaling"
            )

    def wgrad_in_fp8(self, rows_per_weight: int, *weight_dims: int) -> bool:
        """Whether the weight-gradient GEMM of a weight with these dimensions, summed over `rows_per_weight` rows
        (tokens for a linear, the mean rows per expert for the experts), runs in FP8 (else a bf16 GEMM of the
        unquantised operands). `auto`: FP8 where a dimension is >= AUTO_WGRAD_WIDE and the rows are
        >= AUTO_WGRAD_ROWS. Elsewhere FP8 loses twice: the FP8 weight-gradient GEMM is itself slower than bf16's
        for narrow weights or few rows per expert, and both of its operands must first be quantised again along
        the rows (docs/benchmarks.md, "FP8 weight gradients by shape")."""
        if self.wgrad != "auto":
            return self.wgrad == "fp8"
        return max(weight_dims) >= AUTO_WGRAD_WIDE and rows_per_weight >= AUTO_WGRAD_ROWS

    @property
    def alignment(self) -> int:
        """Rows (tokens, and each expert's rows) are padded to this multiple: the block, or 16 for FP8 GEMMs."""
        return fq.BLOCK if self.scaling == "blockwise" else 16

    @classmethod
    def from_config(cls, fp8cfg) -> Fp8Recipe:
        """From an `FP8Config` (moecore/config/fp8.py)."""
        grad = E5M2 if fp8cfg.format == "hybrid" else E4M3
        return cls(
            fp8cfg.recipe,
            grad,
            bool(fp8cfg.pow2_scales),
            bool(fp8cfg.emulate),
            bool(fp8cfg.fprop_fast_accum),
            fp8cfg.wgrad,
            fp8cfg.resolved("padding"),
            fp8cfg.resolved("grouped_gemm"),
        )


@dataclass
class QOperand:
    """A 2-D operand [R, K] in FP8, quantised along K; `gran` names its scale groups (fp8_quant.dequantize)."""

    q: torch.Tensor
    s: torch.Tensor
    gran: str

    def dequantize(self) -> torch.Tensor:
        return fq.dequantize(self.q, self.s, self.gran)

    def rows(self, start: int, n: int) -> QOperand:
        """Rows start..start+n (a block of 128 rows of a 128x128 operand must not be cut)."""
        if self.gran == "tensorwise":
            return QOperand(self.q[start : start + n], self.s, self.gran)
        if self.gran == "128x128":
            return QOperand(
                self.q[start : start + n], self.s[start // fq.BLOCK : (start + n + 127) // fq.BLOCK], self.gran
            )
        return QOperand(self.q[start : start + n], self.s[start : start + n], self.gran)


def fp8_unsupported_reason(device: torch.device | str, scaling: str) -> str | None:
    """Why FP8 GEMMs of `scaling` cannot run on `device`; None when they can."""
    device = torch.device(device)
    if device.type != "cuda":
        return f"no CUDA device (device {device.type}); FP8 GEMMs need an NVIDIA GPU of compute capability >= 8.9"
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < (8, 9):
        return f"this GPU has compute capability {major}.{minor}; FP8 GEMMs need 8.9 (Ada) or newer"
    if scaling == "blockwise" and major < 9:
        return f"blockwise FP8 GEMMs need compute capability 9.0 (Hopper) or newer; this GPU has {major}.{minor}"
    if not hasattr(torch, "_scaled_mm"):
        return f"torch {torch.__version__} has no torch._scaled_mm"
    if scaling == "blockwise" and not hasattr(F, "scaled_mm"):
        return f"torch {torch.__version__} has no torch.nn.functional.scaled_mm (blockwise FP8 GEMMs)"
    return None


# ---------------------------------------------------------------- quantising operands


def quant_rows(x: torch.Tensor, recipe: Fp8Recipe, dtype: torch.dtype, weight: bool = False) -> QOperand:
    """x [R, K] quantised along K: the activation groups of the recipe, or its weight groups (`weight`)."""
    if recipe.scaling == "tensorwise":
        q, s = fq.quantize_tensorwise(x, dtype, recipe.pow2)
        return QOperand(q, s, "tensorwise")
    if recipe.scaling == "rowwise":
        q, s = fq.quantize_rowwise(x, dtype, recipe.pow2)
        return QOperand(q, s, "rowwise")
    if weight:
        q, s = fq.quantize_128x128(x, dtype, recipe.pow2)
        return QOperand(q, s, "128x128")
    q, s = fq.quantize_1x128(x, dtype, recipe.pow2)
    return QOperand(q, s, "1x128")


def transposed(
    op: QOperand | None, x: torch.Tensor, recipe: Fp8Recipe, dtype: torch.dtype, weight: bool = False
) -> QOperand:
    """x^T quantised along x's rows (`weight`: in the recipe's weight groups), reusing `op` (x quantised along
    its columns, or None) where the groups allow."""
    if op is not None and op.gran == "tensorwise" and op.q.dtype == dtype:
        return QOperand(transpose_last2(op.q), op.s, "tensorwise")
    if op is not None and op.gran == "128x128" and op.q.dtype == dtype:
        return QOperand(transpose_last2(op.q), op.s.t().contiguous(), "128x128")
    if recipe.scaling == "rowwise":  # x^T without a bf16 transposed copy
        return QOperand(*fq.quantize_transposed(x, dtype, recipe.pow2), "rowwise")
    return quant_rows(x.t(), recipe, dtype, weight=weight)


def _pad_rows(x: torch.Tensor, multiple: int) -> torch.Tensor:
    pad = -x.shape[0] % multiple
    return F.pad(x, (0, 0, 0, pad)) if pad else x


# ---------------------------------------------------------------- the GEMM primitive


def _scale_mn_major(s: torch.Tensor) -> torch.Tensor:
    """A [R, K/128] scale in the layout cuBLAS's 1x128 scaling reads: shape kept, stride [1, R]."""
    return s.t().contiguous().t()


def _scale_128x128(s: torch.Tensor) -> torch.Tensor:
    """B's [N/128, K/128] tile scales as cuBLAS's 128x128 scaling reads them: [L4, N/128], stride [1, L4]."""
    k_blocks = s.shape[1]
    l4 = -(-k_blocks // 4) * 4
    return F.pad(s, (0, l4 - k_blocks)).contiguous().t()


def cublas_rejects(a: QOperand, b: QOperand) -> bool:
    """Whether a GEMM of these operands goes to moecore's Triton kernels instead of torch's scaled GEMMs: cuBLAS
    (torch 2.11, Hopper) rejects e5m2 operands with row and block scales (the hybrid format's gradient GEMMs),
    where Triton's FP8 dot takes any pair of e4m3 / e5m2 operands. Only where Triton runs (CUDA tensors)."""
    return a.gran != "tensorwise" and E5M2 in (a.q.dtype, b.q.dtype) and use_triton("auto", a.q, b.q)


def _triton_mm(a: QOperand, b: QOperand, out_dtype: torch.dtype, fast: bool) -> torch.Tensor:
    """a @ b^T as one group of moecore's Triton grouped GEMMs: rowwise (grouped_gemm_fp8), or blockwise with b in
    128x128 tiles (forward, input gradient) or 1x128 groups along the contracted dim (weight gradient). The
    group's offsets are made on the GPU (no host copy: the linears run inside captured CUDA graphs too)."""
    M, dev = a.q.shape[0], a.q.device
    if a.gran == "rowwise":
        bounds = torch.arange(2, dtype=torch.int32, device=dev) * M
        cfg = fp8_tiles(a.q, 1, fast)
        return grouped_mm_scaled(a.q.contiguous(), b.q.unsqueeze(0), a.s, b.s, bounds, out_dtype, cfg, fast)
    if b.gran == "128x128":
        counts = torch.full((1,), M, dtype=torch.int64, device=dev)
        return block_gemm_nt(a.q, a.s, b.q.unsqueeze(0), b.s.unsqueeze(0), counts, out_dtype)
    counts = torch.full((1,), a.q.shape[1], dtype=torch.int64, device=dev)  # the contracted dim, one group
    return block_gemm_tn(a.q, a.s, b.q, b.s, counts, out_dtype)[0]


def mm(a: QOperand, b: QOperand, out_dtype: torch.dtype, recipe: Fp8Recipe, fast: bool = False) -> torch.Tensor:
    """a @ b^T -> [Ra, Rb] in out_dtype, both operands quantised along the contracted dim. `fast`: Hopper's
    fast FP8 accumulation (tensorwise, rowwise), which adds partial sums in reduced precision."""
    if recipe.emulate:  # fp32 products of the quantised values (autocast must not turn them into bf16)
        with torch.autocast(a.q.device.type, enabled=False):
            return (a.dequantize() @ b.dequantize().t()).to(out_dtype)
    if cublas_rejects(a, b):
        return _triton_mm(a, b, out_dtype, fast)
    if a.gran == "tensorwise":
        sa, sb = a.s.reshape(()), b.s.reshape(())
        return torch._scaled_mm(a.q, b.q.t(), scale_a=sa, scale_b=sb, out_dtype=out_dtype, use_fast_accum=fast)
    if a.gran == "rowwise":
        sb = b.s.reshape(1, -1)
        return torch._scaled_mm(a.q, b.q.t(), scale_a=a.s, scale_b=sb, out_dtype=out_dtype, use_fast_accum=fast)
    st = F.ScalingType
    sa = _scale_mn_major(a.s)
    if b.gran == "128x128":
        sb, rb = _scale_128x128(b.s), st.BlockWise128x128
    else:
        sb, rb = _scale_mn_major(b.s), st.BlockWise1x128
    return F.scaled_mm(a.q, b.q.t(), sa, st.BlockWise1x128, sb, rb, output_dtype=out_dtype)


# ---------------------------------------------------------------- the FP8 linear


class _Fp8Linear(torch.autograd.Function):
    """y = x W^T with the forward, dgrad and wgrad GEMMs in FP8 (module docstring). x [M, K], W [N, K]."""

    @staticmethod
    def forward(ctx, x, w, recipe: Fp8Recipe):
        m = x.shape[0]
        xp = _pad_rows(x, recipe.alignment)  # zero rows: tokens a multiple of the wgrad groups
        xq = quant_rows(xp, recipe, E4M3)
        wq = getattr(w, "fp8_primary", None)  # FP8 primary weights (moecore/models/fp8.py): already quantised
        wc = w if wq is not None else w.to(x.dtype)
        if wq is None:
            wq = quant_rows(wc, recipe, E4M3, weight=True)
        y = mm(xq, wq, x.dtype, recipe, fast=recipe.fprop_fast_accum)[:m]
        # keep the FP8 copies only where backward reuses them (tensorwise x^T; tensorwise / 128x128 W^T; a rowwise
        # primary weight's own W^T), as saved tensors so that activation checkpointing and offloading hooks see them
        wt = getattr(w, "fp8_primary_t", None)
        ctx.keep_x, ctx.keep_w = xq.gran == "tensorwise", wq.gran in ("tensorwise", "128x128") or wt is not None
        wq = wt if wt is not None else wq
        keep = ([xq] if ctx.keep_x else []) + ([wq] if ctx.keep_w else [])
        ctx.save_for_backward(xp, wc, *(t for op in keep for t in (op.q, op.s)))
        ctx.grans = [op.gran for op in keep]
        ctx.recipe, ctx.m, ctx.w_dtype = recipe, m, w.dtype
        return y

    @staticmethod
    def backward(ctx, dy):
        xp, wc, *kept = ctx.saved_tensors
        ops = [QOperand(kept[2 * i], kept[2 * i + 1], g) for i, g in enumerate(ctx.grans)]
        xq = ops.pop(0) if ctx.keep_x else None
        wq = ops.pop(0) if ctx.keep_w else None
        recipe, m = ctx.recipe, ctx.m
        gd = recipe.grad_dtype
        dyp = _pad_rows(dy.contiguous(), recipe.alignment)
        dyq = quant_rows(dyp, recipe, gd)
        dx = dw = None
        if ctx.needs_input_grad[0]:
            wt = wq if wq is not None and wq.gran == "rowwise" else transposed(wq, wc, recipe, E4M3, weight=True)
            dx = mm(dyq, wt, dy.dtype, recipe)[:m]
        wgrad_fp8 = recipe.wgrad_in_fp8(dyp.shape[0], *wc.shape)
        if ctx.needs_input_grad[1] and not wgrad_fp8:  # bf16 GEMM (fp32 accumulation) of dy^T x
            with torch.autocast(dyp.device.type, enabled=False):
                dw = (dyp.t() @ xp).to(ctx.w_dtype)
        elif ctx.needs_input_grad[1]:
            a = transposed(dyq, dyp, recipe, gd)  # dy^T along the tokens
            b = transposed(xq, xp, recipe, E4M3)
            dw = mm(a, b, dy.dtype, recipe).to(ctx.w_dtype)
        return dx, dw, None


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, recipe: Fp8Recipe) -> torch.Tensor:
    """F.linear(x, weight, bias) with its three GEMMs in FP8; x [..., K], weight [N, K]. The bias is added in bf16."""
    shape = x.shape
    y = _Fp8Linear.apply(x.reshape(-1, shape[-1]), weight, recipe).view(*shape[:-1], weight.shape[0])
    return y if bias is None else y + bias.to(y.dtype)
