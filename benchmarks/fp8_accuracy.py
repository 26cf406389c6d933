"""FP8 training accuracy: a ~100M-parameter MoE trained N steps on the embedded corpus in bf16 and in each FP8 recipe.

Usage (GPU): PYTHONPATH=. python benchmarks/fp8_accuracy.py OUT.json [--steps 1000] [--recipes rowwise,blockwise]
[--seeds 3] [--concurrent] (a CPU smoke run of the script itself: ... --steps 2 --small --emulate). Options follow
a recipe after `+`: `rowwise+bf16wgrad` runs that recipe with `fp8.wgrad=bf16` (weight gradients in bf16),
`rowwise+hybrid` with `fp8.format=hybrid` (e5m2 gradients) whatever `--format` says.

`--plot PNG` draws the loss curves (20-step mean) and each FP8 run's difference from bf16; with an existing
OUT.json and `--plot` alone (`... OUT.json --plot PNG --replot`) it draws them from that file without training.

`--first-seed S` starts the seeds at S (default 1234), so the seeds of one comparison can be run in separate
invocations; `... OUT.json --merge A.json B.json ...` joins such records (same steps, batch, corpus and
recipes) into one and compares them as if they had been one run.

`--concurrent` runs every run in its own process at the same time (the ~100M model leaves most of an H200
idle; the losses do not depend on it, the tokens/s of each run then do and are reported as such).

The model: 8 layers, hidden 512, 8 heads, 16 experts top-2 of width 512 plus a dense first layer (every GEMM
dimension a multiple of 128, as the blockwise recipe needs). For each seed (`--seeds N`: train.seed 1234,
1235, ...) every precision starts from the same weights and reads the same batches; only train.precision and
fp8.recipe differ, so each FP8 run is compared with the bf16 run of its seed (a paired difference), and the
spread of bf16's own results over the seeds says how large a difference the comparison can resolve.

The data, by default, keep the comparison out of memorisation: the whole embedded corpus (`--corpus-mb 64`
takes every standard-library file; `moecore train`'s default is the first 4 MiB, 1.2M tokens) and 8 sequences of
512 tokens per step (`--batch 8`), so 1000 steps read 4.1M tokens, about 1.2 passes over the corpus's training
split. With `--corpus-mb 4 --batch 32` (the setting of runs N to BH) 1000 steps are 13 passes over 1.2M tokens:
the training loss falls to ~0.3 by memorising the text, and bf16 runs that differ only by GPU
non-determinism end 5% apart. The validation loss (the corpus's held-out 2%, `train.eval_iters` 8 batches) is
measured every 100 steps.

OUT.json holds, per run, the loss of every step and the validation losses, the final loss (mean of the last
`--final-window` steps, default 50) and the final validation loss, their relative differences from the bf16 run of
the same seed, and the run's tokens/s; `summary` holds, per precision, those differences over the seeds (each,
mean) and bf16's spread (max - min over the seeds, relative to its mean).
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
    "optim.lr=1e-3",
    "optim.min_lr=1e-4",
    "optim.warmup_steps=50",
    "train.eval_interval=100",
    "train.eval_iters=8",
    "log.interval=1",
    "log.progress=false",
    "log.tensorboard=false",
    "checkpoint.interval=0",
]
RECIPE_OPTIONS = {"bf16wgrad": "fp8.wgrad=bf16", "hybrid": "fp8.format=hybrid"}
SMALL = ["model.hidden_size=128", "model.num_layers=2", "model.ffn_hidden_size=256", "moe.ffn_hidden_size=128",
         "train.seq_length=64", "train.eval_iters=1"]  # fmt: skip
FIRST_SEED = 1234


def corpus_prefix(mb: float) -> str:
    """The embedded corpus's first `mb` MiB of standard-library text as an indexed dataset (built once, cached)."""
    from moecore.data.corpus import build_embedded_corpus
    from moecore.data.tokenizer import load_tokenizer

    return build_embedded_corpus(load_tokenizer(), max_bytes=int(mb * 2**20))


def run_one(name: str, overrides: list[str], steps: int, window: int) -> dict:
    from moecore.config import load_config
    from moecore.train.loop import train

    run_dir = Path(tempfile.mkdtemp(prefix=f"fp8-acc-{name.replace('@', '-')}-"))
    cfg = load_config("tiny-moe", [*overrides, f"train.steps={steps}", f"train.run_dir={run_dir}"])
    t0 = time.perf_counter()
    train(cfg)
    seconds = time.perf_counter() - t0
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in rows if "loss" in r]
    val = [[r["step"], r["val_loss"]] for r in rows if "val_loss" in r]
    tokens = cfg.train.global_batch_size * cfg.train.seq_length * steps
    return {
        "losses": losses,
        "val_losses": val,
        "final_loss": sum(losses[-window:]) / len(losses[-window:]),
        "final_val_loss": val[-1][1] if val else None,
        "tokens_per_s": tokens / seconds,
    }


def compare(runs: dict, window: int) -> dict:
    """Each run's relative differences from the bf16 run of its seed (final loss over the same logged steps,
    final validation loss), and per precision those differences over the seeds and bf16's own spread."""
    summary: dict = {}
    for key, r in runs.items():
        name, seed = key.rsplit("@", 1)
        ref = runs[f"bf16@{seed}"]
        # A run whose steps went non-finite logs fewer losses (the guard skips those steps): compare the same
        # window of logged steps, and say how many there were.
        n = min(len(r["losses"]), len(ref["losses"]))
        mine, base = r["losses"][n - window : n], ref["losses"][n - window : n]
        r["steps_logged"] = len(r["losses"])
        r["final_loss_rel_diff_vs_bf16"] = (sum(mine) / len(mine) - sum(base) / len(base)) / (sum(base) / len(base))
        if r["final_val_loss"] is not None and ref["final_val_loss"] is not None:
            r["final_val_loss_rel_diff_vs_bf16"] = (r["final_val_loss"] - ref["final_val_loss"]) / ref["final_val_loss"]
        s = summary.setdefault(name, {"final_loss": [], "final_loss_rel_diff": [], "final_val_loss_rel_diff": []})
        s["final_loss"].append(r["final_loss"])
        s["final_loss_rel_diff"].append(r["final_loss_rel_diff_vs_bf16"])
        if "final_val_loss_rel_diff_vs_bf16" in r:
            s["final_val_loss_rel_diff"].append(r["final_val_loss_rel_diff_vs_bf16"])
    for s in summary.values():
        for k in ("final_loss_rel_diff", "final_val_loss_rel_diff"):
            s[f"{k}_mean"] = sum(s[k]) / len(s[k]) if s[k] else None
    finals = summary["bf16"]["final_loss"]
    summary["bf16"]["spread_over_seeds"] = (max(finals) - min(finals)) / (sum(finals) / len(finals))
    return summary


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out")
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--recipes", default="rowwise,blockwise")
    p.add_argument("--format", default="e4m3", choices=("e4m3", "hybrid"))
    p.add_argument("--seeds", type=int, default=1, help="repeat every precision with train.seed 1234, 1235, ...")
    p.add_argument("--first-seed", type=int, default=FIRST_SEED, help="train.seed of the first seed")
    p.add_argument("--merge", nargs="+", metavar="JSON", help="join these records (runs of other seeds) into OUT")
    p.add_argument("--batch", type=int, default=8, help="sequences of 512 tokens per step (one micro-batch)")
    p.add_argument("--corpus-mb", type=float, default=64.0, help="MiB of the embedded corpus to train on")
    p.add_argument("--final-window", type=int, default=50, help="steps averaged into the final loss")
    p.add_argument("--small", action="store_true", help="a tiny model (smoke test)")
    p.add_argument("--emulate", action="store_true", help="emulated FP8 GEMMs (CPU smoke test)")
    p.add_argument("--concurrent", action="store_true", help="every run in its own process, at once")
    p.add_argument("--plot", metavar="PNG", help="draw the curves into this PNG (matplotlib)")
    p.add_argument("--replot", action="store_true", help="only draw --plot from an existing OUT.json")
    p.add_argument("--only", help=argparse.SUPPRESS)  # one run, its result as JSON to OUT (--concurrent's workers)
    args = p.parse_args()
    if args.replot:
        plot(json.loads(Path(args.out).read_text()), args.plot)
        return
    if args.merge:
        record = merge([json.loads(Path(f).read_text()) for f in args.merge])
        Path(args.out).write_text(json.dumps(record, indent=1))
        report(record)
        if args.plot:
            plot(record, args.plot)
        return
    if min(args.seeds, args.batch, args.final_window) < 1 or args.corpus_mb <= 0:
        raise SystemExit("--seeds, --batch, --final-window and --corpus-mb must be positive")
    from moecore.data.indexed import IndexedDataset

    prefix = corpus_prefix(args.corpus_mb)
    corpus = {"tokens": IndexedDataset(prefix).num_tokens, "documents": IndexedDataset(prefix).num_documents}
    data = [f"data.paths=[{prefix}]"]
    batch = [f"train.global_batch_size={args.batch}", f"train.micro_batch_size={args.batch}"]
    base = MODEL + batch + data + (SMALL if args.small else [])
    precisions = {"bf16": ["train.precision=bf16"]}
    for entry in args.recipes.split(","):
        recipe, *options = entry.split("+")  # rowwise+bf16wgrad+hybrid: fp8.wgrad=bf16 fp8.format=hybrid
        bad = [o for o in options if o not in RECIPE_OPTIONS]
        if bad:
            raise SystemExit(
                f"--recipes: {entry!r}: {bad[0]!r} is not an option: allowed: {' | '.join(RECIPE_OPTIONS)}"
            )
        fp8 = ["train.precision=fp8", f"fp8.recipe={recipe}", f"fp8.format={args.format}"]
        fp8 += [RECIPE_OPTIONS[o] for o in options]  # later overrides win
        precisions["-".join(["fp8", recipe, *options])] = fp8 + (["fp8.emulate=true"] if args.emulate else [])
    seeds = range(args.first_seed, args.first_seed + args.seeds)
    configs = {f"{n}@{s}": [*base, *over, f"train.seed={s}"] for s in seeds for n, over in precisions.items()}
    if args.only:
        Path(args.out).write_text(json.dumps(run_one(args.only, configs[args.only], args.steps, args.final_window)))
        return
    if args.concurrent:
        parts = {name: Path(tempfile.mkdtemp(prefix="fp8-acc-")) / "run.json" for name in configs}
        flags = [str(a) for a in ("--steps", args.steps, "--recipes", args.recipes, "--format", args.format,
                                  "--seeds", args.seeds, "--first-seed", args.first_seed, "--batch", args.batch, "--corpus-mb", args.corpus_mb,
                                  "--final-window", args.final_window)]  # fmt: skip
        flags += ["--small"] * args.small + ["--emulate"] * args.emulate
        procs = [subprocess.Popen([sys.executable, __file__, str(out), *flags, "--only", name])
                 for name, out in parts.items()]  # fmt: skip
        if any(proc.wait() for proc in procs):
            raise SystemExit("a run failed (its output is above)")
        runs = {name: json.loads(out.read_text()) for name, out in parts.items()}
    else:
        runs = {name: run_one(name, overrides, args.steps, args.final_window) for name, overrides in configs.items()}
    record = {"steps": args.steps, "format": args.format, "concurrent": args.concurrent, "seeds": list(seeds),
              "batch": args.batch, "corpus_mb": args.corpus_mb, "corpus": corpus, "final_window": args.final_window,
              "summary": compare(runs, args.final_window), "runs": runs}  # fmt: skip
    report(record)
    Path(args.out).write_text(json.dumps(record, indent=1))
    if args.plot:
        plot(record, args.plot)


def report(record: dict) -> None:
    """Print each run's final losses against bf16 of its seed, bf16's spread and each precision's mean difference."""
    runs, summary, steps = record["runs"], record["summary"], record["steps"]
    for name, r in runs.items():
        val = r.get("final_val_loss_rel_diff_vs_bf16")
        print(f"{name:22s} final loss {r['final_loss']:.4f} ({100 * r['final_loss_rel_diff_vs_bf16']:+.2f}% vs bf16 "
              f"over the same steps), validation {r['final_val_loss'] or float('nan'):.4f} "
              f"({100 * (val or 0.0):+.2f}%), {r['steps_logged']} of {steps} steps logged, "
              f"{r['tokens_per_s']:.0f} tokens/s", flush=True)  # fmt: skip
    print(
        f"bf16 final loss spread over {len(record['seeds'])} seed(s): {100 * summary['bf16']['spread_over_seeds']:.2f}%"
    )
    for name, s in summary.items():
        if name != "bf16":
            print(f"{name:22s} mean difference from bf16: final loss {100 * s['final_loss_rel_diff_mean']:+.2f}%, "
                  f"validation {100 * (s['final_val_loss_rel_diff_mean'] or 0.0):+.2f}%")  # fmt: skip


def merge(records: list[dict]) -> dict:
    """One record from records of the same comparison run with different seeds (their runs joined, compared anew)."""
    same = ("steps", "format", "batch", "corpus_mb", "final_window")
    first = records[0]
    for r in records[1:]:
        for key in same:
            if r.get(key) != first.get(key):
                raise SystemExit(f"--merge: the records differ in {key!r} ({first.get(key)!r} vs {r.get(key)!r})")
    runs: dict = {}
    for r in records:
        clash = runs.keys() & r["runs"].keys()
        if clash:
            raise SystemExit(f"--merge: run {sorted(clash)[0]!r} is in more than one record")
        runs.update(r["runs"])
    record = {**first, "seeds": sorted(s for r in records for s in r["seeds"]), "runs": runs}
    record["summary"] = compare(runs, first["final_window"])
    return record


def _mean(xs: list[float], window: int = 20) -> list[float]:
    return [sum(xs[max(0, i - window + 1) : i + 1]) / len(xs[max(0, i - window + 1) : i + 1]) for i in range(len(xs))]


def plot(record: dict, png: str) -> None:
    """Loss (20-step mean) of every run, and each run's relative difference from bf16's, against the step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = record["runs"]
    precisions = list(dict.fromkeys(name.partition("@")[0] for name in runs))
    seeds = list(dict.fromkeys(name.partition("@")[2] for name in runs))
    styles = ("-", "--", ":", "-.")
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(7, 6), sharex=True)
    for name, r in runs.items():
        precision, _, seed = name.partition("@")  # records before --seeds name runs without "@seed"
        ref = _mean(runs[f"bf16@{seed}" if seed else "bf16"]["losses"])
        curve = _mean(r["losses"])
        steps = range(1, len(curve) + 1)
        # one colour per precision, one line style per seed; each precision named once in the legends
        label = precision if seeds.index(seed) == 0 else None
        look = dict(color=f"C{precisions.index(precision)}", linestyle=styles[seeds.index(seed) % len(styles)])
        top.plot(steps, curve, label=label, linewidth=1, **look)
        if precision != "bf16":
            n = min(len(curve), len(ref))
            diff = [100 * (a - b) / b for a, b in zip(curve[:n], ref[:n])]
            bottom.plot(steps[:n], diff, label=label, linewidth=1, **look)
    if len(seeds) > 1:
        top.set_title(f"line style: seed ({', '.join(seeds)})", fontsize="small")
    top.set_ylabel("training loss (20-step mean)")
    top.set_yscale("log")
    top.legend(fontsize="small")
    for bound in (1.0, -1.0):
        bottom.axhline(bound, color="grey", linewidth=0.5, linestyle="--")
    bottom.set_ylabel("difference from bf16, same seed (%)")
    bottom.set_xlabel("step")
    bottom.legend(fontsize="small")
    fig.suptitle(f"FP8 against bf16, {record['steps']} steps (benchmarks/fp8_accuracy.py)")
    fig.tight_layout()
    fig.savefig(png, dpi=100)


if __name__ == "__main__":
    main()
