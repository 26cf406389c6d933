"""Per-rank memory by kind, measured from the tensors themselves: parameters, gradients, optimizer state.

`tensor_bytes(model, optimizer, mixed)` walks what this rank holds now:

- params: the model's parameters (bf16 under `train.precision=bf16`; FP8 primary weights: their FP8
  values and scales, `param.fp8_primary` (rowwise also `param.fp8_primary_t`), instead of the placeholder);
- grads: `.grad` and fp32 `main_grad` of every parameter, plus the reduced gradient shards a
  distributed optimizer holds (`memory_tensors()["grads"]`);
- optim: every tensor in the optimizers' `state` (moments, step counters), the fp32 master weights
  of `MixedPrecision`, and the master shards and moments of the distributed optimizer.

A tensor is counted once however many references reach it (by storage address and size). The
training loop reports them as `memory/params_gb`, `memory/grads_gb`, `memory/optim_gb` (GiB), so
sharding shows up in the metrics on CPU as on GPU.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch


def _unique_bytes(tensors: Iterable[torch.Tensor | None]) -> int:
    seen: set[tuple[int, int]] = set()
    total = 0
    for t in tensors:
        if not isinstance(t, torch.Tensor):
            continue
        if hasattr(t, "to_local"):  # a DTensor (FSDP): this rank's shard
            t = t.to_local()
        t = getattr(t, "hp_shard", t)  # a shard FSDP gathers as FP8 (moecore/parallel/fsdp_fp8.py): its values
        key = (t.data_ptr(), t.numel() * t.element_size())
        if key in seen:
            continue
        seen.add(key)
        total += key[1]
    return total


def _optimizers(optimizer) -> list:
    if optimizer is None:
        return []
    return list(getattr(optimizer, "optimizers", [optimizer]))


def _fp8_held(p: torch.Tensor) -> list[torch.Tensor]:
    """An FP8 primary weight's values and scales (and, rowwise, those of its transposed copy)."""
    ops = [p.fp8_primary, getattr(p, "fp8_primary_t", None)]
    return [t for op in ops if op is not None for t in (op.q, op.s)]


def tensor_bytes(model: torch.nn.Module, optimizer=None, mixed=None) -> dict[str, int]:
    """Bytes this rank holds now in parameters, gradients and optimizer state; see the module docstring."""
    params = list(model.parameters())
    held = [t for p in params for t in (_fp8_held(p) if hasattr(p, "fp8_primary") else (p,))]
    own = getattr(optimizer, "memory_tensors", None)
    extra = own() if callable(own) else {"grads": [], "optim": []}
    grads = [t for p in params for t in (p.grad, getattr(p, "main_grad", None))] + list(extra["grads"])
    optim = [t for o in _optimizers(optimizer) for st in o.state.values() for t in st.values()]
    if mixed is not None:
        optim += list(mixed.masters.values())
    optim += list(extra["optim"])
    return {"params": _unique_bytes(held), "grads": _unique_bytes(grads), "optim": _unique_bytes(optim)}


def memory_metrics(model: torch.nn.Module, optimizer=None, mixed=None) -> dict[str, float]:
    """`memory/params_gb`, `memory/grads_gb`, `memory/optim_gb` of this rank (GiB)."""
    return {f"memory/{k}_gb": v / 2**30 for k, v in tensor_bytes(model, optimizer, mixed).items()}
