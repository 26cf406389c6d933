"""The FP8 transpose kernel against torch's transposed copy, bit for bit (in Triton's interpreter on CPU)."""

from __future__ import annotations

import pytest
import torch

from moecore.kernels.fp8_transpose import transpose_last2, transpose_last2_reference
from tests.kernels.conftest import setup


@pytest.mark.parametrize("shape", [(3, 40, 24), (48, 16), (2, 1, 33), (0, 16, 16)])
def test_transpose_last2_matches_torch(backend, shape):
    dev, _ = setup(backend)
    g = torch.Generator().manual_seed(0)
    q = (torch.randn(shape, generator=g) * 50).to(torch.float8_e4m3fn).to(dev)
    got = transpose_last2(q, impl="triton")
    want = transpose_last2_reference(q)
    assert got.shape == want.shape and got.dtype == q.dtype
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
