"""Learning-rate schedules: linear warm-up, then cosine, WSD, linear or constant.

All schedules are pure functions of the step (1-based: the step about to be taken), so resuming
needs only the step number. WSD (warm-up, stable, decay; Hu et al. 2024, MiniCPM) holds the peak
rate and decays linearly to `min_lr` over the last `wsd_decay_fraction` of the steps.
"""

from __future__ import annotations

import math

from moecore.config import OptimConfig


def lr_at(step: int, total_steps: int, cfg: OptimConfig) -> float:
    """The learning rate for optimizer step `step` (1-based) of a run of `total_steps`."""
    if cfg.warmup_steps and step <= cfg.warmup_steps:
        return cfg.lr * step / cfg.warmup_steps
    if cfg.schedule == "constant":
        return cfg.lr
    decay_steps = max(1, total_steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / decay_steps)
    if cfg.schedule == "cosine":
        return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1 + math.cos(math.pi * progress))
    if cfg.schedule == "linear":
        return cfg.lr + (cfg.min_lr - cfg.lr) * progress
    # wsd
    decay_start = total_steps - int(round(cfg.wsd_decay_fraction * total_steps))
    if step <= decay_start:
        return cfg.lr
    frac = (step - decay_start) / max(1, total_steps - decay_start)
    return cfg.lr + (cfg.min_lr - cfg.lr) * min(1.0, frac)
