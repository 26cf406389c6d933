"""Context-parallel attention kernels (moecore/parallel/cp_attention.py) against the plain [S, S] softmax.

One process: the block kernels (forward, and the hand-written backward including the gradient through
lse) on the layout's chunks, GQA, a sliding window and a value size unlike the key size (MLA). Then
4 gloo processes: ring and all-gather attention of every CP rank, gathered back into the full
sequence, against the reference, and their gradients (fp64, so the bar is tight).
"""

from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

from moecore.config import ParallelConfig
from moecore.parallel import context
from moecore.parallel import cp_attention as cpa
from moecore.parallel.dims import ParallelDims
from moecore.parallel.launch import run_local

CASES = [  # (heads q, heads kv, dk, dv, window)
    (4, 2, 8, 8, None),
    (4, 4, 12, 6, None),  # MLA-like: value size unlike the key size
    (4, 1, 8, 8, 5),  # sliding window shorter than a chunk
    (2, 2, 8, 8, 11),
]


def _inputs(hq, hkv, dk, dv, seq, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, hq, seq, dk, generator=g, dtype=torch.float64)
    k = torch.randn(2, hkv, seq, dk, generator=g, dtype=torch.float64)
    v = torch.randn(2, hkv, seq, dv, generator=g, dtype=torch.float64)
    w = torch.randn(2, hq, seq, dv, generator=g, dtype=torch.float64)  # weights of a scalar objective
    wl = torch.randn(2, hq, seq, generator=g, dtype=torch.float64)  # ... and of lse
    return q, k, v, w, wl


def _grads(fn, q, k, v, w, wl):
    q, k, v = (t.clone().requires_grad_(True) for t in (q, k, v))
    out, lse = fn(q, k, v)
    ((out * w).sum() + (lse * wl).sum()).backward()
    return out.detach(), lse.detach(), q.grad, k.grad, v.grad


@pytest.mark.parametrize("case", CASES)
def test_chunked_kernels_match_reference(case) -> None:
    hq, hkv, dk, dv, window = case
    seq, cp = 24, 3
    q, k, v, w, wl = _inputs(hq, hkv, dk, dv, seq)
    ref = _grads(lambda a, b, c: cpa.attention_reference(a, b, c, 0.3, window), q, k, v, w, wl)
    c = seq // (2 * cp)
    chunks = [(j * c, j * c, c) for j in range(2 * cp)]
    got = _grads(
        lambda a, b, c_: cpa.chunked_attention(a, b, c_, chunks, chunks, 0.3, window, q_tile=3), q, k, v, w, wl
    )
    for a, b in zip(ref, got):
        assert_close(b, a, rtol=1e-10, atol=1e-10)


def _dist_worker(rank: int, world: int, cp: int, case, comm: str) -> None:
    hq, hkv, dk, dv, window = case
    dims = ParallelDims(ParallelConfig(cp=cp), world, rank, "cpu")
    seq = 32
    q, k, v, w, wl = _inputs(hq, hkv, dk, dv, seq, seed=dims.dp_group.rank)
    ref = _grads(lambda a, b, c: cpa.attention_reference(a, b, c, 0.25, window), q, k, v, w, wl)
    g = dims.cp_group

    def local_fn(a, b, c):
        if comm == "ring":
            return cpa.ring_attention(a, b, c, g, 0.25, window, q_tile=3)
        kf, vf = context.gather_from_cp(b, dims, 2), context.gather_from_cp(c, dims, 2)
        return cpa.allgather_attention(a, kf, vf, g, 0.25, window)

    split = [context.split_for_cp(t, dims, 2) for t in (q, k, v, w, wl)]
    out, lse, dq, dk_, dv_ = _grads(local_fn, *split)
    full = [context.gather_from_cp_plain(t, g, 2) for t in (out, lse, dq, dk_, dv_)]
    for a, b in zip(ref, full):
        assert_close(b, a, rtol=1e-10, atol=1e-10)


@pytest.mark.distributed
@pytest.mark.parametrize("comm", ["ring", "allgather"])
def test_cp_attention_on_gloo(comm: str) -> None:
    for cp, case in ((4, CASES[0]), (4, CASES[2]), (2, CASES[1]), (2, CASES[3])):
        run_local(_dist_worker, 4, cp, case, comm)
