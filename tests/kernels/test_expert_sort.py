"""Counting sort of expert ids: the reference against a per-element formula, the kernels against torch's stable sort."""

from __future__ import annotations

import pytest
import torch

from moecore.kernels.expert_sort import expert_sort, expert_sort_reference, expert_sort_supported
from tests.kernels.conftest import setup


def _ids(n: int, E: int, skew: bool, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if skew:  # most assignments to a few experts, some experts empty
        return torch.where(
            torch.rand(n, generator=g) < 0.8,
            torch.randint(0, 2, (n,), generator=g),
            torch.randint(0, E, (n,), generator=g),
        )
    return torch.randint(0, E, (n,), generator=g)


def _check(got, flat: torch.Tensor, E: int) -> None:
    sorted_e, order, counts, inv = got
    ref_sorted, ref_order = torch.sort(flat, stable=True)
    assert sorted_e.dtype == flat.dtype and order.dtype == torch.int64 and counts.dtype == torch.int64
    assert torch.equal(sorted_e, ref_sorted) and torch.equal(order, ref_order)
    assert torch.equal(counts, torch.bincount(flat, minlength=E))
    assert torch.equal(inv[order], torch.arange(flat.numel(), device=flat.device))


@pytest.mark.parametrize("skew", [False, True])
def test_reference_is_a_stable_sort_with_counts_and_inverse(skew):
    flat = _ids(500, 7, skew, 0)
    sorted_e, order, counts, inv = expert_sort_reference(flat, 7)
    for row in range(flat.numel()):  # row r holds the r-th assignment in (expert, flat index) order
        a = order[row].item()
        assert sorted_e[row] == flat[a] and inv[a] == row
        assert row == (flat < flat[a]).sum() + (flat[:a] == flat[a]).sum()
    _check((sorted_e, order, counts, inv), flat, 7)


@pytest.mark.parametrize("n, E, skew", [(1, 1, False), (300, 7, False), (2000, 64, True), (777, 512, False)])
def test_kernels_equal_the_stable_sort(backend, n, E, skew):
    dev, _ = setup(backend)
    flat = _ids(n, E, skew, 1).to(dev)
    _check(expert_sort(flat, E, impl="triton"), flat, E)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize(
    "n, E, skew", [(16384 * 10, 512, False), (16384 * 10, 512, True), (65536 * 8 + 5, 256, False), (2**20, 8, True)]
)
def test_kernels_equal_the_stable_sort_at_model_shapes(n, E, skew):
    flat = _ids(n, E, skew, 2).cuda()
    _check(expert_sort(flat, E), flat, E)


def test_falls_back_where_the_kernels_do_not_apply():
    flat = torch.randint(0, 8, (64,))
    assert not expert_sort_supported(flat, 8)  # CPU tensors run the reference under "auto"
    assert not expert_sort_supported(torch.empty(0, dtype=torch.int64), 8, impl="triton")
    assert not expert_sort_supported(torch.zeros(2**20 + 1, dtype=torch.int64), 8, impl="triton")  # blocks too large
    assert not expert_sort_supported(flat, 5000, impl="triton")  # more histogram bins than one program holds
    _check(expert_sort(flat, 8), flat, 8)
