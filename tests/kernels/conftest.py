"""Where the kernel tests run the Triton kernels.

`backend` is "cuda" on a GPU machine (tests marked gpu, skipped without CUDA) and "interpret" when
TRITON_INTERPRET=1 is set and triton imports (Triton's CPU interpreter: slow, so tiny shapes; bf16
dots are not emulated there, so those runs use fp32). Without either, the comparisons are skipped
and only the references are tested against formulas and autograd.

On a machine without CUDA where triton >= 3.9 imports (CI), the tests of this folder run in the interpreter
without TRITON_INTERPRET set for the whole session: Triton picks compiled or interpreted kernels when
`@triton.jit` runs, at import, and other test folders import the kernel modules first. So the package
fixture below sets TRITON_INTERPRET=1 and swaps every kernel of moecore.kernels for an interpreted one
for the tests here only, and undoes both afterwards.
"""

from __future__ import annotations

import importlib
import os
import pkgutil
import sys

import pytest
import torch

import moecore.kernels
from moecore.kernels._triton import triton_importable


def _interpret() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1" and triton_importable()


def _interpreted(obj, mp: pytest.MonkeyPatch):
    """obj with its @triton.jit function interpreted (through autotune/heuristics wrappers), or None."""
    from triton.runtime.autotuner import Autotuner, Heuristics
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    if isinstance(obj, JITFunction):
        return InterpretedFunction(obj.fn)
    if isinstance(obj, (Autotuner, Heuristics)):
        inner = _interpreted(obj.fn, mp)
        if inner is not None:
            mp.setattr(obj, "fn", inner)
        if isinstance(obj, Autotuner):  # the interpreter cannot time configs: the first, no disk cache
            mp.setattr(obj, "configs", obj.configs[:1])
            mp.setattr(obj, "cache_results", False)
        return obj
    return None


def _interpreter_runs_our_kernels() -> bool:
    """Triton 3.9 interprets every kernel here; 3.6's interpreter fails on several of them (scalar
    arguments inside loops) and cannot run an autotuner without a GPU driver."""
    import triton

    version = tuple(int(p) for p in triton.__version__.split("+")[0].split(".")[:2] if p.isdigit())
    return version >= (3, 9)


@pytest.fixture(scope="package", autouse=True)
def _kernels_interpreted_on_cpu():
    if _interpret() or torch.cuda.is_available() or not triton_importable() or not _interpreter_runs_our_kernels():
        yield  # already interpreted (TRITON_INTERPRET=1 at start), a GPU, no triton, or an older triton
        return
    # imported before the env is set, so that a module first imported here stays compiled afterwards
    kernels = [
        importlib.import_module(f"moecore.kernels.{m.name}") for m in pkgutil.iter_modules(moecore.kernels.__path__)
    ]
    mp = pytest.MonkeyPatch()
    mp.setenv("TRITON_INTERPRET", "1")
    # triton.language's own @jit helpers (tl.sigmoid, ...) were built compiled when triton was imported
    tl_modules = [m for n, m in list(sys.modules.items()) if n == "triton.language" or n.startswith("triton.language.")]
    for module in kernels + tl_modules:
        for name, obj in list(vars(module).items()):
            swapped = _interpreted(obj, mp)
            if swapped is not None and swapped is not obj:
                mp.setattr(module, name, swapped)
    yield
    mp.undo()


@pytest.fixture(params=["cuda", "interpret"], ids=["cuda", "interpret"])
def backend(request):
    if request.param == "cuda":
        if not (torch.cuda.is_available() and triton_importable()):
            pytest.skip("needs CUDA and triton")
    elif not _interpret():
        pytest.skip("the kernels run on CPU in Triton's interpreter: needs triton >= 3.9")
    return request.param


def setup(backend: str) -> tuple[torch.device, torch.dtype]:
    """(device, low-precision dtype) for a backend."""
    if backend == "cuda":
        return torch.device("cuda"), torch.bfloat16
    return torch.device("cpu"), torch.float32


def expert_ffn_inputs(E: int, H: int, Fd: int, counts: list, dev, dt, seed: int = 0):
    """(x [M, H], w13 [E, 2F, H], w2 [E, H, F], counts [E], probs [M] fp32, dy [M, H]) for the expert FFN's tests."""
    g = torch.Generator().manual_seed(seed)
    M = sum(counts)
    x = torch.randn(M, H, generator=g).to(dev, dt)
    w13 = (torch.randn(E, 2 * Fd, H, generator=g) * 0.2).to(dev, dt)
    w2 = (torch.randn(E, H, Fd, generator=g) * 0.2).to(dev, dt)
    p = torch.rand(M, generator=g).to(dev, torch.float32)
    dy = torch.randn(M, H, generator=g).to(dev, dt)
    return x, w13, w2, torch.tensor(counts, device=dev), p, dy


def routed_inputs(T: int, H: int, E: int, K: int, Fd: int, dev, dt, seed: int = 0, scale: float = 1.0):
    """(x [T, H], w13 [E, 2Fd, H], w2 [E, H, Fd] scaled by `scale`, idx [T, K] distinct experts, weights [T, K]
    fp32, dout [T, H]) for the routed experts' Functions (moe/minimal.py), drawn on CPU then moved."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g).to(dev, dt)
    w13 = (torch.randn(E, 2 * Fd, H, generator=g) * scale).to(dev, dt)
    w2 = (torch.randn(E, H, Fd, generator=g) * scale).to(dev, dt)
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]).to(dev)
    w, dout = torch.rand(T, K, generator=g).to(dev), torch.randn(T, H, generator=g).to(dev, dt)
    return x, w13, w2, idx, w, dout


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp(min=1e-30)).item()


def pytest_collection_modifyitems(items):
    for item in items:
        callspec = getattr(item, "callspec", None)
        if callspec is not None and callspec.params.get("backend") == "cuda":
            item.add_marker(pytest.mark.gpu)
