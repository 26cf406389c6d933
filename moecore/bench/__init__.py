"""`moecore bench moe-layer|train [--compare hf] [--json OUT]`: GPU benchmarks against transformers.

`main(argv)` parses the arguments after `bench` and returns the exit code (2 on bad input). The two
benchmarks live in `moe_layer.py` and `train.py`; `common.py` holds the timer and the record format
(`shape`, `impl`, `tflops`, `ms`, `peak_mem_gb`, `date`, `gpu`, `torch`; see docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import json
import sys

from moecore.bench.common import print_table


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="moecore bench", description="GPU benchmarks against transformers")
    p.add_argument("what", choices=("moe-layer", "train"), help="the MoE layer alone or a full training step")
    p.add_argument("--compare", choices=("hf",), default=None, help="also time transformers in the same process")
    p.add_argument("--json", default=None, metavar="OUT", help="write the records to this JSON file")
    p.add_argument("--shapes", default=None, help="comma-separated shape names (default: all of the issue's)")
    p.add_argument("--iters", type=int, default=10, help="timed iterations per measurement (median reported)")
    p.add_argument("--warmup", type=int, default=3, help="untimed iterations first")
    p.add_argument("--batch", type=int, default=None, help="train: sequences per step (default 2)")
    p.add_argument("--layers", type=int, default=None, help="train: decoder layers (default 8)")
    p.add_argument("--seq", type=int, default=None, help="train: sequence length (default 4096)")
    p.add_argument("--no-eager", action="store_true", help="moe-layer: skip transformers' eager experts")
    p.add_argument(
        "--variants",
        default="moecore",
        help="comma-separated moecore variants to time: moecore, moecore-unfused-router (both benches), "
        "moecore-all-grouped (moe-layer)",
    )
    p.add_argument("--phases", action="store_true", help="add a GPU-time breakdown by phase (torch.profiler)")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    if args.iters < 1 or args.warmup < 0:
        print("moecore bench: error: --iters must be >= 1 and --warmup >= 0", file=sys.stderr)
        return 2
    if args.what == "moe-layer":
        from moecore.bench.moe_layer import SHAPES, VARIANTS
    else:
        from moecore.bench.train import VARIANTS

        if args.shapes:
            print("moecore bench: error: --shapes applies to moe-layer only (train has one shape)", file=sys.stderr)
            return 2
        SHAPES = {}
    shapes = args.shapes.split(",") if args.shapes else list(SHAPES)
    variants = tuple(args.variants.split(","))
    for flag, given, allowed in (("--shapes", shapes, SHAPES), ("--variants", variants, VARIANTS)):
        bad = [v for v in given if v not in allowed]
        if bad:
            print(f"moecore bench: error: {flag} {bad[0]!r} is unknown; allowed: {', '.join(allowed)}", file=sys.stderr)
            return 2
    import torch

    if not torch.cuda.is_available():
        print("moecore bench: error: needs a CUDA GPU (none is visible)", file=sys.stderr)
        return 2
    if args.what == "moe-layer":
        from moecore.bench.moe_layer import run

        records = run(
            shapes,
            args.compare == "hf",
            args.warmup,
            args.iters,
            eager=not args.no_eager,
            phases=args.phases,
            variants=variants,
        )
    else:
        from moecore.bench.train import run

        records = run(
            args.compare == "hf",
            args.warmup,
            args.iters,
            args.batch,
            args.layers,
            args.seq,
            variants=variants,
            phases=args.phases,
        )
    print_table(records)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(records, f, indent=1)
    return 0
