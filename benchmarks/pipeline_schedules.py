"""Pipeline schedules side by side: micro-batches held in flight per rank (activation memory).

Runs one training step of a tiny 8-layer MoE on `--pp` gloo processes (CPU) under each schedule of
`parallel.pp_schedule` and reports, per pipeline rank:
- `in_flight`: the most micro-batches whose stage activations the rank held at once (measured by
  moecore.parallel.pipeline: counted from each stage's forward to the backward through its input),
  in units of one stage's activations for one micro-batch;
- `layer_microbatches`: the same in units of one decoder layer's activations for one micro-batch
  (a stage holds layers / (pp * vpp) layers here);
- `peak_saved_mib`: the most bytes of tensors saved for backward (parameters aside, each storage once) that the
  rank held at once, from saved-tensor hooks: what activation memory is. Under the zero-bubble and V schedules a
  micro-batch's saved tensors outlive the backward through its input (`in_flight` stops counting there) until
  its weight pass, so this is the measure to compare schedules by;
- `layer_microbatches_saved`: peak_saved_mib in units of one decoder layer's saved bytes for one micro-batch
  (rank 1's peak under 1F1B with one micro-batch, over its layers).

    PYTHONPATH=. python benchmarks/pipeline_schedules.py --pp 4 --microbatches 8
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import weakref
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "distributed"))

from dist_parity import make_dims, tiny_config  # noqa: E402

from moecore.parallel.launch import run_local  # noqa: E402
from moecore.parallel.pipeline import parallelize_pipeline  # noqa: E402

SCHEDULES = [("1f1b", 1), ("interleaved_1f1b", 2), ("zero_bubble", 2), ("zbv", 2), ("dualpipev", 2)]


class SavedBytes:
    """Saved-tensor hooks that track the bytes of the tensors autograd keeps for backward: each storage counted
    once while any saved reference to it lives (parameters excluded), and the peak of that sum."""

    def __init__(self) -> None:
        self.refs: dict[int, int] = {}  # storage pointer -> saved references alive
        self.size: dict[int, int] = {}
        self.live = self.peak = 0

    def pack(self, t: torch.Tensor):
        if isinstance(t, torch.nn.Parameter):
            return t
        key = t.untyped_storage().data_ptr()
        if self.refs.get(key, 0) == 0:
            self.size[key] = t.untyped_storage().nbytes()
            self.live += self.size[key]
            self.peak = max(self.peak, self.live)
        self.refs[key] = self.refs.get(key, 0) + 1
        holder = _Holder(t)
        weakref.finalize(holder, self._release, key)
        return holder

    def _release(self, key: int) -> None:
        self.refs[key] -= 1
        if self.refs[key] == 0:
            self.live -= self.size.pop(key)

    @staticmethod
    def unpack(holder):
        return holder if isinstance(holder, torch.Tensor) else holder.t


class _Holder:
    def __init__(self, t: torch.Tensor) -> None:
        self.t = t


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
    saved = SavedBytes()
    with torch.autograd.graph.saved_tensors_hooks(saved.pack, saved.unpack):
        rec = pipe.step(ids, ids, mask, mask.sum().double(), 1.0, 1.0 / microbatches, microbatches)
    per_stage = cfg.model.num_layers // (world * vpp)
    stages = [m.spec.symbols for m in pipe.stage_modules]
    return {
        "in_flight": rec.peak_live,
        "layer_microbatches": rec.peak_live * per_stage,
        "peak_saved_mib": round(saved.peak / 2**20, 3),
        "stages": stages,
    }


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
        rows[-1].update(date=datetime.date.today().isoformat(), torch=torch.__version__)
    # one decoder layer's saved bytes for one micro-batch: 1F1B's rank 1 holds only decoder layers ("tt")
    one = rows[0]["ranks"][1]
    unit = one["peak_saved_mib"] / one["layer_microbatches"]
    for row in rows:
        for r in row["ranks"]:
            r["layer_microbatches_saved"] = round(r["peak_saved_mib"] / unit, 2)
        fl = " ".join(str(r["in_flight"]) for r in row["ranks"])
        lm = " ".join(str(r["layer_microbatches"]) for r in row["ranks"])
        sv = " ".join(f"{r['layer_microbatches_saved']:g}" for r in row["ranks"])
        print(
            f"{row['schedule']:18s} vpp={row['vpp']}  in-flight stage micro-batches per rank: {fl:12s}  "
            f"layer x micro-batches: {lm:12s}  by saved bytes: {sv}"
        )
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
