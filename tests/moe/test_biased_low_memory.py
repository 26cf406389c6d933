"""gpt-oss's biased, clamped experts in the low-memory expert Functions (moecore/moe/minimal.py,
moecore/moe/chunked.py): output and every gradient (input, weights, both biases, routing weights) against the
expert FFN's autograd reference (moecore/kernels/grouped_ffn.py `expert_ffn_reference`), with the probabilities
in the activation or at the combine, and for the rows an expert-parallel dispatch hands the experts."""

from __future__ import annotations

import pytest
import torch

from moecore.kernels.grouped_ffn import expert_ffn_reference
from moecore.moe.chunked import chunked_experts, chunked_sorted_rows
from moecore.moe.minimal import minimal_experts

T, H, F, E, K = 13, 16, 8, 5, 2
FORM = {"limit": 1.2, "alpha": 1.702}  # a limit the random pre-activations reach


def _operands(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "x": torch.randn(T, H, generator=g),
        "w13": torch.randn(E, 2 * F, H, generator=g) * 0.4,
        "w2": torch.randn(E, H, F, generator=g) * 0.4,
        "b13": torch.randn(E, 2 * F, generator=g) * 0.5,
        "b2": torch.randn(E, H, generator=g) * 0.5,
        "weight": torch.rand(T, K, generator=g),
        "idx": torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]),
        "dy": torch.randn(T, H, generator=g),
    }


def _grads(fn, ops: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    leaves = {n: ops[n].clone().requires_grad_() for n in ("x", "w13", "w2", "b13", "b2", "weight")}
    y = fn(**leaves)
    y.backward(ops["dy"])
    return y.detach(), {n: t.grad for n, t in leaves.items()}


def _token_reference(idx: torch.Tensor, probs_in_act: bool):
    order = idx.flatten().argsort(stable=True)
    counts = torch.bincount(idx.flatten(), minlength=E)

    def run(x, w13, w2, b13, b2, weight):
        p = weight.flatten()[order]
        y = expert_ffn_reference(x[order // K], w13, w2, counts, p if probs_in_act else None, b13=b13, b2=b2, **FORM)
        y = y if probs_in_act else y * p[:, None]
        return torch.zeros_like(x).index_add(0, order // K, y)

    return run


def _check(got, want) -> None:
    (y, g), (y_ref, g_ref) = got, want
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-5)
    for n in g_ref:
        torch.testing.assert_close(g[n], g_ref[n], rtol=1e-4, atol=1e-5, msg=n)


@pytest.mark.parametrize("mode", ["minimal", "chunked"])
@pytest.mark.parametrize("probs_in_act", [False, True])
def test_token_paths_match_reference(mode, probs_in_act):
    ops = _operands()
    idx = ops["idx"]

    def ours(x, w13, w2, b13, b2, weight):
        kw = dict(probs_in_act=probs_in_act, b13=b13, b2=b2, **FORM)
        if mode == "minimal":
            return minimal_experts(x, idx, weight, w13, w2, backend="torch", **kw)[0]
        return chunked_experts(x, idx, weight, w13, w2, 5, backend="torch", **kw)[0]  # several chunks

    _check(_grads(ours, ops), _grads(_token_reference(idx, probs_in_act), ops))


def test_sorted_rows_match_reference():
    """chunked_sorted_rows: rows already grouped by expert (expert parallel), probabilities in the activation."""
    ops = _operands(1)
    counts = torch.tensor([4, 0, 7, 9, 6])  # an expert without rows: zero bias gradients
    ops["x"] = torch.randn(int(counts.sum()), H, generator=torch.Generator().manual_seed(2))
    ops["dy"] = torch.randn_like(ops["x"])
    ops["weight"] = torch.rand(ops["x"].shape[0], generator=torch.Generator().manual_seed(3))

    def ours(x, w13, w2, b13, b2, weight):
        return chunked_sorted_rows(x, counts, weight, w13, w2, 8, backend="torch", b13=b13, b2=b2, **FORM)

    def ref(x, w13, w2, b13, b2, weight):
        return expert_ffn_reference(x, w13, w2, counts, weight, b13=b13, b2=b2, **FORM)

    got, want = _grads(ours, ops), _grads(ref, ops)
    _check(got, want)
    assert got[1]["b13"][1].abs().max() == 0 and got[1]["b2"][1].abs().max() == 0
