"""The step guard: non-finite loss or gradients, and the per-step agreement of every rank.

Once per optimizer step, after the gradient norm and before the update, `StepGuard.check` reduces
two flags over all ranks in one small all-reduce (max): "my loss or gradients are not finite" and
"I received a stop signal" (moecore/train/signals.py). Every rank thus takes the same decision:

- `train.on_nonfinite=error` (default): stop with `NonFiniteError`, one line naming the step, the
  loss, the gradient norm and the newest checkpoint; the CLI exits with `EXIT_NONFINITE` (3);
- `train.on_nonfinite=skip`: drop the step's update (no optimizer step; the step counter, data
  position and LR schedule still advance), count it (`skipped_steps` in the metrics) and stop as
  above once more than `train.max_skipped_steps` steps in a row were non-finite.

Under fp16 loss scaling an infinite gradient is the scaler's business (it skips the step and lowers
the scale), so only the loss is checked there.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
import torch.distributed as dist

from moecore.config import TrainConfig
from moecore.optim.schedule import lr_at

EXIT_NONFINITE = 3


class NonFiniteError(FloatingPointError):
    """Training met a non-finite loss or gradient; the message is one line meant to be shown as is."""

    exit_code = EXIT_NONFINITE


def agree(flags: list[bool], device: torch.device) -> list[bool]:
    """Each flag OR-ed over every rank (one all-reduce); the flags themselves with one process."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return list(flags)
    t = torch.tensor([float(f) for f in flags], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return [bool(v) for v in t.tolist()]


class StepGuard:
    """Per-step checks of the training loop; see the module docstring."""

    def __init__(self, cfg: TrainConfig, device: torch.device, run_dir: Path, stop=None, saver=None, scaler=None):
        self.mode = cfg.on_nonfinite
        self.max_skipped = cfg.max_skipped_steps
        self.device = device
        self.run_dir = Path(run_dir)
        self.stop = stop  # moecore.train.signals.StopRequest or None
        self.saver = saver  # waited for before naming the newest checkpoint
        self.scaler = scaler
        self.skipped_total = 0
        self.skipped_in_row = 0
        self.stop_now = False

    def check(self, step: int, lm_sum: torch.Tensor, grad_norm: float) -> bool:
        """Called once per step before the update on every rank; True: skip this step's update."""
        local_bad = not bool(torch.isfinite(lm_sum).item())
        if self.scaler is None and not math.isfinite(float(grad_norm)):
            local_bad = True
        bad, stop = agree([local_bad, bool(self.stop is not None and self.stop.requested)], self.device)
        self.stop_now = self.stop_now or stop
        if not bad:
            self.skipped_in_row = 0
            return False
        if self.mode == "skip":
            self.skipped_total += 1
            self.skipped_in_row += 1
            if self.skipped_in_row <= self.max_skipped:
                return True
            raise NonFiniteError(
                self._message(
                    step,
                    grad_norm,
                    f"; {self.skipped_in_row} non-finite steps in a row, more than "
                    f"train.max_skipped_steps={self.max_skipped}",
                )  # fmt: skip
            )
        raise NonFiniteError(self._message(step, grad_norm, ""))

    def _message(self, step: int, grad_norm: float, why: str) -> str:
        from moecore.checkpoint import latest_checkpoint

        if self.saver is not None:
            self.saver.wait()
        newest = latest_checkpoint(self.run_dir)
        where = f"newest checkpoint {newest}" if newest is not None else "no checkpoint yet"
        return (
            f"non-finite loss or gradients at step {step} (grad norm {grad_norm:.4g}){why}; {where} "
            "(resume with checkpoint.resume=true, e.g. with a lower optim.lr; or train.on_nonfinite=skip)"
        )

    def skip_step(self, trainer, lm_sum: torch.Tensor, global_tokens: torch.Tensor, grad_norm: float) -> dict:
        """Finish a skipped step without touching the weights; returns its metrics."""
        rt = trainer.rt
        if rt.scaler is not None:  # fp16: close the scaler's step (its unscale_ ran in the clip); lowers the scale
            rt.scaler.update()
        for moe_layer in trainer.model.moe_layers():
            moe_layer.update_expert_bias()  # token counts are finite: the bias moves as on any step
        trainer.step += 1
        loss = (rt.sum_over_dp(lm_sum) / global_tokens).item()
        lr = lr_at(trainer.step, trainer.cfg.train.steps, trainer.cfg.optim)  # what the step would have used
        return {"loss": loss, "lr": lr, "grad_norm": float(grad_norm), "tokens": int(global_tokens.item()),
                "skipped": 1}  # fmt: skip
