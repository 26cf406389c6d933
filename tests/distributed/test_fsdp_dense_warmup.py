"""DSA's dense_warmup under parallel.fsdp=true: the same training as one process.

dense_warmup freezes every parameter but the lightning indexers', whose only gradient comes from the indexer's KL
loss, so a decoder layer's output carries no gradient. FSDP2 gathers a layer's weights again for backward from a
hook on that output; `FullyShardedModel` therefore shards each indexer as a unit of its own (`trainable_islands`),
whose output does carry gradients. Two runs of the tiny DeepSeek-V3.2 recipe, 3 steps each, bf16: one process without
FSDP, and 2 gloo ranks (dp2) with FSDP. The logged losses and gradient norms match within the bf16 tolerance of the
optimizer tests, the indexers moved the same way (their difference <= 5% of how far they moved), and every frozen
weight is the initial one in both runs (bit for bit in bf16, the frozen weights' compute dtype). The bytes each FSDP
rank logs are those `moecore plan` counts.
"""

from __future__ import annotations

import pytest
import torch
from test_distributed_optimizer import BF16_TOL
from test_distributed_optimizer_train import _metrics, _rel

from moecore.config import load_config
from moecore.hf.convert import load_model_checkpoint
from moecore.parallel.launch import run_local
from moecore.plan.layout import layout_of
from moecore.plan.params import precision_mode, state_bytes
from moecore.train.loop import Trainer, train

pytestmark = pytest.mark.distributed

COMMON = [
    "model.dsa_stage=dense_warmup",
    "train.precision=bf16",
    "train.seq_length=16",
    "train.global_batch_size=4",
    "train.micro_batch_size=2",
    "train.steps=3",
    "train.eval_interval=0",
    "train.device=cpu",
    "log.interval=1",
    "log.progress=false",
    "log.tensorboard=false",
    "checkpoint.interval=3",
]


def _train(rank: int, world: int, overrides: list[str]) -> None:
    train(load_config("tiny-deepseek-v32", [*COMMON, *overrides]))


def _weights(run_dir) -> dict[str, torch.Tensor]:
    model, _ = load_model_checkpoint(run_dir / "checkpoints" / "step-3", torch.float32)
    return {k: v.detach() for k, v in model.named_parameters()}


def _initial_weights(run_dir) -> dict[str, torch.Tensor]:
    """The weights a one-process run starts from (the trainer's seeded initialisation), in fp32."""
    trainer = Trainer(load_config("tiny-deepseek-v32", [*COMMON, f"train.run_dir={run_dir}"]))
    return {k: v.detach().float().clone() for k, v in trainer.model.named_parameters()}


def test_dense_warmup_with_fsdp_matches_one_process(tmp_path):
    a, d = tmp_path / "a", tmp_path / "d"
    w0 = _initial_weights(tmp_path / "init")
    _train(0, 1, [f"train.run_dir={a}"])
    run_local(_train, 2, [f"train.run_dir={d}", "parallel.fsdp=true"])
    ma, md = _metrics(a), _metrics(d)
    assert [m["step"] for m in md] == [1, 2, 3]
    for key in ("loss", "grad_norm", "indexer_loss"):
        err = _rel([m[key] for m in md], [m[key] for m in ma])
        print(f"dense_warmup, dp2 fsdp vs one process: {key} {err:.1e}")
        assert err <= BF16_TOL

    wa, wd = _weights(a), _weights(d)
    indexers = [k for k in wa if ".indexer." in k]
    assert indexers, "the tiny recipe has lightning indexers"
    for k in indexers:
        # the runs' indexers differ by bf16 summation orders, amplified by Adam where gradients are near zero (the
        # key norms' biases, measured up to 3.4% of their displacement); a missed or partial update would be ~100%
        moved = (wa[k] - w0[k]).norm()
        assert moved > 0, k
        assert (wd[k] - wa[k]).norm() <= 0.05 * moved, k
    # one process keeps a frozen weight in bf16 only (no master copy); FSDP keeps its fp32 shard: the same bf16 value
    frozen = [k for k in wa if k not in indexers]
    assert frozen and all(torch.equal(wa[k], w0[k]) for k in frozen)
    assert all(torch.equal(wd[k].bfloat16(), w0[k].bfloat16()) for k in frozen)

    # `moecore plan` counts what each FSDP rank holds: the indexers' shards with gradients and moments, the frozen
    # weights' fp32 shards alone (the logged bytes add the optimizer's 4-byte step counters)
    cfg = load_config("tiny-deepseek-v32", [*COMMON, "parallel.fsdp=true"])
    cfg.model.vocab_size = len(w0["embed.weight"])
    layout = layout_of(cfg, 2)
    planned = state_bytes(cfg, layout, 0, precision_mode(cfg, layout, micro_batches=2, device="cpu"))
    logged = {k: round(md[-1][f"memory/{k}_gb"] * 2**30) for k in ("params", "grads", "optim")}
    assert logged["params"] == planned["params"] and logged["grads"] == planned["grads"], (logged, planned)
    assert 0 <= logged["optim"] - planned["optimizer"] <= 4 * len(indexers), (logged, planned)


@pytest.mark.parametrize("stage", ["dense_warmup", "sparse"])
def test_trainable_islands_are_the_indexers_in_dense_warmup(stage: str) -> None:
    from moecore.models.dsa import LightningIndexer
    from moecore.models.transformer import MoETransformer
    from moecore.parallel.fsdp import trainable_islands

    cfg = load_config("tiny-deepseek-v32", [f"model.dsa_stage={stage}", "model.vocab_size=64"])
    model = MoETransformer(cfg)
    indexers = [m for m in model.modules() if isinstance(m, LightningIndexer)]
    islands = trainable_islands(model)
    assert islands == (indexers if stage == "dense_warmup" else [])  # the MTP block's indexer among them
    assert len(indexers) == cfg.model.num_layers + cfg.model.mtp_num_layers
