"""Sort-based permute / unpermute and capacity dropping, checked against brute-force Python."""

from __future__ import annotations

import math

import pytest
import torch

from moecore.moe.permute import capacity_keep, expert_capacity, permute, permute_probs, unpermute


def _random_routing(T: int, E: int, K: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    w = torch.rand(T, K, generator=g)
    w[: T // 3] = torch.round(w[: T // 3] * 4) / 4  # ties between weights
    return idx, w


def _kept_by_brute_force(idx, w, E, C, policy) -> set[tuple[int, int]]:
    """Per expert, rank its assignments (t, k) and keep the first C."""
    T, K = idx.shape
    kept = set()
    for e in range(E):
        mine = [(t, k) for t in range(T) for k in range(K) if idx[t, k] == e]
        if policy == "probs":
            mine.sort(key=lambda tk: (-w[tk].item(), tk[0] * K + tk[1]))
        kept.update(mine[:C])
    return kept


@pytest.mark.parametrize("policy", ["probs", "position"])
@pytest.mark.parametrize("seed", range(4))
def test_capacity_keeps_exactly_the_named_assignments(policy, seed):
    T, E, K = 23, 6, 2
    idx, w = _random_routing(T, E, K, seed)
    C = expert_capacity(T, K, E, 0.8)
    assert C == math.ceil(23 * 2 / 6 * 0.8)
    keep = capacity_keep(idx, w, E, C, policy)
    got = {(t, k) for t in range(T) for k in range(K) if keep[t, k]}
    assert got == _kept_by_brute_force(idx, w, E, C, policy)


def test_permute_groups_rows_by_expert_in_token_order():
    T, E, K = 17, 5, 3
    idx, _ = _random_routing(T, E, K, 0)
    x = torch.arange(T, dtype=torch.float32).unsqueeze(-1).repeat(1, 4)  # row t holds t
    rows, ctx = permute(x, idx, E)
    counts = torch.bincount(idx.reshape(-1), minlength=E)
    assert torch.equal(ctx.tokens_per_expert, counts)
    start = 0
    for e in range(E):
        n = int(counts[e])
        expect = [t for t in range(T) for k in range(K) if idx[t, k] == e]
        assert rows[start : start + n, 0].long().tolist() == expect
        start += n


@pytest.mark.parametrize("seed", range(3))
def test_unpermute_inverts_permute_with_weights(seed):
    T, E, K, H = 19, 7, 2, 5
    idx, w = _random_routing(T, E, K, seed)
    x = torch.randn(T, H)
    rows, ctx = permute(x, idx, E)
    torch.testing.assert_close(unpermute(rows, ctx, w), (w.sum(-1, keepdim=True) * x))
    torch.testing.assert_close(unpermute(rows, ctx), K * x)


@pytest.mark.parametrize("policy", ["probs", "position"])
def test_drops_and_pad_to_capacity(policy):
    T, E, K, H = 21, 4, 2, 3
    idx, w = _random_routing(T, E, K, 7)
    C = expert_capacity(T, K, E, 0.5)
    keep = capacity_keep(idx, w, E, C, policy)
    x = torch.randn(T, H)
    expected = ((w * keep).unsqueeze(-1) * x.unsqueeze(1)).sum(1)  # dropped copies contribute nothing

    rows, ctx = permute(x, idx, E, keep)
    assert rows.shape[0] == int(keep.sum())
    torch.testing.assert_close(unpermute(rows, ctx, w), expected)

    rows, ctx = permute(x, idx, E, keep, pad_to_capacity=C)
    assert rows.shape[0] == E * C and ctx.tokens_per_expert.tolist() == [C] * E
    kept_rows = set(ctx.dest_rows.tolist())
    pad_rows = [r for r in range(E * C) if r not in kept_rows]
    assert rows[pad_rows].abs().sum() == 0
    torch.testing.assert_close(unpermute(rows, ctx, w), expected)
    probs = permute_probs(w, ctx)
    assert probs[pad_rows].abs().sum() == 0
    torch.testing.assert_close(unpermute(rows * probs.unsqueeze(-1), ctx), expected)


def test_permute_gradients():
    T, E, K, H = 9, 3, 2, 4
    idx, w = _random_routing(T, E, K, 3)
    x = torch.randn(T, H, requires_grad=True, dtype=torch.float64)
    w = w.double().requires_grad_()
    torch.autograd.gradcheck(lambda x, w: unpermute(permute(x, idx, E)[0] * 1.5, permute(x, idx, E)[1], w), (x, w))


@pytest.mark.parametrize("pad", [False, True], ids=["drops", "drops-padded"])
def test_dropping_paths_are_differentiable_and_keep_no_row_copies(pad):
    """With drops (padded to capacity or not), the scatters keep only their row indices for backward: never a copy
    of the routed rows (autograd's index_copy would keep its source, [T x K, H]); the gradients stay exact."""
    T, E, K, H = 12, 3, 2, 5
    idx, w = _random_routing(T, E, K, 11)
    C = expert_capacity(T, K, E, 0.5)
    keep = capacity_keep(idx, w, E, C, "probs")
    x = torch.randn(T, H, dtype=torch.float64, requires_grad=True)
    w = w.double().requires_grad_()
    cap = C if pad else None
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        rows, ctx = permute(x, idx, E, keep, pad_to_capacity=cap)
        unpermute(rows, ctx)  # without weights (applied inside the experts): a plain sum over k
    rows_kept = [t for t in saved if t.is_floating_point() and t.dim() == 2 and t.shape[1] == H]
    assert not rows_kept, [(t.dtype, tuple(t.shape)) for t in saved]

    def f(x, w):
        rows, ctx = permute(x, idx, E, keep, pad_to_capacity=cap)
        return unpermute(rows * 1.5, ctx, w)

    torch.autograd.gradcheck(f, (x, w))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_expert_sort_on_narrow_keys_equals_the_int64_sort():
    """On CUDA the ids are sorted as int16 keys: the same ids, the same stable order, as sorting the int64 ids;
    the dropped assignments' sentinel (num_experts) sorts last; the padded path's row arithmetic stays int64."""
    from moecore.moe.permute import sort_expert_ids

    g = torch.Generator().manual_seed(0)
    for E in (8, 512, 20000):
        flat = torch.randint(0, E + 1, (50000,), generator=g).cuda()  # E: the sentinel
        ids, order = sort_expert_ids(flat, E)
        ref_ids, ref_order = torch.sort(flat, stable=True)
        assert ids.dtype == torch.int64 and torch.equal(ids, ref_ids) and torch.equal(order, ref_order)
    idx, w = _random_routing(64, 8, 2, 0)
    x = torch.randn(64, 16)
    rows_cpu, _ = permute(x, idx, 8, pad_to_capacity=64)
    rows_gpu, _ = permute(x.cuda(), idx.cuda(), 8, pad_to_capacity=64)
    assert torch.equal(rows_cpu, rows_gpu.cpu())
