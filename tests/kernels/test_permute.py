"""Sort-based permute / unpermute: references against a one-hot formula, kernels against references."""

from __future__ import annotations

import pytest
import torch

from moecore.kernels.permute import (
    gather_add_rows,
    gather_add_rows_reference,
    make_permutation,
    permute,
    permute_probs,
    unpermute,
)
from tests.kernels.conftest import rel_err, setup


def _routing(T, K, E, gen_device="cpu"):
    idx = torch.stack([torch.randperm(E)[:K] for _ in range(T)])
    probs = torch.rand(T, K)
    return idx, probs


def test_permutation_groups_rows_by_expert_in_token_order():
    torch.manual_seed(0)
    T, K, E = 9, 2, 4
    idx, _ = _routing(T, K, E)
    perm = make_permutation(idx, E)
    experts = idx.reshape(-1)[perm.order_M]
    assert torch.equal(experts, experts.sort().values)
    assert torch.equal(perm.counts_E, torch.bincount(idx.reshape(-1), minlength=E))
    assert torch.equal(perm.order_M[perm.inv_M], torch.arange(T * K))
    # within an expert, token ids increase (stable sort: deterministic order)
    tok = perm.order_M // K
    for e in range(E):
        t = tok[experts == e]
        assert torch.equal(t, t.sort().values)


def test_reference_equals_dense_one_hot_formula():
    torch.manual_seed(1)
    T, K, E, H = 10, 3, 5, 6
    idx, probs = _routing(T, K, E)
    x = torch.randn(T, H, dtype=torch.float64)
    perm = make_permutation(idx, E)
    xp = permute(x, perm, impl="torch")
    # an arbitrary per-expert map applied to the permuted rows, then combined back
    scale = torch.randn(E, dtype=torch.float64)
    experts = idx.reshape(-1)[perm.order_M]
    y = xp * scale[experts].unsqueeze(-1)
    out = unpermute(y, perm, probs.double(), impl="torch")
    one_hot = torch.zeros(T, E, dtype=torch.float64).scatter_(1, idx, probs.double())  # [T, E] weights
    expected = (one_hot * scale).sum(-1, keepdim=True) * x
    assert torch.allclose(out, expected)
    assert torch.allclose(permute_probs(probs, perm), probs.reshape(-1)[perm.order_M])


@pytest.mark.parametrize("with_probs", [True, False])
def test_kernels_match_reference(backend, with_probs):
    dev, dt = setup(backend)
    torch.manual_seed(2)
    T, K, E, H = 37, 4, 6, 72
    idx, probs = _routing(T, K, E)
    idx, probs = idx.to(dev), probs.to(dev)
    perm = make_permutation(idx, E)
    x = torch.randn(T, H, device=dev, dtype=dt)
    w = torch.randn(T * K, H, device=dev, dtype=dt)  # an upstream weight so the gradients differ per row
    g = torch.randn(T, H, device=dev, dtype=dt)
    res = {}
    for impl in ("torch", "triton"):
        xi = x.clone().requires_grad_()
        pi = probs.clone().requires_grad_() if with_probs else None
        xp = permute(xi, perm, impl=impl)
        out = unpermute(xp * w, perm, pi, impl=impl)
        out.backward(g)
        res[impl] = (xp.detach(), out.detach(), xi.grad, None if pi is None else pi.grad)
    assert torch.equal(res["torch"][0], res["triton"][0])  # a gather is exact
    tol = 1e-2 if dt == torch.bfloat16 else 1e-5
    for a, b in zip(res["triton"][1:], res["torch"][1:]):
        if b is not None:
            assert rel_err(a, b) < tol


@pytest.mark.parametrize("H", [72, 768])
def test_rows_written_from_the_source_side_equal_the_gather_bit_for_bit(backend, H):
    """permute's rows and unpermute's row gradients (each token's row stored to its K sorted rows, the
    probabilities multiplied in fp32) equal torch's gathers exactly; H = 768 runs three 256-column blocks."""
    from moecore.kernels.permute import _row_block

    dev, dt = setup(backend)
    torch.manual_seed(3)
    T, K, E = 23, 3, 5
    idx, probs = _routing(T, K, E)
    perm = make_permutation(idx.to(dev), E)
    x = torch.randn(T, H, device=dev, dtype=dt)
    assert torch.equal(permute(x, perm, impl="triton"), x[perm.order_M // K])
    y = torch.randn(T * K, H, device=dev, dtype=dt)
    g = torch.randn(T, H, device=dev, dtype=dt)
    for p in (None, probs.to(dev)):
        grads = []
        for impl in ("torch", "triton"):
            yi = y.clone().requires_grad_()
            unpermute(yi, perm, p, impl=impl).backward(g)
            grads.append(yi.grad)
        assert torch.equal(grads[0], grads[1])
    assert [_row_block(h) for h in (72, 768, 2048, 7168, 5120, 4096)] == [128, 256, 2048, 1024, 1024, 2048]


def test_scatter_rows_keeps_only_the_destinations():
    from moecore.kernels.permute import scatter_rows

    x = torch.randn(4, 3, requires_grad=True)
    dst = torch.tensor([5, 0, 2, 6])  # row 6: a scratch row past what the caller keeps
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out = scatter_rows(x, dst, 7)
    assert len(saved) == 1 and saved[0] is dst
    assert torch.equal(out[dst], x) and out[[1, 3, 4]].abs().sum() == 0
    g = torch.randn(7, 3)
    out.backward(g)
    assert torch.equal(x.grad, g[dst])


def test_weighted_sum_k_keeps_the_rows_in_their_dtype_and_equals_autograd():
    """The unfused unpermutation's weighted sum (fp32 products, bf16 rows): the same values and gradients as
    autograd through the fp32 formula, bit for bit, while backward keeps the bf16 rows, not their fp32 copy."""
    from moecore.kernels.permute import weighted_sum_k

    torch.manual_seed(0)
    slots = torch.randn(6, 3, 8, dtype=torch.bfloat16, requires_grad=True)
    w = torch.rand(6, 3, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out = weighted_sum_k(slots, w)
    assert {t.dtype for t in saved if t.dim() == 3} == {torch.bfloat16}
    ref_slots, ref_w = slots.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    ref = (ref_slots.float() * ref_w.unsqueeze(-1)).sum(1).to(torch.bfloat16)
    assert torch.equal(out, ref)
    g = torch.randn(6, 8, dtype=torch.bfloat16)
    out.backward(g)
    ref.backward(g)
    assert torch.equal(slots.grad, ref_slots.grad) and torch.equal(w.grad, ref_w.grad)


def test_gather_add_reference_sums_each_tokens_rows_of_the_slice():
    torch.manual_seed(4)
    T, K, E, H = 11, 3, 5, 4
    idx, probs = _routing(T, K, E)
    perm = make_permutation(idx, E)
    rows = torch.randn(T * K, H, dtype=torch.float64)  # sorted rows
    w = probs.reshape(-1)[perm.order_M].double()
    r0, r1 = 7, 20
    acc = torch.randn(T, H, dtype=torch.float64)
    expected = acc.clone()
    for t in range(T):
        for k in range(K):
            r = int(perm.inv_M[t * K + k])
            if r0 <= r < r1:
                expected[t] += w[r] * rows[r]
    gather_add_rows_reference(acc, rows[r0:r1], perm.inv_M, K, r0, w)
    assert torch.allclose(acc, expected)


@pytest.mark.parametrize("weighted", [True, False])
def test_gather_add_kernel_matches_reference(backend, weighted):
    dev, dt = setup(backend)
    torch.manual_seed(5)
    T, K, E, H = 29, 4, 7, 40
    idx, probs = _routing(T, K, E)
    perm = make_permutation(idx.to(dev), E)
    rows = torch.randn(T * K, H, device=dev, dtype=dt)
    w = probs.to(dev).reshape(-1)[perm.order_M] if weighted else None
    acc0 = torch.randn(T, H, device=dev)
    got, want = acc0.clone(), acc0.clone()
    for r0, r1 in [(0, 13), (13, 13), (13, 70), (70, T * K)]:  # slices covering every row, one empty
        gather_add_rows(got, rows[r0:r1], perm.inv_M, K, r0, w, impl="triton")
        gather_add_rows_reference(want, rows[r0:r1], perm.inv_M, K, r0, w)
    assert rel_err(got, want) < 1e-6
    before = got.clone()
    gather_add_rows(got, rows[:0], perm.inv_M, K, 0, w, impl="triton")  # an empty slice changes nothing
    assert torch.equal(got, before)
