"""`moecore plan RECIPE [overrides] --gpus N --gpu-mem GB`: the ranked table, one sentence, JSON.

The table lists the top layouts (fits or not, GiB per GPU by kind, estimated tokens/s and MFU, and
whether this version's trainer runs the layout); the sentence explains the top choice and names the
best layout the trainer runs today when the top one is not. `--json OUT` writes every candidate's
estimate with the stated assumptions. Memory is in GiB (2^30 bytes): `--gpu-mem 80` means 80 GiB.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from moecore.config import Config, ConfigError, load_config
from moecore.plan.memory import IMBALANCE_MARGIN, GiB, PlanOptions
from moecore.plan.params import total_params
from moecore.plan.search import Candidate, best_supported, search
from moecore.plan.throughput import (
    HBM_GBPS,
    INTER_NODE_GBPS,
    INTRA_NODE_GBPS,
    MATMUL_EFFICIENCY,
    PEAK_TFLOPS,
    Hardware,
)

HEADER = ("#", "layout", "fits", "params", "grads", "optim", "acts", "other", "total GiB", "tokens/s", "MFU", "runs")


def _row(i: int, c: Candidate) -> tuple:
    k = c.memory.by_kind()
    return (
        str(i),
        c.layout.label(),
        "yes" if c.fits else "no",
        f"{k['params']:.1f}",
        f"{k['grads']:.1f}",
        f"{k['optimizer']:.1f}",
        f"{k['activations']:.1f}",
        f"{k['other'] + k['framework']:.1f}",
        f"{k['total']:.1f}",
        f"{c.step.tokens_per_s:,.0f}",
        f"{c.step.mfu:.3f}",
        "yes" if c.unsupported is None else "not yet",
    )


def format_table(cands: list[Candidate], first: int = 1) -> str:
    """A plain-text table (columns padded) of the given candidates, numbered from `first`."""
    rows = [HEADER] + [_row(first + i, c) for i, c in enumerate(cands)]
    widths = [max(len(r[j]) for r in rows) for j in range(len(HEADER))]
    lines = []
    for n, r in enumerate(rows):
        cells = [r[j].ljust(widths[j]) if j in (1, 11) else r[j].rjust(widths[j]) for j in range(len(r))]
        lines.append("  ".join(cells).rstrip())
        if n == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def explain(cands: list[Candidate], gpus: int, gpu_mem: float) -> str:
    """One sentence about the top choice (and the best one the trainer runs today, if different)."""
    if not cands:
        return f"No valid layout on {gpus} GPUs."
    top = cands[0]
    k = top.memory.by_kind()
    if not top.fits:
        return (
            f"Nothing fits in {gpu_mem:g} GiB on {gpus} GPUs: the leanest layout ({top.layout.label()}) needs "
            f"{k['total']:.1f} GiB per GPU ({k['params'] + k['grads'] + k['optimizer']:.1f} of parameters, "
            f"gradients and optimizer state, {k['activations']:.1f} of activations); use more GPUs or less state."
        )
    why = (
        f"{top.layout.label()} is the fastest layout that fits: {k['total']:.1f} of {gpu_mem:g} GiB per GPU "
        f"({k['params'] + k['grads'] + k['optimizer']:.1f} state, {k['activations']:.1f} activations with "
        f"{top.memory.in_flight:g} micro-batch(es) in flight) at an estimated {top.step.tokens_per_s:,.0f} tokens/s "
        f"(MFU {top.step.mfu:.2f}, {_dominant_cost(top)})"
    )
    if top.unsupported is None:
        return why + "."
    best = best_supported(cands)
    tail = (
        f"; the trainer does not run it yet ({top.unsupported}), and the best layout it runs today is "
        f"{best.layout.label()} at {best.step.tokens_per_s:,.0f} tokens/s."
        if best is not None
        else f"; the trainer does not run it yet ({top.unsupported}), and no layout it runs today fits."
    )
    return why + tail


def _dominant_cost(c: Candidate) -> str:
    s = c.step
    parts = {
        "tensor-parallel communication": s.tp_s,
        "expert all-to-all": s.ep_s,
        "context-parallel communication": s.cp_s,
        "the pipeline bubble": s.bubble_s + s.pp_s,
        "exposed data-parallel communication": s.dp_exposed_s,
        "the chunked experts' per-chunk cost": s.chunks_s,
    }
    name, sec = max(parts.items(), key=lambda kv: kv[1])
    if sec < 0.02 * s.step_s:
        return "communication and bubble under 2% of the step"
    return f"{name} takes {100 * sec / s.step_s:.0f}% of the step"


def plan(cfg: Config, gpus: int, gpu_mem: float, hw: Hardware, opts: PlanOptions) -> list[Candidate]:
    """Validate the inputs (ConfigError on bad ones) and search."""
    if gpus < 1:
        raise ConfigError(f"--gpus={gpus} is invalid: must be >= 1")
    if gpu_mem <= 0:
        raise ConfigError(f"--gpu-mem={gpu_mem:g} is invalid: must be > 0 (GiB per GPU)")
    if hw.gpus_per_node < 1:
        raise ConfigError(f"--gpus-per-node={hw.gpus_per_node} is invalid: must be >= 1")
    if gpus > hw.gpus_per_node and gpus % hw.gpus_per_node:
        raise ConfigError(
            f"--gpus={gpus} is invalid: more than one node needs a multiple of --gpus-per-node={hw.gpus_per_node}"
        )
    cands = search(cfg, gpus, gpu_mem, hw, opts)
    if not cands:
        raise ConfigError(
            f"--gpus={gpus} is invalid for recipe {cfg.recipe}: no layout tiles it (train.global_batch_size="
            f"{cfg.train.global_batch_size} must split over data parallel, heads over tp, experts over ep)"
        )
    return cands


def smallest_fit(cfg: Config, gpus: int, gpu_mem: float, hw: Hardware, opts: PlanOptions) -> str:
    """Where nothing fits: the smallest of 2x, 4x, 8x the GPUs on which a layout fits (its fastest)."""
    for factor in (2, 4, 8):
        n = gpus * factor
        cands = [c for c in search(cfg, n, gpu_mem, hw, opts) if c.fits]
        if cands:
            best = cands[0]
            runs = "runs today" if best.unsupported is None else "the trainer does not run yet"
            return (
                f"On {n} GPUs it fits: {best.layout.label()} at {best.memory.total / GiB:.1f} GiB per GPU, "
                f"{best.step.tokens_per_s:,.0f} tokens/s (a layout {runs})."
            )
    return f"No layout fits on up to {8 * gpus} GPUs of {gpu_mem:g} GiB."


def _resolve_vocab(cfg: Config) -> None:
    """Recipes with model.vocab_size 0 take the embedded tokenizer's vocabulary, as `moecore train` does."""
    if cfg.model.vocab_size <= 0:
        from moecore.data.tokenizer import load_tokenizer

        cfg.model.vocab_size = load_tokenizer(cfg.data.tokenizer).vocab_size


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors (exit code 2), like the rest of the CLI's bad input."""

    def error(self, message: str):
        print(f"moecore: error: plan: {message}", file=sys.stderr)
        raise SystemExit(2)


# DeepSeek-V4's compressed attention runs far below the matmul rate assumed above (docs/plan.md, docs/benchmarks.md
# run CY); said under the table until its cost is modelled from a measurement
COMPRESSED_ATTENTION_CAVEAT = (
    "caution: DeepSeek-V4's compressed attention is timed as plain matmuls here; on one H100 a 2-layer real-width "
    "step ran 12x slower than this estimate (docs/plan.md): read its tokens/s and MFU as an upper bound"
)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="moecore plan", description="What fits, on how many GPUs, in which layout.")
    p.add_argument("recipe", help="a shipped recipe name or a YAML file")
    p.add_argument("overrides", nargs="*", help="section.field=value overrides")
    p.add_argument("--gpus", type=int, required=True, help="number of GPUs")
    p.add_argument("--gpu-mem", type=float, required=True, help="memory per GPU in GiB")
    p.add_argument("--gpus-per-node", type=int, default=8)
    p.add_argument("--top", type=int, default=5, help="rows of the table")
    p.add_argument("--json", default=None, help="write every candidate's estimate here")
    p.add_argument(
        "--imbalance", type=float, default=IMBALANCE_MARGIN, help="routed rows on the busiest expert rank / mean"
    )
    p.add_argument("--efficiency", type=float, default=MATMUL_EFFICIENCY, help="achieved fraction of the peak")
    p.add_argument("--peak-tflops", type=float, default=PEAK_TFLOPS)
    p.add_argument("--intra-gbps", type=float, default=INTRA_NODE_GBPS, help="NVLink GB/s per GPU")
    p.add_argument("--inter-gbps", type=float, default=INTER_NODE_GBPS, help="inter-node GB/s per GPU")
    p.add_argument("--hbm-gbps", type=float, default=HBM_GBPS, help="GPU memory GB/s (optimizer step)")
    return p


def run(args: argparse.Namespace) -> int:
    """The `moecore plan` command (args from `build_parser`)."""
    cfg = load_config(args.recipe, list(args.overrides))
    cfg.validate()
    _resolve_vocab(cfg)
    if args.top < 1:
        raise ConfigError(f"--top={args.top} is invalid: must be >= 1")
    if args.imbalance < 1:
        raise ConfigError(f"--imbalance={args.imbalance:g} is invalid: must be >= 1")
    if not 0 < args.efficiency <= 1:
        raise ConfigError(f"--efficiency={args.efficiency:g} is invalid: must be in (0, 1]")
    hw = Hardware(
        args.gpus_per_node, args.peak_tflops, args.efficiency, args.intra_gbps, args.inter_gbps, args.hbm_gbps
    )
    opts = PlanOptions(imbalance=args.imbalance)
    cands = plan(cfg, args.gpus, args.gpu_mem, hw, opts)
    total, active = total_params(cfg)
    print(
        f"moecore plan {cfg.recipe}: {total / 1e9:.1f}B parameters ({active / 1e9:.1f}B active), "
        f"{args.gpus} GPUs x {args.gpu_mem:g} GiB, global batch {cfg.train.global_batch_size} x "
        f"{cfg.train.seq_length} tokens; {len(cands)} layouts, {sum(c.fits for c in cands)} fit"
    )
    shown = cands[: args.top]
    best = best_supported(cands)
    print(format_table(shown))
    if best is not None and best not in shown:
        print("best layout the trainer runs today:")
        print(format_table([best], cands.index(best) + 1).splitlines()[-1])
    print(explain(cands, args.gpus, args.gpu_mem))
    if not any(c.fits for c in cands):
        print(smallest_fit(cfg, args.gpus, args.gpu_mem, hw, opts))
    print(
        f"assumptions: matmuls at {hw.efficiency:g} x {hw.peak_tflops:g} TFLOP/s"
        + (" (FP8 GEMMs timed as bf16's)" if cfg.train.precision == "fp8" else "")
        + f", optimizer at {hw.hbm_gbps:g} GB/s, "
        f"NVLink {hw.intra_gbps:g} GB/s, "
        f"inter-node {hw.inter_gbps:g} GB/s per GPU, expert load imbalance x{opts.imbalance:g}, "
        "framework = 1 GiB + 0.25 GiB per NCCL group + 5%; 'other' = loss, backward workspace, step buffers, framework"
    )
    if cfg.model.attention_type == "compressed":
        print(COMPRESSED_ATTENTION_CAVEAT)
    if args.json:
        out = {
            "recipe": cfg.recipe,
            "gpus": args.gpus,
            "gpu_mem_gib": args.gpu_mem,
            "hardware": vars(hw),
            "imbalance": opts.imbalance,
            "params_total": total,
            "params_active": active,
            "candidates": [c.to_dict() for c in cands],
            "explanation": explain(cands, args.gpus, args.gpu_mem),
        }
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


def main(argv: list[str] | None = None) -> int:
    return run(build_parser().parse_args(argv))
