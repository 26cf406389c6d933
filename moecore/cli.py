"""The `moecore` command line: train, recipes, generate, convert, preprocess, plot, bench, plan, checkpoint.

Each subcommand is a thin layer over a Python function. Bad input (a `ConfigError` or a missing
file) prints one line naming the field or file, the value and what is allowed, and exits with
code 2; `--debug` before the subcommand shows the traceback instead.

Exit codes of `moecore train`: 0 done; 2 bad input (config, corrupt `checkpoint.load`); 3 non-finite
loss or gradients (moecore/train/guards.py); 75 stopped by a stop signal after saving a checkpoint
(moecore/train/signals.py; run the same command with checkpoint.resume=true to continue); 130 Ctrl-C.
`moecore checkpoint verify PATH`: 0 intact, 1 corrupt or incomplete, 2 no such checkpoint.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from moecore.config import ConfigError
from moecore.train.signals import EXIT_PREEMPTED

EXIT_BAD_INPUT = 2


def _is_main_process() -> bool:
    return os.environ.get("RANK", "0") == "0"


def _console():
    from rich.console import Console

    return Console(stderr=True, quiet=not _is_main_process())


def cmd_train(args: argparse.Namespace) -> int:
    from moecore.config import load_config
    from moecore.train.guards import NonFiniteError
    from moecore.train.loop import preflight, train

    console = _console()
    recipe, overrides = args.recipe, list(args.overrides)
    if recipe is not None and "=" in recipe:  # `moecore train a.b=c`: no recipe, only overrides
        recipe, overrides = None, [recipe, *overrides]
    cfg = load_config(recipe, overrides)
    preflight(cfg)
    console.print(f"[bold]moecore train[/bold] recipe={cfg.recipe}")
    try:
        result = train(cfg, console)
    except NonFiniteError as e:
        if args.debug:
            raise
        if _is_main_process():
            print(f"moecore: error: {e}", file=sys.stderr)
        return e.exit_code
    if result.stopped_by is not None:
        if _is_main_process():
            print(
                f"moecore: stopped by {result.stopped_by} after step {result.last_step}; checkpoint "
                f"{result.checkpoint} saved; resume with checkpoint.resume=true (exit code {EXIT_PREEMPTED})",
                file=sys.stderr,
            )
        return EXIT_PREEMPTED
    if _is_main_process() and result.losses:
        val = f", validation loss {result.val_losses[-1][1]:.4f}" if result.val_losses else ""
        console.print(
            f"[bold green]done[/bold green]: {result.last_step} steps in {result.seconds:.1f}s, "
            f"loss {result.first_loss:.4f} -> {result.final_loss:.4f}{val}; run folder {result.run_dir}"
        )
        for row in result.stages:  # pipeline parallel: what each pipeline rank held
            console.print(
                f"pipeline rank {row['pp_rank']}: stages {' '.join(row['stages'])}, {row['params']:,} parameters, "
                f"peak memory {row['peak_mem_gb']:.2f} GiB ({row['peak_mem_kind']})",
                highlight=False,
            )
        if result.memory:
            mem = ", ".join(f"{k[7:-3]} {v:.3g}" for k, v in result.memory.items())
            console.print(f"memory per rank (GiB): {mem}", highlight=False)
    return 0


def cmd_checkpoint(args: argparse.Namespace) -> int:
    from moecore.checkpoint import checkpoint_dirs, verify_checkpoint

    path = Path(args.path)
    if not path.is_dir():
        raise ConfigError(f"checkpoint verify {str(path)!r} is invalid: no such folder")
    is_run = (path / "checkpoints").is_dir() and not (path / ".metadata").exists()
    targets = sorted((path / "checkpoints").glob("step-*"), key=lambda p: p.name) if is_run else [path]
    if is_run and not checkpoint_dirs(path) and not targets:
        raise ConfigError(f"checkpoint verify {str(path)!r} is invalid: the run folder has no checkpoints")
    bad = 0
    for target in targets:
        result = verify_checkpoint(target)
        bad += not result.ok
        print(result.message(), file=sys.stdout if result.ok else sys.stderr)
    return 1 if bad else 0


def cmd_recipes(args: argparse.Namespace) -> int:
    import yaml

    from moecore.config import RECIPE_DIR, list_recipes

    for name in list_recipes():
        data = yaml.safe_load((RECIPE_DIR / f"{name}.yaml").read_text()) or {}
        desc = data.get("description", "") if isinstance(data, dict) else ""
        print(f"{name:24s} {desc}")
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    from moecore.generate import generate_from_run

    text = generate_from_run(
        Path(args.run_dir),
        args.prompt,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        seed=args.seed,
    )
    print(text)
    return 0


def _delegate(module: str, argv: list[str]) -> int:
    import importlib

    return int(importlib.import_module(module).main(argv) or 0)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="moecore", description="Train Mixture-of-Experts language models.")
    p.add_argument("--debug", action="store_true", help="show tracebacks for bad input")
    sub = p.add_subparsers(dest="command", required=True)

    t = sub.add_parser("train", help="train a model from a recipe (default: the tiny recipe on the embedded corpus)")
    t.add_argument("recipe", nargs="?", default=None, help="a shipped recipe name or a YAML file")
    t.add_argument("overrides", nargs="*", help="section.field=value overrides")
    t.set_defaults(func=cmd_train)

    r = sub.add_parser("recipes", help="list the shipped recipes")
    r.set_defaults(func=cmd_recipes)

    g = sub.add_parser("generate", help="sample text from a run's latest checkpoint")
    g.add_argument("run_dir")
    g.add_argument("--prompt", required=True)
    g.add_argument("--max-new-tokens", type=int, default=100)
    g.add_argument("--temperature", type=float, default=0.8)
    g.add_argument("--top-k", type=int, default=50)
    g.add_argument("--seed", type=int, default=0)
    g.set_defaults(func=cmd_generate)

    c = sub.add_parser("checkpoint", help="check a checkpoint folder (or every checkpoint of a run folder)")
    csub = c.add_subparsers(dest="action", required=True)
    v = csub.add_parser("verify", help="verify files, sizes and sha256 against the checkpoint's manifest")
    v.add_argument("path", help="a checkpoint folder (checkpoints/step-N) or a run folder")
    v.set_defaults(func=cmd_checkpoint)

    # Subcommands implemented in their own modules take the rest of the command line as is.
    for name, module, help_ in (
        ("convert", "moecore.hf.convert", "convert Hugging Face checkpoints to moecore and back"),
        ("preprocess", "moecore.data.preprocess", "tokenize jsonl/parquet into an indexed dataset (.bin/.idx)"),
        ("plot", "moecore.train.plot", "plot loss curves and expert load of a run"),
        ("bench", "moecore.bench", "benchmark the MoE layer or a training step"),
        ("plan", "moecore.plan.report", "what fits, on how many GPUs, in which layout (memory and speed estimates)"),
    ):
        s = sub.add_parser(name, help=help_, add_help=False)
        s.add_argument("rest", nargs=argparse.REMAINDER)
        s.set_defaults(func=lambda a, m=module: _delegate(m, a.rest))
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser()
    # argparse's REMAINDER drops options like `--from-hf` after a subcommand; hand delegated subcommands
    # everything after their name untouched.
    first = next((i for i, a in enumerate(argv) if not a.startswith("-")), None)
    if first is not None and argv[first] in ("convert", "preprocess", "plot", "bench", "plan"):
        args = parser.parse_args(argv[: first + 1])
        args.rest = argv[first + 1 :]
    else:
        args = parser.parse_args(argv)
    try:
        return args.func(args)
    except (ConfigError, FileNotFoundError) as e:
        if args.debug:
            raise
        msg = str(e) if isinstance(e, ConfigError) else f"{e.filename or e}: {e.strerror or 'not found'}"
        if _is_main_process():  # under torchrun every rank fails alike; one line is enough
            print(f"moecore: error: {msg}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:
        print("moecore: interrupted", file=sys.stderr)
        return 130


def entry() -> None:
    sys.exit(main())


if __name__ == "__main__":
    entry()
