"""FP8 training accuracy: a ~100M-parameter MoE trained N steps on the embedded corpus in bf16 and in each FP8 recipe.

Usage (GPU): PYTHONPATH=. python benchmarks/fp8_accuracy.py OUT.json [--steps 1000] [--recipes rowwise,blockwise]
[--concurrent] (a CPU smoke run of the script itself: ... --steps 2 --small --emulate). Options follow a recipe
after `+`: `rowwise+bf16wgrad` runs that recipe with `fp8.wgrad=bf16` (weight gradients in bf16),
`rowwise+hybrid` with `fp8.format=hybrid` (e5m2 gradients) whatever `--format` says.

`--plot PNG` draws the loss curves (20-step mean) and each FP8 run's difference from bf16; with an existing
OUT.json and `--plot` alone (`... OUT.json --plot PNG --replot`) it draws them from that file without training.

`--concurrent` runs every precision in its own process at the same time (the ~100M model leaves most of an H200
idle; the losses do not depend on it, the tokens/s of each run then do and are reported as such).

Every run starts from the same weights (train.seed) and reads the same batches; only train.precision (bf16 or
fp8) and fp8.recipe differ. The model: 8 layers, hidden 512, 8 heads, 16 experts top-2 of width 512 plus a
dense first layer (every GEMM dimension a multiple of 128, as the blockwise recipe needs). OUT.json holds,
per run, the loss of every step, the final loss (mean of the last 10 steps) and its relative difference
from bf16's, and the run's tokens/s.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MODEL = [
    "model.hidden_size=512",
    "model.num_layers=8",
    "model.num_attention_heads=8",
    "model.num_kv_heads=4",
    "model.ffn_hidden_size=2048",
    "moe.num_experts=16",
    "moe.router_topk=2",
    "moe.ffn_hidden_size=512",
    "moe.first_k_dense_replace=1",
    "train.seq_length=512",
    "train.global_batch_size=32",
    "train.micro_batch_size=32",
    "optim.lr=1e-3",
    "optim.min_lr=1e-4",
    "optim.warmup_steps=50",
    "train.eval_interval=0",
    "log.interval=1",
    "log.progress=false",
    "log.tensorboard=false",
    "checkpoint.interval=0",
]
RECIPE_OPTIONS = {"bf16wgrad": "fp8.wgrad=bf16", "hybrid": "fp8.format=hybrid"}
SMALL = ["model.hidden_size=128", "model.num_layers=2", "model.ffn_hidden_size=256", "moe.ffn_hidden_size=128",
         "train.seq_length=64", "train.global_batch_size=4", "train.micro_batch_size=2"]  # fmt: skip


def run_one(name: str, overrides: list[str], steps: int) -> dict:
    from moecore.config import load_config
    from moecore.train.loop import train

    run_dir = Path(tempfile.mkdtemp(prefix=f"fp8-acc-{name}-"))
    cfg = load_config("tiny-moe", [*overrides, f"train.steps={steps}", f"train.run_dir={run_dir}"])
    t0 = time.perf_counter()
    train(cfg)
    seconds = time.perf_counter() - t0
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in rows if "loss" in r]
    tokens = cfg.train.global_batch_size * cfg.train.seq_length * steps
    return {"losses": losses, "final_loss": sum(losses[-10:]) / len(losses[-10:]), "tokens_per_s": tokens / seconds}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out")
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--recipes", default="rowwise,blockwise")
    p.add_argument("--format", default="e4m3", choices=("e4m3", "hybrid"))
    p.add_argument("--small", action="store_true", help="a tiny model (smoke test)")
    p.add_argument("--emulate", action="store_true", help="emulated FP8 GEMMs (CPU smoke test)")
    p.add_argument("--concurrent", action="store_true", help="every precision in its own process, at once")
    p.add_argument("--plot", metavar="PNG", help="draw the curves into this PNG (matplotlib)")
    p.add_argument("--replot", action="store_true", help="only draw --plot from an existing OUT.json")
    p.add_argument("--only", help=argparse.SUPPRESS)  # one run, its result as JSON to OUT (--concurrent's workers)
    args = p.parse_args()
    if args.replot:
        plot(json.loads(Path(args.out).read_text()), args.plot)
        return
    base = MODEL + (SMALL if args.small else [])
    configs = {"bf16": [*base, "train.precision=bf16"]}
    for entry in args.recipes.split(","):
        recipe, *options = entry.split("+")  # rowwise+bf16wgrad+hybrid: fp8.wgrad=bf16 fp8.format=hybrid
        bad = [o for o in options if o not in RECIPE_OPTIONS]
        if bad:
            raise SystemExit(
                f"--recipes: {entry!r}: {bad[0]!r} is not an option: allowed: {' | '.join(RECIPE_OPTIONS)}"
            )
        fp8 = ["train.precision=fp8", f"fp8.recipe={recipe}", f"fp8.format={args.format}"]
        fp8 += [RECIPE_OPTIONS[o] for o in options]  # later overrides win
        name = "-".join(["fp8", recipe, *options])
        configs[name] = [*base, *fp8, *(["fp8.emulate=true"] if args.emulate else [])]
    if args.only:
        Path(args.out).write_text(json.dumps(run_one(args.only, configs[args.only], args.steps)))
        return
    if args.concurrent:
        parts = {name: Path(tempfile.mkdtemp(prefix="fp8-acc-")) / f"{name}.json" for name in configs}
        flags = ["--steps", str(args.steps), "--recipes", args.recipes, "--format", args.format]
        flags += ["--small"] * args.small + ["--emulate"] * args.emulate
        procs = [subprocess.Popen([sys.executable, __file__, str(out), *flags, "--only", name])
                 for name, out in parts.items()]  # fmt: skip
        if any(proc.wait() for proc in procs):
            raise SystemExit("a run failed (its output is above)")
        runs = {name: json.loads(out.read_text()) for name, out in parts.items()}
    else:
        runs = {name: run_one(name, overrides, args.steps) for name, overrides in configs.items()}
    bf16 = runs["bf16"]["losses"]
    for name, r in runs.items():
        # A run whose steps went non-finite logs fewer losses (the guard skips those steps): compare the same
        # window of logged steps, and say how many there were.
        n = min(len(r["losses"]), len(bf16))
        ref = sum(bf16[n - 10 : n]) / len(bf16[n - 10 : n])
        r["steps_logged"] = len(r["losses"])
        r["final_loss_rel_diff_vs_bf16"] = (sum(r["losses"][n - 10 : n]) / len(r["losses"][n - 10 : n]) - ref) / ref
        print(f"{name:16s} final loss {r['final_loss']:.4f} ({100 * r['final_loss_rel_diff_vs_bf16']:+.2f}% vs bf16 "
              f"over the same steps), {r['steps_logged']} of {args.steps} steps logged, "
              f"{r['tokens_per_s']:.0f} tokens/s", flush=True)  # fmt: skip
    record = {"steps": args.steps, "format": args.format, "concurrent": args.concurrent, "runs": runs}
    Path(args.out).write_text(json.dumps(record, indent=1))
    if args.plot:
        plot(record, args.plot)


def _mean(xs: list[float], window: int = 20) -> list[float]:
    return [sum(xs[max(0, i - window + 1) : i + 1]) / len(xs[max(0, i - window + 1) : i + 1]) for i in range(len(xs))]


def plot(record: dict, png: str) -> None:
    """Loss (20-step mean) of every run, and each run's relative difference from bf16's, against the step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = record["runs"]
    ref = _mean(runs["bf16"]["losses"])
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(7, 6), sharex=True)
    for i, (name, r) in enumerate(runs.items()):
        curve = _mean(r["losses"])
        steps = range(1, len(curve) + 1)
        color = f"C{i}"  # one colour per run in both panels
        top.plot(steps, curve, label=name, linewidth=1, color=color)
        if name != "bf16":
            n = min(len(curve), len(ref))
            diff = [100 * (a - b) / b for a, b in zip(curve[:n], ref[:n])]
            bottom.plot(steps[:n], diff, label=name, linewidth=1, color=color)
    top.set_ylabel("training loss (20-step mean)")
    top.set_yscale("log")
    top.legend()
    bottom.axhline(1.0, color="grey", linewidth=0.5, linestyle="--")
    bottom.set_ylabel("difference from bf16 (%)")
    bottom.set_xlabel("step")
    bottom.legend()
    fig.suptitle(f"FP8 against bf16, {record['steps']} steps (benchmarks/fp8_accuracy.py)")
    fig.tight_layout()
    fig.savefig(png, dpi=100)


if __name__ == "__main__":
    main()
