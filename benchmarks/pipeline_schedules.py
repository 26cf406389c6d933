"""Pipeline schedules side by side: micro-batches held in flight per rank (activation memory).

Runs one training step of a tiny 8-layer MoE on `--pp` gloo processes (CPU) under each schedule of
`parallel.pp_schedule` and reports, per pipeline rank:
- `in_flight`: the most micro-batches whose stage activations the rank held at once (measured by
  moecore.parallel.pipeline: counted from each stage's forward to the backward through its input),
  in units of one stage's activations for one micro-batch;
- `layer_microbatches`: the same in units of one decoder layer's activations for one micro-batch
  (a stage holds layers / (pp * vpp) layers here).

    PYTHONPATH=. python benchmarks/pipeline_schedules.py --pp 4 --microbatches 8
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "distributed"))

from dist_parity import make_dims, tiny_config  # noqa: E402

from moecore.parallel.launch import run_local  # noqa: E402
from moecore.parallel.pipeline import parallelize_pipeline  # noqa: E402

SCHEDULES = [("1f1b", 1), ("interleaved_1f1b", 2), ("zero_bubble", 2), ("zbv", 2), ("dualpipev", 2)]


def _one(rank: int, world: int, name: str, vpp: int, microbatches: int) -> dict:
    cfg = tiny_config()
    cfg.model.num_layers = 8
    cfg.parallel.pp, cfg.parallel.vpp, cfg.parallel.pp_schedule = world, vpp, name
    cfg.train.global_batch_size = microbatches * cfg.train.micro_batch_size
    dims = make_dims(cfg, rank, world)
    pipe = parallelize_pipeline(cfg, dims, "cpu")
    g = torch.Generator().manual_seed(0)
    n = cfg.train.global_batch_size
    ids = torch.randint(0, cfg.model.vocab_size, (n, cfg.train.seq_length), generator=g)
    mask = torch.ones(n, cfg.train.seq_length)
    rec = pipe.step(ids, ids, mask, mask.sum().double(), 1.0, 1.0 / microbatches, microbatches)
    per_stage = cfg.model.num_layers // (world * vpp)
    stages = [m.spec.symbols for m in pipe.stage_modules]
    return {"in_flight": rec.peak_live, "layer_microbatches": rec.peak_live * per_stage, "stages": stages}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pp", type=int, default=4)
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    rows = []
    for name, vpp in SCHEDULES:
        res = run_local(_one, args.pp, name, vpp, args.microbatches)
        rows.append({"schedule": name, "vpp": vpp, "pp": args.pp, "microbatches": args.microbatches, "ranks": res})
        fl = " ".join(str(r["in_flight"]) for r in res)
        lm = " ".join(str(r["layer_microbatches"]) for r in res)
        print(f"{name:18s} vpp={vpp}  in-flight stage micro-batches per rank: {fl:12s}  layer x micro-batches: {lm}")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
