"""Attention with sinks (moecore/models/sinks.py): the flex_attention path against the eager reference on a GPU
(forward and every gradient, the sinks' included), with and without a sliding window, grouped-query heads."""

from __future__ import annotations

import pytest
import torch

from moecore.models.sinks import sink_attention_flex, sink_attention_reference


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("window", [None, 128])
def test_flex_sink_attention_matches_reference(window):
    g = torch.Generator(device="cuda").manual_seed(0)
    b, h, kv, s, d = 2, 8, 2, 1000, 64
    q, k, v = (torch.randn(b, n, s, d, device="cuda", generator=g) for n in (h, kv, kv))
    sinks = torch.randn(h, device="cuda", generator=g)
    grad_out = torch.randn(b, h, s, d, device="cuda", generator=g)
    results = []
    for fn in (sink_attention_reference, sink_attention_flex):
        xs = [t.clone().requires_grad_() for t in (q, k, v, sinks)]
        out = fn(*xs, window, d**-0.5)
        out.backward(grad_out)
        results.append([out.detach()] + [x.grad for x in xs])
    for name, ref, got in zip(("out", "dq", "dk", "dv", "dsinks"), *results):
        tol = 2e-3 * max(1.0, ref.abs().max().item())  # TF32 inside flex_attention's matmuls
        assert (got - ref).abs().max().item() <= tol, name
