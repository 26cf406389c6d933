"""Autograd collectives and tensor-parallel layers on 4 gloo processes, against single-process references.

Linear collectives are checked two ways: forward values against the data every rank can rebuild,
and backward by the adjoint identity sum_r <A(x)_r, g_r> = sum_r <x_r, A^T(g)_r>, which holds
exactly when the backward is the true adjoint. The region functions (copy/reduce/scatter/gather),
whose backwards follow the "replicated loss" convention instead, are checked against explicit
expected gradients. TP layers are compared with nn.Linear / F.embedding / F.cross_entropy on the
full tensors. Everything runs in one launch of 4 processes.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.testing import assert_close

from moecore.config import ParallelConfig
from moecore.parallel import comm
from moecore.parallel import tensor_parallel as tpl
from moecore.parallel.dims import ParallelDims
from moecore.parallel.launch import run_local
from moecore.parallel.sharding import global_grads

pytestmark = pytest.mark.distributed


def _sum_world(v: torch.Tensor) -> torch.Tensor:
    v = v.detach().double().clone()
    dist.all_reduce(v)
    return v


def _check_adjoint(op, x: torch.Tensor, seed: int) -> torch.Tensor:
    """Run y = op(x) in fp64, backward with a random g; assert sum <y, g> == sum <x, grad>; return y (fp32)."""
    x = x.double().clone().requires_grad_(True)
    y = op(x)
    g = torch.randn(y.shape, generator=torch.Generator().manual_seed(seed + 17 * dist.get_rank()), dtype=torch.float64)
    y.backward(g)
    lhs = _sum_world((y.detach().double() * g.double()).sum())
    rhs = _sum_world((x.detach().double() * x.grad.double()).sum())
    assert_close(lhs, rhs, rtol=1e-12, atol=1e-12)
    return y.detach().float()


def _collectives(rank: int, world: int) -> None:
    dims = ParallelDims(ParallelConfig(tp=2, ep=2), world, rank, "cpu", num_experts=4)
    W = dims.world_group

    # all_to_all with uneven splits, zero-size blocks included: rank r sends (r + 2j) % 3 rows to j.
    splits = [[(r + 2 * j) % 3 for j in range(world)] for r in range(world)]
    rows = []
    for j in range(world):
        rows += [[1000.0 * rank + 10 * j + i, -1.0, float(i)] for i in range(splits[rank][j])]
    x = torch.tensor(rows).reshape(-1, 3)
    out_splits = [splits[j][rank] for j in range(world)]
    y = _check_adjoint(lambda t: comm.all_to_all(t, W, out_splits, splits[rank]), x, seed=1)
    expect = [[1000.0 * j + 10 * rank + i, -1.0, float(i)] for j in range(world) for i in range(splits[j][rank])]
    assert_close(y, torch.tensor(expect).reshape(-1, 3))

    # all_gather_v / reduce_scatter_v with sizes 2, 0, 3, 1.
    sizes = [2, 0, 3, 1]
    x = torch.full((sizes[rank], 2), float(rank)) + torch.arange(sizes[rank]).unsqueeze(-1)
    y = _check_adjoint(lambda t: comm.all_gather_v(t, W, sizes), x, seed=2)
    expect = torch.cat([torch.full((n, 2), float(j)) + torch.arange(n).unsqueeze(-1) for j, n in enumerate(sizes)])
    assert_close(y, expect)
    full = torch.arange(sum(sizes) * 2, dtype=torch.float32).view(-1, 2) * (rank + 1)
    y = _check_adjoint(lambda t: comm.reduce_scatter_v(t, W, sizes), full, seed=3)
    start = sum(sizes[:rank])
    base = torch.arange(sum(sizes) * 2, dtype=torch.float32).view(-1, 2)[start : start + sizes[rank]]
    assert_close(y, base * sum(range(1, world + 1)))

    # Sequence-parallel gather / reduce-scatter along dim 1 over the TP group (true adjoints of each other).
    tp = dims.tp_group
    x = torch.randn(2, 3, 4, generator=torch.Generator().manual_seed(rank))
    y = _check_adjoint(lambda t: comm.gather_from_sequence_parallel(t, tp, 1), x, seed=4)
    assert y.shape == (2, 6, 4)
    _check_adjoint(lambda t: comm.reduce_scatter_to_sequence_parallel(t, tp, 1), torch.randn(2, 6, 4), seed=5)

    # Region functions: explicit gradients.
    peer_sum = float(sum(tp.ranks))  # sum over TP members of their global rank
    x = torch.ones(3, requires_grad=True)
    comm.copy_to_region(x, tp).mul(float(rank)).sum().backward()
    assert_close(x.grad, torch.full((3,), peer_sum))  # backward all-reduces
    x = torch.full((3,), float(rank), requires_grad=True)
    y = comm.reduce_from_region(x, tp)
    assert_close(y, torch.full((3,), peer_sum))
    y.mul(2.0).sum().backward()
    assert_close(x.grad, torch.full((3,), 2.0))  # backward passes through
    x = torch.arange(8.0, requires_grad=True)
    y = comm.scatter_to_region(x, tp, 0)
    assert_close(y, torch.arange(8.0)[4 * tp.rank : 4 * tp.rank + 4])
    (y * (tp.rank + 1)).sum().backward()
    assert_close(x.grad, torch.tensor([1.0] * 4 + [2.0] * 4))
    x = torch.full((2,), float(tp.rank), requires_grad=True)
    y = comm.gather_from_region(x, tp, 0)
    assert_close(y, torch.tensor([0.0, 0.0, 1.0, 1.0]))
    (y * torch.arange(4.0)).sum().backward()
    assert_close(x.grad, torch.arange(4.0)[2 * tp.rank : 2 * tp.rank + 2])


def _tp_layers(rank: int, world: int) -> None:
    torch.set_default_dtype(torch.float64)  # fp64 so that only a wrong formula, not rounding, can fail
    for sp in (True, False):
        dims = ParallelDims(ParallelConfig(tp=2, sequence_parallel=sp), world, rank, "cpu")
        tp = dims.tp_group
        gen = torch.Generator().manual_seed(0)  # the same full tensors on every rank
        B, S, H, F_, V = 2, 4, 6, 8, 10
        x_full = torch.randn(B, S, H, generator=gen)
        w1, w2, b2 = torch.randn(F_, H, generator=gen), torch.randn(H, F_, generator=gen), torch.randn(H, generator=gen)
        emb, ids = torch.randn(V, H, generator=gen), torch.randint(0, V, (B, S), generator=gen)
        labels = torch.randint(0, V, (B, S), generator=gen)

        # Reference: plain modules on the full tensors.
        xr = x_full.clone().requires_grad_(True)
        ref1, ref2, ref_emb = torch.nn.Linear(H, F_, bias=False), torch.nn.Linear(F_, H), torch.nn.Embedding(V, H)
        with torch.no_grad():
            ref1.weight.copy_(w1)
            ref2.weight.copy_(w2)
            ref2.bias.copy_(b2)
            ref_emb.weight.copy_(emb)
        y_ref = ref2(F.gelu(ref1(xr))) + ref_emb(ids)
        loss_ref = F.cross_entropy(F.linear(y_ref, ref_emb.weight).flatten(0, 1), labels.flatten())
        loss_ref.backward()

        # TP: column -> gelu -> row, vocab-parallel embedding, tied vocab-parallel head + cross-entropy.
        col = tpl.ColumnParallelLinear(H, F_, False, dims)
        row = tpl.RowParallelLinear(F_, H, True, dims)
        vemb = tpl.VocabParallelEmbedding(V, H, dims)
        mod = torch.nn.ModuleDict({"col": col, "row": row, "emb": vemb})
        from moecore.parallel.sharding import load_global_state_dict

        load_global_state_dict(mod, {"col.weight": w1, "row.weight": w2, "row.bias": b2, "emb.weight": emb})
        x_in = tpl.sequence_shard(x_full, dims).clone().requires_grad_(True)
        y = row(F.gelu(col(tpl.tp_region_input(x_in, dims)))) + vemb(ids)
        logits = F.linear(tpl.tp_region_input(y, dims), vemb.weight)
        loss = tpl.vocab_parallel_cross_entropy(logits, labels, dims).mean()
        loss.backward()
        assert_close(loss, loss_ref.detach(), rtol=1e-10, atol=1e-12)
        assert_close(tpl.gather_sequence(y.detach(), dims), y_ref.detach(), rtol=1e-10, atol=1e-12)
        expect_xg = tpl.sequence_shard(xr.grad, dims)
        assert_close(x_in.grad, expect_xg, rtol=1e-10, atol=1e-12)
        # Replicated row bias: partial gradients under SP until the grad sync sums them over TP.
        if sp:
            comm.all_reduce_(row.bias.grad, tp)
        grads = global_grads(mod, dims)
        assert_close(grads["col.weight"], ref1.weight.grad, rtol=1e-10, atol=1e-12)
        assert_close(grads["row.weight"], ref2.weight.grad, rtol=1e-10, atol=1e-12)
        assert_close(grads["row.bias"], ref2.bias.grad, rtol=1e-10, atol=1e-12)
        assert_close(grads["emb.weight"], ref_emb.weight.grad, rtol=1e-10, atol=1e-12)


def _all(rank: int, world: int) -> bool:
    _collectives(rank, world)
    _tp_layers(rank, world)
    torch.set_default_dtype(torch.float32)
    return True


def test_collectives_and_tp_layers_on_4_processes():
    assert run_local(_all, 4) == [True] * 4
