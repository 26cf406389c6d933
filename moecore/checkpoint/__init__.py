"""Checkpoints: the training state through torch.distributed.checkpoint, one folder per step, with a
manifest of checksums (integrity) and an optional asynchronous saver."""

from moecore.checkpoint.manifest import Verification, verify_checkpoint
from moecore.checkpoint.state import (
    checkpoint_dirs,
    find_resumable,
    latest_checkpoint,
    load_model_weights,
    load_training_state,
    require_intact,
    save_training_state,
)

__all__ = [
    "Verification",
    "checkpoint_dirs",
    "find_resumable",
    "latest_checkpoint",
    "load_model_weights",
    "load_training_state",
    "require_intact",
    "save_training_state",
    "verify_checkpoint",
]
