"""Asynchronous checkpoints (`checkpoint.async_save=true`): the step loop goes on while a checkpoint is
written, at most one save is in flight, the manifest and `complete` come after the data, the host
buffers are reused from save to save, and the files are bit-identical to a synchronous save's."""

from __future__ import annotations

import json
import pickle
import threading

import pytest
import rich.style  # noqa: F401  (imported first: it draws from Python's global random at import)
import torch
from reliability_common import TINY

import moecore.checkpoint.saver as saver_mod
from moecore.checkpoint import verify_checkpoint
from moecore.checkpoint.saver import CheckpointSaver
from moecore.config import load_config
from moecore.train.loop import Trainer


def _run(run_dir, async_save: bool) -> Trainer:
    args = [*TINY, "train.steps=6", "checkpoint.interval=2", f"checkpoint.async_save={str(async_save).lower()}"]
    trainer = Trainer(load_config("tiny-moe", [*args, f"train.run_dir={run_dir}"]))
    trainer.result = trainer.run()
    return trainer


def test_async_save_overlaps_steps_and_equals_sync_save(tmp_path, monkeypatch):
    sync = _run(tmp_path / "sync", async_save=False)

    write_state = saver_mod.write_state
    active, seen = [], {"max_active": 0, "final_existed": False, "buffers": []}
    lock = threading.Lock()
    note_step = CheckpointSaver.note_step
    two_steps_overlapped = threading.Event()

    def counting_note_step(self) -> None:
        note_step(self)
        if self.steps_overlapped >= 2:
            two_steps_overlapped.set()

    def slow_write(tmp, *args, **kwargs):  # a slow file system: the loop must not wait for it
        with lock:
            active.append(tmp)
            seen["max_active"] = max(seen["max_active"], len(active))
        final = tmp.with_name(tmp.name[: -len(".tmp")])
        seen["final_existed"] |= final.exists() or (tmp / "manifest.json").exists()
        seen["buffers"].append(sorted(t.data_ptr() for t in args[0]["model"].values()))
        # The write ends once the loop has run two steps beside it (however slow the machine), or after 30 s:
        # a loop that waited for the save would run none, and the assertion below would fail.
        two_steps_overlapped.wait(timeout=30.0)
        write_state(tmp, *args, **kwargs)
        with lock:
            active.remove(tmp)

    monkeypatch.setattr(saver_mod, "write_state", slow_write)
    monkeypatch.setattr(CheckpointSaver, "note_step", counting_note_step)
    asyn = _run(tmp_path / "asyn", async_save=True)

    assert asyn.saver.steps_overlapped >= 2  # steps 3 and 4 (and 5, 6) ran while step 2's save was written
    assert seen["max_active"] == 1 and not seen["final_existed"]
    assert len(seen["buffers"]) == 3 and seen["buffers"][0] == seen["buffers"][2]  # host buffers reused
    assert dict(asyn.result.losses) == dict(sync.result.losses)
    for step in (2, 4, 6):
        a = tmp_path / "sync" / "checkpoints" / f"step-{step}"
        b = tmp_path / "asyn" / "checkpoints" / f"step-{step}"
        assert verify_checkpoint(a).ok and verify_checkpoint(b).ok
        fa = json.loads((a / "manifest.json").read_text())["files"]
        fb = json.loads((b / "manifest.json").read_text())["files"]
        assert fa.keys() == fb.keys()
        for name in fa:
            if name not in ("config.yaml", ".metadata"):  # config.yaml: differs in checkpoint.async_save only
                assert fa[name] == fb[name], f"step {step}: {name} differs between sync and async saves"
        # .metadata also records the folder and a random save id; everything else in it is equal.
        ma, mb = (pickle.loads((d / ".metadata").read_bytes()) for d in (a, b))
        assert ma.state_dict_metadata == mb.state_dict_metadata and ma.storage_data == mb.storage_data


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_async_save_on_gpu_equals_sync_save_of_the_same_state(tmp_path):
    """On GPU (async by default): a synchronous and an asynchronous save of one state, then more steps
    while the second is written; the files match (independent of GPU kernel determinism)."""
    args = [*TINY, "train.steps=6", "train.device=cuda", f"train.run_dir={tmp_path / 'run'}"]
    trainer = Trainer(load_config("tiny-moe", args))
    assert trainer.saver.async_save
    trainer.train_step()
    extra = {"step": 1, "data": trainer.data.train.state_dict()}
    sync = CheckpointSaver(async_save=False)
    a = sync.save(tmp_path / "sync", trainer.model, trainer.optimizer, extra, "x", None)
    b = trainer.saver.save(tmp_path / "asyn", trainer.model, trainer.optimizer, extra, "x", None)
    for _ in range(3):
        trainer.train_step()
    trainer.saver.wait()
    fa = json.loads((a / "manifest.json").read_text())["files"]
    fb = json.loads((b / "manifest.json").read_text())["files"]
    for name in fa:
        if name not in (".metadata", "rank-0.pt"):  # .metadata: folder and save id; rank-0.pt: RNG drawn since
            assert fa[name] == fb[name], name


def test_async_save_of_fsdp_shards_resumes_bit_exactly(tmp_path):
    """FSDP2 (one process) with asynchronous saves: the model and optimizer state are DTensors, staged into host
    buffers as their local shards with their global layout (staging them as plain tensors failed); a run stopped at
    step 2 and resumed continues as the uninterrupted one."""
    from moecore.train.loop import train

    args = [*TINY, "train.steps=4", "parallel.fsdp=true", "checkpoint.async_save=true", "checkpoint.interval=2"]
    full = train(load_config("tiny-moe", [*args, f"train.run_dir={tmp_path / 'full'}"]))
    part = tmp_path / "part"
    train(load_config("tiny-moe", [*args, "train.exit_interval=2", f"train.run_dir={part}"]))
    assert verify_checkpoint(part / "checkpoints" / "step-2").ok
    second = train(load_config("tiny-moe", [*args, "checkpoint.resume=true", f"train.run_dir={part}"]))
    want, got = dict(full.losses), dict(second.losses)
    assert sorted(got) == [3, 4] and all(got[s] == want[s] for s in got), (got, want)
