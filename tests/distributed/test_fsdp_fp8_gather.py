"""FP8 primary weights under FSDP2 (moecore/parallel/fsdp_fp8.py): three gloo ranks each hold a shard of dim 0 of
every weight (FSDP2's uneven chunks: one rank holds none of the smallest; a 128x128 tile straddles two shards), and
the weight FSDP2 all-gathers is the FP8 copy — bytes and scales equal, bit for bit, to quantising the whole weight
(moecore/models/fp8.quantize_primary, what the run uses without FSDP). The shards keep their fp32 values for the
optimizer and are saved as plain tensors."""

from __future__ import annotations

import io
import math

import pytest
import torch
import torch.distributed as dist

from moecore.kernels.fp8_gemm import Fp8Recipe
from moecore.models.fp8 import quantize_primary
from moecore.parallel.launch import run_local

pytestmark = pytest.mark.distributed

# name: (shape, grouped). Over 3 ranks FSDP2 splits dim 0 as 46/46/44 rows (the first 128-row tile spans all three),
# 1/1/1 experts and 1/1/0 experts (the third rank holds nothing of "small")
SHAPES = {"linear": ((136, 72), False), "experts": ((3, 256, 200), True), "small": ((2, 128, 40), True)}


def _masters() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        name: torch.randn(shape, generator=g)
        * torch.logspace(-3, 1, shape[-1])
        * (1 + torch.arange(shape[0])).view(-1, *([1] * (len(shape) - 1)))
        for name, (shape, _) in SHAPES.items()
    }


def _worker(rank: int, world: int, scaling: str, pow2: bool) -> dict:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from moecore.parallel.fsdp_fp8 import Fp8GatheredWeight, Fp8ShardedWeight, gather_as_fp8

    recipe = Fp8Recipe(scaling, pow2=pow2)
    masters = _masters()
    module = torch.nn.Module()
    for name, w in masters.items():
        p = torch.nn.Parameter(w.clone())
        p.fp8_gemm_recipe = recipe
        setattr(module, name, p)
    assert sorted(gather_as_fp8(module)) == sorted(SHAPES)
    mesh = DeviceMesh.from_group(dist.group.WORLD, "cpu")
    fully_shard(module, mesh=mesh, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))
    local = {name: p.to_local() for name, p in module.named_parameters()}
    result = {
        "wrapped": all(isinstance(t, Fp8ShardedWeight) and t.hp_shard.dtype == torch.float32 for t in local.values()),
        "shard_rows": [t.shape[0] for t in local.values()],
        # the shard's values are the fp32 masters' rows (FSDP2's chunk of dim 0)
        "values": all(
            torch.equal(
                t.hp_shard, masters[n].chunk(world)[rank] if rank < len(masters[n].chunk(world)) else t.hp_shard
            )
            for n, t in local.items()
        ),
    }
    # a checkpoint of the shard holds the plain fp32 tensor
    buf = io.BytesIO()
    torch.save({n: t for n, t in local.items()}, buf)
    buf.seek(0)
    saved = torch.load(buf, weights_only=True)
    result["saved_plain"] = all(type(t) is torch.Tensor and t.dtype == torch.float32 for t in saved.values())
    equal = {}
    for step in range(2):  # the second gather refills the first one's buffers in place
        module.unshard()
        for name, (shape, grouped) in SHAPES.items():
            w = getattr(module, name)
            ref = torch.nn.Parameter(masters[name].to(torch.bfloat16))
            quantize_primary(ref, masters[name], recipe, grouped)
            got = w.fp8_primary if isinstance(w, Fp8GatheredWeight) else None
            equal[f"{step}/{name}"] = (
                got is not None
                and type(got) is type(ref.fp8_primary)
                and got.gran == ref.fp8_primary.gran
                and torch.equal(got.q.view(torch.uint8), ref.fp8_primary.q.view(torch.uint8))
                and got.s.shape == ref.fp8_primary.s.shape
                and torch.equal(got.s, ref.fp8_primary.s)
                and w.shape == shape
                and w.dtype == torch.bfloat16
            )
        module.reshard()
        # an optimizer step: every weight scaled by 2 (its scales double, its bytes stay). The local tensors are
        # read again: at its first gather FSDP2 re-pads an uneven shard into storage of its own
        with torch.no_grad():
            for name, p in module.named_parameters():
                p.to_local().hp_shard.mul_(2)
                masters[name].mul_(2)
    result["equal"] = equal
    return result


@pytest.mark.parametrize("scaling,pow2", [("blockwise", False), ("tensorwise", False), ("blockwise", True)])
def test_fsdp_gathers_the_fp8_copy_of_the_whole_weight(scaling, pow2):
    for rank, got in enumerate(run_local(_worker, 3, scaling, pow2)):
        assert got["wrapped"] and got["values"] and got["saved_plain"], got
        assert got["shard_rows"] == [[46, 46, 44][rank], 1, [1, 1, 0][rank]], got["shard_rows"]
        assert all(got["equal"].values()), got["equal"]


@pytest.mark.parametrize(
    "recompute",
    [[], ["model.recompute_granularity=selective", "model.recompute_modules=[moe_act,norm]"]],
    ids=["", "recompute"],
)
def test_fsdp_run_computes_with_the_gathered_fp8_copies(tmp_path, recompute):
    """`moecore train ... parallel.fsdp=true fp8.primary_weights=true` (one process: FSDP2 over a one-rank mesh):
    every FP8 GEMM weight is gathered as FP8, and the layers compute with the gathered copy (also where selective
    recomputation's saved-tensor hooks see the gathered weights)."""
    from moecore.config import load_config
    from moecore.moe.experts import GroupedExperts
    from moecore.parallel.fsdp_fp8 import Fp8GatheredWeight
    from moecore.train.loop import Trainer

    dims = ["model.hidden_size=128", "model.ffn_hidden_size=128", "moe.ffn_hidden_size=128"]
    dims += ["moe.shared_expert_intermediate_size=128", "model.num_attention_heads=2", "model.num_kv_heads=2"]
    run = ["train.device=cpu", "train.seq_length=16", "train.global_batch_size=2", "train.micro_batch_size=1"]
    run += ["log.progress=false", "log.tensorboard=false", "moe.num_experts=4", "moe.first_k_dense_replace=1"]
    fp8 = ["train.precision=fp8", "fp8.emulate=true", "fp8.recipe=blockwise", "fp8.primary_weights=true"]
    cfg = load_config("tiny-moe", dims + run + fp8 + recompute + ["parallel.fsdp=true", f"train.run_dir={tmp_path}"])
    trainer = Trainer(cfg)
    try:
        gathered = trainer.rt.grad_reducer.fp8_gathered
        assert any(n.endswith("experts.w13") for n in gathered) and any(n.endswith("q_proj.weight") for n in gathered)
        seen = []
        for m in trainer.model.modules():
            if isinstance(m, GroupedExperts):
                m.register_forward_pre_hook(lambda mod, _: seen.append(type(mod.w13)))
        loss = trainer.train_step()["loss"]
        assert seen and all(t is Fp8GatheredWeight for t in seen), seen
        assert math.isfinite(loss), loss
    finally:
        trainer.rt.shutdown()
