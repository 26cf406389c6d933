"""Chunked gated delta rule (Gated DeltaNet) in Triton, forward and backward.

Reference (same arguments and results): `moecore.models.linear_attention.gated_delta_rule_chunked`;
it lives in the model layer, so this module only holds the kernels and `gated_delta_rule_triton`, and the
model's `gated_delta_rule` dispatcher chooses between them (this layer never imports the model layer).

Per value head the state S [Dk, Dv] follows S_t = e^{g_t} S_{t-1} + beta_t k_t (v_t - e^{g_t} S_{t-1}^T k_t)^T
and o_t = S_t^T (scale q_t). Split the sequence into chunks of C tokens. Inside one chunk, with start
state S, G = cumsum(g) (so Gam_t = e^{G_t}, gam = e^{G_C}) and E_ts = e^{G_t - G_s}:

    A = strict_lower(diag(beta) (K K^T) o E),  T = (I + A)^-1              (the UT transform)
    W = T diag(beta Gam) K,   U0 = T diag(beta) V,   U = U0 - W S          (the WY form: written values)
    O = diag(Gam) Qs S + P U,  P = lower_incl((Qs K^T) o E),  Qs = scale Q
    S_next = gam S + Kt^T U,   Kt = diag(gam / Gam) K                     (k_s decayed to the chunk end)

Kernels, forward: `_wy_fwd` (one program per chunk: A, T blockwise, W, U0), `_state_fwd`
(one program per head and Dv tile, sequential over chunks from the initial state, zeros unless given: U
and the state at every chunk start),
`_out_fwd` (one program per chunk and Dv tile: O). Saved for backward: the chunk-start states
(S/C * Dk * Dv per head), T (S * C), W, U and G (S * D): memory O(S*D + S/C*D^2). Block sizes,
warps and pipeline stages are autotuned once per head dims and the timings cached on disk (the
interpreter takes the first config).

Backward. Write U = T R with R = diag(beta) (V - diag(Gam) K S), the right-hand side of the UT solve;
then dR = T^T dU and dA = -dR U^T (strict lower part), the usual triangular-solve gradient. With dS'
the gradient of the chunk-end state, `_state_bwd` runs the chunks in reverse (one program per head and
Dv tile):   dU = P^T dO + Kt dS',   dS = gam dS' + (Gam Qs)^T dO - W^T dU   (W^T dU = (beta Gam K)^T dR),
with P^T dO computed beforehand for all chunks in parallel (`_du_intra`); the last dS (first chunk) is the
gradient of the initial state.
Then, one program per chunk, looping over Dv tiles: `_dq_bwd` (X = dO S^T, dP = dO U^T)
    dQs = Gam X + (dP o E) K,   dK += (dP o E)^T Qs
and `_dk_bwd` (dR, dv = beta dR, dR S^T, dA, U dS'^T)
    dK += -beta Gam dR S^T + (gam / Gam) U dS'^T + Z K + Z^T K,   Z = dA o E o beta_t,
plus dbeta, and the log-decay gradient dG from every e^{...} factor, turned into dg by a reverse
cumulative sum over the chunk (g_t enters G_s for all s >= t, and gam).
q/k heads are shared by Hv/Hk consecutive value heads; dq and dk are computed per value head and summed.

Dots take fp32 operands on tensor cores: 3xTF32 (split operands, about fp32 accuracy) when every input
is fp32, TF32 otherwise (bf16 inputs carry larger rounding than TF32 adds); Triton's "ieee" FMA dots
compile to heavily spilling code at these tile sizes. Head dims up to 128; chunk 16, 32 or 64.
"""

from __future__ import annotations

import os

import torch

from moecore.kernels._triton import next_pow2, triton_importable

MAX_HEAD_DIM = 128

if triton_importable():
    import triton
    import triton.language as tl

    def _tunings(blocks: tuple[int, ...], warps: tuple[int, ...], stages: tuple[int, ...]) -> list:
        """Autotuning space (block of Dv per program, warps, pipeline stages), timed once per head dims."""
        return [
            triton.Config({"BV": bv} if bv else {}, num_warps=w, num_stages=st)
            for bv in blocks
            for w in warps
            for st in stages
        ]

    def _autotune(configs: list):
        # cache_results: timings go to Triton's disk cache, so later processes compile only the winner.
        # The interpreter (CPU tensors) cannot time configs: it takes the first.
        interpreted = os.environ.get("TRITON_INTERPRET") == "1"
        return triton.autotune(
            configs[:1] if interpreted else configs, key=["DK", "DV", "C", "PREC"], cache_results=True
        )

    @triton.jit
    def _load_rows(ptr, b, t, S, H, h, D, cols, tmask):
        """Tile [len(t), len(cols)] of a [B, S, H, D] tensor at head h (fp32), zero outside."""
        off = ((b.to(tl.int64) * S + t) * H + h)[:, None] * D + cols[None, :]
        return tl.load(ptr + off, mask=tmask[:, None] & (cols < D)[None, :], other=0.0).to(tl.float32)

    @triton.jit
    def _load_tok(ptr, b, t, S, H, h, tmask):
        """Per-token scalars [len(t)] of a [B, S, H] tensor at head h (fp32), zero outside."""
        return tl.load(ptr + (b.to(tl.int64) * S + t) * H + h, mask=tmask, other=0.0).to(tl.float32)

    @_autotune(_tunings((0,), (4, 8), (1,)))
    @triton.jit
    def _wy_fwd_kernel(
        k_ptr, v_ptr, g_ptr, beta_ptr, gcum_ptr, t_ptr, w_ptr, u0_ptr,
        S, N, HK, HV, R, DK, DV,
        C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, PREC: tl.constexpr,
    ):  # fmt: skip
        n, bh = tl.program_id(0), tl.program_id(1)
        b, h = bh // HV, bh % HV
        r = tl.arange(0, C)
        t = n * C + r
        tmask = t < S
        ck, cv = tl.arange(0, BK), tl.arange(0, BV)
        g = _load_tok(g_ptr, b, t, S, HV, h, tmask)
        beta = _load_tok(beta_ptr, b, t, S, HV, h, tmask)
        k = _load_rows(k_ptr, b, t, S, HK, h // R, DK, ck, tmask)
        v = _load_rows(v_ptr, b, t, S, HV, h, DV, cv, tmask)
        G = tl.cumsum(g, 0)
        strict = r[:, None] > r[None, :]
        decay = tl.exp(tl.where(strict, G[:, None] - G[None, :], 0.0))  # masked before exp: no overflow
        kk = tl.dot(k, tl.trans(k), input_precision=PREC)
        a = tl.where(strict, beta[:, None] * kk * decay, 0.0)
        # T = (I + A)^-1 in two steps. (1) The 16 x 16 diagonal blocks, all at once: with I + A = L_0 ... L_14
        # per block, L_j = I + A[:, j] e_j^T (A strictly lower), the inverse is L_14^-1 ... L_0^-1 applied to I,
        # L_j^-1 = I - A[:, j] e_j^T: 15 rank-1 updates, one column of every block per step.
        blk = r // 16
        same = blk[:, None] == blk[None, :]
        a_diag = tl.where(same, a, 0.0)
        tm = tl.where(r[:, None] == r[None, :], 1.0, 0.0)
        for j in range(15):
            sel = (r % 16) == j
            a_col = tl.sum(tl.where(sel[None, :], a_diag, 0.0), axis=1)  # A[r, 16 blk(r) + j]
            t_row = tl.sum(tl.where(sel[:, None], tm, 0.0), axis=0)  # T[16 blk(c) + j, c]
            tm = tm - tl.where(same, a_col[:, None] * t_row[None, :], 0.0)
        if C > 16:
            # (2) I + A = (I + A_d)(I + N) with N = T_d A_off strictly block-lower, so N^{C/16} = 0 and
            # T = (I + N)^-1 T_d = (I - N (I - N (...))) T_d: C/16 - 1 Horner steps on tensor cores.
            nmat = tl.dot(tm, tl.where(same, 0.0, a), input_precision=PREC)
            t_diag = tm
            for _ in tl.static_range(C // 16 - 1):
                tm = t_diag - tl.dot(nmat, tm, input_precision=PREC)
        w = tl.dot(tm, k * (beta * tl.exp(G))[:, None], input_precision=PREC)
        u0 = tl.dot(tm, v * beta[:, None], input_precision=PREC)
        row = (bh.to(tl.int64) * N + n) * C + r
        tl.store(gcum_ptr + row, G)
        tl.store(t_ptr + row[:, None] * C + r[None, :], tm)
        tl.store(w_ptr + row[:, None] * DK + ck[None, :], w, mask=(ck < DK)[None, :])
        tl.store(u0_ptr + row[:, None] * DV + cv[None, :], u0, mask=(cv < DV)[None, :])

    @_autotune(_tunings((32, 64), (4, 8), (1, 2)))
    @triton.jit
    def _state_fwd_kernel(
        k_ptr, gcum_ptr, w_ptr, u0_ptr, u_ptr, h_ptr, h0_ptr,
        S, N, HK, HV, R, DK, DV,
        C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, PREC: tl.constexpr, HAS_H0: tl.constexpr,
    ):  # fmt: skip
        iv, bh = tl.program_id(0), tl.program_id(1)
        b, h = bh // HV, bh % HV
        r = tl.arange(0, C)
        ck = tl.arange(0, BK)
        cv = iv * BV + tl.arange(0, BV)
        smask = (ck < DK)[:, None] & (cv < DV)[None, :]
        soff = ck[:, None] * DV + cv[None, :]
        if HAS_H0:  # the initial state [B, HV, DK, DV], fp32
            state = tl.load(h0_ptr + bh.to(tl.int64) * DK * DV + soff, mask=smask, other=0.0)
        else:
            state = tl.zeros((BK, BV), dtype=tl.float32)
        for n in range(N):
            tl.store(h_ptr + (bh.to(tl.int64) * (N + 1) + n) * DK * DV + soff, state, mask=smask)
            t = n * C + r
            row = (bh.to(tl.int64) * N + n) * C + r
            G = tl.load(gcum_ptr + row)
            g_last = tl.sum(tl.where(r == C - 1, G, 0.0), axis=0)
            w = tl.load(w_ptr + row[:, None] * DK + ck[None, :], mask=(ck < DK)[None, :], other=0.0)
            u = tl.load(u0_ptr + row[:, None] * DV + cv[None, :], mask=(cv < DV)[None, :], other=0.0)
            u = u - tl.dot(w, state, input_precision=PREC)
            tl.store(u_ptr + row[:, None] * DV + cv[None, :], u, mask=(cv < DV)[None, :])
            k = _load_rows(k_ptr, b, t, S, HK, h // R, DK, ck, t < S)
            k_end = k * tl.exp(g_last - G)[:, None]
            state = state * tl.exp(g_last) + tl.dot(tl.trans(k_end), u, input_precision=PREC)
        tl.store(h_ptr + (bh.to(tl.int64) * (N + 1) + N) * DK * DV + soff, state, mask=smask)

    @triton.jit
    def _intra(
        q_ptr,
        k_ptr,
        gcum_ptr,
        b,
        h,
        bh,
        n,
        S,
        N,
        HK,
        R,
        DK,
        scale,
        C: tl.constexpr,
        BK: tl.constexpr,
        PREC: tl.constexpr,
    ):
        """Shared by output and backward kernels: scaled q, k [C, BK], G [C] and P = lower_incl(Qs K^T o E)."""
        r = tl.arange(0, C)
        t = n * C + r
        ck = tl.arange(0, BK)
        q = _load_rows(q_ptr, b, t, S, HK, h // R, DK, ck, t < S) * scale
        k = _load_rows(k_ptr, b, t, S, HK, h // R, DK, ck, t < S)
        G = tl.load(gcum_ptr + (bh.to(tl.int64) * N + n) * C + r)
        lower = r[:, None] >= r[None, :]
        decay = tl.where(lower, tl.exp(tl.where(lower, G[:, None] - G[None, :], 0.0)), 0.0)
        p = tl.dot(q, tl.trans(k), input_precision=PREC) * decay
        return q, k, G, p, decay

    @_autotune(_tunings((64, 128), (4, 8), (1,)))
    @triton.jit
    def _out_fwd_kernel(
        q_ptr, k_ptr, gcum_ptr, u_ptr, h_ptr, o_ptr, scale,
        S, N, HK, HV, R, DK, DV,
        C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, PREC: tl.constexpr,
    ):  # fmt: skip
        n, iv, bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        b, h = bh // HV, bh % HV
        r = tl.arange(0, C)
        ck = tl.arange(0, BK)
        cv = iv * BV + tl.arange(0, BV)
        q, k, G, p, decay = _intra(q_ptr, k_ptr, gcum_ptr, b, h, bh, n, S, N, HK, R, DK, scale, C, BK, PREC)
        soff = (bh.to(tl.int64) * (N + 1) + n) * DK * DV + ck[:, None] * DV + cv[None, :]
        state = tl.load(h_ptr + soff, mask=(ck < DK)[:, None] & (cv < DV)[None, :], other=0.0)
        row = (bh.to(tl.int64) * N + n) * C + r
        u = tl.load(u_ptr + row[:, None] * DV + cv[None, :], mask=(cv < DV)[None, :], other=0.0)
        o = tl.dot(q * tl.exp(G)[:, None], state, input_precision=PREC) + tl.dot(p, u, input_precision=PREC)
        t = n * C + r
        off = ((b.to(tl.int64) * S + t) * HV + h)[:, None] * DV + cv[None, :]
        tl.store(o_ptr + off, o.to(o_ptr.dtype.element_ty), mask=(t < S)[:, None] & (cv < DV)[None, :])

    @_autotune(_tunings((64, 128), (4, 8), (1,)))
    @triton.jit
    def _du_intra_kernel(
        q_ptr, k_ptr, gcum_ptr, do_ptr, dui_ptr, scale,
        S, N, HK, HV, R, DK, DV,
        C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, PREC: tl.constexpr,
    ):  # fmt: skip
        """P^T dO for one chunk and Dv tile: the part of dU that does not depend on the carried state."""
        n, iv, bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        b, h = bh // HV, bh % HV
        r = tl.arange(0, C)
        t = n * C + r
        cv = iv * BV + tl.arange(0, BV)
        q, k, G, p, decay = _intra(q_ptr, k_ptr, gcum_ptr, b, h, bh, n, S, N, HK, R, DK, scale, C, BK, PREC)
        do = _load_rows(do_ptr, b, t, S, HV, h, DV, cv, t < S)
        row = (bh.to(tl.int64) * N + n) * C + r
        dui = tl.dot(tl.trans(p), do, input_precision=PREC)
        tl.store(dui_ptr + row[:, None] * DV + cv[None, :], dui, mask=(cv < DV)[None, :])

    @_autotune(_tunings((32, 64), (4, 8), (1, 2)))
    @triton.jit
    def _state_bwd_kernel(
        q_ptr, k_ptr, gcum_ptr, w_ptr, do_ptr, dht_ptr, dui_ptr, du_ptr, dh_ptr, dh0_ptr, scale,
        S, N, HK, HV, R, DK, DV,
        C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, PREC: tl.constexpr,
    ):  # fmt: skip
        iv, bh = tl.program_id(0), tl.program_id(1)
        b, h = bh // HV, bh % HV
        r = tl.arange(0, C)
        ck = tl.arange(0, BK)
        cv = iv * BV + tl.arange(0, BV)
        smask = (ck < DK)[:, None] & (cv < DV)[None, :]
        soff = ck[:, None] * DV + cv[None, :]
        dstate = tl.load(dht_ptr + bh.to(tl.int64) * DK * DV + soff, mask=smask, other=0.0)
        for i in range(N):
            n = N - 1 - i
            tl.store(dh_ptr + (bh.to(tl.int64) * N + n) * DK * DV + soff, dstate, mask=smask)
            t = n * C + r
            row = (bh.to(tl.int64) * N + n) * C + r
            G = tl.load(gcum_ptr + row)
            g_last = tl.sum(tl.where(r == C - 1, G, 0.0), axis=0)
            k = _load_rows(k_ptr, b, t, S, HK, h // R, DK, ck, t < S)
            du = tl.load(dui_ptr + row[:, None] * DV + cv[None, :], mask=(cv < DV)[None, :], other=0.0)
            du += tl.dot(k * tl.exp(g_last - G)[:, None], dstate, input_precision=PREC)
            tl.store(du_ptr + row[:, None] * DV + cv[None, :], du, mask=(cv < DV)[None, :])
            q = _load_rows(q_ptr, b, t, S, HK, h // R, DK, ck, t < S) * (scale * tl.exp(G))[:, None]
            do = _load_rows(do_ptr, b, t, S, HV, h, DV, cv, t < S)
            w = tl.load(w_ptr + row[:, None] * DK + ck[None, :], mask=(ck < DK)[None, :], other=0.0)
            dstate = (
                dstate * tl.exp(g_last)
                + tl.dot(tl.trans(q), do, input_precision=PREC)
                - tl.dot(tl.trans(w), du, input_precision=PREC)
            )
        tl.store(dh0_ptr + bh.to(tl.int64) * DK * DV + soff, dstate, mask=smask)  # gradient of the initial state

    @_autotune(_tunings((32, 64), (8,), (1, 2)))
    @triton.jit
    def _dq_bwd_kernel(
        q_ptr, k_ptr, gcum_ptr, u_ptr, h_ptr, do_ptr, dq_ptr, dk_ptr, dg_ptr, scale,
        S, N, HK, HV, R, DK, DV,
        C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, PREC: tl.constexpr,
    ):  # fmt: skip
        """The q side of one chunk: dq, and the parts of dk and dG that come through P and Gam Qs S."""
        n, bh = tl.program_id(0), tl.program_id(1)
        b, h = bh // HV, bh % HV
        r = tl.arange(0, C)
        t = n * C + r
        tmask = t < S
        ck = tl.arange(0, BK)
        row = (bh.to(tl.int64) * N + n) * C + r
        x = tl.zeros((C, BK), dtype=tl.float32)  # dO S^T
        dp = tl.zeros((C, C), dtype=tl.float32)  # dO U^T
        hbase = (bh.to(tl.int64) * (N + 1) + n) * DK * DV
        for v0 in range(0, DV, BV):
            cv = v0 + tl.arange(0, BV)
            vmask = cv < DV
            soff = ck[:, None] * DV + cv[None, :]
            state = tl.load(h_ptr + hbase + soff, mask=(ck < DK)[:, None] & vmask[None, :], other=0.0)
            do = _load_rows(do_ptr, b, t, S, HV, h, DV, cv, tmask)
            u = tl.load(u_ptr + row[:, None] * DV + cv[None, :], mask=vmask[None, :], other=0.0)
            x += tl.dot(do, tl.trans(state), input_precision=PREC)
            dp += tl.dot(do, tl.trans(u), input_precision=PREC)
        q, k, G, p, decay = _intra(q_ptr, k_ptr, gcum_ptr, b, h, bh, n, S, N, HK, R, DK, scale, C, BK, PREC)
        gam = tl.exp(G)
        dpm = dp * decay
        dq = gam[:, None] * x + tl.dot(dpm, k, input_precision=PREC)
        dk = tl.dot(tl.trans(dpm), q, input_precision=PREC)
        pd = dp * p
        dgl = gam * tl.sum(q * x, axis=1) + tl.sum(pd, axis=1) - tl.sum(pd, axis=0)
        off = ((b.to(tl.int64) * S + t) * HV + h)[:, None] * DK + ck[None, :]
        kmask = tmask[:, None] & (ck < DK)[None, :]
        tl.store(dq_ptr + off, dq * scale, mask=kmask)
        tl.store(dk_ptr + off, dk, mask=kmask)
        tl.store(dg_ptr + (b.to(tl.int64) * S + t) * HV + h, dgl, mask=tmask)

    @_autotune(_tunings((32, 64), (8,), (1, 2)))
    @triton.jit
    def _dk_bwd_kernel(
        k_ptr, v_ptr, beta_ptr, gcum_ptr, t_ptr, u_ptr, h_ptr, dh_ptr, du_ptr,
        dkq_ptr, dgq_ptr, dk_ptr, dv_ptr, dbeta_ptr, dg_ptr,
        S, N, HK, HV, R, DK, DV,
        C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, PREC: tl.constexpr,
    ):  # fmt: skip
        """The k side of one chunk: dv, dbeta, dk and dg, adding the q side's dk and dG (`_dq_bwd_kernel`).
        Inputs and outputs are distinct buffers, so that autotuning may run it more than once."""
        n, bh = tl.program_id(0), tl.program_id(1)
        b, h = bh // HV, bh % HV
        r = tl.arange(0, C)
        t = n * C + r
        tmask = t < S
        ck = tl.arange(0, BK)
        row = (bh.to(tl.int64) * N + n) * C + r
        tm = tl.load(t_ptr + row[:, None] * C + r[None, :])
        beta = _load_tok(beta_ptr, b, t, S, HV, h, tmask)
        ds = tl.zeros((C, BK), dtype=tl.float32)  # dR S^T
        dkt = tl.zeros((C, BK), dtype=tl.float32)  # U dS'^T
        da = tl.zeros((C, C), dtype=tl.float32)  # -dR U^T
        dbeta = tl.zeros((C,), dtype=tl.float32)
        dgam = tl.zeros((BK,), dtype=tl.float32)  # sum(S o dS'), per row of the state
        hbase = (bh.to(tl.int64) * (N + 1) + n) * DK * DV
        dhbase = (bh.to(tl.int64) * N + n) * DK * DV
        for v0 in range(0, DV, BV):
            cv = v0 + tl.arange(0, BV)
            vmask = cv < DV
            smask = (ck < DK)[:, None] & vmask[None, :]
            soff = ck[:, None] * DV + cv[None, :]
            state = tl.load(h_ptr + hbase + soff, mask=smask, other=0.0)
            dstate = tl.load(dh_ptr + dhbase + soff, mask=smask, other=0.0)
            v = _load_rows(v_ptr, b, t, S, HV, h, DV, cv, tmask)
            u = tl.load(u_ptr + row[:, None] * DV + cv[None, :], mask=vmask[None, :], other=0.0)
            du = tl.load(du_ptr + row[:, None] * DV + cv[None, :], mask=vmask[None, :], other=0.0)
            dr = tl.dot(tl.trans(tm), du, input_precision=PREC)  # dR = T^T dU
            dbeta += tl.sum(dr * v, axis=1)
            ds += tl.dot(dr, tl.trans(state), input_precision=PREC)
            da -= tl.dot(dr, tl.trans(u), input_precision=PREC)
            dkt += tl.dot(u, tl.trans(dstate), input_precision=PREC)
            dgam += tl.sum(state * dstate, axis=1)
            off = ((b.to(tl.int64) * S + t) * HV + h)[:, None] * DV + cv[None, :]
            tl.store(
                dv_ptr + off, (dr * beta[:, None]).to(dv_ptr.dtype.element_ty), mask=tmask[:, None] & vmask[None, :]
            )
        k = _load_rows(k_ptr, b, t, S, HK, h // R, DK, ck, tmask)
        G = tl.load(gcum_ptr + row)
        gam = tl.exp(G)
        off = ((b.to(tl.int64) * S + t) * HV + h)[:, None] * DK + ck[None, :]
        kmask = tmask[:, None] & (ck < DK)[None, :]
        dgl = tl.load(dgq_ptr + (b.to(tl.int64) * S + t) * HV + h, mask=tmask, other=0.0)
        # R = beta (V - Gam K S)
        bg = beta * gam
        dk = -bg[:, None] * ds
        rk = tl.sum(ds * k, axis=1)
        dbeta -= gam * rk
        dgl -= bg * rk
        # A = strict_lower(beta_t (k_t . k_s) e^{G_t - G_s})
        strict = r[:, None] > r[None, :]
        decay = tl.exp(tl.where(strict, G[:, None] - G[None, :], 0.0))
        kk = tl.dot(k, tl.trans(k), input_precision=PREC)
        dakk = tl.where(strict, da * decay, 0.0)
        dbeta += tl.sum(dakk * kk, axis=1)
        z = dakk * beta[:, None]
        dk += tl.dot(z, k, input_precision=PREC) + tl.dot(tl.trans(z), k, input_precision=PREC)
        ad = z * kk  # dA o A
        dgl += tl.sum(ad, axis=1) - tl.sum(ad, axis=0)
        # S_next = gam S + Kt^T U, Kt = (gam / Gam) K
        g_last = tl.sum(tl.where(r == C - 1, G, 0.0), axis=0)
        to_end = tl.exp(g_last - G)
        dk += to_end[:, None] * dkt
        kd = to_end * tl.sum(k * dkt, axis=1)
        dgl -= kd
        dg_end = tl.sum(kd, axis=0) + tl.exp(g_last) * tl.sum(dgam, axis=0)
        # g_t enters every G_s with s >= t (and G_C): dg = reverse cumulative sum of dG
        dg = tl.sum(dgl, axis=0) - tl.cumsum(dgl, 0) + dgl + dg_end
        dk += tl.load(dkq_ptr + off, mask=kmask, other=0.0)  # the q side's part
        tl.store(dk_ptr + off, dk, mask=kmask)
        tl.store(dbeta_ptr + (b.to(tl.int64) * S + t) * HV + h, dbeta, mask=tmask)
        tl.store(dg_ptr + (b.to(tl.int64) * S + t) * HV + h, dg, mask=tmask)


def _shapes(q: torch.Tensor, v: torch.Tensor, chunk: int) -> tuple[int, ...]:
    b, s, hk, dk = q.shape
    hv, dv = v.shape[2], v.shape[3]
    return b, s, hk, hv, hv // hk, dk, dv, triton.cdiv(s, chunk)


class _GatedDeltaRule(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, g, beta, h0, scale: float, chunk: int):
        q, k, v, g, beta = (x.contiguous() for x in (q, k, v, g, beta))
        ctx.h0_dtype = None if h0 is None else h0.dtype
        h0 = None if h0 is None else h0.float().contiguous()
        b, s, hk, hv, rep, dk, dv, n = _shapes(q, v, chunk)
        bk, bv = max(16, next_pow2(dk)), max(16, next_pow2(dv))
        prec = "tf32x3" if all(x.dtype == torch.float32 for x in (q, k, v)) else "tf32"
        f32 = {"device": v.device, "dtype": torch.float32}
        gcum = torch.empty(b, hv, n * chunk, **f32)
        tmat = torch.empty(b, hv, n * chunk, chunk, **f32)
        w = torch.empty(b, hv, n * chunk, dk, **f32)
        u0 = torch.empty(b, hv, n * chunk, dv, **f32)
        u = torch.empty_like(u0)
        states = torch.empty(b, hv, n + 1, dk, dv, **f32)
        o = torch.empty_like(v)
        dims = (s, n, hk, hv, rep, dk, dv)
        meta = {"C": chunk, "BK": bk, "PREC": prec}
        _wy_fwd_kernel[(n, b * hv)](k, v, g, beta, gcum, tmat, w, u0, *dims, BV=bv, **meta)
        grid = lambda m: (triton.cdiv(dv, m["BV"]), b * hv)  # noqa: E731
        h0_arg = states if h0 is None else h0  # any pointer when there is no initial state (not read)
        _state_fwd_kernel[grid](k, gcum, w, u0, u, states, h0_arg, *dims, HAS_H0=h0 is not None, **meta)
        del u0
        _out_fwd_kernel[lambda m: (n, triton.cdiv(dv, m["BV"]), b * hv)](q, k, gcum, u, states, o, scale, *dims, **meta)
        ctx.save_for_backward(q, k, v, g, beta, gcum, tmat, w, u, states)
        ctx.scale, ctx.chunk, ctx.prec = scale, chunk, prec
        return o, states[:, :, n]

    @staticmethod
    def backward(ctx, do, dht):
        q, k, v, g, beta, gcum, tmat, w, u, states = ctx.saved_tensors
        chunk, prec, scale = ctx.chunk, ctx.prec, ctx.scale
        b, s, hk, hv, rep, dk, dv, n = _shapes(q, v, chunk)
        bk = max(16, next_pow2(dk))
        dims = (s, n, hk, hv, rep, dk, dv)
        do = do.contiguous()
        dht = dht.float().contiguous()
        f32 = {"device": v.device, "dtype": torch.float32}
        du = torch.empty(b, hv, n * chunk, dv, **f32)
        dstates = torch.empty(b, hv, n, dk, dv, **f32)
        meta = {"C": chunk, "BK": bk, "PREC": prec}
        dui = torch.empty_like(du)
        dh0 = torch.empty(b, hv, dk, dv, **f32)
        _du_intra_kernel[lambda m: (n, triton.cdiv(dv, m["BV"]), b * hv)](q, k, gcum, do, dui, scale, *dims, **meta)
        _state_bwd_kernel[lambda m: (triton.cdiv(dv, m["BV"]), b * hv)](
            q, k, gcum, w, do, dht, dui, du, dstates, dh0, scale, *dims, **meta
        )
        del dui
        dq = torch.empty(b, s, hv, dk, **f32)
        dk_ = torch.empty(b, s, hv, dk, **f32)
        dv_ = torch.empty_like(v)
        dbeta = torch.empty(b, s, hv, **f32)
        dg = torch.empty(b, s, hv, **f32)
        dk_q, dg_q = torch.empty_like(dk_), torch.empty_like(dg)  # the q side's parts of dk and dG
        _dq_bwd_kernel[(n, b * hv)](q, k, gcum, u, states, do, dq, dk_q, dg_q, scale, *dims, **meta)
        _dk_bwd_kernel[(n, b * hv)](
            k, v, beta, gcum, tmat, u, states, dstates, du, dk_q, dg_q, dk_, dv_, dbeta, dg, *dims, **meta
        )
        if rep > 1:  # each key head serves `rep` consecutive value heads
            dq, dk_ = (x.view(b, s, hk, rep, dk).sum(3) for x in (dq, dk_))
        dh0 = None if ctx.h0_dtype is None else dh0.to(ctx.h0_dtype)
        return dq.to(q.dtype), dk_.to(k.dtype), dv_, dg.to(g.dtype), dbeta.to(beta.dtype), dh0, None, None


def gated_delta_rule_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    chunk_size: int = 64,
    initial_state: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The chunked rule in Triton, differentiable in q, k, v, g, beta and initial_state (and through the final state).

    q, k: [B, S, Hk, Dk]; v: [B, S, Hv, Dv] (Hv a multiple of Hk); g (log decay, <= 0), beta: [B, S, Hv];
    scale multiplies q (default Dk**-0.5). Inputs fp32 or bf16/fp16, head dims <= 128; chunk_size 16, 32
    or 64 (any other value runs with 64: the result does not depend on it). Returns (o [B, S, Hv, Dv] in v's
    dtype, final state [B, Hv, Dk, Dv] fp32), as `gated_delta_rule_chunked`. initial_state: [B, Hv, Dk, Dv]
    (computed in fp32; its gradient comes back in its dtype), zeros when None.
    """
    hk, hv = k.shape[2], v.shape[2]
    if hv % hk:
        raise ValueError(f"value heads ({hv}) must be a multiple of key heads ({hk})")
    if max(k.shape[-1], v.shape[-1]) > MAX_HEAD_DIM:
        raise ValueError(f"head dims {k.shape[-1]}/{v.shape[-1]} are too large: the kernel takes <= {MAX_HEAD_DIM}")
    if torch.float64 in (q.dtype, k.dtype, v.dtype):
        raise ValueError("gated_delta_rule_triton takes fp32, bf16 or fp16 inputs, not float64")
    if not triton_importable():
        raise ValueError("gated_delta_rule_triton needs the triton package, which does not import here")
    if not q.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError("gated_delta_rule_triton needs CUDA tensors (or TRITON_INTERPRET=1 to run on CPU)")
    chunk = chunk_size if chunk_size in (16, 32, 64) else 64
    scale = k.shape[-1] ** -0.5 if scale is None else float(scale)
    b, _, _, dk = k.shape
    if initial_state is not None and tuple(initial_state.shape) != (b, hv, dk, v.shape[-1]):
        raise ValueError(f"initial_state has shape {tuple(initial_state.shape)}: expected {(b, hv, dk, v.shape[-1])}")
    if q.shape[1] == 0:
        if initial_state is not None:
            return v.new_zeros(v.shape), initial_state.float()
        return v.new_zeros(v.shape), v.new_zeros(b, hv, dk, v.shape[-1], dtype=torch.float32)
    return _GatedDeltaRule.apply(q, k, v, g, beta, initial_state, scale, chunk)
