"""FP8 primary weights gathered as FP8 bytes (moecore/parallel/fp8_gather.py): three gloo ranks each quantise
their shard of a flat bucket (uneven: the last one padded) with scales from one all-reduce of their groups' maxima,
and the gathered bytes and the scales equal, bit for bit, what quantising each whole weight gives
(moecore/models/fp8.quantize_primary, the rebuild the run uses otherwise)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from moecore.kernels.fp8_gemm import Fp8Recipe
from moecore.models.fp8 import quantize_primary
from moecore.parallel.dims import Group
from moecore.parallel.fp8_gather import fp8_bucket_params, quantize_shard, set_gathered
from moecore.parallel.launch import run_local

pytestmark = pytest.mark.distributed

# (shape, grouped): an expert tensor [E, N, K] (N a multiple of the 128 tile) and a linear's [N, K]; K is ragged
# for the 128x128 tiles, and the magnitudes differ by tile and expert so that every scale group has its own scale
# (the first ends before the second rank's shard starts, the last starts after it ends)
SHAPES = [((136, 72), False), ((3, 256, 200), True), ((2, 128, 40), True)]


def _masters() -> list[torch.Tensor]:
    """The fp32 master weights of SHAPES."""
    g = torch.Generator().manual_seed(0)
    return [
        torch.randn(shape, generator=g)
        * torch.logspace(-3, 1, shape[-1])
        * (1 + torch.arange(shape[0])).view(-1, *([1] * (len(shape) - 1)))
        for shape, _ in SHAPES
    ]


def _weights(recipe: Fp8Recipe) -> list[torch.nn.Parameter]:
    params = []
    for w, (_, grouped) in zip(_masters(), SHAPES):
        p = torch.nn.Parameter(w.to(torch.bfloat16))
        quantize_primary(p, w, recipe, grouped)  # from the fp32 values, rounded to bf16 first: the reference
        p.fp8_gemm_recipe = recipe
        params.append(p)
    return params


def _gather_worker(rank: int, world: int, scaling: str, pow2: bool) -> dict:
    recipe = Fp8Recipe(scaling, pow2=pow2)
    params = _weights(recipe)
    want = [(p.fp8_primary.q.clone(), p.fp8_primary.s.clone()) for p in params]
    flat = torch.cat([w.reshape(-1) for w in _masters()])  # the fp32 masters the weights were quantised from
    shard_size = -(-flat.numel() // world)
    flat = torch.nn.functional.pad(flat, (0, shard_size * world - flat.numel()))
    group = Group("dp", list(range(world)), rank, dist.group.WORLD)
    for p in params:  # what a previous step left: replaced below
        p.fp8_primary.q.zero_()
    q, scales = quantize_shard(params, rank * shard_size, flat[rank * shard_size : (rank + 1) * shard_size], group)
    full = q.new_empty(shard_size * world)
    dist.all_gather_into_tensor(full, q)
    off = 0
    for p in params:
        set_gathered(p, full[off : off + p.numel()], scales[p])
        off += p.numel()
    return {
        "selected": len(fp8_bucket_params(params)) == len(params),
        "equal": [
            torch.equal(p.fp8_primary.q.view(torch.uint8), wq.view(torch.uint8))
            and torch.equal(p.fp8_primary.s, ws)
            and p.fp8_primary.s.shape == ws.shape
            for p, (wq, ws) in zip(params, want)
        ],
    }


@pytest.mark.parametrize("scaling,pow2", [("blockwise", False), ("tensorwise", False), ("blockwise", True)])
def test_fp8_gather_equals_quantising_the_whole_weights(scaling, pow2):
    for rank_result in run_local(_gather_worker, 3, scaling, pow2):
        assert rank_result["selected"]
        assert all(rank_result["equal"]), rank_result["equal"]


def test_rowwise_primary_weights_are_gathered_in_bf16():
    """Rowwise primary weights hold two layouts (two bytes per element): not picked for the FP8 gather."""
    params = _weights(Fp8Recipe("rowwise"))
    assert fp8_bucket_params(params) == set()
