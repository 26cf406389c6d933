"""NVTX ranges: named regions for Nsight Systems on CUDA, and labels in torch.profiler traces.

A leaf module (torch only), so that layers of every package can mark their phases.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


@contextlib.contextmanager
def nvtx_range(name: str, enabled: bool | None = None) -> Iterator[None]:
    """An NVTX range on CUDA (`enabled=None`: when CUDA is available) that also labels torch.profiler traces.

    The torch.profiler label is made only while a profiler runs: a `record_function` costs the host more than
    the NVTX push and pop, on every call, and the MoE layer's forward opens eight of these."""
    use_nvtx = torch.cuda.is_available() if enabled is None else enabled
    profiling = torch._C._autograd._profiler_enabled()
    with torch.autograd.profiler.record_function(name) if profiling else contextlib.nullcontext():
        if use_nvtx:
            torch.cuda.nvtx.range_push(name)
        try:
            yield
        finally:
            if use_nvtx:
                torch.cuda.nvtx.range_pop()
