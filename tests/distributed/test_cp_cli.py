"""The CLI under torchrun with context parallel: tiny-deepseek-v3 (MLA, MTP, experts) on 4 gloo processes,
parallel.cp=2 x parallel.ep=2 (so dp 2 for attention, edp 2 for experts).

Run A (one process) trains 2 steps and validates after the second. Run B (torchrun, cp2 x ep2) trains
the same 2 steps from the same seed, checkpointing after each: its losses, gradient norms and validation
loss must equal A's. Run C resumes B's step-1 checkpoint with the same layout: its step 2 must equal B's.
"""

from __future__ import annotations

import shutil
import sys

import pytest
from cli_runs import read_metrics, run_cli, train_forked

pytestmark = pytest.mark.distributed

COMMON = [
    "tiny-deepseek-v3",
    "train.steps=2",
    "train.global_batch_size=4",
    "train.micro_batch_size=2",
    "train.seq_length=64",
    "train.eval_interval=2",
    "train.eval_iters=1",
    "log.interval=1",
    "log.progress=false",
    "log.tensorboard=false",
    "model.hidden_size=64",
    "model.num_layers=2",
]


def _close(got: dict, ref: dict, keys=("loss", "grad_norm", "mtp_loss", "val_loss")) -> None:
    for k in keys:
        if k not in ref:  # validation runs at step 2 only
            continue
        assert abs(got[k] - ref[k]) <= 1e-5 * abs(ref[k]), (got["step"], k, ref[k], got[k])


def test_torchrun_context_parallel_trains_and_resumes(tmp_path):
    a, b, c = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    run_cli([sys.executable, "-m", "moecore", "train", *COMMON, "checkpoint.interval=0", f"train.run_dir={a}"])
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4", "-m", "moecore", "train"]
    layout = ["parallel.cp=2", "parallel.ep=2", "checkpoint.interval=1"]
    proc = run_cli([*torchrun, *COMMON, *layout, f"train.run_dir={b}"], retry_dir=b)
    assert (proc.stdout + proc.stderr).count("done: ") == 1  # rank 0 alone reports
    ref, got = read_metrics(a), read_metrics(b)
    assert [m["step"] for m in got] == [1, 2] and "val_loss" in ref[1]
    for r, g in zip(ref, got):
        _close(g, r)
        assert g["moe/layer_1/tokens_per_expert"] == r["moe/layer_1/tokens_per_expert"]  # counted over cp x dp
    shutil.copytree(b, c)
    shutil.rmtree(c / "checkpoints" / "step-2")
    (c / "metrics.jsonl").unlink()
    run_cli([*torchrun, *COMMON, *layout, f"train.run_dir={c}", "checkpoint.resume=true"])
    resumed = read_metrics(c)
    assert [m["step"] for m in resumed] == [2]
    _close(resumed[0], got[1])
    assert (c / "checkpoints" / "step-2" / "complete").exists()


def test_torchrun_context_parallel_with_fsdp_trains_and_its_checkpoint_resumes_one_process(tmp_path):
    """cp2 x ep2 with FSDP2 (4 gloo processes): the one-process run's losses; its run resumed from the step-1
    checkpoint (weights and optimizer state written from DTensor shards) in one process without FSDP or CP
    reaches the same step 2."""
    a, d, e = tmp_path / "a", tmp_path / "d", tmp_path / "e"
    train_forked([*COMMON, "checkpoint.interval=0", f"train.run_dir={a}"])
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4", "-m", "moecore", "train"]
    layout = ["parallel.cp=2", "parallel.ep=2", "parallel.fsdp=true", "checkpoint.interval=1"]
    run_cli([*torchrun, *COMMON, *layout, f"train.run_dir={d}"], retry_dir=d)
    ref, got = read_metrics(a), read_metrics(d)
    assert [m["step"] for m in got] == [1, 2]
    for r, g in zip(ref, got):
        _close(g, r)
    shutil.copytree(d, e)
    shutil.rmtree(e / "checkpoints" / "step-2")
    (e / "metrics.jsonl").unlink()
    train_forked([*COMMON, "checkpoint.interval=0", f"train.run_dir={e}", "checkpoint.resume=true"])
    resumed = [m for m in read_metrics(e) if "loss" in m]
    assert [m["step"] for m in resumed] == [2]
    _close(resumed[0], got[1], keys=("loss", "mtp_loss", "val_loss"))
