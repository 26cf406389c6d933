"""Machinery of the pipeline-parallel parity tests: a one-process reference and the same steps through the pipeline.

The reference is the one-process model (dims None) trained as moecore/train/loop.py does: LM loss
summed over tokens / global tokens, plus routing and MTP losses / micro-batches, torch's own
clip_grad_norm_. A pipeline layout runs the same steps on gloo processes from the same initial weights
(each stage loads its modules' tensors, cut to its TP / EP shard) through `Pipeline.step` (torch's
schedules); its first-step gradients are compared on every rank with the matching part of the
reference's.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from dist_parity import CLIP, GLOBAL_BATCH, MICRO_BATCH, full_state, make_dims, make_optimizer

from moecore.config import Config
from moecore.models.transformer import MoETransformer
from moecore.parallel import comm
from moecore.parallel.data_parallel import clip_grad_norm_, wrap_model_for_data_parallel
from moecore.parallel.pipeline import clip_grad_norm_pipeline, parallelize_pipeline
from moecore.parallel.sharding import get_shard, load_global_state_dict


def reference(cfg: Config, data, steps: int, seed: int = 0) -> tuple[dict, dict]:
    """(initial full state, results) of the one-process run: losses, grad norms, first-step grads."""
    torch.manual_seed(seed)
    model = MoETransformer(copy.deepcopy(cfg), None)
    init = full_state(model)
    opt = make_optimizer(model)
    n_mb = GLOBAL_BATCH // MICRO_BATCH
    out = {"losses": [], "norms": [], "grads": None}
    for step in range(steps):
        ids, labels, mask = data[step]
        global_tokens = mask.sum().double()
        opt.zero_grad(set_to_none=True)
        lm = 0.0
        for i in range(n_mb):
            sl = slice(i * MICRO_BATCH, (i + 1) * MICRO_BATCH)
            o = model(ids[sl], labels=labels[sl], loss_mask=mask[sl])
            obj = o.lm_loss_sum / global_tokens.to(o.lm_loss_sum.dtype)
            if o.aux_loss is not None:
                obj = obj + o.aux_loss / n_mb
            if o.mtp_loss is not None:
                obj = obj + o.mtp_loss / n_mb
            obj.backward()
            lm += float(o.lm_loss_sum.detach())
        if step == 0:
            out["grads"] = {k: p.grad.detach().clone() for k, p in model.named_parameters() if p.grad is not None}
        # The one-process trainer's clipping (Runtime.clip_grad_norm): per-tensor fp32 norms summed in fp64.
        out["norms"].append(float(clip_grad_norm_(model.parameters(), CLIP, None)))
        opt.step()
        for layer in model.moe_layers():
            layer.update_expert_bias()
        out["losses"].append(lm / float(global_tokens))
    return init, out


def run_pipeline(rank: int, world: int, cfg: Config, init: dict, data, steps: int, ref_grads: dict) -> dict:
    """The same steps through this rank's pipeline stages; returns losses, norms, worst first-step grad error."""
    dims = make_dims(cfg, rank, world)
    pipe = parallelize_pipeline(copy.deepcopy(cfg), dims, "cpu")
    load_global_state_dict(pipe.model, init)
    model = pipe.model
    sync = wrap_model_for_data_parallel(model, dims, bucket_mb=0.002)
    opt = make_optimizer(model)
    dp, dp_rank = dims.dp, dims.dp_group.rank
    n_mb = GLOBAL_BATCH // MICRO_BATCH
    per_rank = n_mb // dp
    rows = slice(dp_rank * per_rank * MICRO_BATCH, (dp_rank + 1) * per_rank * MICRO_BATCH)
    out = {"losses": [], "norms": [], "grad_err": 0.0, "grad_param": "", "params": pipe.num_params()}
    for step in range(steps):
        ids, labels, mask = data[step]
        global_tokens = mask.sum().double()
        opt.zero_grad(set_to_none=True)
        with sync.no_sync():
            rec = pipe.step(ids[rows], labels[rows], mask[rows], global_tokens, dp, dp / n_mb, per_rank)
        sync.finish_grad_sync()
        pipe.sync_shared_grads()
        if step == 0:
            for name, p in model.named_parameters():
                if name not in ref_grads:  # no gradient in one process either (DeepSeek-V4's indexers only select)
                    assert p.grad is None or not p.grad.any(), name
                    continue
                want = get_shard(p).local_of(ref_grads[name])
                got = p.grad if p.grad is not None else torch.zeros_like(p)
                err = float((got - want).norm() / want.norm().clamp(min=1e-30))
                if err > out["grad_err"]:
                    out["grad_err"], out["grad_param"] = err, name
        out["norms"].append(float(clip_grad_norm_pipeline(pipe, CLIP)))
        opt.step()
        for layer in model.moe_layers():
            layer.update_expert_bias()
        lm = torch.stack(rec.lm_sums).double().sum() if rec.lm_sums else torch.zeros((), dtype=torch.float64)
        comm.all_reduce_(lm, dims.dp_cp_group, "sum")
        comm.all_reduce_(lm, dims.pp_group, "sum")
        out["losses"].append(float(lm / global_tokens))
    dist.barrier()
    return out


def worst(ref: dict, results: list[dict]) -> dict:
    """Largest relative differences over ranks: losses, grad norms, first-step gradients."""
    loss = max(abs(a - b) / abs(a) for r in results for a, b in zip(ref["losses"], r["losses"]))
    norm = max(abs(a - b) / abs(a) for r in results for a, b in zip(ref["norms"], r["norms"]))
    grad = max(results, key=lambda r: r["grad_err"])
    return {"loss": loss, "norm": norm, "grad": grad["grad_err"], "grad_param": grad["grad_param"]}


def resume_same_layout(rank: int, world: int, cfg: Config, init: dict, data, path: str) -> dict:
    """Train 2 steps, checkpoint, train a third; a fresh pipeline resumed from the checkpoint trains the
    third again. Returns both third-step losses and grad norms (equal when resuming is exact)."""
    from moecore.checkpoint import load_training_state, save_training_state
    from moecore.optim.adamw import build_optimizer

    dims = make_dims(cfg, rank, world)
    out = {}
    for name in ("run", "resumed"):
        pipe = parallelize_pipeline(copy.deepcopy(cfg), dims, "cpu")
        load_global_state_dict(pipe.model, init)
        sync = wrap_model_for_data_parallel(pipe.model, dims, bucket_mb=0.002)
        opt = build_optimizer(pipe.model, cfg.optim)  # the training loop's: decay and no-decay groups
        first = 0
        if name == "resumed":
            load_training_state(path, pipe.model, opt)
            first = 2
        for step in range(first, 3):
            ids, labels, mask = data[step]
            opt.zero_grad(set_to_none=True)
            dp, n_mb = dims.dp, GLOBAL_BATCH // MICRO_BATCH
            per = n_mb // dp
            rows = slice(dims.dp_group.rank * per * MICRO_BATCH, (dims.dp_group.rank + 1) * per * MICRO_BATCH)
            with sync.no_sync():
                rec = pipe.step(ids[rows], labels[rows], mask[rows], mask.sum().double(), dp, dp / n_mb, per)
            sync.finish_grad_sync()
            pipe.sync_shared_grads()
            norm = float(clip_grad_norm_pipeline(pipe, CLIP))
            opt.step()
            for layer in pipe.model.moe_layers():
                layer.update_expert_bias()
            if name == "run" and step == 1:
                save_training_state(path, pipe.model, opt, {"step": 2}, "")
        lm = torch.stack(rec.lm_sums).double().sum() if rec.lm_sums else torch.zeros((), dtype=torch.float64)
        comm.all_reduce_(lm, dims.dp_cp_group, "sum")
        comm.all_reduce_(lm, dims.pp_group, "sum")
        out[name] = (float(lm), norm)
    return out
