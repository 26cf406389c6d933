"""Token permutation to expert order and back, sort-based (no dense [T, E] one-hot), fused on GPU.

Legend: T tokens, K experts per token, M = T * K routed rows, E experts, H hidden size.

`make_permutation(idx_TK, E)` sorts the M (token, slot) pairs by expert with a stable sort, so rows
of one expert stay in token order (deterministic), and returns:
  order_M  : for each sorted row, the flat index t * K + k it came from;
  inv_M    : for each flat index t * K + k, the sorted row that holds it (inverse of order_M);
  counts_E : rows per expert (int64), the group sizes of the expert GEMMs.
`permute(x_TH, perm)` returns x[order // K] -> [M, H], written from the source side: one program per token reads
its row once and stores it to its K sorted rows inv[t*K + k]. `unpermute(y_MH, perm, probs_TK)` returns
out[t] = sum_k probs[t, k] * y[inv[t*K + k]] (probs optional) in fp32, rounded to y's dtype, a gather. Each
output row is written by one program, so there are no atomics and the result is bit-reproducible. The
backward of each is the other (plus, for the probabilities, a row dot).
`gather_add_rows` adds a slice of the sorted rows (a chunk of whole experts: moecore/moe/chunked.py) into per-token
fp32 sums by the same kind of gather, one program per token.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moecore.kernels._triton import next_pow2, triton_importable, use_triton

if triton_importable():
    import triton
    import triton.language as tl

    @triton.jit
    def _spread_rows_kernel(
        src_ptr, inv_ptr, scale_ptr, out_ptr, H, K: tl.constexpr, HAS_SCALE: tl.constexpr, BLOCK_H: tl.constexpr
    ):
        # out[inv[t*K + k]] = src[t] (* scale[t*K + k]) for k < K: the gather out[i] = src[order[i] // K] written
        # from the source side, so each source row is read from memory once rather than once per copy.
        t = tl.program_id(0)
        rh = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        m = rh < H
        v = tl.load(src_ptr + t.to(tl.int64) * H + rh, mask=m, other=0.0)
        for k in tl.static_range(K):
            r = tl.load(inv_ptr + t * K + k).to(tl.int64)
            if HAS_SCALE:
                s = tl.load(scale_ptr + t * K + k).to(tl.float32)
                tl.store(out_ptr + r * H + rh, (v.to(tl.float32) * s).to(out_ptr.dtype.element_ty), mask=m)
            else:
                tl.store(out_ptr + r * H + rh, v, mask=m)

    @triton.jit
    def _gather_sum_kernel(
        src_ptr, inv_ptr, w_ptr, out_ptr, H, K: tl.constexpr, HAS_W: tl.constexpr, BLOCK_H: tl.constexpr
    ):
        # out[t] = sum_k w[t, k] * src[inv[t*K + k]], accumulated in fp32.
        t = tl.program_id(0)
        pid_h = tl.program_id(1)
        rh = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
        m = rh < H
        acc = tl.zeros((BLOCK_H,), dtype=tl.float32)
        for k in range(K):
            r = tl.load(inv_ptr + t * K + k).to(tl.int64)
            v = tl.load(src_ptr + r * H + rh, mask=m, other=0.0).to(tl.float32)
            if HAS_W:
                v = v * tl.load(w_ptr + t * K + k).to(tl.float32)
            acc += v
        tl.store(out_ptr + t.to(tl.int64) * H + rh, acc.to(out_ptr.dtype.element_ty), mask=m)

    @triton.jit
    def _gather_add_kernel(
        acc_ptr, src_ptr, inv_ptr, w_ptr, r0, r1, H, K: tl.constexpr, HAS_W: tl.constexpr, BLOCK_H: tl.constexpr
    ):
        # acc[t] += sum over k, in k order, of (w[r] *) src[r - r0] for r = inv[t*K + k] in [r0, r1), in fp32;
        # a token with none of its rows in [r0, r1) reads K indices and leaves its row of acc untouched.
        t = tl.program_id(0)
        rh = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        m = rh < H
        acc = tl.zeros((BLOCK_H,), dtype=tl.float32)
        hits = 0
        for k in tl.static_range(K):
            r = tl.load(inv_ptr + t * K + k)
            if (r >= r0) & (r < r1):
                v = tl.load(src_ptr + (r - r0).to(tl.int64) * H + rh, mask=m, other=0.0).to(tl.float32)
                if HAS_W:
                    v = v * tl.load(w_ptr + r).to(tl.float32)
                acc += v
                hits += 1
        if hits > 0:
            dst = acc_ptr + t.to(tl.int64) * H + rh
            tl.store(dst, tl.load(dst, mask=m, other=0.0) + acc, mask=m)

    @triton.jit
    def _gather_dot_kernel(a_ptr, b_ptr, inv_ptr, out_ptr, H, K: tl.constexpr, BLOCK_H: tl.constexpr):
        # out[t, k] = <a[t], b[inv[t*K + k]]> in fp32 (the routing-probability gradient of unpermute).
        t = tl.program_id(0)
        for k in range(K):
            r = tl.load(inv_ptr + t * K + k).to(tl.int64)
            acc = tl.zeros((BLOCK_H,), dtype=tl.float32)
            for h0 in range(0, H, BLOCK_H):
                rh = h0 + tl.arange(0, BLOCK_H)
                m = rh < H
                x = tl.load(a_ptr + t.to(tl.int64) * H + rh, mask=m, other=0.0).to(tl.float32)
                y = tl.load(b_ptr + r * H + rh, mask=m, other=0.0).to(tl.float32)
                acc += x * y
            tl.store(out_ptr + t * K + k, tl.sum(acc, axis=0))


@dataclass
class Permutation:
    """Where each routed row goes; see the module docstring. All tensors live on the tokens' device."""

    order_M: torch.Tensor
    inv_M: torch.Tensor
    counts_E: torch.Tensor
    num_tokens: int
    topk: int


def inverse_permutation(order: torch.Tensor) -> torch.Tensor:
    """inv with inv[order[i]] = i, for a permutation `order` of 0..N-1."""
    inv = torch.empty_like(order)
    inv[order] = torch.arange(order.numel(), device=order.device, dtype=order.dtype)
    return inv


def make_permutation(idx_TK: torch.Tensor, num_experts: int) -> Permutation:
    """Stable sort of the (token, slot) pairs by expert id."""
    T, K = idx_TK.shape
    flat = idx_TK.reshape(-1)
    order = torch.argsort(flat, stable=True)
    inv = inverse_permutation(order)
    counts = torch.bincount(flat, minlength=num_experts)
    return Permutation(order, inv, counts, T, K)


# ---------------------------------------------------------------- scattering rows into a zero buffer


def scatter_rows(x: torch.Tensor, dst: torch.Tensor, num_rows: int) -> torch.Tensor:
    """[N, ...] -> [num_rows, ...] with row i at dst[i], zeros elsewhere; differentiable, keeping only dst for
    backward. Autograd's own `index_copy` keeps its source as well: a copy of every scattered row, for a backward
    that needs only the destinations. dst may repeat a row (a scratch row the caller cuts off): which copy lands
    there is unspecified, and each source row's gradient is the gradient of its destination."""
    if x.requires_grad and torch.is_grad_enabled():
        return _ScatterRows.apply(x, dst, num_rows)
    return _scatter(x, dst, num_rows)


def _scatter(x: torch.Tensor, dst: torch.Tensor, num_rows: int) -> torch.Tensor:
    return x.new_zeros(num_rows, *x.shape[1:]).index_copy(0, dst, x)


class _ScatterRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, dst: torch.Tensor, num_rows: int) -> torch.Tensor:
        ctx.save_for_backward(dst)
        return _scatter(x, dst, num_rows)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (dst,) = ctx.saved_tensors
        return grad.index_select(0, dst), None, None


def weighted_sum_k(slots_TKH: torch.Tensor, weight_TK: torch.Tensor) -> torch.Tensor:
    """sum_k weight[t, k] * slots[t, k] ([T, K, H] -> [T, H]) with fp32 products and sums, rounded to the slots'
    dtype. Backward keeps the slots as they are (bf16: 2 bytes per element), where autograd through
    `(slots.float() * w).sum(1)` would keep their fp32 copy (twice the bytes of every routed row)."""
    if torch.is_grad_enabled() and (slots_TKH.requires_grad or weight_TK.requires_grad):
        return _WeightedSumK.apply(slots_TKH, weight_TK)
    return _weighted_sum(slots_TKH, weight_TK)


def _weighted_sum(slots_TKH: torch.Tensor, weight_TK: torch.Tensor) -> torch.Tensor:
    acc = torch.promote_types(slots_TKH.dtype, torch.float32)
    return (slots_TKH.to(acc) * weight_TK.to(acc).unsqueeze(-1)).sum(dim=1).to(slots_TKH.dtype)


class _WeightedSumK(torch.autograd.Function):
    @staticmethod
    def forward(ctx, slots_TKH: torch.Tensor, weight_TK: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(slots_TKH, weight_TK)
        return _weighted_sum(slots_TKH, weight_TK)

    @staticmethod
    def backward(ctx, d_out: torch.Tensor):
        slots, w = ctx.saved_tensors
        acc = torch.promote_types(slots.dtype, torch.float32)
        g = d_out.to(acc).unsqueeze(1)  # [T, 1, H]
        d_slots = (g * w.to(acc).unsqueeze(-1)).to(slots.dtype) if ctx.needs_input_grad[0] else None
        d_w = (g * slots.to(acc)).sum(-1).to(w.dtype) if ctx.needs_input_grad[1] else None
        return d_slots, d_w


# ---------------------------------------------------------------- references (autograd through torch ops)


def permute_reference(x_TH: torch.Tensor, perm: Permutation) -> torch.Tensor:
    return x_TH[perm.order_M // perm.topk]


def unpermute_reference(y_MH: torch.Tensor, perm: Permutation, probs_TK: torch.Tensor | None = None) -> torch.Tensor:
    y = y_MH[perm.inv_M].view(perm.num_tokens, perm.topk, -1).float()
    if probs_TK is not None:
        y = y * probs_TK.float().unsqueeze(-1)
    return y.sum(1).to(y_MH.dtype)


# ---------------------------------------------------------------- Triton launches


def _row_block(H: int) -> int:
    """Columns per program for the row kernels: a power of two up to 2048 that divides H where one >= 256 does
    (H = 7168: 1024, no masked half block), else the next power of two (capped)."""
    block = min(next_pow2(H), 2048)
    while block > 256 and H % block:
        block //= 2
    return block if H % block == 0 else min(next_pow2(H), 2048)


def _spread_rows(src: torch.Tensor, inv: torch.Tensor, K: int, scale: torch.Tensor | None = None) -> torch.Tensor:
    """out[inv[t*K + k]] = src[t] (* scale[t*K + k]): [T, H] -> [T*K, H] for a bijection `inv` of the T*K rows.
    The same values as the gather out[i] = src[order[i] // K] (* scale[order[i]]) with `order` inv's inverse,
    reading each source row once (a gather reads it K times, and the T*K*H bytes of copies it writes evict it
    from L2 in between)."""
    T, H = src.shape
    out = torch.empty(T * K, H, dtype=src.dtype, device=src.device)
    if T:
        block = _row_block(H)
        _spread_rows_kernel[(T, triton.cdiv(H, block))](
            src, inv, scale if scale is not None else src, out, H, K, scale is not None, block, num_warps=4
        )
    return out


def sorted_copies(
    x_TH: torch.Tensor, order_M: torch.Tensor, inv_M: torch.Tensor, topk: int, impl: str = "auto"
) -> torch.Tensor:
    """x[order // topk] ([T, H] -> [T*K, H]) for a dropless sort `order_M` and its inverse `inv_M`, without
    autograd: the copy `permute` makes, for Functions that write their own backward (moecore/moe/minimal.py)."""
    if not use_triton(impl, x_TH):
        return x_TH.index_select(0, order_M // topk)
    return _spread_rows(x_TH.contiguous(), inv_M, topk)


def _gather_sum(src: torch.Tensor, inv: torch.Tensor, T: int, K: int, w: torch.Tensor | None) -> torch.Tensor:
    H = src.shape[-1]
    out = torch.empty(T, H, dtype=src.dtype, device=src.device)
    if T:
        block = _row_block(H)
        grid = (T, triton.cdiv(H, block))
        _gather_sum_kernel[grid](src, inv, w if w is not None else src, out, H, K, w is not None, block, num_warps=4)
    return out


def gather_add_rows(
    acc_TH: torch.Tensor,
    rows_CH: torch.Tensor,
    inv_M: torch.Tensor,
    topk: int,
    r0: int,
    weight_M: torch.Tensor | None = None,
    impl: str = "auto",
) -> None:
    """acc[t] += sum_k (weight[r] *) rows[r - r0] over the sorted rows r = inv[t*K + k] in [r0, r0 + C), in place.

    Adds one slice of sorted rows (e.g. a chunk of whole experts) back into fp32 per-token sums. On GPU each token's
    row of acc is read and written by one program, its rows summed in k order: deterministic, no atomics and no
    sort of the destinations (which `index_put_(accumulate=True)` needs for determinism). `weight_M`: a factor per
    sorted row (all M), or None.
    """
    if rows_CH.shape[0] == 0:
        return
    if not use_triton(impl, acc_TH, rows_CH):
        gather_add_rows_reference(acc_TH, rows_CH, inv_M, topk, r0, weight_M)
        return
    T, H = acc_TH.shape
    if acc_TH.dtype != torch.float32 or not acc_TH.is_contiguous():
        raise ValueError(f"gather_add_rows: acc must be a contiguous fp32 tensor, got {acc_TH.dtype}")
    rows = rows_CH.contiguous()
    block = min(next_pow2(H), 2048)
    w = weight_M if weight_M is not None else rows
    grid = (T, triton.cdiv(H, block))
    _gather_add_kernel[grid](
        acc_TH, rows, inv_M, w, r0, r0 + rows.shape[0], H, topk, weight_M is not None, block, num_warps=4
    )


def gather_add_rows_reference(
    acc_TH: torch.Tensor,
    rows_CH: torch.Tensor,
    inv_M: torch.Tensor,
    topk: int,
    r0: int,
    weight_M: torch.Tensor | None = None,
) -> None:
    """`gather_add_rows` through torch: index_add_ on CPU (a serial loop), index_put_ on CUDA (sort-based);
    both deterministic (index_add_ accumulates with atomics on CUDA)."""
    r1 = r0 + rows_CH.shape[0]
    flat = torch.arange(inv_M.numel(), device=inv_M.device)
    inside = (inv_M >= r0) & (inv_M < r1)
    src = inv_M[inside] - r0  # rows of this slice, in token order
    rows = rows_CH.index_select(0, src).to(acc_TH.dtype)
    if weight_M is not None:
        rows = rows * weight_M.index_select(0, src + r0).to(acc_TH.dtype)[:, None]
    tokens = flat[inside] // topk
    if acc_TH.is_cuda:
        acc_TH.index_put_((tokens,), rows, accumulate=True)
    else:
        acc_TH.index_add_(0, tokens, rows)


def _gather_dot(a_TH: torch.Tensor, b_MH: torch.Tensor, inv: torch.Tensor, T: int, K: int) -> torch.Tensor:
    out = torch.empty(T, K, dtype=torch.float32, device=a_TH.device)
    if T:
        block = min(next_pow2(a_TH.shape[-1]), 2048)
        _gather_dot_kernel[(T,)](a_TH, b_MH, inv, out, a_TH.shape[-1], K, block, num_warps=4)
    return out


class _Permute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, inv: torch.Tensor, T: int, K: int) -> torch.Tensor:
        ctx.save_for_backward(inv)
        ctx.T, ctx.K = T, K
        return _spread_rows(x.contiguous(), inv, K)

    @staticmethod
    def backward(ctx, d_y: torch.Tensor):
        (inv,) = ctx.saved_tensors
        return _gather_sum(d_y.contiguous(), inv, ctx.T, ctx.K, None), None, None, None


class _Unpermute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y: torch.Tensor, inv: torch.Tensor, probs: torch.Tensor | None, T: int, K: int):
        y = y.contiguous()
        p = probs.contiguous() if probs is not None else None
        ctx.save_for_backward(y if p is not None else None, inv, p)
        ctx.T, ctx.K = T, K
        ctx.p_dtype = None if probs is None else probs.dtype
        return _gather_sum(y, inv, T, K, p)

    @staticmethod
    def backward(ctx, d_out: torch.Tensor):
        y, inv, p = ctx.saved_tensors
        d_out = d_out.contiguous()
        # d y[i] = d_out[order[i] // K] * p[order[i]], written as d y[inv[t*K + k]] = d_out[t] * p[t*K + k]
        d_y = _spread_rows(d_out, inv, ctx.K, p)
        d_p = None
        if p is not None and ctx.needs_input_grad[2]:
            d_p = _gather_dot(d_out, y, inv, ctx.T, ctx.K).to(ctx.p_dtype)
        return d_y, None, d_p, None, None


def permute(x_TH: torch.Tensor, perm: Permutation, impl: str = "auto") -> torch.Tensor:
    """Rows of x in expert order: [M, H]. Differentiable in x."""
    if not use_triton(impl, x_TH):
        return permute_reference(x_TH, perm)
    return _Permute.apply(x_TH, perm.inv_M, perm.num_tokens, perm.topk)


def unpermute(
    y_MH: torch.Tensor, perm: Permutation, probs_TK: torch.Tensor | None = None, impl: str = "auto"
) -> torch.Tensor:
    """Per-token (weighted) sum of its K expert outputs: [T, H]. Differentiable in y and probs."""
    if not use_triton(impl, y_MH):
        return unpermute_reference(y_MH, perm, probs_TK)
    return _Unpermute.apply(y_MH, perm.inv_M, probs_TK, perm.num_tokens, perm.topk)


def permute_probs(probs_TK: torch.Tensor, perm: Permutation) -> torch.Tensor:
    """Routing probabilities in expert order [M] (differentiable; a small gather)."""
    return probs_TK.reshape(-1)[perm.order_M]


def permute_rows(
    x_TH: torch.Tensor, order_M: torch.Tensor, topk: int, impl: str = "auto", inv: torch.Tensor | None = None
) -> torch.Tensor:
    """x[order // topk] for a dropless sort `order_M` (as the MoE layer's permute holds it), fused on GPU.

    Same values as `x_TH.index_select(0, order_M // topk)`; the backward is a per-token gather-sum in
    fp32 instead of an atomic scatter-add. `inv`: `inverse_permutation(order_M)` if the caller has it.
    """
    if not use_triton(impl, x_TH):
        return x_TH.index_select(0, order_M // topk)
    inv = inverse_permutation(order_M) if inv is None else inv
    return _Permute.apply(x_TH, inv, x_TH.shape[0], topk)


def unpermute_rows(
    rows_MH: torch.Tensor,
    order_M: torch.Tensor,
    inv_M: torch.Tensor,
    weight_TK: torch.Tensor | None,
    num_tokens: int,
    topk: int,
    impl: str = "auto",
) -> torch.Tensor:
    """sum_k weight[t, k] * rows[inv[t*K + k]] in fp32, cast to rows' dtype (weight None: plain sum)."""
    perm = Permutation(order_M, inv_M, torch.empty(0), num_tokens, topk)
    return unpermute(rows_MH, perm, weight_TK, impl=impl)
