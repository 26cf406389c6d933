"""How close `moecore plan`'s per-GPU peak estimate is to torch.cuda.max_memory_allocated, on one GPU.

Usage (GPU): PYTHONPATH=. python benchmarks/plan_accuracy.py --out OUT [--only NAME,...] [--steps 2]
writes OUT.json (one record per configuration) and OUT.md (the table of docs/plan.md).

Each configuration is a recipe plus overrides (Qwen3-30B-A3B and DeepSeek-V2-Lite cut to a few
layers, ep 1, sequence 4096, several micro-batch sizes, recomputation options, precisions and
optimizer-state dtypes, FP8 recipes with and without primary weights). It is built by the real `moecore.train.loop.Trainer` on the embedded corpus
and runs `--steps` optimizer steps (`Trainer.train_step`, no checkpoint); the measured peak is
torch.cuda.max_memory_allocated over the whole build and the steps, minus what was allocated before.
The estimate is `estimate_memory(cfg, layout).peak_allocated` for the same config (the framework
overhead is not part of torch's counter, so it is left out). Every configuration runs in a
try/except: an out-of-memory or another error is recorded, and the next one runs. A configuration
needing config fields this version lacks (bf16 optimizer state, offloading) is recorded as skipped.
"""

from __future__ import annotations

import argparse
import gc
import json
import time
import traceback
from pathlib import Path

# (name, recipe, overrides); all on one GPU with ep 1 and a 4096-token sequence
COMMON = ["parallel.ep=1", "train.seq_length=4096", "train.eval_interval=0", "log.progress=false",
          "log.tensorboard=false", "checkpoint.interval=0"]  # fmt: skip
Q, D, N = "qwen3-30b-a3b", "deepseek-v2-lite", "qwen3-next-80b-a3b"
CONFIGS = [
    ("qwen3-4L-none-mbs1x2", Q, ["model.num_layers=4", "model.recompute_granularity=none",
                                 "train.micro_batch_size=1", "train.global_batch_size=2"]),
    ("qwen3-4L-recipe-mbs2", Q, ["model.num_layers=4", "train.micro_batch_size=2", "train.global_batch_size=2"]),
    ("qwen3-8L-recipe-mbs1x2", Q, ["model.num_layers=8", "train.micro_batch_size=1", "train.global_batch_size=2"]),
    ("qwen3-8L-moe-mbs2", Q, ["model.num_layers=8", "model.recompute_modules=[moe_act,norm,moe]",
                              "train.micro_batch_size=2", "train.global_batch_size=2"]),
    ("qwen3-8L-full-mbs4", Q, ["model.num_layers=8", "model.recompute_granularity=full",
                               "train.micro_batch_size=4", "train.global_batch_size=4"]),
    ("qwen3-8L-bf16state-mbs2", Q, ["model.num_layers=8", "optim.state_dtype=bf16", "optim.master_weights=bf16",
                                    "train.micro_batch_size=2", "train.global_batch_size=2"]),
    ("qwen3-8L-norm-mbs4", Q, ["model.num_layers=8", "model.recompute_modules=[norm]",
                             "train.micro_batch_size=4", "train.global_batch_size=4"]),
    ("qwen3-8L-offload-moe_act-mbs4", Q, ["model.num_layers=8", "model.recompute_modules=[norm]",
                                          "model.offload_modules=[moe_act]",
                                          "train.micro_batch_size=4", "train.global_batch_size=4"]),
    *[(f"qwen3-4L-fp8-{r}{'-primary' if p else ''}-mbs2", Q,
       ["model.num_layers=4", "train.micro_batch_size=2", "train.global_batch_size=2", "train.precision=fp8",
        f"fp8.recipe={r}", f"fp8.primary_weights={str(p).lower()}"]) for r in ("rowwise", "blockwise") for p in (False, True)],
    ("qwen3-4L-capacity-mbs2", Q, ["model.num_layers=4", "moe.expert_capacity_factor=1.0",
                                   "moe.pad_expert_input_to_capacity=true", "train.micro_batch_size=2",
                                   "train.global_batch_size=2"]),
    # gated DeltaNet (3 of 4 layers) and 512 experts; bf16 state so that 4 layers fit an 80 GB GPU
    ("qwen3next-4L-recipe-mbs1", N, ["model.num_layers=4", "model.layer_types=[" + ",".join(
                                         ["linear_attention"] * 3 + ["full_attention"]) + "]",
                                     "optim.state_dtype=bf16", "optim.master_weights=bf16",
                                     "train.micro_batch_size=1", "train.global_batch_size=1"]),
    ("dsv2lite-4L-none-mbs2", D, ["model.num_layers=4", "model.recompute_granularity=none",
                                  "train.micro_batch_size=2", "train.global_batch_size=2"]),
    ("dsv2lite-4L-recipe-mbs1x2", D, ["model.num_layers=4", "train.micro_batch_size=1",
                                      "train.global_batch_size=2"]),
    ("dsv2lite-8L-recipe-mbs2", D, ["model.num_layers=8", "train.micro_batch_size=2", "train.global_batch_size=2"]),
    ("dsv2lite-8L-full-mbs4x2", D, ["model.num_layers=8", "model.recompute_granularity=full",
                                    "train.micro_batch_size=4", "train.global_batch_size=8"]),
    ("dsv2lite-4L-fp32-mbs1", D, ["model.num_layers=4", "train.precision=fp32", "train.micro_batch_size=1",
                                  "train.global_batch_size=1"]),
]  # fmt: skip

GiB = float(2**30)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="output prefix: writes OUT.json and OUT.md")
    p.add_argument("--only", default=None, help="comma-separated configuration names (default: all)")
    p.add_argument("--steps", type=int, default=2, help="optimizer steps per configuration")
    a = p.parse_args(argv)
    names = [c[0] for c in CONFIGS]
    if a.only:
        wanted = [s.strip() for s in a.only.split(",") if s.strip()]
        unknown = [w for w in wanted if w not in names]
        if unknown:
            p.error(f"--only: unknown configuration(s) {', '.join(unknown)}; known: {', '.join(names)}")
        a.only = wanted
    if a.steps < 1:
        p.error("--steps must be >= 1")
    return a


def selected(only: list[str] | None) -> list[tuple[str, str, list[str]]]:
    return [c for c in CONFIGS if only is None or c[0] in only]


def estimate(recipe: str, overrides: list[str]) -> dict:
    """The planner's numbers for one configuration on one GPU (no torch needed)."""
    from moecore.config import load_config
    from moecore.plan.layout import layout_of
    from moecore.plan.memory import estimate_memory

    cfg = load_config(recipe, COMMON + overrides)
    est = estimate_memory(cfg, layout_of(cfg, 1))
    return {
        "estimate_gib": est.peak_allocated / GiB,
        "estimate_total_gib": est.total / GiB,
        "phase": est.phase,
        "mode": est.mode,
        "by_kind_gib": est.by_kind(),
    }


def measure(recipe: str, overrides: list[str], steps: int) -> dict:
    """Build the Trainer and run `steps` steps; peak allocated bytes and the last step's seconds."""
    import torch

    from moecore.config import load_config
    from moecore.train.loop import Trainer

    cfg = load_config(recipe, COMMON + overrides + ["train.preflight_memory=off"])
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    trainer = Trainer(cfg)
    step_s = None
    try:
        for _ in range(steps):
            torch.cuda.synchronize()
            t = time.perf_counter()
            trainer.train_step(with_moe_metrics=False)
            torch.cuda.synchronize()
            step_s = time.perf_counter() - t
        peak = torch.cuda.max_memory_allocated() - base
    finally:
        trainer.rt.shutdown()
        del trainer
        gc.collect()
        torch.cuda.empty_cache()
    return {"measured_gib": peak / GiB, "step_s": step_s}


def run_one(name: str, recipe: str, overrides: list[str], steps: int) -> dict:
    """One configuration's record; never raises (errors and out-of-memory are recorded)."""
    rec: dict = {"name": name, "recipe": recipe, "overrides": overrides, "status": "ok"}
    try:
        rec.update(estimate(recipe, overrides))
    except Exception as e:  # a field this version lacks: the configuration cannot run either
        rec.update(status="skipped", error=f"{type(e).__name__}: {e}")
        return rec
    try:
        rec.update(measure(recipe, overrides, steps))
        rec["error_pct"] = 100.0 * (rec["estimate_gib"] / rec["measured_gib"] - 1.0)
    except Exception as e:
        import torch

        oom = isinstance(e, torch.cuda.OutOfMemoryError)
        rec.update(status="oom" if oom else "error", error=f"{type(e).__name__}: {str(e)[:300]}")
        if not oom:
            rec["traceback"] = traceback.format_exc()[-2000:]
        gc.collect()
        torch.cuda.empty_cache()
    return rec


def markdown(records: list[dict]) -> str:
    """The docs/plan.md table: configuration, estimate, measurement, error, peak phase, step time."""
    lines = [
        "| configuration | precision | estimate GiB | measured GiB | error | peak phase | step s |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in records:
        est = f"{r['estimate_gib']:.2f}" if "estimate_gib" in r else "—"
        if r["status"] == "ok":
            meas, err, step = f"{r['measured_gib']:.2f}", f"{r['error_pct']:+.1f}%", f"{r['step_s']:.3f}"
        else:
            meas, err, step = r["status"], "—", "—"
        lines.append(
            f"| {r['name']} | {r.get('mode', '—')} | {est} | {meas} | {err} | {r.get('phase', '—')} | {step} |"
        )
    ok = [abs(r["error_pct"]) for r in records if r["status"] == "ok"]
    if ok:
        lines.append("")
        lines.append(f"{len(ok)} measured; largest |error| {max(ok):.1f}%, mean {sum(ok) / len(ok):.1f}%.")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    a = parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("plan_accuracy.py needs a CUDA GPU")
    records = []
    t0 = time.perf_counter()
    for name, recipe, overrides in selected(a.only):
        rec = run_one(name, recipe, overrides, a.steps)
        rec.update(device=torch.cuda.get_device_name(), torch=torch.__version__, date=time.strftime("%Y-%m-%d"))
        records.append(rec)
        print(json.dumps({k: v for k, v in rec.items() if k != "traceback"}), flush=True)
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    Path(f"{out}.json").write_text(json.dumps(records, indent=1))
    Path(f"{out}.md").write_text(markdown(records))
    print(markdown(records))
    print(f"total {time.perf_counter() - t0:.0f}s")


if __name__ == "__main__":
    main()
