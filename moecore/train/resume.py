"""Which checkpoint `checkpoint.resume=true` continues from, and the resume cases that need a word.

The newest checkpoint of `train.run_dir` that passes its manifest check is used; every newer one
that does not (interrupted, truncated, corrupt) is skipped with a one-line warning. Then:
- no intact checkpoint: a note, and the run starts from step 0;
- the checkpoint is at or past `train.steps`: a note that the run is complete, nothing is trained;
- `train.exit_interval` at or before the checkpoint's step: a ConfigError (nothing would train).
A checkpoint whose tensor shapes do not fit the model is refused when loading (moecore.checkpoint).
"""

from __future__ import annotations

from pathlib import Path

from moecore.checkpoint.state import find_resumable, note, step_of
from moecore.config import Config, ConfigError


def resolve_resume(cfg: Config) -> Path | None:
    """The intact checkpoint to resume from (None: start fresh); collective over the ranks (verification)."""
    if not cfg.checkpoint.resume:
        return None
    run_dir = Path(cfg.train.run_dir)
    path, skipped = find_resumable(run_dir)
    for line in skipped:
        note(f"warning: {line}")
    if path is None:
        if skipped:
            note(f"warning: no intact checkpoint in {run_dir}; training starts from step 0")
        return None
    if skipped:
        note(f"resuming from {path}")
    step = step_of(path)
    if step >= cfg.train.steps:
        note(f"note: the run in {run_dir} is complete ({path.name}, train.steps={cfg.train.steps}); nothing to train")
    elif cfg.train.exit_interval is not None and cfg.train.exit_interval <= step:
        raise ConfigError(
            f"train.exit_interval={cfg.train.exit_interval} is invalid: the run resumes after step {step} "
            f"({path}); set a later step (<= train.steps={cfg.train.steps}) or drop it"
        )
    return path
