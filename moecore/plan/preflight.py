"""The memory preflight of `moecore train`: refuse or warn before a layout runs out of GPU memory.

`check_memory(cfg, world_size, device_bytes)` estimates this run's per-GPU peak (moecore.plan.memory,
framework overhead included) and, when it exceeds `device_bytes`, returns one line with the estimate
by kind and the best layout `moecore plan` would pick on the same GPUs. `train.preflight_memory`
decides what happens: `warn` (default) prints the line, `error` raises it as a ConfigError (exit 2),
`off` skips the check. The trainer calls it on CUDA, where the device's memory is known.
"""

from __future__ import annotations

from moecore.config import Config, ConfigError
from moecore.plan.layout import layout_of
from moecore.plan.memory import GiB, PlanOptions, estimate_memory


def memory_message(cfg: Config, world_size: int, device_bytes: float, device: str = "cuda") -> str | None:
    """None when this run's estimate fits in `device_bytes` per GPU, else the one-line explanation."""
    from moecore.plan.search import best_supported, search

    layout = layout_of(cfg, world_size)
    opts = PlanOptions(device=device)
    est = estimate_memory(cfg, layout, opts)
    if est.total <= device_bytes:
        return None
    k = est.by_kind()
    mem_gib = device_bytes / GiB
    kinds = ", ".join(f"{name} {k[name]:.1f}" for name in ("params", "grads", "optimizer", "activations", "other"))
    line = (
        f"memory preflight: this layout ({layout.label()}) needs about {k['total']:.1f} GiB per GPU "
        f"({kinds}, framework {k['framework']:.1f}) but the GPU has {mem_gib:.1f} GiB"
    )
    best = best_supported(search(cfg, world_size, mem_gib, opts=PlanOptions(device=device)))
    if best is None:
        return line + f"; no layout this version runs fits on {world_size} GPU(s) (see `moecore plan`)"
    return (
        line + f"; `moecore plan` would pick {best.layout.label()}: {' '.join(best.layout.overrides(best.pp_layout))}"
    )


def check_memory(cfg: Config, world_size: int, device_bytes: float | None, device: str = "cuda") -> str | None:
    """Apply `train.preflight_memory` (module docstring); returns the warning line, if any, for the caller to print."""
    mode = getattr(cfg.train, "preflight_memory", "warn")
    if mode in ("off", False) or device_bytes is None:  # YAML reads a bare `off` as false
        return None
    msg = memory_message(cfg, world_size, device_bytes, device)
    if msg is not None and mode == "error":
        raise ConfigError(msg + " (train.preflight_memory=error; set warn or off to run anyway)")
    return msg
