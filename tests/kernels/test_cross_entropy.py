"""Chunked linear + cross-entropy against the unfused formula (and transformers-style F.cross_entropy)."""

from __future__ import annotations

import pytest
import torch

from moecore.kernels.cross_entropy import linear_cross_entropy, linear_cross_entropy_reference
from tests.kernels.conftest import rel_err, setup


def _data(N, H, V, dev, dt, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(N, H, generator=g).to(dev, dt)
    w = (torch.randn(V, H, generator=g) * 0.5).to(dev, dt)
    labels = torch.randint(0, V, (N,), generator=g).to(dev)
    labels[3] = -100
    mask = (torch.rand(N, generator=g) > 0.2).float().to(dev)
    return h, w, labels, mask


@pytest.mark.parametrize("chunk", [4, 7, 64])
def test_chunked_reference_matches_unfused_fp64(chunk):
    h, w, labels, mask = _data(19, 8, 23, "cpu", torch.float64)
    res = {}
    for name, fn in (
        ("fused", lambda *a: linear_cross_entropy(*a, chunk=chunk, impl="torch")),
        ("ref", linear_cross_entropy_reference),
    ):
        hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
        loss = fn(hh, ww, labels, mask)
        (loss * 0.37).backward()
        res[name] = (loss.detach(), hh.grad, ww.grad)
    for a, b in zip(res["fused"], res["ref"]):
        assert torch.allclose(a.double(), b.double(), rtol=1e-6, atol=1e-9)


def test_no_grad_path_and_bad_chunk():
    h, w, labels, mask = _data(5, 4, 6, "cpu", torch.float32)
    with torch.no_grad():
        a = linear_cross_entropy(h, w, labels, mask, chunk=2, impl="torch")
    assert torch.allclose(a, linear_cross_entropy_reference(h, w, labels, mask), rtol=1e-5)
    with pytest.raises(ValueError, match="chunk"):
        linear_cross_entropy(h, w, labels, chunk=0)


def test_kernel_matches_reference(backend):
    dev, dt = setup(backend)
    N, H, V = (33, 16, 300) if backend == "interpret" else (300, 64, 5000)
    h, w, labels, mask = _data(N, H, V, dev, dt, seed=1)
    res = {}
    for impl in ("torch", "triton"):
        hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
        loss = linear_cross_entropy(hh, ww, labels, mask, chunk=N // 3 + 1, impl=impl)
        (loss / mask.sum()).backward()
        res[impl] = (loss.detach(), hh.grad, ww.grad)
    tol = 2e-2 if dt == torch.bfloat16 else 1e-5
    assert rel_err(res["triton"][0], res["torch"][0]) < 1e-5
    assert rel_err(res["triton"][1], res["torch"][1]) < tol
    assert rel_err(res["triton"][2], res["torch"][2]) < tol


def test_under_bf16_autocast_matches_unfused():
    """fp32 h and W under bf16 autocast (the training loop's setup): the same loss and gradients as the
    unfused head under the same autocast (bf16 logits, fp32 softmax); the GPU run once failed here."""
    h, w, labels, mask = _data(21, 16, 37, "cpu", torch.float32, seed=2)
    res = {}
    for name, fn in (
        ("fused", lambda *a: linear_cross_entropy(*a, chunk=8, impl="torch")),
        ("ref", linear_cross_entropy_reference),
    ):
        hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = fn(hh, ww, labels, mask)
        loss.backward()
        assert loss.dtype == torch.float32 and hh.grad.dtype == ww.grad.dtype == torch.float32
        res[name] = (loss.detach(), hh.grad, ww.grad)
    assert rel_err(res["fused"][0], res["ref"][0]) < 1e-5
    # the gradients are rounded to bf16 before their GEMMs in both paths, summed in different orders
    assert rel_err(res["fused"][1], res["ref"][1]) < 1e-2
    assert rel_err(res["fused"][2], res["ref"][2]) < 1e-2
