"""FP8 quantisation: each reference against a float64 computation, each Triton kernel against its reference."""

from __future__ import annotations

import pytest
import torch

from moecore.kernels import fp8_quant as fq
from tests.kernels.conftest import setup

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
QUANT = {
    "tensorwise": (fq.quantize_tensorwise, fq.quantize_tensorwise_reference),
    "rowwise": (fq.quantize_rowwise, fq.quantize_rowwise_reference),
    "1x128": (fq.quantize_1x128, fq.quantize_1x128_reference),
    "128x128": (fq.quantize_128x128, fq.quantize_128x128_reference),
}


def _groups64(x: torch.Tensor, granularity: str) -> torch.Tensor:
    """Each element's group amax, in float64, by explicit loops over the groups."""
    x = x.double().abs()
    R, C = x.shape
    out = torch.empty_like(x)
    if granularity == "tensorwise":
        out[:] = x.max()
    elif granularity == "rowwise":
        for r in range(R):
            out[r] = x[r].max()
    else:
        br = 1 if granularity == "1x128" else 128
        for r0 in range(0, R, br):
            for c0 in range(0, C, 128):
                out[r0 : r0 + br, c0 : c0 + 128] = x[r0 : r0 + br, c0 : c0 + 128].max()
    return out


@pytest.mark.parametrize("granularity", list(QUANT))
@pytest.mark.parametrize("dtype", [E4M3, E5M2])
def test_reference_matches_float64(granularity, dtype):
    torch.manual_seed(0)
    x = torch.randn(130, 300) * torch.logspace(-3, 2, 300)  # columns of very different magnitudes
    x[5] = 0.0  # an all-zero row: scale from the floor, q = 0
    q, s = QUANT[granularity][1](x, dtype)
    fmax = fq.FP8_MAX[dtype]
    amax = _groups64(x, granularity)
    scale64 = amax.clamp(min=fq.AMAX_FLOOR) / fmax
    deq = fq.dequantize(q, s, granularity).double()
    # scales: amax / fp8_max to fp32 rounding; values: within half an fp8 step of their group's scale
    assert torch.allclose(fq.dequantize(torch.ones_like(q), s, granularity).double(), scale64, rtol=1e-6, atol=0)
    step = 2.0 ** (-3 if dtype == E4M3 else -2)  # relative spacing of fp8 normal values
    err = (deq - x.double()).abs()
    bound = torch.maximum(x.double().abs() * step / 2, scale64 * 2.0 ** (-9 if dtype == E4M3 else -16)) * (1 + 1e-6)
    assert (err <= bound).all()
    assert (q[5].float() == 0).all()
    # the largest element of each group lands on fp8_max
    assert deq.abs().amax().item() == pytest.approx(x.abs().amax().item(), rel=1e-6)
    assert q.float().abs().amax().item() == fmax


def test_pow2_scales_are_powers_of_two_and_cover_amax():
    torch.manual_seed(1)
    x = torch.randn(8, 256) * 3.7
    q, s = fq.quantize_1x128_reference(x, E4M3, pow2=True)
    m, e = torch.frexp(s)
    assert (m == 0.5).all()  # exactly a power of two
    assert (s * fq.FP8_MAX[E4M3] >= x.abs().view(8, 2, 128).amax(-1)).all()
    assert (s < 2 * fq.scale_from_amax(x.abs().view(8, 2, 128).amax(-1), E4M3)).all()


def test_dequantize_rejects_unknown_granularity():
    with pytest.raises(ValueError, match="granularity"):
        fq.dequantize(torch.zeros(2, 2, dtype=E4M3), torch.ones(()), "colwise")


@pytest.mark.parametrize("granularity", list(QUANT))
@pytest.mark.parametrize("shape,pow2", [((130, 200), False), ((37, 256), True)])  # partial tiles; aligned
def test_kernel_matches_reference(backend, granularity, pow2, shape):
    dev, _ = setup(backend)
    torch.manual_seed(2)
    x = (torch.randn(*shape) * torch.logspace(-2, 1, shape[1])).to(dev)
    if backend == "cuda":
        x = x.bfloat16()
    kernel, ref = QUANT[granularity]
    dtype = E5M2 if granularity == "rowwise" else E4M3
    q, s = kernel(x, dtype, pow2, impl="triton")
    qr, sr = ref(x, dtype, pow2)
    assert s.shape == sr.shape or s.numel() == sr.numel() == 1
    assert torch.equal(s.reshape(sr.shape), sr)
    assert torch.equal(q.view(torch.uint8), qr.view(torch.uint8))


def test_grouped_cols_reference_matches_float64():
    torch.manual_seed(3)
    counts = torch.tensor([16, 0, 48, 32])
    x = torch.randn(96, 40) * torch.logspace(-2, 1, 40)
    q_t, s = fq.quantize_grouped_cols_reference(x, counts, E4M3)
    assert q_t.shape == (40, 96) and s.shape == (4, 40)
    bounds = [0, 16, 16, 64, 96]
    for e in range(4):
        seg = x[bounds[e] : bounds[e + 1]].double()
        amax = seg.abs().amax(0) if seg.numel() else torch.zeros(40, dtype=torch.float64)
        assert torch.allclose(s[e].double(), amax.clamp(min=fq.AMAX_FLOOR) / 448.0, rtol=1e-6, atol=0)
        deq = q_t[:, bounds[e] : bounds[e + 1]].t().double() * s[e].double()
        assert ((deq - seg).abs() <= seg.abs() / 16 * (1 + 1e-6) + s[e].double() * 2**-9).all()


@pytest.mark.parametrize("cols", ["one pass", "two passes"])
def test_row_kernel_one_and_two_passes_match_reference(backend, cols):
    """Rows short enough to sit in registers are read once (fp8_quant._row_tiles), longer ones twice: both exact."""
    dev, _ = setup(backend)
    torch.manual_seed(9)
    short, long = (96, 300) if backend != "cuda" else (2048, 1536)
    C = short if cols == "one pass" else long
    assert fq._row_tiles(C, backend == "cuda")[1] == (cols == "one pass")
    x = (torch.randn(67, C) * torch.logspace(-2, 1, C)).to(dev)
    x[3] = 0.0
    if backend == "cuda":
        x = x.bfloat16()
    q, s = fq.quantize_rowwise(x, E4M3, impl="triton")
    qr, sr = fq.quantize_rowwise_reference(x, E4M3)
    assert torch.equal(s, sr) and torch.equal(q.view(torch.uint8), qr.view(torch.uint8))


@pytest.mark.parametrize("pow2", [False, True])
def test_grouped_cols_kernel_matches_reference(backend, pow2):
    dev, _ = setup(backend)
    torch.manual_seed(4)
    counts = torch.tensor([32, 0, 16, 80], device=dev)
    x = (torch.randn(128, 72) * torch.logspace(-2, 1, 72)).to(dev)
    if backend == "cuda":
        x = x.bfloat16()
    q, s = fq.quantize_grouped_cols(x, counts, E5M2, pow2, impl="triton")
    qr, sr = fq.quantize_grouped_cols_reference(x, counts, E5M2, pow2)
    assert torch.equal(s, sr)
    assert torch.equal(q.view(torch.uint8), qr.view(torch.uint8))


def test_grouped_cols_padded_output_equals_padding_first():
    """pad_to: the unpadded rows quantised straight into the padded layout equal padding the rows first."""
    torch.manual_seed(5)
    counts, padded = torch.tensor([5, 0, 16, 17]), torch.tensor([16, 0, 16, 48])  # slack on the last group
    x = torch.randn(38, 24)
    dst = fq.padded_positions(counts, padded, 38)
    assert dst.tolist() == list(range(5)) + list(range(16, 32)) + list(range(32, 49))
    xp = torch.zeros(80, 24).index_copy(0, dst, x)
    q, s = fq.quantize_grouped_cols_reference(x, counts, E4M3, pad_to=(padded, 80))
    qp, sp = fq.quantize_grouped_cols_reference(xp, padded, E4M3)
    assert torch.equal(s[[0, 2, 3]], sp[[0, 2, 3]])  # an empty group's scale is the floor either way
    assert torch.equal(q.view(torch.uint8), qp.view(torch.uint8))


@pytest.mark.parametrize("slack,aligned", [(0, True), (48, True), (37, False)])  # aligned: multiples of 16
def test_grouped_cols_kernel_pads_like_reference(backend, slack, aligned):
    dev, _ = setup(backend)
    torch.manual_seed(6)
    counts = torch.tensor([19, 0, 32, 5], device=dev)
    padded = (counts + 15) // 16 * 16
    padded[-1] += slack  # the fixed-bound padding of the sync-free path gives the slack to the last group
    P = int(padded.sum())
    x = (torch.randn(56, 72) * torch.logspace(-2, 1, 72)).to(dev)
    if backend == "cuda":
        x = x.bfloat16()
    q = fq.quantize_grouped_cols(x, counts, E4M3, impl="triton", pad_to=(padded, P), aligned=aligned)[0]
    qr, _ = fq.quantize_grouped_cols_reference(x, counts, E4M3, pad_to=(padded, P))
    assert q.shape == (72, P) and torch.equal(q.view(torch.uint8), qr.view(torch.uint8))


def test_grouped_cols_kernel_splits_long_groups(backend):
    """Groups long enough that the GPU launch splits each one's rows into chunks (their maxima merged after)."""
    if backend != "cuda":
        pytest.skip("the GPU split of long groups (the interpreter runs the small groups above in a few chunks)")
    dev, _ = setup(backend)
    torch.manual_seed(4)
    counts = torch.tensor([1040, 0, 3056, 16], device=dev)
    x = (torch.randn(4112, 200) * torch.logspace(-2, 1, 200)).to(dev).bfloat16()
    q, s = fq.quantize_grouped_cols(x, counts, E4M3, impl="triton")
    qr, sr = fq.quantize_grouped_cols_reference(x, counts, E4M3)
    assert torch.equal(s, sr) and torch.equal(q.view(torch.uint8), qr.view(torch.uint8))


@pytest.mark.parametrize("pow2", [False, True])
def test_transposed_kernel_matches_rowwise_of_the_transpose(backend, pow2):
    """x^T quantised rowwise by the column kernels in one group: bit for bit the row reference of x.t()."""
    dev, _ = setup(backend)
    torch.manual_seed(8)
    rows = 4112 if backend == "cuda" else 72  # the GPU splits a long group into chunks
    x = (torch.randn(rows, 200) * torch.logspace(-2, 1, 200)).to(dev)
    if backend == "cuda":
        x = x.bfloat16()
    q, s = fq.quantize_transposed(x, E4M3, pow2, impl="triton")
    qr, sr = fq.quantize_rowwise_reference(x.t(), E4M3, pow2)
    assert q.shape == (200, rows) and s.shape == (200, 1)
    assert torch.equal(s, sr) and torch.equal(q.view(torch.uint8), qr.view(torch.uint8))


def test_tile_kernel_reads_a_transposed_view(backend):
    dev, _ = setup(backend)
    torch.manual_seed(5)
    x = torch.randn(256, 200, device=dev)
    q, s = fq.quantize_1x128(x.t(), E4M3, impl="triton")
    qr, sr = fq.quantize_1x128_reference(x.t().contiguous(), E4M3)
    assert torch.equal(s, sr) and torch.equal(q.view(torch.uint8), qr.view(torch.uint8))


@pytest.mark.parametrize("granularity", ["rowwise", "1x128"])
@pytest.mark.parametrize("with_probs", [True, False])
@pytest.mark.parametrize("width", [64, 200])  # rowwise in one pass (the row in registers) and in two
def test_fused_swiglu_quantize_matches_unfused(backend, granularity, with_probs, width):
    """The fused SwiGLU (* probs) + quantisation kernel gives bit for bit the SwiGLU kernel's output quantised."""
    from moecore.kernels.swiglu import swiglu

    dev, dt = setup(backend)
    torch.manual_seed(7)
    if backend == "cuda":
        width *= 64  # 4096: one pass on the GPU; 12800: two
    h = (torch.randn(37, 2 * width) * 3).to(dev, dt)
    p = torch.rand(37, device=dev) if with_probs else None
    q, s = fq.swiglu_quantize(h, p, granularity)
    a = swiglu(h, p, impl="triton")
    quant = fq.quantize_rowwise if granularity == "rowwise" else fq.quantize_1x128
    qr, sr = quant(a, impl="triton")
    assert torch.equal(s, sr) and torch.equal(q.view(torch.uint8), qr.view(torch.uint8))
