"""Where the kernel tests run the Triton kernels.

`backend` is "cuda" on a GPU machine (tests marked gpu, skipped without CUDA) and "interpret" when
TRITON_INTERPRET=1 is set and triton imports (Triton's CPU interpreter: slow, so tiny shapes; bf16
dots are not emulated there, so those runs use fp32). Without either, the comparisons are skipped
and only the references are tested against formulas and autograd.
"""

from __future__ import annotations

import os

import pytest
import torch

from moecore.kernels._triton import triton_importable


def _interpret() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1" and triton_importable()


@pytest.fixture(params=["cuda", "interpret"], ids=["cuda", "interpret"])
def backend(request):
    if request.param == "cuda":
        if not (torch.cuda.is_available() and triton_importable()):
            pytest.skip("needs CUDA and triton")
    elif not _interpret():
        pytest.skip("set TRITON_INTERPRET=1 with triton installed to run the kernels on CPU")
    return request.param


def setup(backend: str) -> tuple[torch.device, torch.dtype]:
    """(device, low-precision dtype) for a backend."""
    if backend == "cuda":
        return torch.device("cuda"), torch.bfloat16
    return torch.device("cpu"), torch.float32


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp(min=1e-30)).item()


def pytest_collection_modifyitems(items):
    for item in items:
        callspec = getattr(item, "callspec", None)
        if callspec is not None and callspec.params.get("backend") == "cuda":
            item.add_marker(pytest.mark.gpu)
