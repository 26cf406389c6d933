"""The CUDA kernels that take the most GPU time in one moecore training step of the Qwen3 proxy.

Usage (GPU): PYTHONPATH=. python benchmarks/train_top_kernels.py [--layers 8] [--top 30] [--json OUT]
Same model, batch and optimizer as `moecore bench train`; torch.profiler over 2 steps after warm-up;
prints each kernel's milliseconds per step, its launch count per step and the phase it falls in.
"""

from __future__ import annotations

import argparse
import json

import torch
from torch.profiler import ProfilerActivity, profile

from moecore.bench.common import kernel_rows
from moecore.bench.train import PHASES, V, _moecore_model, _train_step


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    torch.manual_seed(0)
    ids = torch.randint(0, V, (a.batch, a.seq), device="cuda")
    with torch.device("cuda"):
        model = _moecore_model(a.layers, a.seq)
    model = model.to(torch.bfloat16).train()
    step = _train_step(model, ids, torch.roll(ids, -1, dims=1))
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    steps = 2
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    rows = kernel_rows(prof, steps, PHASES)
    total = sum(r["ms"] for r in rows)
    print(f"total kernel time {total:.1f} ms per step, {sum(r['calls'] for r in rows)} launches")
    for r in rows[: a.top]:
        print(f"{r['ms']:8.2f} ms {r['calls']:6d}x  {r['phase'][:22]:22s} {r['kernel'][:110]}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
