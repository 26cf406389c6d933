"""SwiGLU with routing probabilities: the reference against autograd, the kernel against the reference."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from moecore.kernels.swiglu import swiglu, swiglu_backward, swiglu_backward_reference, swiglu_reference
from tests.kernels.conftest import rel_err, setup


def _autograd(h, p, dout, limit=None, alpha=None):
    h = h.double().requires_grad_()
    p = p.double().requires_grad_() if p is not None else None
    g, u = h.chunk(2, -1)
    if limit is not None:  # DeepSeek-V4's clipped SwiGLU, as transformers writes it
        g, u = g.clamp(max=limit), u.clamp(min=-limit, max=limit)
    out = F.silu(g) * u if alpha is None else g * torch.sigmoid(alpha * g) * (u + 1)  # gpt-oss's, as transformers
    if p is not None:
        out = out * p.unsqueeze(-1)
    out.backward(dout.double())
    return out, h.grad, (p.grad if p is not None else None)


FORMS = [(None, None), (0.7, None), (0.7, 1.702)]  # (limit, alpha): SwiGLU, DeepSeek-V4's clip, gpt-oss's form


@pytest.mark.parametrize("limit, alpha", FORMS, ids=["swiglu", "clipped", "gpt-oss"])
@pytest.mark.parametrize("with_probs", [True, False])
def test_reference_matches_autograd_fp64(with_probs, limit, alpha):
    torch.manual_seed(0)
    h = torch.randn(7, 2 * 12, dtype=torch.float64)
    if limit is not None:  # elements exactly at +-limit: clamp passes their gradient
        h[0, :3], h[0, 12:14] = limit, -limit
        assert (h.abs() > limit).float().mean() > 0.3  # the clip is exercised
    p = torch.rand(7, dtype=torch.float64) if with_probs else None
    dout = torch.randn(7, 12, dtype=torch.float64)
    out, dh, dp = _autograd(h, p, dout, limit, alpha)
    assert torch.allclose(swiglu_reference(h, p, limit, alpha), out)
    rdh, rdp, ra = swiglu_backward_reference(h, p, dout, limit, alpha)
    assert torch.allclose(rdh, dh) and torch.allclose(ra, out)
    if with_probs:
        assert torch.allclose(rdp.double(), dp)
    else:
        assert rdp is None


def test_rejects_odd_width():
    with pytest.raises(ValueError, match="even"):
        swiglu(torch.randn(2, 5), impl="torch")


@pytest.mark.parametrize(
    "limit, alpha", [(None, None), (1.0, None), (1.0, 1.702)], ids=["swiglu", "clipped", "gpt-oss"]
)
@pytest.mark.parametrize("with_probs", [True, False])
@pytest.mark.parametrize("shape", [(33, 2 * 40), (4, 5, 2 * 24)])
def test_kernel_matches_reference(backend, with_probs, shape, limit, alpha):
    dev, dt = setup(backend)
    torch.manual_seed(1)
    h = torch.randn(*shape, device=dev, dtype=dt)
    p = torch.rand(*shape[:-1], device=dev, dtype=torch.float32) if with_probs else None
    dout = torch.randn(*shape[:-1], shape[-1] // 2, device=dev, dtype=dt)
    hr = h.clone().requires_grad_()
    pr = p.clone().requires_grad_() if with_probs else None
    ref = swiglu(hr, pr, impl="torch", limit=limit, alpha=alpha)
    ref.backward(dout)
    hk = h.clone().requires_grad_()
    pk = p.clone().requires_grad_() if with_probs else None
    out = swiglu(hk, pk, impl="triton", limit=limit, alpha=alpha)
    out.backward(dout)
    tol = 1e-2 if dt == torch.bfloat16 else 1e-5
    assert rel_err(out, ref) < tol
    assert rel_err(hk.grad, hr.grad) < tol
    if with_probs:
        assert rel_err(pk.grad, pr.grad) < tol
    dh, dp, a = swiglu_backward(
        h.reshape(-1, shape[-1]),
        None if p is None else p.reshape(-1),
        dout.reshape(-1, shape[-1] // 2),
        impl="triton",
        limit=limit,
        alpha=alpha,
    )
    rdh, rdp, ra = swiglu_backward_reference(
        h.reshape(-1, shape[-1]), None if p is None else p.reshape(-1), dout.reshape(-1, shape[-1] // 2), limit, alpha
    )
    assert rel_err(dh, rdh) < tol and rel_err(a, ra) < tol
    if with_probs:
        assert rel_err(dp, rdp) < tol
