"""Run a function on N local processes with torch.distributed (gloo on CPU): tests and quick experiments.

`run_local(fn, world_size, *args)` forks `world_size` processes (so nothing is re-imported and the
arguments need no pickling), initialises a gloo process group through a file store in a fresh
temporary folder (no TCP port to collide with other runs), calls `fn(rank, world_size, *args)` on
each and returns the list of their return values. The parent collects its garbage before forking and the
ranks never collect what they inherited (a gloo process group's destructor would wait for threads fork did not
copy). If a rank raises, its traceback is re-raised in
the caller as a RuntimeError; ranks still waiting in a collective are terminated.

Production runs use torchrun (`moecore.parallel.dims.init_distributed`); this is the laptop path.
"""

from __future__ import annotations

import gc
import multiprocessing as mp
import os
import shutil
import tempfile
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist


def _worker(
    fn: Callable, rank: int, world_size: int, tmp: str, args: tuple, threads: int, process_group: bool = True
) -> None:
    # What the parent left for its garbage collector must not be collected here: a gloo process group's destructor
    # joins worker threads that fork did not copy, and would wait forever.
    gc.freeze()
    code = 0
    try:
        torch.set_num_threads(threads)
        if process_group:
            _init_group(rank, world_size, tmp)
        result = fn(rank, world_size, *args)
        torch.save(result, os.path.join(tmp, f"out-{rank}.pt"))
    except BaseException:  # report anything, including KeyboardInterrupt, to the parent
        with open(os.path.join(tmp, f"err-{rank}.txt"), "w") as f:
            f.write(traceback.format_exc())
        code = 1
    finally:
        try:
            if dist.is_initialized():
                dist.destroy_process_group()
        except Exception:
            pass
    os._exit(code)  # skip the parent's atexit handlers (pytest's, for instance) in the child


def _init_group(rank: int, world_size: int, tmp: str) -> None:
    dist.init_process_group(
        "gloo",
        init_method=f"file://{tmp}/store",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=120),
    )


def _warm_up() -> None:
    """Import lazily loaded torch modules once here, so that the forked ranks do not each import them."""
    import torch.distributed.tensor  # noqa: F401  (DTensor: used by checkpoints and torch.testing)

    x = torch.zeros(1, requires_grad=True)
    (x * 1.0).sum().backward()  # the first backward imports torch's symbolic-shape machinery


def run_local(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout_s: float = 300.0,
    threads: int = 1,
    process_group: bool = True,
) -> list[Any]:
    """fn(rank, world_size, *args) on `world_size` forked gloo processes; returns their results by rank.

    process_group=False: no process group is initialised (fn, e.g. a one-process training run, makes its own or
    none: what `moecore train` does without torchrun, without importing torch again)."""
    if world_size < 1:
        raise ValueError(f"world_size={world_size} is invalid: must be >= 1")
    _warm_up()
    gc.collect()  # destroy unreachable process groups here, where their threads exist (see _worker)
    tmp = tempfile.mkdtemp(prefix="moecore-dist-")
    ctx = mp.get_context("fork")
    procs = [
        ctx.Process(target=_worker, args=(fn, r, world_size, tmp, args, threads, process_group))
        for r in range(world_size)
    ]
    try:
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout_s
        while any(p.is_alive() for p in procs):
            failed = [r for r in range(world_size) if os.path.exists(os.path.join(tmp, f"err-{r}.txt"))]
            if failed or time.monotonic() > deadline:
                time.sleep(1.0)  # let the other ranks report their own errors
                break
            time.sleep(0.02)
        terminated = [p.is_alive() for p in procs]
        for p in procs:
            if p.is_alive():
                p.terminate()
            p.join()
        errors = []
        reported = [os.path.exists(os.path.join(tmp, f"err-{r}.txt")) for r in range(world_size)]
        for r, p in enumerate(procs):
            path = os.path.join(tmp, f"err-{r}.txt")
            if reported[r]:
                with open(path) as f:
                    errors.append(f"--- rank {r} ---\n{f.read()}")
            elif p.exitcode and not terminated[r]:  # died without a traceback: a signal (e.g. -11) or os._exit
                errors.append(f"--- rank {r} ---\nexited with code {p.exitcode} without an error report")
            elif terminated[r] and any(reported):
                errors.append(f"--- rank {r} ---\nstill running when another rank failed: terminated")
        if errors:
            raise RuntimeError("distributed run failed:\n" + "\n".join(errors))
        missing = [r for r in range(world_size) if not os.path.exists(os.path.join(tmp, f"out-{r}.pt"))]
        if missing:
            raise RuntimeError(
                f"distributed run did not finish within {timeout_s:.0f} s; ranks without result: {missing}"
            )
        return [torch.load(os.path.join(tmp, f"out-{r}.pt"), weights_only=False) for r in range(world_size)]
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        shutil.rmtree(tmp, ignore_errors=True)
