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
    p.add_argument("--shapes", default=None, help="comma-separated shape names (default: all of them)")
    p.add_argument("--iters", type=int, default=10, help="timed iterations per measurement (median reported)")
    p.add_argument("--warmup", type=int, default=3, help="untimed iterations first")
    p.add_argument(
        "--model",
        default="qwen3-30b-a3b",
        help="train: the proxy (recipe + overrides): qwen3-30b-a3b, qwen3-next, deepseek-v3",
    )
    p.add_argument(
        "--precision", default="bf16,mixed", help="train: comma-separated modes: bf16 (bf16 weights and moments), "
        "mixed (bf16 weights, fp32 master weights and moments), fp8 (mixed with FP8 GEMMs); moe-layer: fp8 adds "
        "the variants moecore-fp8-tensorwise, -rowwise, -blockwise beside moecore"
    )  # fmt: skip
    p.add_argument("--batch", type=int, default=None, help="train: sequences per step (one micro-batch)")
    p.add_argument("--layers", type=int, default=None, help="train: decoder layers")
    p.add_argument("--seq", type=int, default=None, help="train: sequence length")
    p.add_argument("overrides", nargs="*", help="train: more section.field=value overrides of the proxy's config")
    p.add_argument("--no-eager", action="store_true", help="moe-layer: skip transformers' eager experts")
    p.add_argument(
        "--variants",
        default="moecore",
        help="comma-separated moecore variants to time: moecore, moecore-unfused-router (both benches), "
        "moecore-all-grouped, moecore-all-triton, moecore-all-quack, moecore-torch-gemms, moecore-fp32-router-gemm, moecore-minimal[-swiglu-epilogue], moecore-chunked[-<rows>], moecore-sync-free, "
        "moecore-fp8-<tensorwise|rowwise|blockwise>, moecore-fp8-rowwise-bf16wgrad, moecore-fp8-rowwise-fp8wgrad, moecore-fp8-rowwise-primary, "
        "moecore-fp8-rowwise-wgradpad, moecore-fp8-rowwise-primary-wgradpad, moecore-fp8-rowwise-[primary-]triton, "
        "-allpad, -torchgemm, -hybrid, moecore-clipped[-unfused] (moe-layer); moecore-sparse-attention (train, DeepSeek-V4)",
    )
    p.add_argument(
        "--routing", default="random", help="moe-layer: comma-separated: random (near-uniform) and/or skewed (a few "
        "experts take most tokens)"
    )  # fmt: skip
    p.add_argument("--phases", action="store_true", help="add a GPU-time breakdown by phase (torch.profiler)")
    p.add_argument("--trace", default=None, metavar="DIR", help="train: write a gzipped Chrome trace of one step each")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_intermixed_args(argv)
    if args.iters < 1 or args.warmup < 0:
        print("moecore bench: error: --iters must be >= 1 and --warmup >= 0", file=sys.stderr)
        return 2
    if args.what == "moe-layer":
        from moecore.bench.moe_layer import ROUTINGS, SHAPES, VARIANTS, is_variant

        bad = [v for v in args.routing.split(",") if v not in ROUTINGS]
        if bad:
            print(
                f"moecore bench: error: --routing {bad[0]!r} is unknown; allowed: {', '.join(ROUTINGS)}",
                file=sys.stderr,
            )
            return 2
    else:
        from moecore.bench.train import MODES, PROXIES, VARIANTS

        is_variant = VARIANTS.__contains__

        if args.shapes:
            print("moecore bench: error: --shapes applies to moe-layer only (train: --model)", file=sys.stderr)
            return 2
        SHAPES = {}
        for flag, given, allowed in (
            ("--model", [args.model], PROXIES),
            ("--precision", args.precision.split(","), MODES),
        ):
            bad = [v for v in given if v not in allowed]
            if bad:
                print(
                    f"moecore bench: error: {flag} {bad[0]!r} is unknown; allowed: {', '.join(allowed)}",
                    file=sys.stderr,
                )
                return 2
    if args.what == "train":
        from moecore.bench.train import bench_config
        from moecore.config import ConfigError

        try:
            for mode in args.precision.split(","):
                bench_config(args.model, mode, "moecore", args.overrides).validate()
        except ConfigError as e:
            print(f"moecore bench: error: {e}", file=sys.stderr)
            return 2
    if args.what == "moe-layer" and args.overrides:
        print("moecore bench: error: overrides apply to train only", file=sys.stderr)
        return 2
    shapes = args.shapes.split(",") if args.shapes else list(SHAPES)
    variants = tuple(args.variants.split(","))
    if args.what == "moe-layer" and "fp8" in args.precision.split(","):  # FP8 experts beside the bf16 layer
        fp8 = ("moecore-fp8-tensorwise", "moecore-fp8-rowwise", "moecore-fp8-blockwise")
        variants += tuple(v for v in fp8 if v not in variants)
    for flag, given, allowed, known in (
        ("--shapes", shapes, SHAPES, SHAPES.__contains__),
        ("--variants", variants, VARIANTS, is_variant),
    ):
        bad = [v for v in given if not known(v)]
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
            routing=tuple(args.routing.split(",")),
        )
    else:
        from moecore.bench.train import run

        overrides = list(args.overrides)
        if args.batch:
            overrides += [f"train.global_batch_size={args.batch}", f"train.micro_batch_size={args.batch}"]
        if args.layers:
            overrides.append(f"model.num_layers={args.layers}")
        if args.seq:
            overrides.append(f"train.seq_length={args.seq}")
        records = run(
            args.compare == "hf",
            args.warmup,
            args.iters,
            model=args.model,
            modes=tuple(args.precision.split(",")),
            variants=variants,
            phases=args.phases,
            overrides=tuple(overrides),
            trace=args.trace,
        )
    print_table(records)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(records, f, indent=1)
    return 0
