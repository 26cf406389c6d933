"""The few lines a run prints at its start: model, parameters, layout, batch, precision, run folder.

The full resolved configuration goes to `config.yaml` in the run folder only.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from moecore.config import Config
from moecore.parallel.sharding import get_shard


def global_param_counts(model: torch.nn.Module, cfg: Config) -> tuple[int, int]:
    """(total, active per token) parameters of the whole model, from global shapes (any layout)."""
    total = experts = 0
    for name, p in model.named_parameters():
        n = math.prod(get_shard(p).global_shape)
        total += n
        if ".experts." in f".{name}":
            experts += n
    e = cfg.moe
    inactive = experts - experts * e.router_topk // e.num_experts if e.num_experts else 0
    return total, total - inactive


def _count(n: int) -> str:
    for unit, div in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= div:
            return f"{n / div:.2f}{unit}"
    return str(n)


def run_summary(cfg: Config, model: torch.nn.Module, rt, run_dir: Path, start_step: int) -> list[str]:
    """The start-of-run summary lines."""
    m, e, t = cfg.model, cfg.moe, cfg.train
    total, active = global_param_counts(model, cfg)
    moe = f", {e.num_experts} experts top-{e.router_topk}" if e.num_experts else ", dense"
    d = rt.dims
    layout = " ".join(f"{k}{getattr(d, k)}" for k in ("tp", "pp", "cp", "ep", "etp", "dp"))
    mbs = t.global_batch_size // (t.micro_batch_size * d.dp)
    precision = t.precision if t.precision != "auto" else ("bf16" if rt.device.type == "cuda" else "fp32")
    start = f", resuming after step {start_step}" if start_step else ""
    return [
        f"model    {cfg.recipe} ({m.family}): {m.num_layers} layers, hidden {m.hidden_size}{moe}; "
        f"{_count(total)} parameters, {_count(active)} active per token",
        f"layout   {d.world_size} process(es) on {rt.device.type}: {layout}",
        f"batch    {t.global_batch_size} sequences x {t.seq_length} tokens (micro-batch {t.micro_batch_size}, "
        f"{mbs} per rank per step); {t.steps} steps{start}",
        f"precision {precision}; seed {t.seed}",
        f"run      {run_dir} (full config: {Path(run_dir) / 'config.yaml'})",
    ]
