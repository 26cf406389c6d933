"""`run_local`, the forked gloo launcher of the tests: what the parent process leaves behind must not hang its ranks."""

from __future__ import annotations

import gc

import pytest
import torch.distributed as dist

from moecore.parallel.launch import run_local

pytestmark = pytest.mark.distributed


def _collect(rank: int, world: int) -> int:
    gc.collect()
    return rank


def test_ranks_survive_a_process_group_the_parent_left_to_its_garbage_collector():
    """A gloo process group that only a reference cycle keeps (a trainer of an earlier test, say) is destroyed by
    the next garbage collection. In a forked rank its destructor would join the parent's gloo threads, which fork
    does not copy, and wait forever; run_local collects in the parent before forking."""
    enabled = gc.isenabled()
    gc.disable()  # keep the cycle alive until the launch, whatever the collector's timing
    try:
        group = dist.ProcessGroupGloo(dist.HashStore(), 0, 1)
        cycle: list = [group]
        cycle.append(cycle)
        del group, cycle
        assert run_local(_collect, 2, timeout_s=60) == [0, 1]
    finally:
        if enabled:
            gc.enable()
