"""Rowwise FP8 weights in both GEMM layouts (fp8_quant.quantize_weight_layouts): the reference against quantising
each expert's weight and its transpose rowwise, the Triton kernel pair against the reference bit for bit."""

from __future__ import annotations

import pytest
import torch

from moecore.kernels import fp8_quant as fq
from tests.kernels.conftest import setup

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def _weights(dev, e=3, n=48, k=80, dtype=torch.bfloat16):
    torch.manual_seed(6)  # columns of very different magnitudes: the two layouts' scales differ
    w = torch.randn(e, n, k) * torch.logspace(-2, 1, k)
    w[1, 5, :] = 0.0  # an all-zero row: its scale is the floor's, its values 0
    return w.to(dtype).to(dev)


def _bits(q: torch.Tensor) -> torch.Tensor:
    return q.view(torch.uint8)


@pytest.mark.parametrize("dtype", [E4M3, E5M2])
def test_reference_is_rowwise_quantisation_of_each_layout(dtype):
    w = _weights("cpu")
    (q, s), (qt, st) = fq.quantize_weight_layouts_reference(w, dtype)
    assert q.shape == (3, 48, 80) and s.shape == (3, 48, 1) and qt.shape == (3, 80, 48) and st.shape == (3, 80, 1)
    for e in range(3):
        qe, se = fq.quantize_rowwise_reference(w[e], dtype)
        assert torch.equal(se, s[e]) and torch.equal(_bits(qe), _bits(q[e]))
        qe, se = fq.quantize_rowwise_reference(w[e].t().contiguous(), dtype)
        assert torch.equal(se, st[e]) and torch.equal(_bits(qe), _bits(qt[e]))
    assert float(q[1, 5].float().abs().max()) == 0.0


@pytest.mark.parametrize("layouts", [(True, True), (False, True), (True, False)])
@pytest.mark.parametrize("pow2", [False, True])
def test_kernel_matches_reference(backend, layouts, pow2):
    dev, _ = setup(backend)
    rows, cols = layouts
    w = _weights(dev)
    got = fq.quantize_weight_layouts(w, E4M3, pow2, rows=rows, cols=cols, impl="triton")
    ref = fq.quantize_weight_layouts(w, E4M3, pow2, rows=rows, cols=cols, impl="torch")
    for g, r, asked in zip(got, ref, layouts):
        assert (g is None) == (r is None) == (not asked)
        if g is not None:
            assert torch.equal(g[1], r[1]) and torch.equal(_bits(g[0]), _bits(r[0]))


def test_kernel_on_fp32_weights_and_ragged_tiles(backend):
    """fp32 input (a master weight), dims that are not multiples of the tiles, e5m2."""
    dev, _ = setup(backend)
    w = _weights(dev, e=2, n=37, k=70, dtype=torch.float32)
    got = fq.quantize_weight_layouts(w, E5M2, impl="triton")
    ref = fq.quantize_weight_layouts(w, E5M2, impl="torch")
    for g, r in zip(got, ref):
        assert torch.equal(g[1], r[1]) and torch.equal(_bits(g[0]), _bits(r[0]))


@pytest.mark.parametrize("n", [16, 24])  # aligned (16-byte stores) and not
def test_kernel_with_one_chunk_per_expert(backend, n):
    """Experts of few rows: one launch reads each expert's rows for the column maxima and again to quantise."""
    dev, _ = setup(backend)
    w = _weights(dev, e=4, n=n, k=40)
    got = fq.quantize_weight_layouts(w, E4M3, impl="triton")
    ref = fq.quantize_weight_layouts(w, E4M3, impl="torch")
    for g, r in zip(got, ref):
        assert torch.equal(g[1], r[1]) and torch.equal(_bits(g[0]), _bits(r[0]))


def test_bad_input():
    with pytest.raises(ValueError, match="expert weights"):
        fq.quantize_weight_layouts(torch.zeros(4, 4))
    with pytest.raises(ValueError, match="rows, cols or both"):
        fq.quantize_weight_layouts(torch.zeros(1, 4, 4), rows=False, cols=False)


def test_kernel_splits_tall_weights(backend):
    """Experts of many rows: the GPU launch splits each expert's rows into chunks for the column maxima."""
    if backend != "cuda":
        pytest.skip("the GPU split of long groups (the interpreter runs the small weights above in a few chunks)")
    dev, _ = setup(backend)
    w = _weights(dev, e=2, n=2048, k=96)
    got = fq.quantize_weight_layouts(w, E4M3, impl="triton")
    ref = fq.quantize_weight_layouts(w, E4M3, impl="torch")
    for g, r in zip(got, ref):
        assert torch.equal(g[1], r[1]) and torch.equal(_bits(g[0]), _bits(r[0]))
