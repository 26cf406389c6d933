"""Shared tiny configuration of the reliability tests (checkpoint integrity, faults, signals, NaN)."""

from __future__ import annotations

import json
from pathlib import Path

TINY = [
    "model.hidden_size=32",
    "model.num_layers=2",
    "model.num_attention_heads=2",
    "model.num_kv_heads=1",
    "model.ffn_hidden_size=64",
    "moe.num_experts=4",
    "moe.ffn_hidden_size=32",
    "moe.shared_expert_intermediate_size=32",
    "moe.first_k_dense_replace=1",
    "moe.router_enable_expert_bias=true",
    "train.seq_length=16",
    "train.global_batch_size=4",
    "train.micro_batch_size=2",
    "train.eval_interval=0",
    "optim.warmup_steps=2",
    "log.interval=1",
    "log.progress=false",
    "log.tensorboard=false",
]


def logged_losses(run_dir: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines() if line]
    return {r["step"]: r["loss"] for r in rows}


def flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
