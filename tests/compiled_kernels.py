"""How many compiled variants Triton holds for moecore's kernels (the GPU tests that guard against recompiling)."""

from __future__ import annotations

import importlib
import pkgutil

import pytest

import moecore.kernels


def compiled_variants(kernel) -> int:
    """Compiled variants of one @triton.jit kernel on every device so far; skips the test where this Triton
    keeps them elsewhere (so that the count cannot read as a vacuous 0)."""
    caches = getattr(kernel, "device_caches", None)
    if not isinstance(caches, dict):
        pytest.skip("this Triton keeps its compiled kernels elsewhere")
    return sum(len(entry[0]) for entry in caches.values())


def all_compiled_variants() -> int:
    """compiled_variants summed over every Triton kernel of moecore.kernels."""
    from triton.runtime.jit import JITFunction

    kernels = {}  # by identity: a module may import another's kernel or jit helper
    for info in pkgutil.iter_modules(moecore.kernels.__path__):
        module = importlib.import_module(f"moecore.kernels.{info.name}")
        kernels.update({id(obj): obj for obj in vars(module).values() if isinstance(obj, JITFunction)})
    return sum(compiled_variants(k) for k in kernels.values())
