"""RoPE: the reference equals the model's apply_rotary; the kernel equals the reference (GQA and MLA layouts)."""

from __future__ import annotations

import pytest
import torch

from moecore.kernels.rope import apply_rotary, apply_rotary_reference
from moecore.models.rope import RotaryEmbedding
from moecore.models.rope import apply_rotary as model_apply_rotary
from tests.kernels.conftest import rel_err, setup


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("rot_dim", [16, 8])
def test_reference_equals_model(interleaved, rot_dim):
    torch.manual_seed(0)
    x = torch.randn(2, 3, 5, 16)
    cos, sin = RotaryEmbedding(rot_dim, 10000.0)(torch.arange(5), torch.float32)
    assert torch.equal(apply_rotary_reference(x, cos, sin, interleaved), model_apply_rotary(x, cos, sin, interleaved))


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("D,rot_dim", [(32, 32), (48, 16)], ids=["full", "partial"])
def test_kernel_matches_reference(backend, interleaved, D, rot_dim):
    dev, dt = setup(backend)
    torch.manual_seed(1)
    B, S, NH = 2, 7, 3
    x = torch.randn(B, S, NH, D, device=dev, dtype=dt).transpose(1, 2)  # the attention layout: a strided view
    cos, sin = RotaryEmbedding(rot_dim, 10000.0).to(dev)(torch.arange(S, device=dev), dt)
    g = torch.randn(B, S, NH, D, device=dev, dtype=dt).transpose(1, 2)  # SDPA's gradients come in q's layout
    res = {}
    for impl in ("torch", "triton"):
        xx = x.detach().clone().requires_grad_()
        y = apply_rotary(xx, cos, sin, interleaved, impl=impl)
        y.backward(g)
        res[impl] = (y.detach(), xx.grad)
        if impl == "triton":  # the kernel keeps the [B, S, heads, D] memory layout both ways: no copies
            assert y.stride() == x.stride() and xx.grad.stride() == g.stride()
    tol = 1e-2 if dt == torch.bfloat16 else 1e-5
    assert rel_err(res["triton"][0], res["torch"][0]) < tol
    assert rel_err(res["triton"][1], res["torch"][1]) < tol
