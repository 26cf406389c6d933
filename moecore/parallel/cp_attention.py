"""Causal attention over a context-parallel sequence: block kernels with log-sum-exp, ring and all-gather.

Every CP rank holds its queries, keys and values in the layout of moecore/parallel/context.py (chunks r
and 2cp-1-r of 2cp). Attention is computed block by block: a block is a tile of at most `q_tile` query
rows of one chunk against one key chunk, so no [seq, seq] tensor exists, only [tile, seq / 2cp] ones.
For queries i and keys j of a block with scores s_ij = q_i . k_j * scale (masked where j > i, or where
j <= i - window with a sliding window),

    lse_i = log sum_j exp(s_ij)          out_i = sum_j exp(s_ij - lse_i) v_j

and two partial results over disjoint key sets merge exactly (`merge`):

    lse = logaddexp(lse_a, lse_b)        out = exp(lse_a - lse) out_a + exp(lse_b - lse) out_b

The backward recomputes each block's probabilities p_ij = exp(s_ij - lse_i) from the final lse (as
flash attention does; nothing of size [tile, chunk] is kept between forward and backward):

    D_i = sum_d dout_id out_id           ds_ij = p_ij (dp_ij - D_i + dlse_i),  dp_ij = dout_i . v_j
    dq_i += scale sum_j ds_ij k_j        dk_j += scale sum_i ds_ij q_i        dv_j += sum_i p_ij dout_i

where dlse is the gradient reaching lse itself (attention sinks use lse: moecore/models/sinks.py).
Blocks whose keys all lie after their queries (or all outside the window) are skipped, so the load-
balanced layout gives every rank the same work.

Three exchanges (`parallel.cp_comm`):
- `ring_attention`: K/V travel around the CP ring with batched isend/irecv, the transfer of the next
  rank's K/V overlapping the blocks of the K/V in hand; the backward runs its own ring, K/V travelling
  again together with the gradient accumulators dK/dV, which reach their owner after one last hop.
  One torch.autograd.Function with a hand-written backward (not autograd through collectives), so the
  backward keeps nothing but q, k, v, out and lse per layer.
- `alltoall_attention` (DeepSpeed-Ulysses): an all-to-all swaps this rank's tokens of every head for every
  token of H / cp heads, each rank attends over the whole sequence with its heads (`chunked_attention`),
  and the reverse all-to-all brings its tokens back; traffic per layer is q, k, v and the output once each.
- `chunked_attention`: no communication; the caller all-gathers K/V (or, for MLA, the compressed
  latent and the rope key, then up-projects) with `context.gather_from_cp`, whose backward sums and
  scatters dK/dV.
Grouped-query attention keeps K/V at their own head count: the query heads of one K/V head are folded
into the row dimension of a block. `attention_reference` is the plain [S, S] softmax the kernels are
tested against (tests/distributed/test_cp_attention.py).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F

from moecore.parallel.comm import all_to_all_single
from moecore.parallel.context import cp_chunk_ids, cp_global_order, cp_rank_major_positions
from moecore.parallel.dims import Group

Q_TILE = 1024  # query rows per block: bounds a block's score tile at [Q_TILE * heads-per-kv-head, chunk]

# A chunk of a local tensor: (offset in the local tensor, global position of its first token, length).
Chunk = tuple[int, int, int]


def attention_reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, window: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Full causal attention of one sequence as a [S, S] softmax: (out [B, Hq, S, Dv], lse [B, Hq, S])."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    s = q.shape[2]
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    i, j = torch.arange(s, device=q.device)[:, None], torch.arange(s, device=q.device)[None, :]
    visible = (j <= i) if window is None else (j <= i) & (j > i - window)
    scores = scores.masked_fill(~visible, float("-inf"))
    lse = scores.logsumexp(-1)
    return torch.matmul(torch.softmax(scores, -1), v), lse


# --------------------------------------------------------------------------------------------------
# Block kernels (plain torch; no autograd)
# --------------------------------------------------------------------------------------------------


def _visibility(q0: int, nq: int, k0: int, nk: int, window: int | None) -> str:
    """'none', 'all' or 'partial': which keys [k0, k0+nk) queries [q0, q0+nq) see (global positions)."""
    if k0 > q0 + nq - 1 or (window is not None and k0 + nk - 1 <= q0 - window):
        return "none"
    if k0 + nk - 1 <= q0 and (window is None or k0 > q0 + nq - 1 - window):
        return "all"
    return "partial"


def _mask(q0: int, nq: int, k0: int, nk: int, window: int | None, device: torch.device) -> torch.Tensor:
    i = torch.arange(q0, q0 + nq, device=device)[:, None]
    j = torch.arange(k0, k0 + nk, device=device)[None, :]
    return (j <= i) if window is None else (j <= i) & (j > i - window)


def _scores(q: torch.Tensor, k: torch.Tensor, scale: float, mask: torch.Tensor | None) -> torch.Tensor:
    """q [B, Hkv, G, n, D] . k [B, Hkv, m, D] -> masked scores [B, Hkv, G, n, m] (the only score tile made)."""
    s = torch.matmul(q, k.unsqueeze(2).transpose(-1, -2)) * scale
    return s if mask is None else s.masked_fill(~mask, float("-inf"))


def _tiles(q_chunks: Sequence[Chunk], q_tile: int):
    """(offset, global start, rows) of every query tile of every chunk."""
    for off, start, n in q_chunks:
        for t in range(0, n, q_tile):
            yield off + t, start + t, min(q_tile, n - t)


def block_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_chunks: Sequence[Chunk],
    k_chunks: Sequence[Chunk],
    scale: float,
    window: int | None,
    out: torch.Tensor,
    lse: torch.Tensor,
    q_tile: int = Q_TILE,
) -> None:
    """Merge the attention of q (grouped: [B, Hkv, G, Lq, D]) against k/v [B, Hkv, Lk, D(v)] into the running
    out [B, Hkv, G, Lq, Dv] (fp32) and lse [B, Hkv, G, Lq] (fp32, -inf where nothing was seen yet)."""
    for qo, qs, nq in _tiles(q_chunks, q_tile):
        for ko, ks, nk in k_chunks:
            vis = _visibility(qs, nq, ks, nk, window)
            if vis == "none":
                continue
            mask = None if vis == "all" else _mask(qs, nq, ks, nk, window, q.device)
            s = _scores(q[..., qo : qo + nq, :], k[..., ko : ko + nk, :], scale, mask).to(_acc(q))
            blse = s.logsumexp(-1)
            p = torch.exp(s - torch.where(torch.isinf(blse), 0.0, blse).unsqueeze(-1))
            bout = torch.matmul(p.to(v.dtype), v[..., ko : ko + nk, :].unsqueeze(2)).to(_acc(q))
            merge(out[..., qo : qo + nq, :], lse[..., qo : qo + nq], bout, blse)


def merge(out: torch.Tensor, lse: torch.Tensor, bout: torch.Tensor, blse: torch.Tensor) -> None:
    """In place: (out, lse) <- the log-sum-exp merge of (out, lse) and a block's (bout, blse)."""
    new = torch.logaddexp(lse, blse)
    safe = torch.where(torch.isinf(new), 0.0, new)  # rows that saw nothing yet stay 0 / -inf
    out.mul_(torch.exp(lse - safe).unsqueeze(-1)).add_(torch.exp(blse - safe).unsqueeze(-1) * bout)
    lse.copy_(new)


def block_backward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_chunks: Sequence[Chunk],
    k_chunks: Sequence[Chunk],
    scale: float,
    window: int | None,
    dout: torch.Tensor,
    lse: torch.Tensor,
    delta: torch.Tensor,
    dq: torch.Tensor,
    dk: torch.Tensor,
    dv: torch.Tensor,
    q_tile: int = Q_TILE,
) -> None:
    """Accumulate into dq [B, Hkv, G, Lq, D], dk [B, Hkv, Lk, D], dv [B, Hkv, Lk, Dv] (fp32) the gradients
    of these blocks; lse is the final one, delta = rowsum(dout * out) - dlse (module docstring)."""
    for qo, qs, nq in _tiles(q_chunks, q_tile):
        qt, dot = q[..., qo : qo + nq, :], dout[..., qo : qo + nq, :]
        for ko, ks, nk in k_chunks:
            vis = _visibility(qs, nq, ks, nk, window)
            if vis == "none":
                continue
            mask = None if vis == "all" else _mask(qs, nq, ks, nk, window, q.device)
            kt, vt = k[..., ko : ko + nk, :].unsqueeze(2), v[..., ko : ko + nk, :].unsqueeze(2)
            s = _scores(qt, k[..., ko : ko + nk, :], scale, mask).to(_acc(q))
            p = torch.exp(s - lse[..., qo : qo + nq].unsqueeze(-1))  # masked entries: exp(-inf) = 0
            dv[..., ko : ko + nk, :] += torch.matmul(p.transpose(-1, -2), dot).sum(2)
            dp = torch.matmul(dot, vt.to(_acc(q)).transpose(-1, -2))
            ds = p * (dp - delta[..., qo : qo + nq].unsqueeze(-1)) * scale
            dq[..., qo : qo + nq, :] += torch.matmul(ds, kt.to(_acc(q)))
            dk[..., ko : ko + nk, :] += torch.matmul(ds.transpose(-1, -2), qt.to(_acc(q))).sum(2)


def _acc(t: torch.Tensor) -> torch.dtype:
    """Accumulation dtype: fp32, or fp64 for fp64 inputs."""
    return torch.promote_types(t.dtype, torch.float32)


def _grouped(q: torch.Tensor, hkv: int) -> torch.Tensor:
    b, hq, s, d = q.shape
    return q.view(b, hkv, hq // hkv, s, d)


def _local_chunks(seq_local: int, cp: int, rank: int) -> list[Chunk]:
    """The two chunks of a CP rank's local tensor of length seq_local."""
    c = seq_local // 2
    a, b = cp_chunk_ids(cp, rank)
    return [(0, a * c, c), (c, b * c, c)]


# --------------------------------------------------------------------------------------------------
# No communication: q against K/V already in hand (all-gathered)
# --------------------------------------------------------------------------------------------------


class _ChunkedAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, q_chunks, k_chunks, scale, window, q_tile):
        qg = _grouped(q, k.shape[1])
        out = qg.new_zeros((*qg.shape[:-1], v.shape[-1]), dtype=_acc(q))
        lse = qg.new_full(qg.shape[:-1], float("-inf"), dtype=_acc(q))
        block_forward(qg, k, v, q_chunks, k_chunks, scale, window, out, lse, q_tile)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.args = (q_chunks, k_chunks, scale, window, q_tile)
        b, hq, s, _ = q.shape
        return out.view(b, hq, s, -1).to(q.dtype), lse.view(b, hq, s)

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse = ctx.saved_tensors
        q_chunks, k_chunks, scale, window, q_tile = ctx.args
        qg = _grouped(q, k.shape[1])
        dout = dout.to(_acc(q)).view(out.shape)
        delta = (dout * out).sum(-1)
        if dlse is not None:
            delta = delta - dlse.to(_acc(q)).view(delta.shape)
        dq = torch.zeros(qg.shape, dtype=_acc(q), device=q.device)
        dk = torch.zeros(k.shape, dtype=_acc(q), device=k.device)
        dv = torch.zeros(v.shape, dtype=_acc(q), device=v.device)
        block_backward(qg, k, v, q_chunks, k_chunks, scale, window, dout, lse, delta, dq, dk, dv, q_tile)
        return dq.view(q.shape).to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None, None


def chunked_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_chunks: Sequence[Chunk],
    k_chunks: Sequence[Chunk],
    scale: float,
    window: int | None = None,
    q_tile: int = Q_TILE,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention of q [B, Hq, Lq, D] against k [B, Hkv, Lk, D], v [B, Hkv, Lk, Dv], the positions of
    both given as chunks (offset, global start, length); returns (out [B, Hq, Lq, Dv], lse [B, Hq, Lq] fp32)."""
    return _ChunkedAttention.apply(q, k, v, tuple(q_chunks), tuple(k_chunks), scale, window, q_tile)


def allgather_attention(
    q: torch.Tensor, k_full: torch.Tensor, v_full: torch.Tensor, group: Group, scale: float, window: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """This CP rank's queries (local layout) against the full sequence's K/V in global order."""
    seq = k_full.shape[2]
    q_chunks = _local_chunks(q.shape[2], group.size, group.rank)
    c = seq // (2 * group.size)
    k_chunks = [(j * c, j * c, c) for j in range(2 * group.size)]
    return chunked_attention(q, k_full, v_full, q_chunks, k_chunks, scale, window)


# --------------------------------------------------------------------------------------------------
# All-to-all: heads split over the CP ranks, each with the whole sequence
# --------------------------------------------------------------------------------------------------


def _sequence_to_heads(x: torch.Tensor, group: Group) -> torch.Tensor:
    """[B, H, L, ...] (this rank's tokens, every head) -> [B, H / cp, cp * L, ...] (head group `rank`, the whole
    sequence in global order)."""
    cp = group.size
    b, h, ln = x.shape[:3]
    send = x.reshape(b, cp, h // cp, ln, *x.shape[3:]).transpose(0, 1)  # [cp (destination), B, H/cp, L, ...]
    got = all_to_all_single(send.reshape(cp * b, *send.shape[2:]), group, [b] * cp, [b] * cp)
    got = got.view(cp, b, h // cp, ln, *x.shape[3:]).permute(1, 2, 0, *range(3, x.dim() + 1))  # source rank third
    full = got.reshape(b, h // cp, cp * ln, *x.shape[3:])  # rank-major: rank j's chunks j and 2cp-1-j
    return full.index_select(2, cp_global_order(cp * ln, cp, x.device))


def _heads_to_sequence(y: torch.Tensor, group: Group) -> torch.Tensor:
    """The inverse of `_sequence_to_heads`: [B, H / cp, S, ...] in global order -> [B, H, S / cp, ...]."""
    cp = group.size
    b, hg, seq = y.shape[:3]
    ln = seq // cp
    y = y.index_select(2, cp_rank_major_positions(seq, cp, y.device)).reshape(
        b, hg, cp, ln, *y.shape[3:]
    )  # [B, H/cp, cp (destination), L, ...]
    send = y.permute(2, 0, 1, *range(3, y.dim()))  # [cp (destination), B, H/cp, L, ...]
    got = all_to_all_single(send.reshape(cp * b, *send.shape[2:]), group, [b] * cp, [b] * cp)
    got = got.view(cp, b, hg, ln, *y.shape[4:]).transpose(0, 1)  # [B, cp (head group), H/cp, L, ...]
    return got.reshape(b, cp * hg, ln, *y.shape[4:])


class _SwapSequenceAndHeads(torch.autograd.Function):
    """`_sequence_to_heads` (to_heads) or `_heads_to_sequence`; each one's backward is the other."""

    @staticmethod
    def forward(ctx, x, group, to_heads):
        ctx.group, ctx.to_heads = group, to_heads
        return (_sequence_to_heads if to_heads else _heads_to_sequence)(x.contiguous(), group)

    @staticmethod
    def backward(ctx, g):
        return (_heads_to_sequence if ctx.to_heads else _sequence_to_heads)(g.contiguous(), ctx.group), None, None


def alltoall_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    group: Group,
    scale: float,
    window: int | None = None,
    need_lse: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """This CP rank's queries (local layout) against the whole sequence by exchanging heads for tokens: an
    all-to-all gives each rank H / cp heads of q, k and v for every token, it attends causally over the
    whole sequence, and a second all-to-all returns its tokens of every head (DeepSpeed-Ulysses). Needs
    Hq % cp == 0; K/V heads fewer than, or not divisible by, cp are repeated to lcm(Hkv, cp) first.
    Returns (out [B, Hq, L, Dv], lse [B, Hq, L] fp32) as `ring_attention` does; without `need_lse` and without a
    window the whole-sequence attention is torch's SDPA (flash attention on a GPU) and lse is None."""
    cp = group.size
    if q.shape[1] % cp:
        raise ValueError(f"{q.shape[1]} query heads per rank do not split over parallel.cp={cp} (cp_comm=a2a)")
    hkv = k.shape[1]
    if hkv % cp:
        rep = math.lcm(hkv, cp) // hkv
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    qh, kh, vh = (_SwapSequenceAndHeads.apply(t, group, True) for t in (q, k, v))
    if not need_lse and window is None:
        gqa = kh.shape[1] != qh.shape[1]
        out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale, enable_gqa=gqa)
        return _SwapSequenceAndHeads.apply(out, group, False), None
    seq = qh.shape[2]
    out, lse = chunked_attention(qh, kh, vh, [(0, 0, seq)], [(0, 0, seq)], scale, window)
    out = _SwapSequenceAndHeads.apply(out, group, False)
    lse = _SwapSequenceAndHeads.apply(lse.unsqueeze(-1), group, False).squeeze(-1)
    return out, lse


# --------------------------------------------------------------------------------------------------
# Ring
# --------------------------------------------------------------------------------------------------


def _shift(tensors: list[torch.Tensor], group: Group) -> tuple[list, list[torch.Tensor]]:
    """Start sending `tensors` to the next CP rank and receiving the previous rank's; (pending, buffers).

    `pending` holds the requests and the tensors being sent, which must stay alive (and unchanged) until
    `_wait(pending)`.
    """
    nxt = group.ranks[(group.rank + 1) % group.size]
    prv = group.ranks[(group.rank - 1) % group.size]
    sent = [t.contiguous() for t in tensors]
    bufs = [torch.empty_like(t) for t in sent]
    ops = [dist.P2POp(dist.isend, t, nxt, group.pg) for t in sent]
    ops += [dist.P2POp(dist.irecv, b, prv, group.pg) for b in bufs]
    return [dist.batch_isend_irecv(ops), sent], bufs


def _wait(pending: list) -> None:
    if pending:
        for r in pending[0]:
            r.wait()
        pending.clear()


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group, scale, window, q_tile):
        cp, rank = group.size, group.rank
        qg = _grouped(q, k.shape[1])
        q_chunks = _local_chunks(q.shape[2], cp, rank)
        out = qg.new_zeros((*qg.shape[:-1], v.shape[-1]), dtype=_acc(q))
        lse = qg.new_full(qg.shape[:-1], float("-inf"), dtype=_acc(q))
        kv = [k.contiguous(), v.contiguous()]
        for step in range(cp):
            # the transfer of the next K/V overlaps this step's blocks
            reqs, nxt = _shift(kv, group) if step < cp - 1 else ([], None)
            src = (rank - step) % cp
            block_forward(
                qg, kv[0], kv[1], q_chunks, _local_chunks(k.shape[2], cp, src), scale, window, out, lse, q_tile
            )
            _wait(reqs)
            kv = nxt
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.args = (group, scale, window, q_tile)
        b, hq, s, _ = q.shape
        return out.view(b, hq, s, -1).to(q.dtype), lse.view(b, hq, s)

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse = ctx.saved_tensors
        group, scale, window, q_tile = ctx.args
        cp, rank = group.size, group.rank
        qg = _grouped(q, k.shape[1])
        q_chunks = _local_chunks(q.shape[2], cp, rank)
        dout = dout.to(_acc(q)).view(out.shape)
        delta = (dout * out).sum(-1)
        if dlse is not None:
            delta = delta - dlse.to(_acc(q)).view(delta.shape)
        dq = torch.zeros(qg.shape, dtype=_acc(q), device=q.device)
        kv = [k.contiguous(), v.contiguous()]
        acc = None  # [dk, dv] of the K/V in hand, summed over the ranks it has visited (arriving)
        acc_reqs: list = []
        for step in range(cp):
            reqs, nxt = _shift(kv, group) if step < cp - 1 else ([], None)
            src = (rank - step) % cp
            dk = torch.zeros(k.shape, dtype=_acc(q), device=k.device)
            dv = torch.zeros(v.shape, dtype=_acc(q), device=v.device)
            k_chunks = _local_chunks(k.shape[2], cp, src)
            block_backward(qg, kv[0], kv[1], q_chunks, k_chunks, scale, window, dout, lse, delta, dq, dk, dv, q_tile)
            _wait(acc_reqs)
            if acc is not None:
                dk.add_(acc[0])
                dv.add_(acc[1])
            # the accumulators follow their K/V to the next rank; after the last step one more hop takes
            # them to their owner (rank r ends holding the K/V of rank r + 1)
            acc_reqs, acc = _shift([dk, dv], group)
            _wait(reqs)
            kv = nxt
        _wait(acc_reqs)
        return dq.view(q.shape).to(q.dtype), acc[0].to(k.dtype), acc[1].to(v.dtype), None, None, None, None


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    group: Group,
    scale: float,
    window: int | None = None,
    q_tile: int = Q_TILE,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention of this CP rank's q [B, Hq, L, D] over the whole sequence, K/V [B, Hkv, L, D(v)]
    passed around the CP ring; returns (out [B, Hq, L, Dv], lse [B, Hq, L] fp32)."""
    if group.size == 1:
        return chunked_attention(q, k, v, [(0, 0, q.shape[2])], [(0, 0, k.shape[2])], scale, window, q_tile)
    return _RingAttention.apply(q, k, v, group, scale, window, q_tile)


def context_parallel_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dims,
    scale: float,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """What a GQA layer calls under cp > 1: this rank's q [B, Hq, L, D] against the whole sequence's keys,
    through the exchange `parallel.cp_comm`; with `sinks` [Hq] the gpt-oss sink rescaling
    out * sigmoid(lse - sink) (moecore/models/sinks.py). Returns [B, Hq, L, Dv] in q's dtype."""
    from moecore.parallel.context import gather_from_cp

    g = dims.cp_group
    if dims.cfg.cp_comm == "ring":
        out, lse = ring_attention(q, k, v, g, scale, window)
    elif dims.cfg.cp_comm == "a2a":
        out, lse = alltoall_attention(q, k, v, g, scale, window, need_lse=sinks is not None)
    else:
        k_full, v_full = gather_from_cp(k, dims, 2), gather_from_cp(v, dims, 2)
        out, lse = allgather_attention(q, k_full, v_full, g, scale, window)
    if sinks is not None:
        gate = torch.sigmoid(lse - sinks.to(lse.dtype).view(1, -1, 1))
        return (out.to(lse.dtype) * gate.unsqueeze(-1)).to(q.dtype)
    return out
