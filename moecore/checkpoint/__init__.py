"""Checkpoints: the training state through torch.distributed.checkpoint, one folder per step."""

from moecore.checkpoint.state import (
    checkpoint_dirs,
    latest_checkpoint,
    load_model_weights,
    load_training_state,
    save_training_state,
)

__all__ = ["checkpoint_dirs", "latest_checkpoint", "load_model_weights", "load_training_state", "save_training_state"]
