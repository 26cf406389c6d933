"""The CLI under torchrun with context parallel: tiny-deepseek-v3 (MLA, MTP, experts) on 4 gloo processes,
parallel.cp=2 x parallel.ep=2 (so dp 2 for attention, edp 2 for experts).

Run A (one process) trains 2 steps and validates after the second. Run B (torchrun, cp2 x ep2) trains
the same 2 steps from the same seed, checkpointing after each: its losses, gradient norms and validation
loss must equal A's. Run C resumes B's step-1 checkpoint with the same layout: its step 2 must equal B's.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

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


TEARDOWN_ABORT = "terminate called without an active exception"


def _run(args: list[str], run_dir=None) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(args, env=env, capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    if proc.returncode != 0 and run_dir is not None and TEARDOWN_ABORT in out and "done: " in out:
        # Known intermittent defect (seen once in ~15 launches of this 4-process gloo run): a rank aborts in
        # C++ after rank 0 reported the finished run. It is not what this test checks; the launch is
        # repeated once from a clean run folder, and a second abort fails the test.
        shutil.rmtree(run_dir, ignore_errors=True)
        proc = subprocess.run(args, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def _metrics(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def _close(got: dict, ref: dict, keys=("loss", "grad_norm", "mtp_loss", "val_loss")) -> None:
    for k in keys:
        if k not in ref:  # validation runs at step 2 only
            continue
        assert abs(got[k] - ref[k]) <= 1e-5 * abs(ref[k]), (got["step"], k, ref[k], got[k])


def test_torchrun_context_parallel_trains_and_resumes(tmp_path):
    a, b, c = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    _run([sys.executable, "-m", "moecore", "train", *COMMON, "checkpoint.interval=0", f"train.run_dir={a}"])
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4", "-m", "moecore", "train"]
    layout = ["parallel.cp=2", "parallel.ep=2", "checkpoint.interval=1"]
    proc = _run([*torchrun, *COMMON, *layout, f"train.run_dir={b}"], run_dir=b)
    assert (proc.stdout + proc.stderr).count("done: ") == 1  # rank 0 alone reports
    ref, got = _metrics(a), _metrics(b)
    assert [m["step"] for m in got] == [1, 2] and "val_loss" in ref[1]
    for r, g in zip(ref, got):
        _close(g, r)
        assert g["moe/layer_1/tokens_per_expert"] == r["moe/layer_1/tokens_per_expert"]  # counted over cp x dp
    shutil.copytree(b, c)
    shutil.rmtree(c / "checkpoints" / "step-2")
    (c / "metrics.jsonl").unlink()
    _run([*torchrun, *COMMON, *layout, f"train.run_dir={c}", "checkpoint.resume=true"])
    resumed = _metrics(c)
    assert [m["step"] for m in resumed] == [2]
    _close(resumed[0], got[1])
    assert (c / "checkpoints" / "step-2" / "complete").exists()
