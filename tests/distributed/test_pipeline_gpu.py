"""Pipeline parallel on GPUs with NCCL (the installed torch's pipelining API): pp2 and pp2 x ep2 from the CLI.

Run A: one GPU, fp32, 3 steps, checkpoint after step 1. Run B resumes A's step-1 checkpoint under
`torchrun --nproc-per-node N ... parallel.pp=2 [parallel.ep=2]` (N = 2 or 4 GPUs, same precision):
steps 2-3 must match A's loss and grad norm. fp32 on GPUs sums in another order than on one device
(cuBLAS, NCCL), so the bar is relative 1e-4 here (1e-5 on CPU, tests/distributed/test_pipeline.py).
A bf16 run of each schedule checks that the compute-precision path trains (finite, decreasing loss).
"""

from __future__ import annotations

import shutil
import sys

import pytest
import torch
from cli_runs import MULTI_GPU, metrics_by_step, run_cli

pytestmark = MULTI_GPU

COMMON = [
    "tiny-deepseek-v3",
    "train.steps=3",
    "train.global_batch_size=8",
    "train.micro_batch_size=2",
    "train.seq_length=64",
    "train.eval_interval=0",
    "log.interval=1",
    "log.progress=false",
    "log.tensorboard=false",
    "train.device=cuda",
]


@pytest.mark.parametrize("gpus, extra", [(2, []), (4, ["parallel.ep=2"])])
def test_gpu_pipeline_resumes_one_gpurun_cli(tmp_path, gpus, extra):
    if torch.cuda.device_count() < gpus:
        pytest.skip(f"needs {gpus} GPUs")
    a, b = tmp_path / "a", tmp_path / "b"
    fp32 = ["train.precision=fp32", "checkpoint.interval=1"]
    run_cli([sys.executable, "-m", "moecore", "train", *COMMON, *fp32, f"train.run_dir={a}"])
    shutil.copytree(a, b)
    for step in (2, 3):
        shutil.rmtree(b / "checkpoints" / f"step-{step}")
    (b / "metrics.jsonl").unlink()
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(gpus), "-m", "moecore", "train"]
    run_cli([*torchrun, *COMMON, *fp32, f"train.run_dir={b}", "checkpoint.resume=true", "parallel.pp=2", *extra])
    ref, got = metrics_by_step(a), metrics_by_step(b)
    assert sorted(got) == [2, 3]
    for step in (2, 3):
        for key in ("loss", "grad_norm", "mtp_loss"):
            assert abs(got[step][key] - ref[step][key]) <= 1e-4 * abs(ref[step][key]), (step, key)


@pytest.mark.parametrize("schedule", ["1f1b", "interleaved_1f1b", "zero_bubble", "zbv", "dualpipev"])
def test_gpu_pipeline_schedules_train_in_bf16(tmp_path, schedule):
    vpp = "1" if schedule == "1f1b" else "2"
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "-m", "moecore", "train"]
    run_cli(
        [
            *torchrun,
            *COMMON,
            "train.steps=6",
            "train.precision=bf16",
            f"train.run_dir={tmp_path}",
            "parallel.pp=2",
            f"parallel.vpp={vpp}",
            f"parallel.pp_schedule={schedule}",
        ]
    )
    m = metrics_by_step(tmp_path)
    assert all(v["loss"] == v["loss"] for v in m.values()) and m[6]["loss"] < m[1]["loss"]
