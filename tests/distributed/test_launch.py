"""`run_local`, the forked gloo launcher of the tests: what the parent process leaves behind must not hang its ranks,
and a rank that dies without a traceback is reported."""

from __future__ import annotations

import gc
import os
import threading

import pytest

from moecore.parallel.launch import run_local

pytestmark = pytest.mark.distributed

DIED_IN_CHILD = 17  # the exit code of a rank whose destructor found no parent thread to answer it


def _answer(request: threading.Event, reply: threading.Event) -> None:
    request.wait()
    reply.set()


class _NeedsParentThread:
    """An object whose destructor waits for a thread of the process that made it, as a gloo process group's joins
    its worker threads. fork copies the object but not the thread: destroyed in a forked rank, it would wait forever
    (here it gives up after 10 s and ends the rank with DIED_IN_CHILD)."""

    def __init__(self) -> None:
        self.pid = os.getpid()
        self.request, self.reply = threading.Event(), threading.Event()
        # the thread holds the events, not the object: only the cycle keeps the object alive
        threading.Thread(target=_answer, args=(self.request, self.reply), daemon=True).start()

    def __del__(self) -> None:
        self.request.set()
        if not self.reply.wait(timeout=10.0) and os.getpid() != self.pid:
            os._exit(DIED_IN_CHILD)


def _collect(rank: int, world: int) -> int:
    gc.collect()
    return rank


def test_ranks_survive_an_object_the_parent_left_to_its_garbage_collector():
    """An object that only a reference cycle keeps (a trainer of an earlier test, with its process group, say) is
    destroyed by the next garbage collection. In a forked rank its destructor would wait for the parent's threads;
    run_local collects in the parent before forking, and the ranks never collect what they inherited."""
    enabled = gc.isenabled()
    gc.disable()  # keep the cycle alive until the launch, whatever the collector's timing
    try:
        cycle: list = [_NeedsParentThread()]
        cycle.append(cycle)
        del cycle
        assert run_local(_collect, 2, timeout_s=60) == [0, 1]
    finally:
        if enabled:
            gc.enable()


def _die_on_rank_one(rank: int, world: int) -> int:
    if rank == 1:
        os._exit(5)  # no traceback, no result
    return rank


def test_a_rank_that_dies_without_a_traceback_is_named():
    with pytest.raises(RuntimeError, match="rank 1 ---\nexited with code 5 without an error report"):
        run_local(_die_on_rank_one, 2, timeout_s=60)
