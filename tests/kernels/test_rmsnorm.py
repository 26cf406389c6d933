"""RMSNorm: the reference equals the model's norm and the textbook formula; the kernel equals the reference."""

from __future__ import annotations

import pytest
import torch

from moecore.kernels.rmsnorm import rms_norm, rms_norm_reference
from moecore.models.norms import rms_norm as model_rms_norm
from tests.kernels.conftest import rel_err, setup


@pytest.mark.parametrize("zero_centered", [False, True])
def test_reference_matches_model_norm_and_formula(zero_centered):
    torch.manual_seed(0)
    x = torch.randn(3, 5, 16, dtype=torch.bfloat16)
    w = torch.randn(16, dtype=torch.bfloat16)
    assert torch.equal(rms_norm_reference(x, w, 1e-6, zero_centered), model_rms_norm(x, w, 1e-6, zero_centered))
    xd, wd = x.double(), w.double() + (1 if zero_centered else 0)
    formula = xd / torch.sqrt((xd**2).mean(-1, keepdim=True) + 1e-6) * wd
    assert rel_err(rms_norm_reference(x, w, 1e-6, zero_centered), formula) < 1e-2


@pytest.mark.parametrize("zero_centered", [False, True])
@pytest.mark.parametrize("shape", [(7, 24), (2, 3, 100)])
def test_kernel_matches_reference(backend, zero_centered, shape):
    dev, dt = setup(backend)
    torch.manual_seed(1)
    x = torch.randn(*shape, device=dev, dtype=dt)
    w = torch.randn(shape[-1], device=dev, dtype=dt)
    dy = torch.randn(*shape, device=dev, dtype=dt)
    res = {}
    for impl in ("torch", "triton"):
        xx, ww = x.clone().requires_grad_(), w.clone().requires_grad_()
        y = rms_norm(xx, ww, 1e-5, zero_centered, impl=impl)
        y.backward(dy)
        res[impl] = (y.detach(), xx.grad, ww.grad)
    tol = 1e-2 if dt == torch.bfloat16 else 1e-5
    for a, b in zip(res["triton"], res["torch"]):
        assert rel_err(a, b) < tol
