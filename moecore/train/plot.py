"""`moecore plot RUN_DIR`: PNG plots of a run's metrics.jsonl (matplotlib, the optional `plot` extra).

Writes into RUN_DIR/plots (or `--out DIR`):
- `loss.png`: training loss (and the LM loss when logged apart) and validation loss over steps;
- `expert_load.png`: one heatmap per MoE layer, steps across, experts down, colour = the expert's share of
  the layer's routed tokens divided by the balanced share 1/E (1 = balanced, 0 = an unused expert), from
  the `moe/layer_{i}/tokens_per_expert` lists; a collapsed router shows as a few bright rows;
- `moe_balance.png`: per-layer aux loss and imbalance over steps, where logged.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections import defaultdict
from pathlib import Path

_LAYER_KEY = re.compile(r"^moe/layer_(\d+)/(tokens_per_expert|aux_loss|imbalance)$")
_VALID_KEYS = ("valid_loss", "valid/loss", "val_loss", "eval_loss", "eval/loss", "valid/lm_loss")


def read_metrics(path: Path) -> list[dict]:
    """The records of a metrics.jsonl file (a line cut short by a crash is ignored)."""
    out = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if isinstance(rec, dict) and "step" in rec:
            out.append(rec)
    return out


def _series(records: list[dict], key: str) -> tuple[list[int], list[float]]:
    xs, ys = [], []
    for r in records:
        v = r.get(key)
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            xs.append(r["step"])
            ys.append(float(v))
    return xs, ys


def plot_loss(records: list[dict], out: Path, plt) -> Path | None:
    fig, ax = plt.subplots(figsize=(8, 4.5))
    drawn = 0
    for key, label in (("loss", "train loss"), ("lm_loss", "train LM loss")):
        xs, ys = _series(records, key)
        if xs:
            ax.plot(xs, ys, label=label, linewidth=1.2)
            drawn += 1
    valid_keys = [k for k in _VALID_KEYS if any(k in r for r in records)]
    for key in valid_keys:
        xs, ys = _series(records, key)
        if xs:
            ax.plot(xs, ys, "o-", label=key.replace("_", " ").replace("/", " "), markersize=3)
            drawn += 1
    if not drawn:
        plt.close(fig)
        return None
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.grid(alpha=0.3)
    ax.legend()
    ax.set_title("Loss")
    fig.tight_layout()
    path = out / "loss.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _layer_series(records: list[dict]) -> dict[int, dict[str, list]]:
    """layer -> {stat: [(step, value), ...]} for the per-layer MoE keys."""
    layers: dict[int, dict[str, list]] = defaultdict(lambda: defaultdict(list))
    for r in records:
        for k, v in r.items():
            m = _LAYER_KEY.match(k)
            if m and v is not None:
                layers[int(m.group(1))][m.group(2)].append((r["step"], v))
    return layers


def plot_expert_load(records: list[dict], out: Path, plt) -> Path | None:
    import numpy as np

    layers = {i: d["tokens_per_expert"] for i, d in sorted(_layer_series(records).items()) if d["tokens_per_expert"]}
    if not layers:
        return None
    n = len(layers)
    cols = min(n, 4)
    rows = -(-n // cols)
    fig, axes = plt.subplots(
        rows, cols, figsize=(4.2 * cols + 1, 3.2 * rows + 0.6), squeeze=False, layout="constrained"
    )
    image = None
    for ax, (layer, series) in zip(axes.flat, layers.items()):
        steps = [s for s, _ in series]
        counts = np.asarray([np.asarray(v, dtype=np.float64).ravel() for _, v in series])  # [steps, experts]
        totals = counts.sum(axis=1, keepdims=True)
        rel = np.divide(counts * counts.shape[1], totals, out=np.zeros_like(counts), where=totals > 0)
        # Cell edges halfway between logged steps, so uneven logging intervals keep their true spacing.
        x = np.asarray(steps, dtype=np.float64)
        gaps = np.diff(x) if len(x) > 1 else np.ones(1)
        edges = np.concatenate([[x[0] - gaps[0] / 2], (x[:-1] + x[1:]) / 2, [x[-1] + gaps[-1] / 2]])
        image = ax.pcolormesh(
            edges,
            np.arange(counts.shape[1] + 1) - 0.5,
            rel.T,
            cmap="viridis",
            vmin=0.0,
            vmax=max(2.0, float(rel.max())),
            shading="flat",
        )
        ax.set_title(f"layer {layer}")
        ax.set_xlabel("step")
        ax.set_ylabel("expert")
    for ax in list(axes.flat)[n:]:
        ax.axis("off")
    fig.colorbar(image, ax=axes.ravel().tolist(), label="token share x num_experts (1 = balanced)")
    fig.suptitle("Expert load per MoE layer")
    path = out / "expert_load.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_balance(records: list[dict], out: Path, plt) -> Path | None:
    layers = _layer_series(records)
    stats = [s for s in ("aux_loss", "imbalance") if any(d[s] for d in layers.values())]
    if not stats:
        return None
    fig, axes = plt.subplots(1, len(stats), figsize=(6 * len(stats), 4), squeeze=False)
    for ax, stat in zip(axes.flat, stats):
        for layer, d in sorted(layers.items()):
            pts = [(s, float(v)) for s, v in d[stat] if isinstance(v, (int, float))]
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], label=f"layer {layer}", linewidth=1)
        ax.set_title(stat.replace("_", " "))
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        if len(layers) <= 12:
            ax.legend(fontsize=7)
    fig.tight_layout()
    path = out / "moe_balance.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


class _ArgError(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line instead of usage + error
        raise _ArgError(message)


def main(argv: list[str] | None = None) -> int:
    """Run `moecore plot`; returns the exit code (2 with one line on stderr for bad input)."""
    ap = _Parser(prog="moecore plot", description="Plot loss curves and expert load of a run.")
    ap.add_argument("run_dir", type=Path)
    ap.add_argument("--out", type=Path, default=None, help="output folder (default RUN_DIR/plots)")
    try:
        args = ap.parse_args(argv)
    except _ArgError as e:
        print(f"moecore plot: error: {e}", file=sys.stderr)
        return 2
    except SystemExit as e:  # --help
        return int(e.code or 0)
    metrics = args.run_dir / "metrics.jsonl"
    if not args.run_dir.is_dir():
        print(f"moecore plot: error: run folder {str(args.run_dir)!r} does not exist", file=sys.stderr)
        return 2
    if not metrics.is_file():
        print(f"moecore plot: error: {metrics} does not exist (is {args.run_dir} a run folder?)", file=sys.stderr)
        return 2
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("moecore plot: error: needs matplotlib (pip install 'moecore[plot]')", file=sys.stderr)
        return 2
    records = read_metrics(metrics)
    if not records:
        print(f"moecore plot: error: {metrics} holds no metric records", file=sys.stderr)
        return 2
    out = args.out or args.run_dir / "plots"
    out.mkdir(parents=True, exist_ok=True)
    written = [
        p
        for p in (plot_loss(records, out, plt), plot_expert_load(records, out, plt), plot_balance(records, out, plt))
        if p
    ]
    if not written:
        print(f"moecore plot: error: {metrics} has no loss or MoE keys to plot", file=sys.stderr)
        return 2
    for p in written:
        print(f"wrote {p}")
    return 0
