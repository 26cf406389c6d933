"""When a Triton kernel runs instead of its PyTorch reference.

Every public kernel function in this package takes `impl`: "auto" (Triton for CUDA tensors when Triton
imports, the reference otherwise), "triton" (force the kernel; with TRITON_INTERPRET=1 it also runs on
CPU tensors, which is how the CPU tests exercise the kernels) or "torch" (force the reference).
"""

from __future__ import annotations

import functools
import importlib.util

import torch

IMPLS = ("auto", "triton", "torch")


@functools.cache
def modules_import(*names: str) -> bool:
    """True when every module of `names` imports; the first is the package, looked up before importing anything.
    For optional dependencies: a broken or mismatched install behaves as absent."""
    if importlib.util.find_spec(names[0]) is None:
        return False
    try:
        for name in names:
            importlib.import_module(name)
    except Exception:
        return False
    return True


def triton_importable() -> bool:
    """True when the `triton` package can be imported (it is not a dependency on CPU installs)."""
    return modules_import("triton", "triton.language")


def use_triton(impl: str, *tensors: torch.Tensor) -> bool:
    """Resolve `impl` for these tensors: whether to launch the Triton kernel."""
    if impl not in IMPLS:
        raise ValueError(f"impl={impl!r} is invalid: allowed: {' | '.join(IMPLS)}")
    if impl == "torch":
        return False
    if impl == "triton":
        if not triton_importable():
            raise ValueError("impl='triton' needs the triton package, which does not import here")
        return True
    return triton_importable() and all(t.is_cuda for t in tensors)


def next_pow2(n: int) -> int:
    """Smallest power of two >= n (Triton block sizes must be powers of two)."""
    return 1 << max(0, (int(n) - 1).bit_length())
