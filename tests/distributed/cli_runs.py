"""Running `moecore train` (alone or under torchrun) from tests, and reading its metrics.jsonl."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

# The marks of a test that needs several CUDA GPUs (NCCL runs under torchrun).
MULTI_GPU = [
    pytest.mark.gpu,
    pytest.mark.distributed,
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs"),
]

# A known intermittent defect (seen once in ~15 launches of a 4-process gloo run): a rank aborts in C++ after
# rank 0 reported the finished run. `run_cli(..., retry_dir=...)` repeats such a launch once.
TEARDOWN_ABORT = "terminate called without an active exception"


def run_cli(
    args: list[str], timeout: int = 600, threads: int | None = 1, retry_dir: Path | None = None
) -> subprocess.CompletedProcess:
    """Run the command; fail the test with the output's tail unless it exits 0.

    `threads`: OMP_NUM_THREADS of the processes (None: inherited). `retry_dir`: the run folder, removed and the
    command repeated once when a finished run ends in TEARDOWN_ABORT (a second one fails the test).
    """
    env = dict(os.environ) if threads is None else dict(os.environ, OMP_NUM_THREADS=str(threads))
    proc = subprocess.run(args, env=env, capture_output=True, text=True, timeout=timeout)
    out = proc.stdout + proc.stderr
    if proc.returncode != 0 and retry_dir is not None and TEARDOWN_ABORT in out and "done: " in out:
        shutil.rmtree(retry_dir, ignore_errors=True)
        proc = subprocess.run(args, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def _train_one_process(rank: int, world: int, recipe: str, overrides: list[str]) -> None:
    from moecore.config import load_config
    from moecore.train.loop import train

    train(load_config(recipe, overrides))


def train_forked(args: list[str]) -> None:
    """`moecore train RECIPE OVERRIDES...` (args as the command line takes them) in one forked process: the same
    run as the command, without starting Python and importing torch again (a few seconds per run on 2 cores)."""
    from moecore.parallel.launch import run_local

    run_local(_train_one_process, 1, args[0], list(args[1:]), process_group=False)


def read_metrics(run_dir: Path) -> list[dict]:
    """Every record of the run's metrics.jsonl, in order."""
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines() if line.strip()]


def metrics_by_step(run_dir: Path, having: str | None = None) -> dict[int, dict]:
    """The records by step; with `having`, only those that carry that key (e.g. the training records)."""
    return {m["step"]: m for m in read_metrics(run_dir) if having is None or having in m}
