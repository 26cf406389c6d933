"""moecore's FP8 Triton grouped GEMMs (grouped_gemm_fp8.py) against float64 from the dequantised operands."""

from __future__ import annotations

import itertools

import pytest
import torch

from moecore.kernels.fp8_quant import quantize_rowwise_reference
from moecore.kernels.grouped_gemm import TileConfig
from moecore.kernels.grouped_gemm_fp8 import (
    grouped_mm_scaled,
    grouped_mm_scaled_reference,
    grouped_wgrad_scaled,
    grouped_wgrad_scaled_reference,
)
from tests.kernels.conftest import rel_err, setup
from tests.kernels.test_grouped_gemm import _bounds, _config, _counts

# A: e4m3, or e5m2 (the hybrid format's gradients, e.g. dy of the input-gradient GEMM); B always e4m3
A_FORMATS = pytest.mark.parametrize("a_dtype", [torch.float8_e4m3fn, torch.float8_e5m2], ids=["e4m3", "e5m2-a"])


@pytest.mark.parametrize("persistent,tma", [(True, True), (False, False)], ids=["persistent-tma", "grid"])
@A_FORMATS
def test_grouped_mm_scaled_matches_float64_of_the_dequantised_operands(backend, persistent, tma, a_dtype):
    """FP8 operands with row scales: the experts' rows unaligned (the counts of _counts), scales in the epilogue."""
    dev, dt = setup(backend)
    g = torch.Generator().manual_seed(5)
    counts = _counts(backend)
    E, M = len(counts), sum(counts)
    K, N = (64, 40) if backend == "interpret" else (256, 320)
    e4m3 = torch.float8_e4m3fn
    a_q, sa = quantize_rowwise_reference(torch.randn(M, K, generator=g) * 3.0, a_dtype)
    b_q, sb = quantize_rowwise_reference(torch.randn(E * N, K, generator=g) * 0.02, e4m3)
    a_q, sa, b_q, sb = a_q.to(dev), sa.to(dev), b_q.view(E, N, K).to(dev), sb.view(E, N).to(dev)
    bounds = _bounds(counts, dev)
    cfg = _config(backend, persistent, tma)
    if backend == "cuda":
        cfg = TileConfig(64, 128, 128, 4, 4, 3, persistent, tma)
    ref = grouped_mm_scaled_reference(a_q, b_q, sa, sb, bounds)
    for fast in (False, True):
        out = grouped_mm_scaled(a_q, b_q, sa, sb, bounds, dt, cfg, fast_accum=fast)
        assert out.dtype == dt and out.shape == (M, N)
        # products of FP8 values are exact in fp32: the error is the fp32 sums (and the bf16 output on the GPU)
        assert rel_err(out, ref) < (1e-2 if dt == torch.bfloat16 else 1e-6), fast


def test_grouped_mm_scaled_refuses_unquantised_operands():
    a, b = torch.zeros(4, 16), torch.zeros(2, 8, 16)
    with pytest.raises(ValueError, match="FP8 operands"):
        grouped_mm_scaled(a, b, torch.ones(4), torch.ones(2, 8), _bounds([2, 2], "cpu"), torch.float32, TileConfig())


@pytest.mark.parametrize("persistent,tma", [(True, True), (False, False)], ids=["persistent-tma", "grid"])
@A_FORMATS
def test_grouped_wgrad_scaled_matches_float64_of_the_dequantised_operands(backend, persistent, tma, a_dtype):
    """The FP8 weight-gradient GEMM over each expert's columns of transposed operands (padded to 16 as the FP8
    expert FFN writes them, and unpadded), scales per expert and row; empty experts give zeros; outputs stored
    through TMA (N1 a multiple of the tile) and not."""
    dev, dt = setup(backend)
    g = torch.Generator().manual_seed(6)
    e4m3 = torch.float8_e4m3fn
    N2 = 40 if backend == "interpret" else 320
    cfg = (
        _config(backend, persistent, tma)
        if backend == "interpret"
        else TileConfig(64, 128, 128, 4, 4, 3, persistent, tma)
    )
    widths = (24, 32) if backend == "interpret" else (200, 192)  # N1 a multiple of the tile: the TMA store
    padded = [-(-c // 16) * 16 for c in _counts(backend)]
    for N1, counts in itertools.product(widths, (_counts(backend), padded)):
        E, P = len(counts), sum(counts)
        a_q = (torch.randn(N1, P, generator=g) * 100).clamp(-448, 448).to(a_dtype).to(dev)
        b_q = (torch.randn(N2, P, generator=g) * 100).clamp(-448, 448).to(e4m3).to(dev)
        sa, sb = (torch.rand(E, N1, generator=g) + 0.5).to(dev), (torch.rand(E, N2, generator=g) + 0.5).to(dev)
        bounds = _bounds(counts, dev)
        out = grouped_wgrad_scaled(a_q, b_q, sa, sb, bounds, dt, cfg)
        ref = grouped_wgrad_scaled_reference(a_q, b_q, sa, sb, bounds)
        assert out.dtype == dt and out.shape == (E, N1, N2)
        for e, n in enumerate(counts):
            if n == 0:
                assert torch.count_nonzero(out[e]) == 0, e
            else:
                assert rel_err(out[e], ref[e]) < (1e-2 if dt == torch.bfloat16 else 1e-6), e
