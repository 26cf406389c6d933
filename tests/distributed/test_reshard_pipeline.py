"""Checkpoints with optimizer state across the pipeline: distributed optimizer dp2 -> pp2 -> one process.

The tiny MoE of dist_parity (3 layers; AdamW with decay / no-decay groups, active clipping) trains
3 steps on one process (the reference). A run with the distributed optimizer on 2 ranks (dp2) saves
after step 1; a pp2 pipeline (stages "Ett|tL", no data parallel) with fresh weights resumes it, takes
step 2 and saves; one process resumes that and takes step 3. Each resumed step's loss and grad norm
equal the reference's (relative <= 1e-5): the AdamW state moved from flat data-parallel shards to
per-stage parameters and back to one model without loss.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import zero_harness as zh
from dist_parity import CLIP, GLOBAL_BATCH, MICRO_BATCH, full_state, make_data, make_dims, tiny_config

from moecore.checkpoint import load_training_state, save_training_state
from moecore.models.transformer import MoETransformer
from moecore.optim.adamw import param_groups
from moecore.parallel import comm
from moecore.parallel.data_parallel import wrap_model_for_data_parallel
from moecore.parallel.launch import run_local
from moecore.parallel.pipeline import clip_grad_norm_pipeline, parallelize_pipeline

pytestmark = pytest.mark.distributed

TOL = 1e-5


def _dist_opt_dp2(rank: int, world: int, init: dict, data, path: str) -> dict:
    return zh.train(rank, world, {}, init, data, ckpt=path, steps=1)


def _pp2(rank: int, world: int, data, src: str, dst: str) -> dict:
    cfg = tiny_config()
    cfg.parallel.pp, cfg.parallel.pp_layout = 2, "Ett|tL"
    dims = make_dims(cfg, rank, world)
    torch.manual_seed(7 + rank)  # other weights than the reference's: the checkpoint must replace them
    pipe = parallelize_pipeline(copy.deepcopy(cfg), dims, "cpu")
    sync = wrap_model_for_data_parallel(pipe.model, dims, bucket_mb=0.002)
    opt = torch.optim.AdamW(param_groups(pipe.model, zh.WD), lr=zh.LR, betas=zh.BETAS)
    step = load_training_state(src, pipe.model, opt)["step"]
    ids, labels, mask = data[step]
    opt.zero_grad(set_to_none=True)
    n_mb = GLOBAL_BATCH // MICRO_BATCH
    with sync.no_sync():
        rec = pipe.step(ids, labels, mask, mask.sum().double(), 1, 1 / n_mb, n_mb)
    sync.finish_grad_sync()
    pipe.sync_shared_grads()
    norm = float(clip_grad_norm_pipeline(pipe, CLIP))
    opt.step()
    save_training_state(dst, pipe.model, opt, {"step": step + 1}, cfg.to_yaml())
    lm = torch.stack(rec.lm_sums).double().sum() if rec.lm_sums else torch.zeros((), dtype=torch.float64)
    comm.all_reduce_(lm, dims.pp_group, "sum")
    dist.barrier()
    return {"step": step, "loss": float(lm / mask.sum().double()), "norm": norm}


def test_distributed_optimizer_to_pipeline_to_one_process(tmp_path):
    data = make_data()
    torch.manual_seed(0)
    init = full_state(MoETransformer(copy.deepcopy(tiny_config()), None))
    ref = zh.train(0, 1, {}, init, data, dist_opt=False)
    a, b = str(tmp_path / "dist-dp2"), str(tmp_path / "pp2")
    run_local(_dist_opt_dp2, 2, init, data, a)
    pp = run_local(_pp2, 2, data, a, b)[0]
    last = zh.resume(0, 1, {}, b, data, dist_opt=False)
    assert pp["step"] == 1 and last["step"] == 2
    got = {"pp2 step 2": (pp["loss"], pp["norm"], 1), "one process step 3": (last["losses"][0], last["norms"][0], 2)}
    for name, (loss, norm, i) in got.items():
        dl, dn = abs(loss - ref["losses"][i]) / ref["losses"][i], abs(norm - ref["norms"][i]) / ref["norms"][i]
        print(f"dist-opt dp2 -> pp2 -> 1, {name}: loss {dl:.1e} grad norm {dn:.1e}")
        assert dl <= TOL and dn <= TOL, (name, dl, dn)
