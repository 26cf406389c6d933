"""moecore's Triton grouped GEMMs against loops of torch matmuls (float64), for every schedule and layout."""

from __future__ import annotations

import pytest
import torch

from moecore.kernels.grouped_gemm import (
    TileConfig,
    group_bounds,
    group_bounds_reference,
    grouped_mm,
    grouped_mm_reference,
    grouped_wgrad,
    grouped_wgrad_reference,
    tile_starts,
    tile_starts_reference,
)
from tests.kernels.conftest import rel_err, setup

# (persistent, tma): one tile per program, persistent, persistent with TMA loads, one tile per program with TMA
SCHEDULES = [(False, False), (True, False), (True, True), (False, True)]
SCHEDULE_IDS = ["grid", "persistent", "persistent-tma", "grid-tma"]


def _bounds(counts: list[int], dev) -> torch.Tensor:
    b = torch.zeros(len(counts) + 1, dtype=torch.int32)
    b[1:] = torch.cumsum(torch.tensor(counts), 0)
    return b.to(dev)


def _config(backend: str, persistent: bool, tma: bool) -> TileConfig:
    if backend == "cuda":
        return TileConfig(64, 128, 64, 4, 4, 3, persistent, tma)
    return TileConfig(16, 32, 16, 2, 4, 2, persistent, tma)


def _counts(backend: str) -> list[int]:
    # empty experts first, inside and last; groups shorter than a tile, exactly one tile, and ragged
    small = [0, 3, 17, 40, 0, 1, 16, 33, 0]
    return small if backend == "interpret" else [c * 13 for c in small] + [64, 0, 257]


def test_tile_starts_number_each_experts_tiles():
    bounds = _bounds([0, 3, 17, 0, 32, 1], "cpu")
    assert tile_starts(bounds, 16).tolist() == [0, 0, 1, 3, 3, 5, 6]


@pytest.mark.parametrize("num_experts", [1, 6, 600])
def test_tile_starts_kernel_matches_reference(backend, num_experts):
    dev, _ = setup(backend)
    g = torch.Generator().manual_seed(num_experts)
    counts = torch.randint(0, 300, (num_experts,), generator=g)
    counts[::3] = 0  # empty experts, the first among them
    bounds = _bounds(counts.tolist(), dev)
    for block_m in (16, 64, 128):
        got = tile_starts(bounds, block_m, impl="triton")
        assert got.dtype == torch.int32
        assert torch.equal(got.cpu(), tile_starts_reference(bounds.cpu(), block_m))


@pytest.mark.parametrize("num_experts", [1, 6, 600])
def test_group_bounds_kernel_matches_reference(backend, num_experts):
    dev, _ = setup(backend)
    g = torch.Generator().manual_seed(num_experts)
    counts = torch.randint(0, 3000, (num_experts,), generator=g)
    counts[::3] = 0
    assert group_bounds_reference(torch.tensor([3, 0, 5])).tolist() == [0, 3, 3, 8]
    for dtype in (torch.int64, torch.int32):
        got = group_bounds(counts.to(dev, dtype), impl="triton")
        assert got.dtype == torch.int32
        assert torch.equal(got.cpu(), group_bounds_reference(counts))


def test_references_match_per_row_formula():
    g = torch.Generator().manual_seed(1)
    counts = [2, 0, 3]
    bounds = _bounds(counts, "cpu")
    a = torch.randn(5, 4, generator=g, dtype=torch.float64)
    b = torch.randn(3, 6, 4, generator=g, dtype=torch.float64)
    out = grouped_mm_reference(a, b, bounds, trans_b=True)
    expert = torch.repeat_interleave(torch.arange(3), torch.tensor(counts))
    for r in range(5):
        assert torch.allclose(out[r], b[expert[r]] @ a[r])
    c = torch.randn(5, 2, generator=g, dtype=torch.float64)
    w = grouped_wgrad_reference(a, c, bounds)
    assert torch.count_nonzero(w[1]) == 0
    assert torch.allclose(w[2], sum(torch.outer(a[r], c[r]) for r in range(2, 5)))


@pytest.mark.parametrize("persistent,tma", SCHEDULES, ids=SCHEDULE_IDS)
@pytest.mark.parametrize("trans_b", [True, False], ids=["nt", "nn"])
def test_grouped_mm_matches_reference(backend, persistent, tma, trans_b):
    dev, dt = setup(backend)
    g = torch.Generator().manual_seed(2)
    counts = _counts(backend)
    E, M = len(counts), sum(counts)
    K, N = (48, 40) if backend == "interpret" else (192, 320)
    a = torch.randn(M, K, generator=g).to(dev, dt)
    b = (torch.randn(E, N, K, generator=g) if trans_b else torch.randn(E, K, N, generator=g)).to(dev, dt)
    bounds = _bounds(counts, dev)
    out = grouped_mm(a, b, bounds, trans_b, _config(backend, persistent, tma))
    ref = grouped_mm_reference(a.double(), b.double(), bounds, trans_b)
    assert out.dtype == dt and out.shape == (M, N)
    assert rel_err(out, ref) < (1e-2 if dt == torch.bfloat16 else 1e-6)


def test_grouped_mm_reduction_not_a_multiple_of_the_block(backend):
    dev, dt = setup(backend)
    g = torch.Generator().manual_seed(3)
    counts = _counts(backend)
    E, M = len(counts), sum(counts)
    K, N = (40, 24) if backend == "interpret" else (200, 136)  # K % block_k != 0: the masked loads
    a = torch.randn(M, K, generator=g).to(dev, dt)
    b = torch.randn(E, N, K, generator=g).to(dev, dt)
    bounds = _bounds(counts, dev)
    out = grouped_mm(a, b, bounds, True, _config(backend, True, True))
    ref = grouped_mm_reference(a.double(), b.double(), bounds, True)
    assert rel_err(out, ref) < (1e-2 if dt == torch.bfloat16 else 1e-6)


@pytest.mark.parametrize("persistent,tma", SCHEDULES, ids=SCHEDULE_IDS)
def test_grouped_wgrad_matches_reference(backend, persistent, tma):
    dev, dt = setup(backend)
    g = torch.Generator().manual_seed(4)
    counts = _counts(backend)
    M = sum(counts)
    N1, N2 = (24, 40) if backend == "interpret" else (192, 320)
    a = torch.randn(M, N1, generator=g).to(dev, dt)
    b = torch.randn(M, N2, generator=g).to(dev, dt)
    bounds = _bounds(counts, dev)
    out = grouped_wgrad(a, b, bounds, torch.float32, _config(backend, persistent, tma))
    ref = grouped_wgrad_reference(a, b, bounds)
    for e, n in enumerate(counts):
        if n == 0:
            assert torch.count_nonzero(out[e]) == 0, e
        else:
            assert rel_err(out[e], ref[e]) < (1e-2 if dt == torch.bfloat16 else 1e-6), e


def test_grouped_mm_rejects_mismatched_reduction():
    a = torch.zeros(4, 8)
    with pytest.raises(ValueError, match="reduction dimension"):
        grouped_mm(a, torch.zeros(2, 5, 7), _bounds([2, 2], "cpu"), True, TileConfig())


@pytest.mark.parametrize("mode", ["minimal", "chunked"])
def test_low_memory_experts_through_triton_gemms_match_torchs(backend, mode):
    """moe.activation_memory=minimal / chunked with the GEMMs planned on moecore's Triton kernels (chunked: weight
    gradients written into slices) gives what it gives with torch._grouped_mm (fp32 in the interpreter: summation
    orders only; bf16 on the GPU)."""
    from moecore.kernels.grouped_ffn import GemmPlan
    from moecore.moe.chunked import chunked_experts
    from moecore.moe.minimal import minimal_experts

    dev, dt = setup(backend)
    g = torch.Generator().manual_seed(7)
    T, H, F, E, K = (24, 32, 16, 5, 2) if backend == "interpret" else (512, 256, 128, 8, 2)
    x = torch.randn(T, H, generator=g).to(dev, dt)
    w13 = (torch.randn(E, 2 * F, H, generator=g) * 0.2).to(dev, dt)
    w2 = (torch.randn(E, H, F, generator=g) * 0.2).to(dev, dt)
    idx = torch.randn(T, E, generator=g).topk(K, dim=-1).indices.to(dev)
    weight = torch.rand(T, K, generator=g).to(dev, dt)
    dy = torch.randn(T, H, generator=g).to(dev, dt)
    res = []
    for plan in (GemmPlan(), GemmPlan.uniform("triton")):
        ts = [t.clone().requires_grad_() for t in (x, w13, w2, weight)]
        if mode == "chunked":
            y, _ = chunked_experts(ts[0], idx, ts[3], ts[1], ts[2], chunk_rows=T * K // 3, plan=plan)
        else:
            y, _ = minimal_experts(ts[0], idx, ts[3], ts[1], ts[2], plan=plan)
        y.backward(dy)
        res.append([y] + [t.grad for t in ts])
    for got, want in zip(res[1], res[0]):
        assert rel_err(got, want) < (1e-2 if dt == torch.bfloat16 else 1e-5)


def test_grouped_wgrad_writes_into_a_slice_only(backend):
    """`out=`: the kernel fills a contiguous slice of a larger gradient (moe.activation_memory=chunked) and
    touches nothing outside it."""
    dev, dt = setup(backend)
    g = torch.Generator().manual_seed(5)
    counts = [3, 0, 20]
    a = torch.randn(23, 24, generator=g).to(dev, dt)
    b = torch.randn(23, 40, generator=g).to(dev, dt)
    full = torch.full((5, 24, 40), 7.0, device=dev)
    got = grouped_wgrad(a, b, _bounds(counts, dev), torch.float32, _config(backend, True, False), out=full[1:4])
    assert got.data_ptr() == full[1].data_ptr()
    ref = grouped_wgrad_reference(a, b, _bounds(counts, "cpu"))
    assert rel_err(full[1], ref[0]) < 1e-2 and rel_err(full[3], ref[2]) < 1e-2
    assert torch.count_nonzero(full[2]) == 0 and (full[0] == 7).all() and (full[4] == 7).all()
    with pytest.raises(ValueError, match="contiguous"):
        grouped_wgrad(a, b, _bounds(counts, dev), torch.float32, TileConfig(), out=full[1:4, :, :20])


def test_persistent_launch_size_does_not_follow_the_rows():
    """The program count is a compile-time constant of the kernels: persistent launches use one count for every
    problem size, so that rows that change with the routing never recompile them."""
    from moecore.kernels.grouped_gemm import _programs

    cfg = TileConfig(persistent=True)
    assert {_programs(torch.device("cpu"), n, cfg) for n in (1, 3, 4, 5, 1000)} == {4}
    assert _programs(torch.device("cpu"), 7, TileConfig(persistent=False)) == 7
