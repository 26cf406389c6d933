"""Tensor parallel for MLA (+ MTP), DSA and gated DeltaNet on GPUs with NCCL, from the CLI: tp2 against one GPU.

Run A: one GPU, fp32, 3 steps. Run B: the same under `torchrun --nproc-per-node 2 ... parallel.tp=2` (sequence
parallel on). Both start from the same seeded weights (moecore/models/init.py), so their losses and grad norms
must agree; fp32 on GPUs sums in another order than on one device (cuBLAS, NCCL, the Triton kernels of the
gated delta rule and of sparse MLA on each rank's heads), so the bar is relative 1e-4 here, as in
test_pipeline_gpu.py (1e-5 on CPU: test_tp_attention_parity.py).
"""

from __future__ import annotations

import sys

import pytest
from cli_runs import MULTI_GPU, metrics_by_step, run_cli

pytestmark = MULTI_GPU

COMMON = [
    "train.steps=3",
    "train.global_batch_size=8",
    "train.micro_batch_size=2",
    "train.seq_length=256",
    "train.eval_interval=0",
    "train.precision=fp32",
    "train.device=cuda",
    "log.interval=1",
    "log.progress=false",
    "log.tensorboard=false",
    "checkpoint.interval=0",
]


@pytest.mark.parametrize("recipe", ["tiny-deepseek-v3", "tiny-deepseek-v32", "tiny-qwen3-next"])
def test_gpu_tp2_matches_one_gpu(tmp_path, recipe):
    a, b = tmp_path / "a", tmp_path / "b"
    run_cli([sys.executable, "-m", "moecore", "train", recipe, *COMMON, f"train.run_dir={a}"])
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"]
    run_cli([*torchrun, "-m", "moecore", "train", recipe, *COMMON, "parallel.tp=2", f"train.run_dir={b}"])
    ma, mb = metrics_by_step(a, having="grad_norm"), metrics_by_step(b, having="grad_norm")
    assert sorted(ma) == sorted(mb) == [1, 2, 3]
    for step in (1, 2, 3):
        for key in ("loss", "grad_norm"):
            want, got = ma[step][key], mb[step][key]
            assert abs(got - want) <= 1e-4 * abs(want), (recipe, step, key, got, want)
