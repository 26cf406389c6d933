"""Save and load the whole training state.

Layout of `checkpoints/step-N/` (or any folder given to `checkpoint.load`):
- `*.distcp` + `.metadata`: model and optimizer tensors through torch.distributed.checkpoint, keyed
  by parameter name (fully qualified), so that the files do not depend on how the run was laid out;
- `rank-R.pt`: per-rank state that is not a tensor of the model: step, data position, RNG states;
  (the distributed optimizer gathers its shards into the same per-parameter entries: `_per_parameter`);
- `config.yaml`: the resolved config of the run that wrote it;
- `manifest.json`: every file above with its size and sha256, the step, layout and versions
  (moecore/checkpoint/manifest.py), written once all data is on disk;
- `complete`: written last; a folder without it is an interrupted save and is never resumed from.

Writes go to `step-N.tmp/` and are renamed at the end by rank 0, so a crash never leaves a
half-written folder that looks complete. A save is three phases (`begin_save`, `write_state`,
`finish_save`) so that `moecore.checkpoint.saver` can run the last two in a background thread.
Loading verifies the manifest first (a corrupt folder is refused with one line naming the bad file)
and checks that the checkpoint's tensor shapes fit the model.
"""

from __future__ import annotations

import contextlib
import copy
import itertools
import os
import random
import shutil
import sys
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
from torch.distributed.tensor import DTensor

from moecore.checkpoint.manifest import (
    COMPLETE,
    Verification,
    data_files,
    fsync,
    hash_files,
    merge_verifications,
    verify_checkpoint,
    write_manifest,
)
from moecore.config import ConfigError
from moecore.parallel.sharding import get_shard, wrap_for_checkpoint

# Optimizer state keyed per parameter name ("state.<fqn>.exp_avg", "param_groups.<fqn>.lr"): every
# rank's entries are its own parameters', so the files stay layout-free also when ranks hold different
# parameters (pipeline stages). Checkpoints written before keep one list of groups ("param_groups.0.lr").
_FLAT = StateDictOptions(flatten_optimizer_state_dict=True)


def _flat_optim(path: Path) -> bool:
    """Whether the checkpoint at `path` keys its optimizer hyper-parameters per parameter name."""
    keys = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    return not any(k.startswith("optim.param_groups.") and k.split(".")[2].isdigit() for k in keys)


def _per_parameter(optimizer) -> bool:
    """The distributed optimizer (moecore.parallel.distributed_optimizer) states itself per parameter name.

    Its `state_dict(flat)` gathers each shard into tensors shaped like the local parameters, in the
    format `get_state_dict` gives for torch's AdamW (flattened or not), so the files are the same as
    without it; `load_state_dict` cuts its shards out of that format again.
    """
    return hasattr(optimizer, "clip_grad_norm") and hasattr(optimizer, "buckets")


def _refuse_old_shards(path: Path) -> None:
    if (path / "optim-rank-0.pt").exists():
        raise ConfigError(
            f"checkpoint.resume={str(path)!r} is invalid: its optimizer state was saved per rank by an older "
            "distributed optimizer; load its weights only (checkpoint.load)"
        )


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


def _barrier(group=None) -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier(group=group)


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


def _group_rank_world(group=None) -> tuple[int, int]:
    if not (dist.is_available() and dist.is_initialized()):
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def _gather(obj, group=None) -> list:
    """Every rank's `obj` (in rank order), on every rank."""
    rank, world = _group_rank_world(group)
    if world == 1:
        return [obj]
    out = [None] * world
    dist.all_gather_object(out, obj, group=group)
    return out


def note(message: str) -> None:
    """A one-line warning or note on stderr, from rank 0 only (every rank would print the same)."""
    if _rank() == 0:
        print(f"moecore: {message}", file=sys.stderr, flush=True)


def step_of(p: Path) -> int | None:
    name = p.name[5:]
    name = name[:-4] if name.endswith(".tmp") else name
    return int(name) if p.name.startswith("step-") and name.isdigit() else None


def checkpoint_dirs(run_dir: Path) -> list[Path]:
    """Checkpoints of a run that carry the `complete` marker, oldest first (not verified: see `find_resumable`)."""
    root = Path(run_dir) / "checkpoints"
    if not root.is_dir():
        return []
    found = [
        p
        for p in root.glob("step-*")
        if p.is_dir() and not p.name.endswith(".tmp") and step_of(p) is not None and (p / COMPLETE).exists()
    ]
    return sorted(found, key=step_of)


def latest_checkpoint(run_dir: Path) -> Path | None:
    dirs = checkpoint_dirs(run_dir)
    return dirs[-1] if dirs else None


def layout_of(model: torch.nn.Module) -> dict:
    """The parallel layout a model was built for (recorded in the manifest)."""
    dims = getattr(model, "dims", None)
    if dims is None:
        return {"world_size": 1}
    names = ("world_size", "tp", "pp", "cp", "ep", "etp", "dp")
    return {n: int(getattr(dims, n)) for n in names if isinstance(getattr(dims, n, None), int)}


# --------------------------------------------------------------------------------------------------
# Saving: begin (folder), write (tensors, per-rank files), finish (manifest, marker, rename)
# --------------------------------------------------------------------------------------------------


def begin_save(path: Path, config_yaml: str, group=None) -> Path:
    """Create the empty `step-N.tmp/` (rank 0) with the run's config; returns it. Collective."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    if _rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True, exist_ok=True)
        (tmp / "config.yaml").write_text(config_yaml)
    _barrier(group)
    return tmp


class HostStager:
    """Copies a state (nested dicts / lists of tensors) into host buffers kept from one save to the next.

    What an asynchronous save writes from: the training may change the model as soon as `stage`
    returns. Buffers are reused while shapes and dtypes stay the same (at most one save is in flight,
    so the previous save is done with them) and pinned for device tensors, so after the first save a
    stage costs one device-to-host copy per tensor and no allocation. Call `synchronize` (the saver
    does) before another thread reads the buffers.
    """

    def __init__(self) -> None:
        self.buffers: dict[tuple, torch.Tensor] = {}

    def _buffer(self, key: tuple, t: torch.Tensor) -> torch.Tensor:
        buf = self.buffers.get(key)
        if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
            buf = torch.empty(t.shape, dtype=t.dtype, device="cpu")
            if t.is_cuda:
                try:
                    buf = buf.pin_memory()
                except RuntimeError:  # no page-locked memory left: pageable buffers work, more slowly
                    pass
            self.buffers[key] = buf
        return buf

    def stage(self, obj, key: tuple = ()):
        if isinstance(obj, DTensor):  # FSDP2's shards: stage the local shard, keep the global layout for dcp
            local = self.stage(obj.to_local(), key)
            return DTensor.from_local(local, obj.device_mesh, obj.placements, run_check=False, shape=obj.shape,
                                      stride=obj.stride())  # fmt: skip
        if isinstance(obj, torch.Tensor):
            t = obj.detach()
            buf = self._buffer(key, t)
            buf.copy_(t, non_blocking=t.is_cuda and buf.is_pinned())
            return buf
        if isinstance(obj, dict):
            return {k: self.stage(v, (*key, k)) for k, v in obj.items()}
        if isinstance(obj, (list, tuple)):
            return type(obj)(self.stage(v, (*key, i)) for i, v in enumerate(obj))
        return copy.deepcopy(obj)


def state_for_save(model: torch.nn.Module, optimizer, stager: HostStager | None = None) -> tuple[dict, dict | None]:
    """(state dict for dcp with sharded tensors wrapped, per-rank optimizer shard or None).

    `stager`: copy every tensor to its host buffers first, so that training may go on changing the
    model while the copy is written (asynchronous save).
    """
    stage = (lambda x, key: x) if stager is None else stager.stage
    if _per_parameter(optimizer):  # collective; first: it also finishes the parameters' pending all-gathers
        optim_sd = optimizer.state_dict(flat=True)
        model_sd = get_model_state_dict(model)
    else:
        model_sd, optim_sd = get_state_dict(model, _optimizers(optimizer), options=_FLAT)
    # Sharded (TP / EP) tensors are saved as chunks of their global tensors: layout-free files.
    model_sd, optim_sd = wrap_for_checkpoint(model, stage(model_sd, ("model",)), stage(optim_sd, ("optim",)))
    return {"model": model_sd, "optim": optim_sd}, None


def write_state(tmp: Path, state: dict, optim_shard: dict | None, extra: dict, group=None) -> None:
    """Write the tensors (dcp, collective over `group`) and this rank's files into `tmp`."""
    tmp = Path(tmp)
    mine = [(extra, tmp / f"rank-{_rank()}.pt")]
    if optim_shard is not None:
        mine.append((optim_shard, tmp / f"optim-rank-{_rank()}.pt"))
    for obj, file in mine:
        torch.save(obj, file)
        fsync(file)  # durable on this rank's node before the manifest (written by rank 0) lists it
    with _quiet_single_process():
        dcp.save(state, checkpoint_id=str(tmp), process_group=group)  # its writer fsyncs the .distcp files


def _prune(root: Path, keep_last: int) -> None:
    """Delete all but the newest `keep_last` checkpoints; each is renamed first so that a crash mid-way
    never leaves a half-deleted folder that still looks complete."""
    for old in checkpoint_dirs(root.parent)[:-keep_last]:
        doomed = old.with_name(old.name + ".deleting")
        os.replace(old, doomed)
        shutil.rmtree(doomed, ignore_errors=True)
    for leftover in root.glob("step-*.deleting"):
        shutil.rmtree(leftover, ignore_errors=True)


def finish_save(tmp: Path, path: Path, step: int | None, layout: dict, keep_last: int | None, group=None) -> Path:
    """Hash the files (spread over the ranks), write the manifest and `complete` (rank 0), rename. Collective."""
    tmp, path = Path(tmp), Path(path)
    _barrier(group)  # every rank's files are written
    rank, world = _group_rank_world(group)
    names = data_files(tmp)
    files: dict = {}
    for part in _gather(hash_files(tmp, names, rank, world), group):
        files.update(part)
    if rank == 0:
        write_manifest(tmp, files, step, layout)
        shutil.rmtree(path, ignore_errors=True)
        os.replace(tmp, path)
        if keep_last:
            _prune(path.parent, keep_last)
    _barrier(group)
    return path


def save_training_state(
    path: Path, model: torch.nn.Module, optimizer, extra: dict, config_yaml: str, keep_last: int | None = None
) -> Path:
    """Write model + optimizer (dcp) and `extra` (per rank) to `path`; returns the final folder."""
    tmp = begin_save(path, config_yaml)
    state, optim_shard = state_for_save(model, optimizer)
    write_state(tmp, state, optim_shard, {**extra, "rng": rng_state()})
    return finish_save(tmp, path, extra.get("step"), layout_of(model), keep_last)


# --------------------------------------------------------------------------------------------------
# Checking: integrity (manifest), fit (tensor shapes), the newest intact checkpoint of a run
# --------------------------------------------------------------------------------------------------


def verify(path: Path, group=None) -> Verification:
    """`verify_checkpoint` with the hashing spread over the ranks; the same verdict on every rank. Collective."""
    rank, world = _group_rank_world(group)
    return merge_verifications(_gather(verify_checkpoint(Path(path), rank, world), group))


def require_intact(path: Path, what: str = "checkpoint.load") -> Path:
    """ConfigError (one line naming the bad file) unless `path` is a complete checkpoint matching its manifest."""
    path = Path(path)
    result = verify(path)
    if not result.ok:
        raise ConfigError(f"{what}={str(path)!r} is invalid: {result.reason}")
    if result.manifest is None:
        note(f"note: {result.message()}")
    return path


def _config_changes(path: Path, model: torch.nn.Module) -> str:
    """' (model.hidden_size 64 -> 32, ...)': the model/moe fields that differ from the checkpoint's config."""
    cfg = getattr(model, "cfg", None)
    saved_file = Path(path) / "config.yaml"
    if cfg is None or not saved_file.is_file():
        return ""
    import yaml

    try:
        saved = yaml.safe_load(saved_file.read_text()) or {}
    except yaml.YAMLError:
        return ""
    now = cfg.to_dict()
    diffs = []
    for section in ("model", "moe"):
        for key, old in (saved.get(section) or {}).items():
            new = now.get(section, {}).get(key)
            if key in now.get(section, {}) and old != new:
                diffs.append(f"{section}.{key} {old} -> {new}")
    return f" (changed since it was saved: {', '.join(diffs[:4])})" if diffs else ""


def check_fits(path: Path, model: torch.nn.Module, what: str = "checkpoint.load") -> None:
    """ConfigError unless every tensor of the model is in the checkpoint with the same global shape."""
    meta = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    tensors = dict(itertools.chain(model.named_parameters(), model.named_buffers()))
    for name in model.state_dict():
        if name not in tensors:
            continue
        want = tuple(get_shard(tensors[name]).global_shape)
        item = meta.get(f"model.{name}")
        if item is None:
            problem = f"it has no tensor {name}"
        elif tuple(getattr(item, "size", want)) != want:
            problem = f"{name} is {list(item.size)} there and {list(want)} here"
        else:
            continue
        raise ConfigError(
            f"{what}={str(path)!r} does not fit this model: {problem}{_config_changes(path, model)}; "
            "a checkpoint resumes only the model shape that wrote it"
        )


def find_resumable(run_dir: Path) -> tuple[Path | None, list[str]]:
    """The newest intact checkpoint of a run and one warning per newer checkpoint skipped. Collective.

    Candidates are all `step-N` folders and interrupted `step-N.tmp` saves, newest first; each is
    verified against its manifest until one passes.
    """
    root = Path(run_dir) / "checkpoints"
    if not root.is_dir():
        return None, []
    cands = [p for p in root.glob("step-*") if p.is_dir() and step_of(p) is not None]
    cands.sort(key=lambda p: (step_of(p), not p.name.endswith(".tmp")), reverse=True)
    warnings_ = []
    for p in cands:
        if p.name.endswith(".tmp"):
            warnings_.append(f"checkpoint {p.name} skipped: an interrupted save (no manifest)")
            continue
        result = verify(p)
        if result.ok:
            return p, warnings_
        warnings_.append(f"checkpoint {p.name} skipped: {result.reason}")
    return None, warnings_


# --------------------------------------------------------------------------------------------------
# Loading
# --------------------------------------------------------------------------------------------------


def _check_folder(path: Path, what: str = "checkpoint.load", verify_files: bool = True) -> Path:
    path = Path(path)
    if not path.is_dir() or not (path / ".metadata").exists():
        raise ConfigError(f"{what}={str(path)!r} is invalid: not a moecore checkpoint folder (no .metadata)")
    if verify_files:
        require_intact(path, what)
    return path


def load_training_state(path: Path, model: torch.nn.Module, optimizer, verify_files: bool = True) -> dict:
    """Load model + optimizer from `path`, restore RNG; returns this rank's extra state.

    `verify_files=False` skips the manifest check (the caller verified the folder already)."""
    path = _check_folder(path, "checkpoint.resume", verify_files)
    check_fits(path, model, "checkpoint.resume")
    _refuse_old_shards(path)
    if _per_parameter(optimizer):
        flat = _flat_optim(path)
        optim_sd, model_sd = optimizer.state_dict(flat=flat), get_model_state_dict(model)  # templates
        with _quiet_single_process():
            wrapped = wrap_for_checkpoint(model, model_sd, optim_sd)
            dcp.load(dict(zip(("model", "optim"), wrapped)), checkpoint_id=str(path))
        set_model_state_dict(model, model_sd)
        optimizer.load_state_dict(optim_sd)  # after the weights: it re-cuts its master shards from them
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


def load_model_weights(
    path: Path, model: torch.nn.Module, verify_files: bool = True, what: str = "checkpoint.load"
) -> None:
    """Load only the model's tensors from a checkpoint folder (fine-tuning start, conversion)."""
    path = _check_folder(path, what, verify_files)
    check_fits(path, model, what)
    state = {"model": get_model_state_dict(model)}
    with _quiet_single_process():
        dcp.load({"model": wrap_for_checkpoint(model, state["model"])[0]}, checkpoint_id=str(path))
    set_model_state_dict(model, state["model"])
