"""Sparse multi-query attention over selected tokens (DeepSeek sparse attention's main attention), forward and
backward in Triton.

Inputs (the absorbed MLA form, moecore/models/dsa.py): q [B, S, n, D] (every head's [q_nope W_UK ; rotated
q_rope]), kv [B, S, D] (one shared row per token: [normalised latent c (DV channels) ; rotated k_rope]) and
idx [B, S, K] (int, the K tokens query t attends to; -1 for none). Values are kv[..., :DV]. For query t,
head h:

    s_j = q[t, h] . kv[idx[t, j]] * scale            (j over the valid entries of idx[t])
    o[t, h] = sum_j softmax(s)_j kv[idx[t, j], :DV]      lse[t, h] = log sum_j exp(s_j)

Forward: one program handles one query and a block of `block_h` heads and walks its K selected rows in tiles
(online softmax, as flash attention), so memory is O(B S n D) whatever S: no [S, S] and no [S, K, D] tensor.
It saves lse. Both backwards recompute the probabilities from it; with delta = do . o (per query and head):

    p_j = exp(s_j - lse),   dp_j = do . v_j,   ds_j = p_j (dp_j - delta)
    dq = scale sum_j ds_j kv_j,   dkv_j += scale ds_j q  (all D channels, summed over heads),   dkv_j[:DV] += p_j do

lse is differentiable too (DeepSeek-V4's sinks gate the output by it): its gradient g enters as delta - g, since
d lse / d s_j = p_j.

A row is selected by many queries, so dkv sums over queries into an fp32 buffer; the two backwards
(`sparse_mla_attention(..., backward=...)`) differ in how:

- "atomic": one kernel, one program per (query, block of <= 32 heads) walking the K rows in 16-row tiles,
  dq in registers, one atomic add of the tile's [16, D] dkv share per tile: S K D ceil(n / 32) adds per
  sequence (4 S K D at n = 128; 32 heads is the most whose tiles fit in shared memory at DV = 512).
- "split": two passes over chunks of query rows that share a scratch buffer [2, rows, n, K] (in q's dtype,
  bounded by `SplitBackward.scratch_bytes`). Pass A, one program per (query, block of heads): recomputes s,
  p, dp, ds tile by tile (two GEMMs of the gathered rows, no accumulator over K) and writes p and scale ds.
  Pass B, one program per (query, channel block, head group; the rope channels are one block): for each tile
  of selected rows, dq[heads, channels] += (scale ds) @ kv[rows, channels] in registers and the tile's dkv
  share (scale ds)^T @ q + p^T @ do, summed over the whole head group by the GEMM itself, added atomically
  once: S K D ceil(n / b_block_h) adds (S K D at n <= 128, the default group), and each program gathers only
  its own channels of the selected rows. With `SplitBackward.b_reduce="sorted"` pass B stores each query's
  share instead (one fp32 row per query, slot and head group, in a second scratch buffer), and a third kernel
  sums them per kv row over the chunk's (query, slot) pairs grouped by a stable sort of idx: no atomics, and
  the same gradients bit for bit on every run (dq is never summed by atomics).

Same result as `moecore.models.dsa.sparse_mqa_attention_reference` (tests/kernels/test_sparse_mla.py, both
backwards, in Triton's interpreter on CPU and on a GPU). Launch sizes are arguments (`block_h`, `block_k`,
`num_warps`, `num_stages`, `SplitBackward`) so that benchmarks/sparse_mla_bench.py can sweep them; its H200
timings against dense MLA attention of the same shape are in docs/benchmarks.md.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moecore.kernels._triton import next_pow2, triton_importable

if triton_importable():
    import triton
    import triton.language as tl

    @triton.jit
    def _load_heads(ptr, row, h, mh, cols, mc, stride_t, stride_h):
        # [heads, cols] of one query row (q's latent or rope channels, dO)
        base = ptr + row.to(tl.int64) * stride_t + h[:, None].to(tl.int64) * stride_h
        return tl.load(base + cols[None, :], mask=mh[:, None] & mc[None, :], other=0.0)

    @triton.jit
    def _backward_inputs(
        q_ptr, do_ptr, lse_ptr, delta_ptr, row, h, mh, dv, mv, dr, mr, NH, DV, sq_t, sq_h, sdo_t, sdo_h
    ):
        # what both backward kernels read per query row and head block: q (latent, rope), dO, lse, delta = dO . O
        q_lat = _load_heads(q_ptr, row, h, mh, dv, mv, sq_t, sq_h)
        q_rope = _load_heads(q_ptr + DV, row, h, mh, dr, mr, sq_t, sq_h)
        do = _load_heads(do_ptr, row, h, mh, dv, mv, sdo_t, sdo_h)
        lse = tl.load(lse_ptr + row.to(tl.int64) * NH + h, mask=mh, other=0.0)
        delta = tl.load(delta_ptr + row.to(tl.int64) * NH + h, mask=mh, other=0.0)
        return q_lat, q_rope, do, lse, delta

    @triton.jit
    def _gather_selected(kv_ptr, idx_ptr, row, b, S, K, k0, DV, dv, dr, mv, mr, skv_t, BLOCK_K: tl.constexpr):
        # The tile of BLOCK_K selected rows from slot k0 of query `row`: (slots, valid, kv rows, latent, rope key)
        kk = k0 + tl.arange(0, BLOCK_K)
        ids = tl.load(idx_ptr + row.to(tl.int64) * K + kk, mask=kk < K, other=-1)
        valid = ids >= 0
        rows = (b * S + tl.maximum(ids, 0)).to(tl.int64)
        kvb = kv_ptr + rows[:, None] * skv_t
        kv_lat = tl.load(kvb + dv[None, :], mask=valid[:, None] & mv[None, :], other=0.0)
        k_rope = tl.load(kvb + DV + dr[None, :], mask=valid[:, None] & mr[None, :], other=0.0)
        return kk, valid, rows, kv_lat, k_rope

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
        q_lat = _load_heads(q_ptr, row, h, mh, dv, mv, sq_t, sq_h)
        q_rope = _load_heads(q_ptr + DV, row, h, mh, dr, mr, sq_t, sq_h)
        m_i = tl.full([BLOCK_H], -1.0e30, dtype=tl.float32)
        l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
        acc = tl.zeros([BLOCK_H, BLOCK_V], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            kk, valid, rows, kv_lat, k_rope = _gather_selected(
                kv_ptr, idx_ptr, row, b, S, K, k0, DV, dv, dr, mv, mr, skv_t, BLOCK_K
            )
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
    def _row_dot(a_ptr, b_ptr, out_ptr, R, DV, BLOCK_R: tl.constexpr, BLOCK_V: tl.constexpr):
        # delta = sum over the value channels of do * o, in fp32, for BLOCK_R (query, head) rows
        r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
        dv = tl.arange(0, BLOCK_V)
        m = (r < R)[:, None] & (dv < DV)[None, :]
        off = r[:, None].to(tl.int64) * DV + dv[None, :]
        a = tl.load(a_ptr + off, mask=m, other=0.0).to(tl.float32)
        b = tl.load(b_ptr + off, mask=m, other=0.0).to(tl.float32)
        tl.store(out_ptr + r, tl.sum(a * b, 1), mask=r < R)

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
        q_lat, q_rope, do, lse, delta = _backward_inputs(
            q_ptr, do_ptr, lse_ptr, delta_ptr, row, h, mh, dv, mv, dr, mr, NH, DV, sq_t, sq_h, sdo_t, sdo_h
        )
        dq_lat = tl.zeros([BLOCK_H, BLOCK_V], dtype=tl.float32)
        dq_rope = tl.zeros([BLOCK_H, BLOCK_R], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            kk, valid, rows, kv_lat, k_rope = _gather_selected(
                kv_ptr, idx_ptr, row, b, S, K, k0, DV, dv, dr, mv, mr, skv_t, BLOCK_K
            )
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
            tl.atomic_add(db + dv[None, :], d_lat, mask=valid[:, None] & mv[None, :], sem="relaxed")
            tl.atomic_add(db + DV + dr[None, :], d_rope, mask=valid[:, None] & mr[None, :], sem="relaxed")
        dqb = dq_ptr + row.to(tl.int64) * sq_t + h[:, None].to(tl.int64) * sq_h
        tl.store(dqb + dv[None, :], (dq_lat * scale).to(dq_ptr.dtype.element_ty), mask=mh[:, None] & mv[None, :])
        tl.store(dqb + DV + dr[None, :], (dq_rope * scale).to(dq_ptr.dtype.element_ty), mask=mh[:, None] & mr[None, :])

    @triton.jit
    def _sparse_mla_bwd_pds(
        q_ptr, kv_ptr, idx_ptr, do_ptr, lse_ptr, delta_ptr, pds_ptr, row0, S, NH, K, DV, DR, scale,
        sq_t, sq_h, skv_t, sdo_t, sdo_h, spds_w, spds_t, spds_h,
        BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_R: tl.constexpr,
    ):  # fmt: skip
        # split backward, pass A: p and scale * ds of one query and head block into the chunk's scratch rows
        local = tl.program_id(0)  # query row inside the chunk
        row = row0 + local  # b * S + t
        b = row // S
        h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        mh = h < NH
        dv = tl.arange(0, BLOCK_V)
        dr = tl.arange(0, BLOCK_R)
        mv = dv < DV
        mr = dr < DR
        q_lat, q_rope, do, lse, delta = _backward_inputs(
            q_ptr, do_ptr, lse_ptr, delta_ptr, row, h, mh, dv, mv, dr, mr, NH, DV, sq_t, sq_h, sdo_t, sdo_h
        )
        pb = pds_ptr + local.to(tl.int64) * spds_t + h[:, None].to(tl.int64) * spds_h
        for k0 in range(0, K, BLOCK_K):
            kk, valid, rows, kv_lat, k_rope = _gather_selected(
                kv_ptr, idx_ptr, row, b, S, K, k0, DV, dv, dr, mv, mr, skv_t, BLOCK_K
            )
            s = (tl.dot(q_lat, tl.trans(kv_lat)) + tl.dot(q_rope, tl.trans(k_rope))) * scale
            p = tl.where(valid[None, :] & mh[:, None], tl.exp(s - lse[:, None]), 0.0)
            dp = tl.dot(do, tl.trans(kv_lat))
            ds = p * (dp - delta[:, None]) * scale  # scale * ds: what dq and dkv take
            mk = mh[:, None] & (kk < K)[None, :]
            tl.store(pb + kk[None, :], p.to(pds_ptr.dtype.element_ty), mask=mk)
            tl.store(pb + spds_w + kk[None, :], ds.to(pds_ptr.dtype.element_ty), mask=mk)

    @triton.jit
    def _dq_dkv_channels(
        q_ptr, kv_ptr, idx_ptr, do_ptr, pds_ptr, dq_ptr, dkv_ptr, row, local, b, h0, c0, CW, S, NH, K,
        sq_t, sq_h, skv_t, sdo_t, sdo_h, spds_w, spds_t, spds_h, sdkv_t,
        BLOCK_K: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_C: tl.constexpr, HAS_V: tl.constexpr,
        ATOMIC: tl.constexpr,
    ):  # fmt: skip
        # channels [c0, c0 + CW) of dq (heads h0 ...) and of this query's share of dkv, over all its K rows
        h = h0 + tl.arange(0, BLOCK_H)
        mh = h < NH
        cc = tl.arange(0, BLOCK_C)
        ch = c0 + cc
        mc = cc < CW
        q_c = tl.load(
            q_ptr + row.to(tl.int64) * sq_t + h[:, None].to(tl.int64) * sq_h + ch[None, :],
            mask=mh[:, None] & mc[None, :],
            other=0.0,
        )
        if HAS_V:
            do_c = tl.load(
                do_ptr + row.to(tl.int64) * sdo_t + h[:, None].to(tl.int64) * sdo_h + ch[None, :],
                mask=mh[:, None] & mc[None, :],
                other=0.0,
            )
        pb = pds_ptr + local.to(tl.int64) * spds_t + h[:, None].to(tl.int64) * spds_h
        dq = tl.zeros([BLOCK_H, BLOCK_C], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + tl.arange(0, BLOCK_K)
            mk = kk < K
            ids = tl.load(idx_ptr + row.to(tl.int64) * K + kk, mask=mk, other=-1)
            valid = ids >= 0
            rows = (b * S + tl.maximum(ids, 0)).to(tl.int64)
            kv_c = tl.load(
                kv_ptr + rows[:, None] * skv_t + ch[None, :], mask=valid[:, None] & mc[None, :], other=0.0
            )  # [BLOCK_K, BLOCK_C]
            ds = tl.load(pb + spds_w + kk[None, :], mask=mh[:, None] & mk[None, :], other=0.0)  # [BLOCK_H, BLOCK_K]
            dq = tl.dot(ds, kv_c.to(ds.dtype), dq)
            d = tl.dot(tl.trans(ds), q_c.to(ds.dtype))  # [BLOCK_K, BLOCK_C], summed over the heads
            if HAS_V:
                p = tl.load(pb + kk[None, :], mask=mh[:, None] & mk[None, :], other=0.0)
                d = tl.dot(tl.trans(p), do_c.to(p.dtype), d)
            if ATOMIC:
                tl.atomic_add(
                    dkv_ptr + rows[:, None] * sdkv_t + ch[None, :], d, mask=valid[:, None] & mc[None, :], sem="relaxed"
                )
            else:  # "sorted": dkv_ptr holds one row per (query, selected slot), summed by _sparse_mla_dkv_sum
                slot = (local * K + kk).to(tl.int64)
                tl.store(dkv_ptr + slot[:, None] * sdkv_t + ch[None, :], d, mask=valid[:, None] & mc[None, :])
        dqb = dq_ptr + row.to(tl.int64) * sq_t + h[:, None].to(tl.int64) * sq_h + ch[None, :]
        tl.store(dqb, dq.to(dq_ptr.dtype.element_ty), mask=mh[:, None] & mc[None, :])

    @triton.jit
    def _sparse_mla_bwd_dq_dkv(
        q_ptr, kv_ptr, idx_ptr, do_ptr, pds_ptr, dq_ptr, dkv_ptr, row0, S, NH, K, DV, DR,
        sq_t, sq_h, skv_t, sdo_t, sdo_h, spds_w, spds_t, spds_h, sdkv_t, sdkv_g,
        BLOCK_K: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_R: tl.constexpr,
        ATOMIC: tl.constexpr,
    ):  # fmt: skip
        # split backward, pass B: program (c, g) of a query: latent channels [c BLOCK_C, ...) for
        # c < cdiv(DV, BLOCK_C), else the rope channels; heads [g BLOCK_H, ...)
        n_c = tl.cdiv(DV, BLOCK_C) + 1
        c = tl.program_id(0) % n_c
        group = tl.program_id(0) // n_c
        h0 = group * BLOCK_H
        dkv_ptr += group.to(tl.int64) * sdkv_g  # "sorted": each head group has its own slot rows (0 if atomic)
        local = tl.program_id(1)
        row = row0 + local
        b = row // S
        if c < n_c - 1:
            _dq_dkv_channels(
                q_ptr, kv_ptr, idx_ptr, do_ptr, pds_ptr, dq_ptr, dkv_ptr, row, local, b, h0, c * BLOCK_C,
                tl.minimum(BLOCK_C, DV - c * BLOCK_C), S, NH, K, sq_t, sq_h, skv_t, sdo_t, sdo_h, spds_w, spds_t,
                spds_h, sdkv_t, BLOCK_K, BLOCK_H, BLOCK_C, True, ATOMIC,
            )  # fmt: skip
        else:
            _dq_dkv_channels(
                q_ptr, kv_ptr, idx_ptr, do_ptr, pds_ptr, dq_ptr, dkv_ptr, row, local, b, h0, DV, DR,
                S, NH, K, sq_t, sq_h, skv_t, sdo_t, sdo_h, spds_w, spds_t, spds_h, sdkv_t,
                BLOCK_K, BLOCK_H, BLOCK_R, False, ATOMIC,
            )  # fmt: skip

    @triton.jit
    def _sparse_mla_dkv_sum(
        con_ptr, order_ptr, offs_ptr, dkv_ptr, D, G, scon_g, sdkv_t, BLOCK_E: tl.constexpr, BLOCK_D: tl.constexpr
    ):
        # "sorted" reduction: dkv[r] += the (query, slot) rows that selected kv row r, in the fixed order of a
        # stable sort (order[offs[r]:offs[r + 1]]), over the G head groups; one program per kv row, no atomics
        r = tl.program_id(0)
        start = tl.load(offs_ptr + r)
        end = tl.load(offs_ptr + r + 1)
        if end > start:
            d = tl.arange(0, BLOCK_D)
            md = d < D
            acc = tl.zeros([BLOCK_D], dtype=tl.float32)
            for e0 in range(start, end, BLOCK_E):
                e = e0 + tl.arange(0, BLOCK_E)
                me = e < end
                slot = tl.load(order_ptr + e, mask=me, other=0)
                for g in range(G):
                    v = tl.load(
                        con_ptr + scon_g.to(tl.int64) * g + slot[:, None] * D + d[None, :],
                        mask=me[:, None] & md[None, :],
                        other=0.0,
                    )
                    acc += tl.sum(v, 0)
            ptr = dkv_ptr + r.to(tl.int64) * sdkv_t + d
            tl.store(ptr, tl.load(ptr, mask=md, other=0.0) + acc, mask=md)


BACKWARDS = ("atomic", "split")
# Defaults by the inputs' element size. 2 bytes (bf16 / fp16): the fastest measured at DeepSeek-V3.2's shape on an
# H200 (S 32768, K 2048, 128 heads; docs/benchmarks.md): forward 64 heads x 64-row tiles, 8 warps, 2 stages;
# the split backward. 4 bytes (fp32): tiles of half the rows (a 576-wide fp32 tile of 64 rows is 147 KB of
# shared memory per stage) and the atomic backward, whose pass fits at 32 heads.
LAUNCH_DEFAULTS = {
    2: {"block_h": 64, "num_warps": 8, "block_k": 64, "num_stages": 2, "backward": "split"},
    4: {"block_h": 32, "num_warps": 4, "block_k": 32, "num_stages": None, "backward": "atomic"},
}


@dataclass(frozen=True)
class SplitBackward:
    """Launch sizes of the split backward (module docstring). Pass A (p and ds): `a_block_h` heads per program,
    `a_block_k` selected rows per tile, `a_warps`, `a_stages`. Pass B (dq and dkv): `b_block_c` latent channels
    per program (the rope channels get a program of their own), `b_block_h` heads per program (all heads when
    >= n: each further head group adds its own dkv shares), `b_block_k` selected rows per tile, `b_warps`,
    `b_stages`. `b_reduce`: how pass B sums a row's dkv over the queries that selected it, "atomic" (fp32 atomic
    adds) or "sorted" (each query's share stored, then summed per row in a fixed order: deterministic, no
    atomics, at the price of a [rows, K, D] fp32 buffer per chunk). `scratch_bytes` bounds the scratch buffers:
    query rows are processed in chunks that fit it."""

    a_block_h: int = 64
    a_block_k: int = 64
    a_warps: int = 8
    a_stages: int = 1
    b_block_c: int = 128
    b_block_h: int = 128
    b_block_k: int = 64
    b_warps: int = 8
    b_stages: int = 2
    b_reduce: str = "atomic"
    scratch_bytes: int = 2 << 30

    def validate(self) -> None:
        for name in ("a_block_h", "a_block_k", "b_block_c", "b_block_h", "b_block_k"):
            _pow2(f"SplitBackward.{name}", getattr(self, name))
        for name in ("a_warps", "b_warps"):
            if getattr(self, name) not in (1, 2, 4, 8, 16):
                raise ValueError(f"SplitBackward.{name}={getattr(self, name)} is invalid: 1, 2, 4, 8 or 16")
        if self.b_reduce not in ("atomic", "sorted"):
            raise ValueError(f"SplitBackward.b_reduce={self.b_reduce!r} is invalid: atomic | sorted")
        for name in ("a_stages", "b_stages", "scratch_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"SplitBackward.{name}={getattr(self, name)} is invalid: >= 1")


def _pow2(name: str, v: int) -> int:
    if v < 16 or v & (v - 1):
        raise ValueError(f"{name}={v} is invalid: a power of two >= 16")
    return v


def _blocks(dv: int, dr: int, block_h: int, block_k: int = 32) -> dict:
    return dict(
        BLOCK_H=_pow2("block_h", block_h),
        BLOCK_K=_pow2("block_k", block_k),
        BLOCK_V=max(16, next_pow2(dv)),
        BLOCK_R=max(16, next_pow2(dr)),
    )


def _backward_atomic(ctx, q, kv, idx, d_out, lse, delta) -> tuple[torch.Tensor, torch.Tensor]:
    """The one-kernel backward: dq in registers, dkv by atomic adds per (query, head block, tile of rows)."""
    b, s, nh, d = q.shape
    dv = ctx.dv
    dq = torch.empty_like(q)
    dkv = torch.zeros(kv.shape, dtype=torch.float32, device=q.device)
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
    return dq, dkv


def _backward_split(ctx, q, kv, idx, d_out, lse, delta) -> tuple[torch.Tensor, torch.Tensor]:
    """Pass A then pass B (module docstring) over chunks of query rows sharing one p / ds scratch buffer."""
    b, s, nh, d = q.shape
    dv, k, cfg = ctx.dv, idx.shape[-1], ctx.split
    dq = torch.empty_like(q)
    dkv = torch.zeros(kv.shape, dtype=torch.float32, device=q.device)
    rows = b * s
    kv_rows = kv.shape[0] * kv.shape[1]
    # no block wider than the heads / latent channels it covers (small models, heads split by tensor parallel)
    a_h, b_h = (min(v, max(16, next_pow2(nh))) for v in (cfg.a_block_h, cfg.b_block_h))
    b_c = min(cfg.b_block_c, max(16, next_pow2(dv)))
    groups = triton.cdiv(nh, b_h)
    sorted_ = cfg.b_reduce == "sorted"
    # per query row: p and scale * ds [2, n, K] in q's dtype, and for "sorted" its dkv shares [groups, K, D] fp32
    per_row = 2 * nh * k * q.element_size() + (groups * k * d * 4 if sorted_ else 0)
    chunk = max(1, min(rows, 65535, cfg.scratch_bytes // per_row))  # pass B's grid axis 1 is <= 65535
    pds = torch.empty(2, chunk, nh, k, dtype=q.dtype, device=q.device)
    con = torch.empty(groups, chunk * k, d, dtype=torch.float32, device=q.device) if sorted_ else dkv
    a = _blocks(dv, d - dv, a_h, cfg.a_block_k)
    n_pb = (triton.cdiv(dv, b_c) + 1) * groups  # pass B programs per query
    flat_idx = idx.view(rows, k)
    for row0 in range(0, rows, chunk):
        n = min(chunk, rows - row0)
        _sparse_mla_bwd_pds[(n, triton.cdiv(nh, a_h))](
            q, kv, idx, d_out, lse, delta, pds, row0, s, nh, k, dv, d - dv, ctx.scale,
            q.stride(1), q.stride(2), kv.stride(1), d_out.stride(1), d_out.stride(2),
            pds.stride(0), pds.stride(1), pds.stride(2), num_warps=cfg.a_warps, num_stages=cfg.a_stages, **a,
        )  # fmt: skip
        _sparse_mla_bwd_dq_dkv[(n_pb, n)](
            q, kv, idx, d_out, pds, dq, con, row0, s, nh, k, dv, d - dv,
            q.stride(1), q.stride(2), kv.stride(1), d_out.stride(1), d_out.stride(2),
            pds.stride(0), pds.stride(1), pds.stride(2), con.stride(-2), con.stride(0) if sorted_ else 0,
            BLOCK_K=cfg.b_block_k, BLOCK_H=b_h, BLOCK_C=b_c, BLOCK_R=a["BLOCK_R"], ATOMIC=not sorted_,
            num_warps=cfg.b_warps, num_stages=cfg.b_stages,
        )  # fmt: skip
        if sorted_:
            # the chunk's (query, slot) pairs grouped by the kv row they selected (-1: past the last row), in
            # (query, slot) order within a row: a stable sort, so the sums are the same on every run
            base = torch.arange(row0, row0 + n, device=q.device)[:, None] // s * s
            ids = flat_idx[row0 : row0 + n]
            key = torch.where(ids >= 0, ids + base, kv_rows).int().flatten()
            order = torch.argsort(key, stable=True)
            offs = torch.zeros(kv_rows + 1, dtype=torch.int64, device=q.device)
            offs[1:] = torch.bincount(key, minlength=kv_rows + 1)[:kv_rows].cumsum(0)
            _sparse_mla_dkv_sum[(kv_rows,)](
                con, order, offs, dkv, d, groups, con.stride(0), dkv.stride(1),
                BLOCK_E=8, BLOCK_D=max(16, next_pow2(d)),
            )  # fmt: skip
    return dq, dkv


class _SparseMLA(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx,
        q: torch.Tensor,
        kv: torch.Tensor,
        idx: torch.Tensor,
        scale: float,
        dv: int,
        block_h: int,
        num_warps: int,
        block_k: int,
        num_stages: int | None,
        backward: str,
        split: SplitBackward,
    ):
        b, s, nh, d = q.shape
        q, kv = q.contiguous(), kv.contiguous()
        idx = idx.to(torch.int32).contiguous()
        k = idx.shape[-1]
        out = torch.empty(b, s, nh, dv, dtype=q.dtype, device=q.device)
        lse = torch.empty(b, s, nh, dtype=torch.float32, device=q.device)
        blocks = _blocks(dv, d - dv, block_h, block_k)
        if num_stages is not None:
            blocks["num_stages"] = num_stages
        grid = (b * s, triton.cdiv(nh, blocks["BLOCK_H"]))
        _sparse_mla_fwd[grid](
            q, kv, idx, out, lse, s, nh, k, dv, d - dv, scale,
            q.stride(1), q.stride(2), kv.stride(1), out.stride(1), out.stride(2), num_warps=num_warps, **blocks,
        )  # fmt: skip
        ctx.save_for_backward(q, kv, idx, out, lse)
        ctx.scale, ctx.dv, ctx.block_h, ctx.num_warps = scale, dv, block_h, num_warps
        ctx.backward, ctx.split = backward, split
        return out, lse

    @staticmethod
    def backward(ctx, d_out: torch.Tensor, d_lse: torch.Tensor | None):
        q, kv, idx, out, lse = ctx.saved_tensors
        if d_out is None:  # only lse is used downstream
            d_out = torch.zeros_like(out)
        d_out = d_out.contiguous()
        delta = torch.empty(lse.shape, dtype=torch.float32, device=q.device)
        rows, block_v = delta.numel(), max(16, next_pow2(ctx.dv))
        block_r = max(1, 4096 // block_v)  # 4096 elements of each operand per program
        _row_dot[(triton.cdiv(rows, block_r),)](d_out, out, delta, rows, ctx.dv, BLOCK_R=block_r, BLOCK_V=block_v)
        if d_lse is not None:  # d lse / d s_j = p_j: ds_j = p_j (dp_j - delta + d_lse), the same kernels
            delta = delta - d_lse.float()
        run = _backward_split if ctx.backward == "split" else _backward_atomic
        dq, dkv = run(ctx, q, kv, idx, d_out, lse, delta)
        return (dq, dkv.to(kv.dtype)) + (None,) * 9


def sparse_mla_attention(
    q: torch.Tensor,
    kv: torch.Tensor,
    idx: torch.Tensor,
    scale: float,
    dv: int,
    block_h: int | None = None,
    num_warps: int | None = None,
    *,
    block_k: int | None = None,
    num_stages: int | None = None,
    backward: str | None = None,
    split: SplitBackward | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out [B, S, n, dv], lse [B, S, n] fp32) of the module docstring; differentiable in q and kv.

    Forward: `block_h` heads per program (a power of two >= 16; larger blocks re-read the gathered rows fewer
    times, at the price of registers), `block_k` selected rows per tile, `num_warps`, `num_stages` (Triton's
    launch options; None: Triton's default). `backward`: "atomic" (one kernel; its heads per program follow
    `block_h`, at most 32 at a 512-wide latent, and `num_warps`) or "split" (two passes, sized by `split`).
    benchmarks/sparse_mla_bench.py sweeps these. Arguments left None take `LAUNCH_DEFAULTS` for q's element size.
    """
    if not triton_importable():
        raise ValueError("the sparse MLA kernel needs the triton package, which does not import here")
    if kv.shape[1] != q.shape[1] and q.shape[0] != 1:  # kv's rows are addressed as batch * S + selected row
        raise ValueError(
            f"kv holds {kv.shape[1]} rows per sequence for {q.shape[1]} queries: fold the batch into one "
            "(moecore.models.dsa.sparse_mqa_attention_to_sequence)"
        )
    given = {"block_h": block_h, "num_warps": num_warps, "block_k": block_k, "backward": backward}
    defaults = LAUNCH_DEFAULTS[2 if q.element_size() <= 2 else 4]
    block_h, num_warps, block_k, backward = (defaults[k] if v is None else v for k, v in given.items())
    if num_stages is None and given["block_k"] is None:
        num_stages = defaults["num_stages"]
    if backward not in BACKWARDS:
        raise ValueError(f"backward={backward!r} is invalid: allowed: {' | '.join(BACKWARDS)}")
    split = split if split is not None else SplitBackward()
    split.validate()
    return _SparseMLA.apply(q, kv, idx, scale, dv, block_h, num_warps, block_k, num_stages, backward, split)
