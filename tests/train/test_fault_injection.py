"""Fault injection: a run killed with SIGKILL at random moments (mid-step, mid-save, mid-rename) always
resumes, and the resumed losses equal the uninterrupted run's bit for bit.

Each trial forks the training (so no interpreter start-up per trial), waits until the child has saved a
seeded random step (none for step 0), kills it after a further random delay of up to one and a half steps
of the reference run (so the kill lands mid-step, mid-save or mid-rename), then resumes in this process
with `checkpoint.resume=true`. The wait is anchored to the child's own progress, not to the parent's
clock, so a slow machine still spreads the kills over the run. The reference run is computed once.
"""

from __future__ import annotations

import os
import random
import signal
import time
from pathlib import Path

import torch
from reliability_common import TINY

from moecore.config import load_config
from moecore.train.loop import train

STEPS, TRIALS = 8, 10


def _cfg(run_dir, *extra):
    args = [*TINY, f"train.steps={STEPS}", "checkpoint.interval=1", f"train.run_dir={run_dir}", *extra]
    return load_config("tiny-moe", args)


def _train_in_child(run_dir) -> int:
    pid = os.fork()
    if pid:
        return pid
    code = 1
    try:
        fd = os.open(os.path.join(run_dir, "child.log"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        torch.set_num_threads(1)
        train(_cfg(run_dir))
        code = 0
    finally:
        os._exit(code)


def _wait_for_save(pid: int, saved: Path, timeout: float = 120.0) -> bool:
    """Poll until the child has renamed `saved` into place; False if the child exited first."""
    deadline = time.perf_counter() + timeout
    while not saved.is_dir():
        if os.waitpid(pid, os.WNOHANG)[0]:
            return False
        assert time.perf_counter() < deadline, f"the child did not save {saved.name} in {timeout:.0f} s"
        time.sleep(0.001)
    return True


def test_kill_9_at_random_points_always_resumes_exactly(tmp_path):
    # One intra-op thread here as in the forked children (forking a multi-threaded OpenMP runtime can hang):
    # CPU reductions round differently with another thread count, and bit equality is the claim.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        _trials(tmp_path)
    finally:
        torch.set_num_threads(threads)


def _trials(tmp_path) -> None:
    start = time.perf_counter()
    reference = dict(train(_cfg(tmp_path / "reference")).losses)
    duration = time.perf_counter() - start
    rng = random.Random(18)
    resumed_from = []
    for trial in range(TRIALS):
        run = tmp_path / f"trial-{trial}"
        run.mkdir()
        checkpoints = run / "checkpoints"
        after_step = rng.randrange(STEPS)
        pid = _train_in_child(run)
        alive = _wait_for_save(pid, checkpoints / f"step-{after_step}") if after_step else True
        if alive:
            time.sleep(rng.uniform(0.0, 1.5 * duration / STEPS))
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        done = (
            sorted(int(p.name[5:]) for p in checkpoints.glob("step-*") if p.name[5:].isdigit())
            if checkpoints.is_dir()
            else []
        )
        resumed_from.append(done[-1] if done else 0)
        result = train(_cfg(run, "checkpoint.resume=true"))
        assert result.last_step == STEPS, f"trial {trial}: resumed run stopped at {result.last_step}"
        for step, loss in result.losses:
            assert loss == reference[step], f"trial {trial}: step {step} resumed {loss!r} != {reference[step]!r}"
    # The kills landed at different points of the run, not all before the first or after the last save.
    assert len(set(resumed_from)) >= 3, resumed_from
