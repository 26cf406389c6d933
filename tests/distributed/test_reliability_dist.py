"""Reliability under several processes (gloo): every rank takes the same decision when only one rank
sees a non-finite loss or a stop signal (the guard alone, and whole Trainers under ep2 where one rank's
stop request makes both save the same step and stop), and an asynchronous save from an ep2 layout (its
own gloo group, files hashed by all ranks) loads into one process exactly."""

from __future__ import annotations

import copy
import math
import os

import pytest
import torch
from dist_parity import build, full_state, make_data, make_dims, make_optimizer, tiny_config, train_steps

from moecore.checkpoint import load_training_state, verify_checkpoint
from moecore.checkpoint.saver import CheckpointSaver
from moecore.config import load_config
from moecore.models.transformer import MoETransformer
from moecore.parallel.launch import run_local
from moecore.parallel.sharding import global_state_dict
from moecore.train.guards import NonFiniteError, StepGuard
from moecore.train.loop import Trainer

pytestmark = pytest.mark.distributed


class _Stop:
    def __init__(self, requested: bool) -> None:
        self.requested = requested


def _guards(rank: int, world: int, run_dir: str) -> dict:
    cfg = tiny_config().train
    guard = StepGuard(cfg, torch.device("cpu"), run_dir, stop=_Stop(rank == 1))
    fine = guard.check(1, torch.tensor(1.0, dtype=torch.float64), 0.5)  # stop requested on rank 1 only
    out = {"skip": fine, "stop_now": guard.stop_now}
    loss = torch.tensor(math.nan if rank == 0 else 1.0, dtype=torch.float64)  # NaN on rank 0 only
    try:
        guard.check(2, loss, 0.5)
        out["error"] = None
    except NonFiniteError as e:
        out["error"] = str(e)
    return out


def test_ranks_agree_on_stop_and_nonfinite(tmp_path):
    for r in run_local(_guards, 2, str(tmp_path)):
        assert r["skip"] is False and r["stop_now"] is True
        assert r["error"] is not None and "at step 2" in r["error"]


def _save(rank: int, world: int, init: dict, data, path: str) -> dict:
    cfg = tiny_config()
    cfg.parallel.ep = 2
    dims = make_dims(cfg, rank, world)
    model = build(cfg, dims, init)
    opt = make_optimizer(model)
    train_steps(model, dims, data, steps=1, opt=opt)
    saver = CheckpointSaver(async_save=True)
    saver.save(path, model, opt, {"step": 1}, cfg.to_yaml(), keep_last=None)
    state = global_state_dict(model, dims)  # collectives on the training groups while the save is written
    train_steps(model, dims, data, steps=1, opt=opt, first=1)  # the model moves on: the save must not see it
    saver.wait()
    return {"state": state if rank == 0 else None}


def test_async_save_from_two_ranks_loads_in_one(tmp_path):
    data = make_data()
    cfg = tiny_config()
    init = full_state(MoETransformer(copy.deepcopy(cfg), None))
    path = tmp_path / "step-1"
    saved = run_local(_save, 2, init, data, str(path))[0]["state"]
    assert verify_checkpoint(path).ok
    model = MoETransformer(copy.deepcopy(cfg), None)
    assert load_training_state(path, model, make_optimizer(model))["step"] == 1
    for name, p in model.named_parameters():
        assert torch.equal(p.detach(), saved[name]), name


TINY = [
    "model.hidden_size=32",
    "model.num_layers=2",
    "model.num_attention_heads=2",
    "model.num_kv_heads=1",
    "model.ffn_hidden_size=64",
    "moe.num_experts=4",
    "moe.ffn_hidden_size=32",
    "moe.first_k_dense_replace=1",
    "train.seq_length=16",
    "train.global_batch_size=4",
    "train.micro_batch_size=1",
    "train.eval_interval=0",
    "train.steps=50",
    "parallel.ep=2",
    "log.progress=false",
    "log.tensorboard=false",
]


def _stop_seen_by_rank_1(rank: int, world: int, run_dir: str) -> dict:
    os.environ.update(WORLD_SIZE=str(world), RANK=str(rank), LOCAL_RANK=str(rank))  # as torchrun sets them
    trainer = Trainer(load_config("tiny-moe", [*TINY, f"train.run_dir={run_dir}"]))
    if rank == 1:  # what the SIGTERM handler records, on this rank only
        trainer.stop.requested, trainer.stop.signal_name = True, "SIGTERM"
    result = trainer.run()
    return {"stopped_by": result.stopped_by, "last_step": result.last_step, "checkpoint": result.checkpoint}


def test_a_signal_on_one_rank_stops_every_rank_at_the_same_step(tmp_path):
    results = run_local(_stop_seen_by_rank_1, 2, str(tmp_path))
    assert [r["last_step"] for r in results] == [1, 1]
    assert results[1]["stopped_by"] == "SIGTERM" and results[0]["stopped_by"].startswith("a stop signal")
    ckpt = tmp_path / "checkpoints" / "step-1"
    assert all(r["checkpoint"] == ckpt for r in results)
    result = verify_checkpoint(ckpt)
    assert result.ok and result.manifest["layout"]["ep"] == 2 and result.manifest["layout"]["world_size"] == 2
