"""Stop signals and non-finite steps: SIGTERM saves the step in progress and exits 75; a NaN run ends
with one line and exit code 3; `train.on_nonfinite=skip` skips, counts, and stops after too many in a row."""

from __future__ import annotations

import math
import os
import signal
import sys
import time

import pytest
import torch
from reliability_common import TINY, logged_losses

from moecore.checkpoint import verify_checkpoint
from moecore.cli import main
from moecore.config import load_config
from moecore.train.guards import NonFiniteError, StepGuard
from moecore.train.loop import Trainer
from moecore.train.signals import EXIT_PREEMPTED


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGUSR1"])
def test_stop_signal_saves_the_step_in_progress_and_exits_75(tmp_path, sig):
    run = tmp_path / "run"
    log = tmp_path / "stderr.txt"
    pid = os.fork()
    if pid == 0:  # the training, as `moecore train` runs it
        code = 1
        try:
            sys.stdout = sys.stderr = open(log, "w", buffering=1)  # noqa: SIM115  (pytest captures the parent's)
            torch.set_num_threads(1)
            code = main(["train", "tiny-moe", *TINY, "train.steps=100000", f"train.run_dir={run}"])
        finally:
            sys.stderr.flush()
            os._exit(code)
    deadline = time.monotonic() + 120
    metrics = run / "metrics.jsonl"
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 3):
        assert time.monotonic() < deadline, log.read_text()[-2000:]
        time.sleep(0.05)
    os.kill(pid, getattr(signal, sig))
    _, status = os.waitpid(pid, 0)
    err = log.read_text()
    assert os.waitstatus_to_exitcode(status) == EXIT_PREEMPTED, err[-2000:]
    last = max(logged_losses(run))
    assert err.strip().splitlines()[-1] == (
        f"moecore: stopped by {sig} after step {last}; checkpoint {run / 'checkpoints' / f'step-{last}'} saved; "
        f"resume with checkpoint.resume=true (exit code {EXIT_PREEMPTED})"
    )
    assert "Traceback" not in err
    assert [p.name for p in (run / "checkpoints").iterdir()] == [f"step-{last}"]
    assert verify_checkpoint(run / "checkpoints" / f"step-{last}").ok


def test_nan_run_ends_with_one_line(tmp_path, capsys):
    run = tmp_path / "run"
    args = [*TINY, "train.steps=20", "optim.lr=1e4", "optim.warmup_steps=0", "checkpoint.interval=1"]
    assert main(["train", "tiny-moe", *args, f"train.run_dir={run}"]) == 3
    err = capsys.readouterr().err
    assert "Traceback" not in err
    line = err.strip().splitlines()[-1]
    assert line.startswith("moecore: error: non-finite loss or gradients at step ")
    step = int(line.split("at step ")[1].split()[0])
    assert f"newest checkpoint {run / 'checkpoints' / f'step-{step - 1}'} " in line
    assert step - 1 == max(logged_losses(run))  # the bad step is neither applied nor saved


def _nan_at(monkeypatch, steps) -> None:
    """Make the loss of the given steps NaN, as the guard sees it."""
    check = StepGuard.check

    def poisoned(self, step, lm_sum, grad_norm):
        return check(self, step, lm_sum * math.nan if step in steps else lm_sum, grad_norm)

    monkeypatch.setattr(StepGuard, "check", poisoned)


@pytest.mark.parametrize("precision", ["fp32", "fp16"])  # fp16: the loss scaler's step is closed on a skip
def test_skip_mode_skips_and_counts(tmp_path, monkeypatch, precision):
    _nan_at(monkeypatch, {3})
    args = [*TINY, "train.steps=6", "train.on_nonfinite=skip", f"train.precision={precision}"]
    cfg = load_config("tiny-moe", [*args, f"train.run_dir={tmp_path}"])
    trainer = Trainer(cfg)
    result = trainer.run()
    assert result.last_step == 6
    rows = {s: r for s, r in _rows(tmp_path).items()}
    assert [rows[s]["skipped_steps"] for s in range(1, 7)] == [0, 0, 1, 1, 1, 1]
    assert rows[3].get("skipped") == 1 and all("skipped" not in rows[s] for s in (1, 2, 4, 5, 6))
    assert all(math.isfinite(rows[s]["loss"]) for s in (4, 5, 6))
    if precision == "fp32":  # 6 steps, one update skipped: AdamW took 5 steps (fp16's scaler may skip more)
        steps = {float(st["step"]) for st in trainer.optimizer.state.values()}
        assert steps == {5.0}


def test_skip_mode_stops_after_too_many_in_a_row(tmp_path, monkeypatch):
    _nan_at(monkeypatch, set(range(3, 100)))
    args = [*TINY, "train.steps=10", "train.on_nonfinite=skip", "train.max_skipped_steps=2"]
    with pytest.raises(NonFiniteError, match="at step 5 .*3 non-finite steps in a row, more than train.max_skipped"):
        Trainer(load_config("tiny-moe", [*args, f"train.run_dir={tmp_path}"])).run()


def _rows(run_dir) -> dict[int, dict]:
    import json

    return {r["step"]: r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())}


@pytest.mark.parametrize(
    "override, word",
    [
        ("train.on_nonfinite=ignore", "train.on_nonfinite='ignore' is invalid: allowed: error | skip"),
        ("train.max_skipped_steps=0", "train.max_skipped_steps=0 is invalid: must be in [1, inf]"),
        ("train.stop_signals=[SIGKILL]", "train.stop_signals='SIGKILL' is invalid: allowed: SIGTERM"),
        ("train.stop_signals=SIGTERM", "train.stop_signals='SIGTERM' is invalid: expected a list"),
    ],
)
def test_bad_reliability_settings_are_one_line(override, word, capsys):
    assert main(["train", override]) == 2
    err = capsys.readouterr().err
    assert word in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("norm", [1.0, math.inf, math.nan])
def test_fp16_overflow_is_decided_by_the_global_norm(norm):
    """A rank whose own gradients are finite skips the step and lowers its scale as the overflowing rank does when
    the global gradient norm is not finite (otherwise replicated weights would part between ranks)."""
    from moecore.train.runtime import Runtime

    p = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([p], lr=0.5)
    scaler = torch.amp.GradScaler("cpu", init_scale=8.0)
    rt = Runtime(dims=None, device=torch.device("cpu"), autocast_dtype=torch.float16, scaler=scaler, precision="fp16")
    rt._optimizer = opt
    (scaler.scale(torch.ones(())) * p.sum()).backward()  # this rank's gradient is finite
    scaler.unscale_(opt)
    rt.agree_on_overflow(norm)
    scaler.step(opt)
    scaler.update()
    finite = math.isfinite(norm)
    assert torch.equal(p.detach(), torch.full((3,), 0.5 if finite else 1.0))
    assert scaler.get_scale() == (8.0 if finite else 4.0)
