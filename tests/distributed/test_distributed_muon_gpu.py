"""Distributed Muon and QK-Clip on GPUs with NCCL, from the CLI: the same steps as one GPU.

Run A: one GPU, fp32, Muon with `optim.muon_qk_clip` (tau below the tiny model's logits, so heads are
rescaled), 3 steps. Runs B: `torchrun --nproc-per-node 2` with tp2, with the distributed optimizer
(dp2) and with FSDP (dp2), same options: each step's loss and grad norm must match A's. fp32 on GPUs
sums in another order than on one device (cuBLAS, NCCL), so the bar is relative 1e-4 here (1e-5 on
CPU, tests/distributed/test_distributed_muon.py). The layouts start from A's weights (the seeded
initialisation is layout-independent for dense and expert parallel layouts without pp).
"""

from __future__ import annotations

import sys

import pytest
from cli_runs import MULTI_GPU, metrics_by_step, run_cli

pytestmark = MULTI_GPU

COMMON = [
    "tiny-moe",
    "train.steps=3",
    "train.global_batch_size=8",
    "train.micro_batch_size=2",
    "train.seq_length=64",
    "train.eval_interval=0",
    "log.interval=1",
    "log.progress=false",
    "log.tensorboard=false",
    "train.device=cuda",
    "train.precision=fp32",
    "checkpoint.interval=0",
    "optim.name=muon",
    "optim.muon_qk_clip=0.05",
]


@pytest.mark.parametrize("extra", [["parallel.tp=2"], ["parallel.distributed_optimizer=true"], ["parallel.fsdp=true"]])
def test_gpu_distributed_muon_matches_one_gpu(tmp_path, extra):
    a, b = tmp_path / "a", tmp_path / "b"
    run_cli([sys.executable, "-m", "moecore", "train", *COMMON, f"train.run_dir={a}"])
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "-m", "moecore", "train"]
    run_cli([*torchrun, *COMMON, f"train.run_dir={b}", *extra])
    ref, got = metrics_by_step(a, having="loss"), metrics_by_step(b, having="loss")
    assert sorted(got) == [1, 2, 3] and ref[1]["attn/max_logit"] > 0.05
    for step in (1, 2, 3):
        for key in ("loss", "grad_norm", "attn/max_logit"):
            assert abs(got[step][key] - ref[step][key]) <= 1e-4 * abs(ref[step][key]), (step, key)
