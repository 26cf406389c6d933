"""Save and load the whole training state.

Layout of `checkpoints/step-N/` (or any folder given to `checkpoint.load`):
- `*.distcp` + `.metadata`: model and optimizer tensors through torch.distributed.checkpoint, keyed
  by parameter name (fully qualified), so that the files do not depend on how the run was laid out;
- `rank-R.pt`: per-rank state that is not a tensor of the model: step, data position, RNG states;
- `optim-rank-R.pt` instead of the optimizer's dcp tensors under `parallel.distributed_optimizer`:
  each rank's AdamW shard state with its layout (resumable under the same layout only);
- `config.yaml`: the resolved config of the run that wrote it;
- `complete`: written last; a folder without it is an interrupted save and is never resumed from.

Writes go to `step-N.tmp/` and are renamed at the end by rank 0, so a crash never leaves a
half-written folder that looks complete.
"""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import warnings
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from moecore.config import ConfigError
from moecore.parallel.sharding import wrap_for_checkpoint

# Optimizer state keyed per parameter name ("state.<fqn>.exp_avg", "param_groups.<fqn>.lr"): every
# rank's entries are its own parameters', so the files stay layout-free also when ranks hold different
# parameters (pipeline stages). Checkpoints written before keep one list of groups ("param_groups.0.lr").
_FLAT = StateDictOptions(flatten_optimizer_state_dict=True)


def _flat_optim(path: Path) -> bool:
    """Whether the checkpoint at `path` keys its optimizer hyper-parameters per parameter name."""
    keys = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    return not any(k.startswith("optim.param_groups.") and k.split(".")[2].isdigit() for k in keys)


def _sharded(optimizer) -> bool:
    """A distributed optimizer (moecore.parallel.distributed_optimizer) saves its shards per rank."""
    return hasattr(optimizer, "layout_signature")


def _optimizers(optimizer) -> list[torch.optim.Optimizer]:
    return list(getattr(optimizer, "optimizers", [optimizer]))


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


@contextlib.contextmanager
def _quiet_single_process() -> Iterator[None]:
    """Silence dcp's warning that no process group exists: one process is our normal case, not a mistake."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def checkpoint_dirs(run_dir: Path) -> list[Path]:
    """Complete checkpoints of a run, oldest first."""
    root = Path(run_dir) / "checkpoints"
    if not root.is_dir():
        return []
    found = [p for p in root.glob("step-*") if p.is_dir() and (p / "complete").exists() and p.name[5:].isdigit()]
    return sorted(found, key=lambda p: int(p.name[5:]))


def latest_checkpoint(run_dir: Path) -> Path | None:
    dirs = checkpoint_dirs(run_dir)
    return dirs[-1] if dirs else None


def save_training_state(
    path: Path, model: torch.nn.Module, optimizer, extra: dict, config_yaml: str, keep_last: int | None = None
) -> Path:
    """Write model + optimizer (dcp) and `extra` (per rank) to `path`; returns the final folder."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    if _rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True, exist_ok=True)
    _barrier()
    if _sharded(optimizer):
        # The model stays layout-free; each rank's AdamW shard goes to its own file.
        dcp.save({"model": wrap_for_checkpoint(model, get_model_state_dict(model))[0]}, checkpoint_id=str(tmp))
        torch.save(optimizer.state_dict(), tmp / f"optim-rank-{_rank()}.pt")
    else:
        model_sd, optim_sd = get_state_dict(model, _optimizers(optimizer), options=_FLAT)
        # Sharded (TP / EP) tensors are saved as chunks of their global tensors: layout-free files.
        model_sd, optim_sd = wrap_for_checkpoint(model, model_sd, optim_sd)
        with _quiet_single_process():
            dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(tmp))
    torch.save({**extra, "rng": rng_state()}, tmp / f"rank-{_rank()}.pt")
    _barrier()
    if _rank() == 0:
        (tmp / "config.yaml").write_text(config_yaml)
        (tmp / "complete").write_text("ok\n")
        shutil.rmtree(path, ignore_errors=True)
        os.replace(tmp, path)
        if keep_last:
            for old in checkpoint_dirs(path.parent.parent)[:-keep_last]:
                shutil.rmtree(old, ignore_errors=True)
    _barrier()
    return path


def _check_folder(path: Path) -> Path:
    path = Path(path)
    if not path.is_dir() or not (path / ".metadata").exists():
        raise ConfigError(f"checkpoint.load={str(path)!r} is invalid: not a moecore checkpoint folder (no .metadata)")
    return path


def load_training_state(path: Path, model: torch.nn.Module, optimizer) -> dict:
    """Load model + optimizer from `path`, restore RNG; returns this rank's extra state."""
    path = _check_folder(path)
    has_shards = (path / "optim-rank-0.pt").exists()
    if _sharded(optimizer) or has_shards:
        optim_file = path / f"optim-rank-{_rank()}.pt"
        if not (_sharded(optimizer) and optim_file.exists()):
            mine, saved = str(_sharded(optimizer)).lower(), str(has_shards).lower()
            why = "by fewer ranks" if mine == saved else f"with parallel.distributed_optimizer={saved}"
            raise ConfigError(
                f"parallel.distributed_optimizer={mine} cannot resume {str(path)!r}: its optimizer state was saved "
                f"{why}; resume with the setting and layout it was saved under (or load its weights: checkpoint.load)"
            )
        load_model_weights(path, model)
        optimizer.load_state_dict(torch.load(optim_file, weights_only=False))
    else:
        options = _FLAT if _flat_optim(path) else None
        model_sd, optim_sd = get_state_dict(model, _optimizers(optimizer), options=options)
        with _quiet_single_process():
            wrapped = wrap_for_checkpoint(model, model_sd, optim_sd)
            dcp.load(dict(zip(("model", "optim"), wrapped)), checkpoint_id=str(path))
        state = {"model": model_sd, "optim": optim_sd}  # the wrapped shards were loaded in place
        set_state_dict(
            model,
            _optimizers(optimizer),
            model_state_dict=state["model"],
            optim_state_dict=state["optim"],
            options=options,
        )
    rank_file = path / f"rank-{_rank()}.pt"
    if not rank_file.exists():
        rank_file = path / "rank-0.pt"
    extra = torch.load(rank_file, weights_only=False)
    set_rng_state(extra.pop("rng"))
    return extra


def load_model_weights(path: Path, model: torch.nn.Module) -> None:
    """Load only the model's tensors from a checkpoint folder (fine-tuning start, conversion)."""
    path = _check_folder(path)
    state = {"model": get_model_state_dict(model)}
    with _quiet_single_process():
        dcp.load({"model": wrap_for_checkpoint(model, state["model"])[0]}, checkpoint_id=str(path))
    set_model_state_dict(model, state["model"])
