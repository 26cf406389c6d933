"""Sparse multi-query attention over selected tokens (DeepSeek sparse attention's main attention), forward and
backward in Triton.

Inputs (the absorbed MLA form, moecore/models/dsa.py): q [B, S, n, D] (every head's [q_nope W_UK ; rotated
q_rope]), kv [B, S, D] (one shared row per token: [normalised latent c (DV channels) ; rotated k_rope]) and
idx [B, S, K] (int, the K tokens query t attends to; -1 for none). Values are kv[..., :DV]. For query t,
head h:

    s_j = q[t, h] . kv[idx[t, j]] * scale            (j over the valid entries of idx[t])
    o[t, h] = sum_j softmax(s)_j kv[idx[t, j], :DV]      lse[t, h] = log sum_j exp(s_j)

One program handles one query and a block of heads and walks its K selected rows in blocks (online
softmax, as flash attention), so memory is O(B S n D) whatever S: no [S, S] and no [S, K, D] tensor. The
backward recomputes the probabilities from lse, accumulates dq in registers and adds each row's dkv
contribution atomically into an fp32 buffer (a row is selected by many queries):

    dp_j = do . v_j,   ds_j = p_j (dp_j - delta),   delta = do . o
    dq  += scale ds_j kv_j,   dkv_j += scale ds_j q  (all D channels),   dkv_j[:DV] += p_j do

Same result as `moecore.models.dsa.sparse_mqa_attention_reference` (tests/kernels/test_sparse_mla.py, in
Triton's interpreter on CPU and on a GPU). Rows are gathered by index, so each head block re-reads them:
heads are processed `block_h` at a time (32 by default; the backward at most 32 at DV = 512, for shared
memory). Measured on an H200 at S = 32768, K = 2048 (docs/benchmarks.md): the forward runs at 140-167
TFLOP/s and the backward is bound by its atomic adds (one [K, D] block per query and head block), so the
kernel is slower than dense flash attention of the same shape there.
"""

from __future__ import annotations

import torch

from moecore.kernels._triton import next_pow2, triton_importable

if triton_importable():
    import triton
    import triton.language as tl

    @triton.jit
    def _sparse_mla_fwd(
        q_ptr, kv_ptr, idx_ptr, o_ptr, lse_ptr, S, NH, K, DV, DR, scale,
        sq_t, sq_h, skv_t, so_t, so_h,
        BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_R: tl.constexpr,
    ):  # fmt: skip
        row = tl.program_id(0)  # b * S + t
        b = row // S
        h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        mh = h < NH
        dv = tl.arange(0, BLOCK_V)
        dr = tl.arange(0, BLOCK_R)
        mv = dv < DV
        mr = dr < DR
        qb = q_ptr + row.to(tl.int64) * sq_t + h[:, None].to(tl.int64) * sq_h
        q_lat = tl.load(qb + dv[None, :], mask=mh[:, None] & mv[None, :], other=0.0)
        q_rope = tl.load(qb + DV + dr[None, :], mask=mh[:, None] & mr[None, :], other=0.0)
        m_i = tl.full([BLOCK_H], -1.0e30, dtype=tl.float32)
        l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
        acc = tl.zeros([BLOCK_H, BLOCK_V], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + tl.arange(0, BLOCK_K)
            ids = tl.load(idx_ptr + row.to(tl.int64) * K + kk, mask=kk < K, other=-1)
            valid = ids >= 0
            rows = (b * S + tl.maximum(ids, 0)).to(tl.int64)
            kvb = kv_ptr + rows[:, None] * skv_t
            kv_lat = tl.load(kvb + dv[None, :], mask=valid[:, None] & mv[None, :], other=0.0)
            k_rope = tl.load(kvb + DV + dr[None, :], mask=valid[:, None] & mr[None, :], other=0.0)
            s = tl.dot(q_lat, tl.trans(kv_lat)) + tl.dot(q_rope, tl.trans(k_rope))
            s = tl.where(valid[None, :], s * scale, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p.to(kv_lat.dtype), kv_lat)
            m_i = m_new
        out = acc / l_i[:, None]
        ob = o_ptr + row.to(tl.int64) * so_t + h[:, None].to(tl.int64) * so_h + dv[None, :]
        tl.store(ob, out.to(o_ptr.dtype.element_ty), mask=mh[:, None] & mv[None, :])
        tl.store(lse_ptr + row.to(tl.int64) * NH + h, m_i + tl.log(l_i), mask=mh)

    @triton.jit
    def _sparse_mla_bwd(
        q_ptr, kv_ptr, idx_ptr, do_ptr, lse_ptr, delta_ptr, dq_ptr, dkv_ptr, S, NH, K, DV, DR, scale,
        sq_t, sq_h, skv_t, sdo_t, sdo_h, sdkv_t,
        BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_R: tl.constexpr,
    ):  # fmt: skip
        row = tl.program_id(0)
        b = row // S
        h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        mh = h < NH
        dv = tl.arange(0, BLOCK_V)
        dr = tl.arange(0, BLOCK_R)
        mv = dv < DV
        mr = dr < DR
        qb = q_ptr + row.to(tl.int64) * sq_t + h[:, None].to(tl.int64) * sq_h
        q_lat = tl.load(qb + dv[None, :], mask=mh[:, None] & mv[None, :], other=0.0)
        q_rope = tl.load(qb + DV + dr[None, :], mask=mh[:, None] & mr[None, :], other=0.0)
        do = tl.load(
            do_ptr + row.to(tl.int64) * sdo_t + h[:, None].to(tl.int64) * sdo_h + dv[None, :],
            mask=mh[:, None] & mv[None, :],
            other=0.0,
        )
        lse = tl.load(lse_ptr + row.to(tl.int64) * NH + h, mask=mh, other=0.0)
        delta = tl.load(delta_ptr + row.to(tl.int64) * NH + h, mask=mh, other=0.0)
        dq_lat = tl.zeros([BLOCK_H, BLOCK_V], dtype=tl.float32)
        dq_rope = tl.zeros([BLOCK_H, BLOCK_R], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + tl.arange(0, BLOCK_K)
            ids = tl.load(idx_ptr + row.to(tl.int64) * K + kk, mask=kk < K, other=-1)
            valid = ids >= 0
            rows = (b * S + tl.maximum(ids, 0)).to(tl.int64)
            kvb = kv_ptr + rows[:, None] * skv_t
            kv_lat = tl.load(kvb + dv[None, :], mask=valid[:, None] & mv[None, :], other=0.0)
            k_rope = tl.load(kvb + DV + dr[None, :], mask=valid[:, None] & mr[None, :], other=0.0)
            s = (tl.dot(q_lat, tl.trans(kv_lat)) + tl.dot(q_rope, tl.trans(k_rope))) * scale
            p = tl.where(valid[None, :] & mh[:, None], tl.exp(s - lse[:, None]), 0.0)
            dp = tl.dot(do, tl.trans(kv_lat))
            ds = p * (dp - delta[:, None])
            dsl = ds.to(kv_lat.dtype)
            dq_lat += tl.dot(dsl, kv_lat)
            dq_rope += tl.dot(dsl, k_rope)
            d_lat = tl.dot(tl.trans(dsl), q_lat) * scale + tl.dot(tl.trans(p.to(do.dtype)), do)
            d_rope = tl.dot(tl.trans(dsl), q_rope) * scale
            db = dkv_ptr + rows[:, None] * sdkv_t
            tl.atomic_add(db + dv[None, :], d_lat, mask=valid[:, None] & mv[None, :])
            tl.atomic_add(db + DV + dr[None, :], d_rope, mask=valid[:, None] & mr[None, :])
        dqb = dq_ptr + row.to(tl.int64) * sq_t + h[:, None].to(tl.int64) * sq_h
        tl.store(dqb + dv[None, :], (dq_lat * scale).to(dq_ptr.dtype.element_ty), mask=mh[:, None] & mv[None, :])
        tl.store(dqb + DV + dr[None, :], (dq_rope * scale).to(dq_ptr.dtype.element_ty), mask=mh[:, None] & mr[None, :])


DEFAULT_BLOCK_H = 32  # fastest of 16 / 32 / 64 at DeepSeek-V3.2's shape (docs/benchmarks.md)


def _blocks(dv: int, dr: int, block_h: int) -> dict:
    if block_h < 16 or block_h & (block_h - 1):
        raise ValueError(f"block_h={block_h} is invalid: a power of two >= 16")
    return dict(BLOCK_H=block_h, BLOCK_K=32, BLOCK_V=max(16, next_pow2(dv)), BLOCK_R=max(16, next_pow2(dr)))


class _SparseMLA(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx, q: torch.Tensor, kv: torch.Tensor, idx: torch.Tensor, scale: float, dv: int, block_h: int, num_warps: int
    ):
        b, s, nh, d = q.shape
        q, kv = q.contiguous(), kv.contiguous()
        idx = idx.to(torch.int32).contiguous()
        k = idx.shape[-1]
        out = torch.empty(b, s, nh, dv, dtype=q.dtype, device=q.device)
        lse = torch.empty(b, s, nh, dtype=torch.float32, device=q.device)
        blocks = _blocks(dv, d - dv, block_h)
        grid = (b * s, triton.cdiv(nh, blocks["BLOCK_H"]))
        _sparse_mla_fwd[grid](
            q, kv, idx, out, lse, s, nh, k, dv, d - dv, scale,
            q.stride(1), q.stride(2), kv.stride(1), out.stride(1), out.stride(2), num_warps=num_warps, **blocks,
        )  # fmt: skip
        ctx.save_for_backward(q, kv, idx, out, lse)
        ctx.scale, ctx.dv, ctx.block_h, ctx.num_warps = scale, dv, block_h, num_warps
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, d_out: torch.Tensor, _d_lse: torch.Tensor):
        q, kv, idx, out, lse = ctx.saved_tensors
        b, s, nh, d = q.shape
        dv = ctx.dv
        d_out = d_out.contiguous()
        delta = (d_out.float() * out.float()).sum(-1).contiguous()
        dq = torch.empty_like(q)
        dkv = torch.zeros(b, s, d, dtype=torch.float32, device=q.device)
        blocks = _blocks(dv, d - dv, ctx.block_h)
        if blocks["BLOCK_V"] > 256:
            # DeepSeek's 512-wide latent: the backward holds q, dO, dq and a gathered kv tile of 512 columns;
            # at most 32 heads per program, 16-row kv tiles without multi-buffering keep it inside the H200's
            # 227 KB of shared memory (64 heads need 304 KB). The head blocking of the backward is free of the
            # forward's: it only decides the grid.
            blocks.update(BLOCK_H=min(blocks["BLOCK_H"], 32), BLOCK_K=16, num_stages=1)
        blocks.setdefault("num_warps", ctx.num_warps)
        grid = (b * s, triton.cdiv(nh, blocks["BLOCK_H"]))
        _sparse_mla_bwd[grid](
            q, kv, idx, d_out, lse, delta, dq, dkv, s, nh, idx.shape[-1], dv, d - dv, ctx.scale,
            q.stride(1), q.stride(2), kv.stride(1), d_out.stride(1), d_out.stride(2), dkv.stride(1), **blocks,
        )  # fmt: skip
        return dq, dkv.to(kv.dtype), None, None, None, None, None


def sparse_mla_attention(
    q: torch.Tensor,
    kv: torch.Tensor,
    idx: torch.Tensor,
    scale: float,
    dv: int,
    block_h: int = DEFAULT_BLOCK_H,
    num_warps: int = 4,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out [B, S, n, dv], lse [B, S, n] fp32) of the module docstring; differentiable in q and kv.

    `block_h`: heads per program (a power of two >= 16); larger blocks re-read the gathered rows fewer times
    and issue fewer atomic adds in the backward, at the price of registers (benchmarks/sparse_mla_bench.py);
    `num_warps`: warps per program (Triton's launch option), for the forward and the backward.
    """
    if not triton_importable():
        raise ValueError("the sparse MLA kernel needs the triton package, which does not import here")
    return _SparseMLA.apply(q, kv, idx, scale, dv, block_h, num_warps)
