"""The few lines a run prints at its start: model, parameters, layout, batch, precision, kernels, run folder.

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


def kernels_line(cfg: Config, device: torch.device) -> str | None:
    """On a GPU, which kernels the MoE layers' expert GEMMs use (None on CPU or for a dense model)."""
    if device.type != "cuda" or not cfg.moe.num_experts:
        return None
    from moecore.kernels import quack_gemm
    from moecore.kernels._triton import triton_importable

    triton = "Triton kernels" if triton_importable() else "no Triton (PyTorch references)"
    if cfg.moe.gemm_backend == "torch":
        experts = "torch's / moecore's Triton GEMMs per shape (moe.gemm_backend=torch)"
    elif quack_gemm.quack_available(device):
        experts = "QuACK's grouped GEMMs where they time faster than torch's (moe.gemm_backend=auto)"
        if cfg.moe.swiglu_epilogue:
            experts += ", the SwiGLU in their epilogues (moe.swiglu_epilogue)"
    else:
        experts = "torch's / moecore's Triton GEMMs per shape (QuACK not installed, or not a Hopper GPU)"
    return f"kernels  {triton}; expert GEMMs: {experts}"


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
    kernels = kernels_line(cfg, rt.device)
    return [
        f"model    {cfg.recipe} ({m.family}): {m.num_layers} layers, hidden {m.hidden_size}{moe}; "
        f"{_count(total)} parameters, {_count(active)} active per token",
        f"layout   {d.world_size} process(es) on {rt.device.type}: {layout}",
        f"batch    {t.global_batch_size} sequences x {t.seq_length} tokens (micro-batch {t.micro_batch_size}, "
        f"{mbs} per rank per step); {t.steps} steps{start}",
        f"precision {precision}; seed {t.seed}",
        *([kernels] if kernels else []),
        f"run      {run_dir} (full config: {Path(run_dir) / 'config.yaml'})",
    ]
