"""The sparse MLA attention kernel (moecore/kernels/sparse_mla.py) against its PyTorch reference
(moecore.models.dsa.sparse_mqa_attention_reference): output, lse and the gradients of q and kv, with
queries that have fewer visible tokens than K (-1 entries), head counts and widths that are not powers of
two; on the GPU also at DeepSeek-V3.2's head shape. In Triton's interpreter on CPU with TRITON_INTERPRET=1."""

from __future__ import annotations

import pytest
import torch
from tests.kernels.conftest import rel_err, setup

from moecore.models.dsa import sparse_mqa_attention_reference


def _inputs(b, s, nh, dv, dr, k, device, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, s, nh, dv + dr, generator=g)
    kv = torch.randn(b, s, dv + dr, generator=g)
    # each query t picks min(k, t + 1) distinct visible tokens at random, -1 for the rest
    idx = torch.full((b, s, k), -1, dtype=torch.long)
    for bb in range(b):
        for t in range(s):
            n = min(k, t + 1)
            idx[bb, t, :n] = torch.randperm(t + 1, generator=g)[:n]
    return q.to(device, dtype), kv.to(device, dtype), idx.to(device)


def _run(fn, q, kv, idx, scale, dv, grad_out):
    q, kv = q.clone().requires_grad_(), kv.clone().requires_grad_()
    out, lse = fn(q, kv, idx, scale, dv)
    out.backward(grad_out)
    return out.detach(), lse.detach(), q.grad, kv.grad


@pytest.mark.parametrize("shape", [(2, 21, 3, 24, 8, 6), (1, 40, 17, 16, 16, 33)], ids=["small", "wide-k"])
def test_sparse_mla_kernel_matches_reference(backend, shape):
    from moecore.kernels.sparse_mla import sparse_mla_attention

    device, _ = setup(backend)
    b, s, nh, dv, dr, k = shape
    q, kv, idx = _inputs(b, s, nh, dv, dr, k, device, torch.float32)
    grad_out = torch.randn(b, s, nh, dv, generator=torch.Generator().manual_seed(5)).to(device)
    scale = (dv + dr) ** -0.5
    ref = _run(sparse_mqa_attention_reference, q, kv, idx, scale, dv, grad_out)
    got = _run(sparse_mla_attention, q, kv, idx, scale, dv, grad_out)
    tol = 1e-5 if backend == "interpret" else 2e-3  # TF32 dots on the GPU
    for name, r, g in zip(("out", "lse", "dq", "dkv"), ref, got):
        assert rel_err(g, r) < tol, (name, rel_err(g, r))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_sparse_mla_kernel_deepseek_shape_bf16():
    """DeepSeek-V3.2's head shape (128 heads, latent 512 + rope 64) in bf16, top-256 of 1024 tokens."""
    from moecore.kernels.sparse_mla import sparse_mla_attention

    b, s, nh, dv, dr, k = 1, 1024, 128, 512, 64, 256
    q, kv, idx = _inputs(b, s, nh, dv, dr, k, "cuda", torch.bfloat16)
    grad_out = torch.randn(b, s, nh, dv, device="cuda", dtype=torch.bfloat16)
    scale = (128 + dr) ** -0.5
    ref = _run(sparse_mqa_attention_reference, q.float(), kv.float(), idx, scale, dv, grad_out.float())
    got = _run(sparse_mla_attention, q, kv, idx, scale, dv, grad_out)
    for name, r, g in zip(("out", "lse", "dq", "dkv"), ref, got):
        assert rel_err(g.float(), r) < 2e-2, (name, rel_err(g.float(), r))
