"""`moecore convert`: Hugging Face folders to moecore checkpoints and back.

    moecore convert --from-hf HF_DIR OUT_CKPT    # then: moecore train OUT_CKPT/config.yaml checkpoint.load=OUT_CKPT
    moecore convert --to-hf CKPT HF_DIR          # CKPT: a converted folder or a run's checkpoints/step-N

A moecore checkpoint folder is what training writes (`moecore.checkpoint.state`): the model's tensors
under "model" through torch.distributed.checkpoint (`*.distcp` + `.metadata`), `config.yaml`,
`manifest.json` (checksums) and a `complete` marker. A converted folder also carries the Hugging Face tokenizer files, and its
config.yaml points `data.tokenizer` at them. Both directions stream one Hugging Face tensor at a time
behind a progress bar; peak memory is about one copy of the model.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import shutil
import sys
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
import yaml
from torch import nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict

from moecore.config import Config, ConfigError, config_from_dict
from moecore.hf.families import family_names, get_family
from moecore.hf.io import DEFAULT_MAX_SHARD_BYTES, SafetensorsReader, copy_tokenizer_files, read_config_json
from moecore.hf.pretrained import (
    build_model_on_meta,
    checkpoint_dtype,
    config_for_checkpoint,
    count_hf_tensors,
    load_weights,
    materialize_params,
    pick_family,
    save_pretrained,
)

EXIT_BAD_INPUT = 2
DTYPE_CHOICES = {"auto": None, "fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


# --------------------------------------------------------------------------------------------------
# moecore checkpoint folders (model weights only)
# --------------------------------------------------------------------------------------------------


@contextlib.contextmanager
def _single_process_quiet() -> Iterator[None]:
    """Silence torch.distributed.checkpoint's notice that it runs in one process (conversion always does)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def save_model_checkpoint(model: nn.Module, cfg: Config, path: str | Path) -> Path:
    """Write the model's weights as a moecore checkpoint folder that `checkpoint.load` accepts."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    with _single_process_quiet():
        dcp.save({"model": get_model_state_dict(model)}, checkpoint_id=str(tmp))
    (tmp / "config.yaml").write_text(cfg.to_yaml())
    from moecore.checkpoint.manifest import data_files, hash_files, write_manifest

    write_manifest(tmp, hash_files(tmp, data_files(tmp)), step=None)  # checksums, then `complete`
    if path.exists():
        shutil.rmtree(path)
    os.replace(tmp, path)
    return path


def _checkpoint_config(path: Path) -> Config:
    """The config beside a checkpoint: its own config.yaml, else the run folder's (checkpoints/step-N/../..)."""
    for candidate in (path / "config.yaml", path.parent.parent / "config.yaml"):
        if candidate.is_file():
            return config_from_dict(yaml.safe_load(candidate.read_text()) or {})
    raise ValueError(f"{path} has no config.yaml (nor does its run folder); cannot tell what model it holds")


def _stored_dtype(path: Path) -> torch.dtype:
    meta = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    for key, item in meta.items():
        if key.startswith("model.") and hasattr(item, "properties") and item.properties.dtype.is_floating_point:
            return item.properties.dtype
    return torch.float32


def _check_checkpoint(path: Path) -> Path:
    if not path.is_dir() or not (path / ".metadata").exists():
        raise ValueError(f"{path} is not a moecore checkpoint folder (no .metadata)")
    return path


def load_model_checkpoint(path: str | Path, dtype: torch.dtype | None = None) -> tuple[nn.Module, Config]:
    """(model, config) from a moecore checkpoint folder; dtype None keeps the stored dtype."""
    from moecore.checkpoint import load_model_weights

    path = _check_checkpoint(Path(path))
    cfg = _checkpoint_config(path)
    cfg.parallel.tp = cfg.parallel.pp = cfg.parallel.cp = cfg.parallel.ep = cfg.parallel.etp = 1
    model = build_model_on_meta(cfg)
    materialize_params(model, dtype or _stored_dtype(path))
    with _single_process_quiet():
        load_model_weights(path, model)
    return model.eval(), cfg


# --------------------------------------------------------------------------------------------------
# The two directions
# --------------------------------------------------------------------------------------------------


def convert_from_hf(
    hf_dir: str | Path,
    out: str | Path,
    dtype: torch.dtype | None = None,
    on_tensor: Callable[[str], None] | None = None,
) -> Path:
    """Hugging Face folder -> moecore checkpoint folder (weights, config.yaml, tokenizer files)."""
    hf_dir, out = Path(hf_dir), Path(out)
    hf = read_config_json(hf_dir)
    family = get_family(hf.get("model_type"))
    with SafetensorsReader(hf_dir) as reader:
        cfg = config_for_checkpoint(family, hf, reader.names())
        model = build_model_on_meta(cfg)
        load_weights(model, family, cfg, reader, dtype or checkpoint_dtype(hf, reader), on_tensor)
    cfg.recipe = f"converted-{hf_dir.name}"
    if (hf_dir / "tokenizer.json").is_file():
        cfg.data.tokenizer = str(out.resolve())
    save_model_checkpoint(model, cfg, out)
    copy_tokenizer_files(hf_dir, out)
    return out


def convert_to_hf(
    ckpt: str | Path,
    hf_dir: str | Path,
    model_type: str | None = None,
    dtype: torch.dtype | None = None,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    on_tensor: Callable[[str], None] | None = None,
) -> Path:
    """moecore checkpoint folder -> Hugging Face folder that transformers loads (with tokenizer files)."""
    ckpt = Path(ckpt)
    model, cfg = load_model_checkpoint(ckpt)
    if dtype is None and cfg.train.precision == "fp8":  # never FP8 on export: an FP8 run's compute dtype is bf16
        dtype = torch.bfloat16
    tokenizer_dir = ckpt if (ckpt / "tokenizer.json").is_file() else cfg.data.tokenizer
    save_pretrained(model, hf_dir, model_type, dtype, max_shard_bytes, tokenizer_dir, on_tensor)
    return Path(hf_dir)


# --------------------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------------------


def parse_size(text: str) -> int:
    """'5GB', '500MB', '1.5GiB', '1000' -> bytes."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([KMGT]?i?B?)?\s*", text, re.IGNORECASE)
    if not m:
        raise ValueError(f"--max-shard-size={text!r} is invalid: a size such as 5GB, 500MB or 1000000")
    unit = (m.group(2) or "").upper().rstrip("B")
    powers = {"": 0, "K": 1, "M": 2, "G": 3, "T": 4}
    base = 1024 if unit.endswith("I") else 1000
    return int(float(m.group(1)) * base ** powers[unit.rstrip("I")])


def _progress(total: int, description: str, enabled: bool):
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    progress = Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("tensors"),
        TimeElapsedColumn(),
        disable=not enabled,
        transient=False,
    )
    task = progress.add_task(description, total=total)
    return progress, (lambda name: progress.advance(task))


def _count_import(hf_dir: Path) -> int:
    hf = read_config_json(hf_dir)
    family = get_family(hf.get("model_type"))
    with SafetensorsReader(hf_dir) as reader:
        cfg = config_for_checkpoint(family, hf, reader.names())
        return sum(len(mp.hf_names()) for mp in family.tensor_maps(cfg, set(reader.names())))


def _check_out(path: Path, overwrite: bool) -> None:
    if path.exists() and any(path.iterdir()) and not overwrite:
        raise ValueError(f"{path} exists and is not empty; choose a new folder or pass --overwrite")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="moecore convert", description="Convert Hugging Face checkpoints to moecore and back."
    )
    way = p.add_mutually_exclusive_group(required=True)
    way.add_argument(
        "--from-hf", nargs=2, metavar=("HF_DIR", "OUT_CKPT"), help="Hugging Face folder -> moecore checkpoint"
    )
    way.add_argument("--to-hf", nargs=2, metavar=("CKPT", "HF_DIR"), help="moecore checkpoint -> Hugging Face folder")
    p.add_argument(
        "--dtype", choices=sorted(DTYPE_CHOICES), default="auto", help="stored dtype (auto: keep the source's)"
    )
    p.add_argument(
        "--model-type", choices=family_names(), default=None, help="--to-hf: the Hugging Face family to write"
    )
    p.add_argument("--max-shard-size", default="5GB", help="--to-hf: largest safetensors shard (default 5GB)")
    p.add_argument("--overwrite", action="store_true", help="write into a folder that is not empty")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def main(argv: list[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    except SystemExit as e:  # argparse already printed the usage line
        return int(e.code or 0)
    dtype = DTYPE_CHOICES[args.dtype]
    show = not args.no_progress
    try:
        if args.from_hf:
            src, out = (Path(a) for a in args.from_hf)
            _check_out(out, args.overwrite)
            progress, tick = _progress(_count_import(src), f"import {src.name}", show)
            with progress:
                convert_from_hf(src, out, dtype, tick)
        else:
            src, out = (Path(a) for a in args.to_hf)
            _check_out(out, args.overwrite)
            max_bytes = parse_size(args.max_shard_size)
            cfg = _checkpoint_config(_check_checkpoint(src))
            model_type = args.model_type or pick_family(cfg)
            total = count_hf_tensors(cfg, model_type)
            progress, tick = _progress(total, f"export {src.name}", show)
            with progress:
                convert_to_hf(src, out, model_type, dtype, max_bytes, tick)
    except (ValueError, ConfigError, FileNotFoundError) as e:
        print(f"moecore convert: error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    print(f"wrote {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
