"""On a GPU, the real recipes train with their default precision on the fused kernels.

Real widths, few layers: qwen3-30b-a3b, qwen3-next-80b-a3b and gpt-oss-20b at 2 layers (gpt-oss also with
moe.activation_memory=minimal), deepseek-v3 at 2 layers (one dense, one MoE, plus its MTP layer) and
deepseek-v4-flash at 2 layers (one of each compressed kind), both with 16 experts so they fit one GPU. Every MoE
layer must have run the fused expert FFN (or the configured low-memory Function) on bf16 weights in every step (no
loop over experts, no fp32 expert GEMM), the optimizer must be the fused mixed-precision AdamW on fp32 masters, and
the loss must fall.
"""

from __future__ import annotations

import gc

import pytest
import torch

from moecore.config import load_config
from moecore.moe.experts import GroupedExperts
from moecore.optim.fused_adamw import FusedAdamW
from moecore.train.loop import Trainer

pytestmark = pytest.mark.gpu

CASES = {
    "qwen3-30b-a3b": ["model.num_layers=2"],
    "qwen3-next-80b-a3b": ["model.num_layers=2", "model.layer_types=[linear_attention,full_attention]"],
    # vocabulary 32768 (the embedded tokenizer's 4096 ids fit): with the recipe's 129280 (an embedding and a head
    # of 0.93B parameters each) the case ran out of memory on an 80 GB H100
    "deepseek-v3": [
        "model.num_layers=2",
        "moe.first_k_dense_replace=1",
        "moe.num_experts=16",
        "model.vocab_size=32768",
    ],
    # biased experts with the clamped SwiGLU, sinks, a sliding and a full layer
    "gpt-oss-20b": [
        "model.num_layers=2",
        "model.layer_types=[sliding_attention,full_attention]",
        "model.vocab_size=32768",
    ],
    # the same through the low-memory expert Function (biases and the clamped form inside it)
    "gpt-oss-20b/minimal": [
        "model.num_layers=2",
        "model.layer_types=[sliding_attention,full_attention]",
        "model.vocab_size=32768",
        "moe.activation_memory=minimal",
    ],
    # the real-size compressed attention (both kinds) and hyper-connections, a hash-routed layer, clipped SwiGLU
    "deepseek-v4-flash": [
        "model.num_layers=2",
        "model.layer_types=[heavily_compressed_attention,compressed_sparse_attention]",
        "moe.num_hash_layers=1",
        "moe.num_experts=16",
        "model.vocab_size=32768",
    ],
}
COMMON = [
    "parallel.ep=1",
    "train.global_batch_size=2",
    "train.micro_batch_size=1",
    "train.seq_length=1024",
    "train.steps=8",
    "optim.warmup_steps=0",
    "log.progress=false",
    "log.tensorboard=false",
]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("recipe", list(CASES))
def test_recipe_trains_on_fused_kernels(recipe, tmp_path):
    overrides = CASES[recipe]
    cfg = load_config(recipe.split("/")[0], overrides + COMMON + [f"train.run_dir={tmp_path}"])
    path = cfg.moe.activation_memory if cfg.moe.activation_memory != "standard" else "fused"
    trainer = Trainer(cfg)
    try:
        assert isinstance(trainer.optimizer, FusedAdamW)
        experts = [m for m in trainer.model.modules() if isinstance(m, GroupedExperts)]
        assert experts
        losses = []
        for _ in range(8):
            for m in experts:
                m.last_path = None
            losses.append(trainer.train_step(with_moe_metrics=False)["loss"])
            for m in experts:
                assert m.last_path == path, f"{m.name} ran {m.last_path}"
                assert m.w13.dtype == m.w2.dtype == torch.bfloat16
        assert min(losses[-3:]) < losses[0] - 0.1, losses
    finally:
        trainer.rt.shutdown()
        del trainer
        gc.collect()
        torch.cuda.empty_cache()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize(
    "precision", [[], ["train.precision=fp8"], ["train.precision=fp8", "fp8.recipe=blockwise"]],
    ids=["default", "fp8-rowwise", "fp8-blockwise"],
)  # fmt: skip
def test_training_steps_do_not_recompile_kernels(precision, tmp_path):
    """The routing changes every step, and with it the rows per expert (padded, for FP8). No kernel may be
    compiled again for that: once the first steps have compiled what a step runs, later steps compile nothing.
    (A program count passed as a compile-time constant recompiled the blockwise GEMM every step: 2.9 s each.)"""
    pytest.importorskip("triton")
    from tests.compiled_kernels import all_compiled_variants

    cfg = load_config("qwen3-30b-a3b", CASES["qwen3-30b-a3b"] + COMMON + precision + [f"train.run_dir={tmp_path}"])
    trainer = Trainer(cfg)
    try:
        counts = []
        for _ in range(6):
            trainer.train_step(with_moe_metrics=False)
            counts.append(all_compiled_variants())
        assert counts[2] > 0 and counts[-1] == counts[2], counts  # > 0: the steps ran Triton kernels
    finally:
        trainer.rt.shutdown()
        del trainer
        gc.collect()
        torch.cuda.empty_cache()
