"""Checkpoint saving for the training loop, synchronous or asynchronous (`checkpoint.async_save`).

An asynchronous save copies the training state to host memory (the only part the step loop waits
for; the host buffers, pinned for GPU tensors, are kept for the next save), then writes it in a background thread: torch.distributed.checkpoint's `save` on a process
group of its own (gloo), the manifest and the `complete` marker after every rank's data is on disk
(fsynced), then the rename to `step-N/`. At most one save is in flight: a new save, the end of the
run and any early exit first wait for the previous one. Its own process group keeps the
background collectives apart from the training's.

Why not `dcp.async_save`: its staging turns our layout-free `CheckpointShard` wrappers into plain
tensors, and the manifest must be written after the data; the thread below does both with
`dcp.save` in a few lines.
"""

from __future__ import annotations

import threading
from pathlib import Path

import torch
import torch.distributed as dist

from moecore.checkpoint.state import (
    HostStager,
    begin_save,
    finish_save,
    layout_of,
    rng_state,
    state_for_save,
    write_state,
)


class CheckpointSaver:
    """Saves the training state; `async_save=True` overlaps the writing with the next steps."""

    def __init__(self, async_save: bool) -> None:
        self.async_save = async_save
        self.group = None  # the background saves' own gloo group, made at the first save (collective)
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self.stager = HostStager()  # host buffers reused by every asynchronous save
        self.steps_overlapped = 0  # train steps run while a save was being written (for tests and logs)

    @property
    def in_flight(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def wait(self) -> None:
        """Block until the save in flight (if any) is complete; re-raise its error."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            err, self._error = self._error, None
            raise err

    def note_step(self) -> None:
        if self.in_flight:
            self.steps_overlapped += 1

    def save(
        self, path: Path, model: torch.nn.Module, optimizer, extra: dict, config_yaml: str, keep_last: int | None
    ) -> Path:
        """Write a checkpoint to `path` (returns at once when asynchronous: call `wait` for durability)."""
        self.wait()
        if self.async_save and self.group is None and dist.is_available() and dist.is_initialized():
            self.group = dist.new_group(backend="gloo")  # every rank saves at the same step
        extra = {**extra, "rng": rng_state()}
        step, layout = extra.get("step"), layout_of(model)
        tmp = begin_save(path, config_yaml, self.group)
        if not self.async_save:
            state, shard = state_for_save(model, optimizer)
            write_state(tmp, state, shard, extra)
            return finish_save(tmp, path, step, layout, keep_last)
        state, shard = state_for_save(model, optimizer, self.stager)
        if torch.cuda.is_available():
            torch.cuda.synchronize()  # the (non-blocking) host copies are complete before the thread reads them

        def job() -> None:
            try:
                write_state(tmp, state, shard, extra, self.group)
                finish_save(tmp, path, step, layout, keep_last, self.group)
            except BaseException as e:  # re-raised by wait() in the training thread
                self._error = e

        self._thread = threading.Thread(target=job, name=f"moecore-save-{Path(path).name}", daemon=True)
        self._thread.start()
        return Path(path)
