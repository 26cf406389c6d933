"""The context-parallel sequence layout (moecore/parallel/context.py): indices, split, gather, halo roll.

One-process checks of the layout itself, then 4 gloo processes (cp = 4, and cp = 2 x dp = 2) checking
that split + gather reproduce the full sequence, that gather's backward is the adjoint of its forward
(sum_r <gather(x)_r, g_r> == sum_r <x_r, grad_r>), and that the halo roll equals a roll of the full
sequence followed by the split.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.testing import assert_close

from moecore.config import ConfigError, ParallelConfig
from moecore.parallel import context
from moecore.parallel.dims import ParallelDims
from moecore.parallel.launch import run_local


def test_local_indices_layout() -> None:
    # S = 8, cp = 2: chunks [0 1] [2 3] [4 5] [6 7]; rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2
    assert context.cp_local_indices(8, 2, 0).tolist() == [0, 1, 6, 7]
    assert context.cp_local_indices(8, 2, 1).tolist() == [2, 3, 4, 5]
    for cp in (1, 2, 4):
        held = torch.cat([context.cp_local_indices(32, cp, r) for r in range(cp)])
        assert sorted(held.tolist()) == list(range(32))  # a partition of the sequence
    assert context.cp_local_indices(16, 4, 3).tolist() == [6, 7, 8, 9]


def test_seq_len_must_split_into_2cp_chunks() -> None:
    with pytest.raises(ConfigError, match=r"train.seq_length=12 .* 2 \* parallel.cp = 8"):
        context.cp_local_indices(12, 4, 0)
    context.check_cp_seq_len(12, 3)  # 12 = 6 chunks of 2


def _worker(rank: int, world: int, cp: int) -> None:
    dims = ParallelDims(ParallelConfig(cp=cp), world, rank, "cpu")
    g = torch.Generator().manual_seed(dims.dp_group.rank)  # same data on the CP ranks of one replica
    full = torch.randn(2, 16, 3, generator=g, dtype=torch.float64)
    local = context.split_for_cp(full, dims)
    assert local.shape == (2, 16 // cp, 3)
    assert_close(local, full[:, context.cp_local_indices(16, cp, dims.cp_group.rank)])
    assert_close(context.gather_from_cp_plain(local, dims.cp_group), full)
    # adjoint of gather (grad="sum"): sum over CP of <y_r, g_r> == sum over CP of <x_r, grad_r>
    x = local.clone().requires_grad_(True)
    y = context.gather_from_cp(x, dims)
    assert_close(y.detach(), full)
    gy = torch.randn(y.shape, generator=torch.Generator().manual_seed(7 + rank), dtype=torch.float64)
    y.backward(gy)
    pair = torch.stack([(y.detach() * gy).sum(), (x.detach() * x.grad).sum()])
    dist.all_reduce(pair, group=dims.cp_group.pg)
    assert_close(pair[0], pair[1], rtol=1e-12, atol=1e-12)
    # grad="replicated": the backward keeps this rank's positions of the (identical) gradient
    x2 = local.clone().requires_grad_(True)
    context.gather_from_cp(x2, dims, grad="replicated").backward(full)
    assert_close(x2.grad, local)
    # halo roll: a roll of the full sequence, then the split
    ids = torch.randint(0, 50, (2, 16), generator=g)
    rolled = context.cp_roll_left(context.split_for_cp(ids, dims), dims, fill=-1)
    expect = torch.cat((ids[:, 1:], torch.full((2, 1), -1)), dim=1)
    assert torch.equal(rolled, context.split_for_cp(expect, dims))
    twice = context.cp_roll_left(rolled, dims, fill=-1)
    assert torch.equal(twice, context.split_for_cp(torch.cat((expect[:, 1:], torch.full((2, 1), -1)), 1), dims))
    b = context.split_batch_for_cp({"input_ids": ids, "labels": ids, "loss_mask": ids > 3}, dims)
    assert b["position_ids"].tolist() == context.cp_local_indices(16, cp, dims.cp_group.rank).tolist()
    assert torch.equal(b["loss_mask"], context.split_for_cp(ids > 3, dims))


@pytest.mark.distributed
@pytest.mark.parametrize("cp", [4, 2])
def test_split_gather_roll_on_gloo(cp: int) -> None:
    run_local(_worker, 4, cp)
