"""Attention with sinks (moecore/models/sinks.py): the SDPA path (a sink key) against the eager reference on CPU,
and the SDPA and flex_attention paths on a GPU: forward and every gradient (the sinks' included), with and
without a sliding window, grouped-query heads. (The reference against transformers: tests/hf/test_gpt_oss.py.)"""

from __future__ import annotations

import pytest
import torch

from moecore.models.sinks import sink_attention_flex, sink_attention_reference, sink_attention_sdpa


def _compare(fn, device, dtype, b, h, kv, s, d, window, tol):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(b, n, s, d, generator=g).to(device, dtype) for n in (h, kv, kv))
    sinks = (torch.randn(h, generator=g) * 2).to(device, dtype)
    grad_out = torch.randn(b, h, s, d, generator=g).to(device, dtype)
    results = []
    for f in (sink_attention_reference, fn):
        xs = [t.clone().requires_grad_() for t in (q, k, v, sinks)]
        out = f(*xs, window, d**-0.5)
        out.backward(grad_out)
        results.append([out.detach()] + [x.grad for x in xs])
    for name, ref, got in zip(("out", "dq", "dk", "dv", "dsinks"), *results):
        err = (got.float() - ref.float()).abs().max().item()
        assert err <= tol * max(1.0, ref.abs().max().item()), (name, err)


@pytest.mark.parametrize("window", [None, 4])
def test_sdpa_sink_key_matches_reference(window):
    _compare(sink_attention_sdpa, "cpu", torch.float32, 2, 4, 2, 11, 8, window, 1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("fn", [sink_attention_sdpa, sink_attention_flex], ids=["sdpa", "flex"])
@pytest.mark.parametrize("window", [None, 128])
def test_gpu_sink_attention_matches_reference(fn, window):
    _compare(fn, "cuda", torch.float32, 2, 8, 2, 1000, 64, window, 2e-3)  # TF32 inside the fused kernels
