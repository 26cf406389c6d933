"""Profiling helpers: torch.profiler traces for chosen steps, NVTX ranges, CUDA memory snapshots on OOM.

- `Profiler(cfg.train.profile_steps, run_dir / "profile", rank)` records steps a..b (inclusive) with
  torch.profiler (CPU, and CUDA where present) and writes `trace_rank{r}_steps{a}-{b}.json` (open it in
  Perfetto or chrome://tracing) plus `summary_rank{r}.txt` (the top operators). The loop calls
  `step_begin(step)` / `step_end(step)` around each step; with `profile_steps=None` both are no-ops.
- `nvtx_range(name)` marks a region for Nsight Systems on CUDA (and as a `record_function` label inside
  torch.profiler traces); on CPU-only machines it costs next to nothing.
- `enable_oom_snapshot(out_dir, rank)` records the CUDA allocator's history and, on an out-of-memory error,
  writes `oom_snapshot_rank{r}.pickle`, which https://pytorch.org/memory_viz renders; `dump_memory_snapshot`
  writes one on demand. Both return False without CUDA.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from moecore.nvtx import nvtx_range  # noqa: F401  (re-exported: the profiling helpers in one place)


class Profiler:
    """torch.profiler over steps [a, b] of a run; a context manager that stops and exports on exit."""

    def __init__(
        self,
        profile_steps: list[int] | tuple[int, int] | None,
        out_dir: Path | str,
        rank: int = 0,
        record_shapes: bool = True,
        profile_memory: bool = True,
        with_stack: bool = False,
    ) -> None:
        self.steps = tuple(profile_steps) if profile_steps else None
        if self.steps is not None and (len(self.steps) != 2 or self.steps[0] > self.steps[1]):
            raise ValueError(f"train.profile_steps={list(self.steps)} is invalid: two step numbers [a,b] with a <= b")
        self.out_dir = Path(out_dir)
        self.rank = rank
        self._kwargs = dict(record_shapes=record_shapes, profile_memory=profile_memory, with_stack=with_stack)
        self._prof: torch.profiler.profile | None = None
        self.trace_path: Path | None = None

    @property
    def active(self) -> bool:
        return self._prof is not None

    def step_begin(self, step: int) -> None:
        """Call at the start of each step; starts recording at step a."""
        if self.steps is None or self._prof is not None or step != self.steps[0]:
            return
        activities = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self._prof = torch.profiler.profile(activities=activities, **self._kwargs)
        self._prof.start()

    def step_end(self, step: int) -> None:
        """Call at the end of each step; stops recording and writes the trace after step b."""
        if self._prof is None:
            return
        if step >= self.steps[1]:
            self._finish()

    def _finish(self) -> None:
        prof, self._prof = self._prof, None
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        prof.stop()
        self.out_dir.mkdir(parents=True, exist_ok=True)
        a, b = self.steps
        self.trace_path = self.out_dir / f"trace_rank{self.rank}_steps{a}-{b}.json"
        prof.export_chrome_trace(str(self.trace_path))
        sort = "self_cuda_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
        table = prof.key_averages().table(sort_by=sort, row_limit=40)
        (self.out_dir / f"summary_rank{self.rank}.txt").write_text(table)

    def __enter__(self) -> Profiler:
        return self

    def __exit__(self, *exc: object) -> None:
        if self._prof is not None:  # the run ended (or failed) inside the window: keep what was recorded
            self._finish()


def dump_memory_snapshot(path: Path | str) -> bool:
    """Write the CUDA allocator snapshot (with recorded history, if on) to `path`; False without CUDA."""
    if not torch.cuda.is_available():
        return False
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    torch.cuda.memory._dump_snapshot(str(path))
    return True


class _OomObserver:
    """The one out-of-memory observer of this process (torch keeps every attached observer for the process's
    life): each run points it at its own snapshot file, so a later run's error never writes into an earlier
    run's folder, and one error writes one snapshot."""

    def __init__(self) -> None:
        self.path: Path | None = None
        self.attached = False

    def __call__(self, device: int, alloc: int, device_alloc: int, device_free: int) -> None:
        if self.path is None:
            return
        dump_memory_snapshot(self.path)
        print(
            f"CUDA out of memory on device {device} (asked {alloc / 2**30:.2f} GiB, {device_free / 2**30:.2f} GiB free): "
            f"memory snapshot written to {self.path} (view it at https://pytorch.org/memory_viz)",
            file=sys.stderr,
        )


_OOM = _OomObserver()


def enable_oom_snapshot(out_dir: Path | str, rank: int = 0, max_entries: int = 100_000) -> bool:
    """Record allocator history and write a snapshot when CUDA runs out of memory; False without CUDA."""
    if not torch.cuda.is_available():
        return False
    _OOM.path = Path(out_dir) / f"oom_snapshot_rank{rank}.pickle"
    torch.cuda.memory._record_memory_history(max_entries=max_entries)
    if not _OOM.attached:
        torch._C._cuda_attach_out_of_memory_observer(_OOM)
        _OOM.attached = True
    return True


def disable_oom_snapshot() -> None:
    """Stop recording allocator history and writing snapshots (the observer stays attached, idle)."""
    _OOM.path = None
    if torch.cuda.is_available():
        torch.cuda.memory._record_memory_history(enabled=None)
