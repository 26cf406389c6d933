"""Shared machinery of the multi-process parity tests: a tiny MoE model, a training step, a comparison.

The reference is the one-process run (dims None; torch's own clip_grad_norm_); a layout runs the same
steps on N gloo processes from the same initial weights (cut out of the reference's full tensors)
and the same global batches (data-parallel rank d takes its contiguous share of the micro-batches).
The objective is the training loop's (moecore/train/loop.py): LM loss summed over tokens / global
tokens x dp x cp, plus each micro-batch's routing (and MTP) losses x dp x cp / micro-batches; under context
parallel every rank of a CP group takes the same micro-batches and keeps its chunks of them.
"""

from __future__ import annotations

import contextlib
import copy

import torch

from moecore.config import Config
from moecore.models.transformer import MoETransformer
from moecore.parallel.context import split_batch_for_cp
from moecore.parallel.data_parallel import clip_grad_norm_, wrap_model_for_data_parallel
from moecore.parallel.dims import ParallelDims
from moecore.parallel.fsdp import FullyShardedModel
from moecore.parallel.sharding import _ATTR, get_shard, global_grads, global_tensor, load_global_state_dict

STEPS, GLOBAL_BATCH, MICRO_BATCH, SEQ, VOCAB = 3, 8, 2, 8, 64
CLIP = 0.05  # small enough that clipping is active, so the global norm matters


def tiny_config(**moe_overrides) -> Config:
    """3 layers: layer 0 dense, layers 1-2 MoE with 8 experts (top-2) and a shared expert."""
    cfg = Config()
    m, e = cfg.model, cfg.moe
    m.vocab_size, m.hidden_size, m.num_layers = VOCAB, 32, 3
    m.num_attention_heads, m.num_kv_heads, m.ffn_hidden_size, m.init_std = 4, 2, 64, 0.1
    e.num_experts, e.router_topk, e.ffn_hidden_size, e.shared_expert_intermediate_size = 8, 2, 16, 24
    e.first_k_dense_replace, e.aux_loss_coeff, e.z_loss_coeff = 1, 1e-2, 1e-3
    for k, v in moe_overrides.items():
        setattr(e, k, v)
    cfg.train.seq_length, cfg.train.global_batch_size, cfg.train.micro_batch_size = SEQ, GLOBAL_BATCH, MICRO_BATCH
    return cfg


def make_data(seed: int = 0, seq: int = SEQ) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(STEPS):
        ids = torch.randint(0, VOCAB, (GLOBAL_BATCH, seq), generator=g)
        labels = torch.randint(0, VOCAB, (GLOBAL_BATCH, seq), generator=g)
        mask = (torch.rand(GLOBAL_BATCH, seq, generator=g) > 0.15).float()  # some padding positions
        out.append((ids, labels, mask))
    return out


def full_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    sd = {k: v.detach().clone() for k, v in model.named_parameters()}
    sd.update({k: v.detach().clone() for k, v in model.named_buffers()})
    return sd


def make_optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)


def build(cfg: Config, dims: ParallelDims | None, init: dict) -> MoETransformer:
    """The model for this layout with the reference's initial weights (the local random init is overwritten)."""
    model = MoETransformer(copy.deepcopy(cfg), dims)
    load_global_state_dict(model, init)
    return model


def make_dims(cfg: Config, rank: int, world: int) -> ParallelDims:
    m = cfg.model
    return ParallelDims(
        cfg.parallel,
        world,
        rank,
        "cpu",
        num_experts=cfg.moe.num_experts,
        num_attention_heads=m.num_attention_heads,
        vocab_size=m.vocab_size,
    )


def train_steps(
    model: MoETransformer, dims: ParallelDims | None, data, steps: int = STEPS, opt=None, first: int = 0
) -> dict:
    """`steps` optimizer steps on data[first:]; returns losses, grad norms and (full) grads after the first one."""
    dp = 1 if dims is None else dims.dp
    replicas = 1 if dims is None else dims.dp * dims.cp  # gradients are averaged over dp x cp
    dp_rank = 0 if dims is None else dims.dp_group.rank
    fsdp = dims is not None and dims.cfg.fsdp
    if fsdp:  # FSDP2 over dp x cp (experts over edp): sharded weights and gradients (moecore/parallel/fsdp.py)
        sync = FullyShardedModel(model, dims)
    else:
        sync = None if dims is None else wrap_model_for_data_parallel(model, dims, bucket_mb=0.002)
    opt = make_optimizer(model) if opt is None else opt  # after FSDP2 replaced the parameters with its DTensors
    n_mb = GLOBAL_BATCH // MICRO_BATCH
    per_rank = n_mb // dp
    out = {"losses": [], "norms": [], "grads": None}
    for step in range(steps):
        ids, labels, mask = data[first + step]
        global_tokens = mask.sum().double()
        opt.zero_grad(set_to_none=True)
        lm_sum = torch.zeros((), dtype=torch.float64)
        for i in range(per_rank):
            sl = slice((dp_rank * per_rank + i) * MICRO_BATCH, (dp_rank * per_rank + i + 1) * MICRO_BATCH)
            last = i == per_rank - 1
            ctx = sync.no_sync() if sync is not None and not last else contextlib.nullcontext()
            with ctx:
                # context parallel: this rank's chunks of the micro-batch (moecore/parallel/context.py)
                b = split_batch_for_cp({"input_ids": ids[sl], "labels": labels[sl], "loss_mask": mask[sl]}, dims)
                o = model(
                    b["input_ids"], labels=b["labels"], loss_mask=b["loss_mask"], position_ids=b.get("position_ids")
                )
                obj = o.lm_loss_sum / global_tokens.to(o.lm_loss_sum.dtype) * replicas + o.aux_loss * (replicas / n_mb)
                if o.mtp_loss is not None:
                    obj = obj + o.mtp_loss * (replicas / n_mb)
                if o.indexer_loss is not None:  # DSA's lightning indexers
                    obj = obj + o.indexer_loss * (replicas / n_mb)
                obj.backward()
            lm_sum += o.lm_loss_sum.detach().double()
        if dims is None:
            if step == 0:
                out["grads"] = {k: p.grad.detach().clone() for k, p in model.named_parameters() if p.grad is not None}
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        else:
            if not fsdp:  # Overlap: buckets whose gradients were complete have been launched from the backward hooks.
                out.setdefault("launched_in_backward", []).append((sync._next_launch, len(sync.buckets)))
            sync.finish_grad_sync()
            if step == 0:
                out["grads"] = _fsdp_global_grads(model, dims) if fsdp else global_grads(model, dims)
            norm = sync.clip_grad_norm(CLIP) if fsdp else clip_grad_norm_(model, CLIP, dims)
            lm_sum = dims.all_reduce_dp(lm_sum)
        opt.step()
        for layer in model.moe_layers():
            layer.update_expert_bias()
        out["losses"].append(float(lm_sum / global_tokens))
        out["norms"].append(float(norm))
    out["expert_paths"] = sorted({str(layer.experts.last_path) for layer in model.moe_layers()})
    return out


def _fsdp_global_grads(model: MoETransformer, dims: ParallelDims) -> dict[str, torch.Tensor]:
    """`global_grads` of a model under FSDP2: each DTensor gradient gathered over its FSDP mesh first (the
    rank's TP / EP-local tensor), then assembled from the TP / EP shards."""
    out = {}
    for name, p in model.named_parameters():
        carrier = p.grad.full_tensor() if p.grad is not None else torch.zeros(p.shape, dtype=p.dtype)
        setattr(carrier, _ATTR, get_shard(p))
        out[name] = global_tensor(carrier, dims)
    return out


def reference(cfg: Config, data, seed: int = 0, init_hook=None) -> tuple[dict, dict]:
    """(initial full state, results) of the one-process run."""
    torch.manual_seed(seed)
    model = MoETransformer(copy.deepcopy(cfg), None)
    if init_hook is not None:
        init_hook(model)
    init = full_state(model)
    return init, train_steps(model, None, data)


def run_layout(rank: int, world: int, cfg: Config, init: dict, data) -> dict:
    """One layout on this rank: build, load the reference's initial weights, train."""
    dims = make_dims(cfg, rank, world)
    return train_steps(build(cfg, dims, init), dims, data)


def compare(ref: dict, got: dict) -> dict:
    """Largest relative differences: losses, grad norms, and per-parameter gradient (norm-wise)."""
    loss = max(abs(a - b) / abs(a) for a, b in zip(ref["losses"], got["losses"]))
    norm = max(abs(a - b) / abs(a) for a, b in zip(ref["norms"], got["norms"]))
    worst, worst_name = 0.0, ""
    for name, g in ref["grads"].items():
        err = float((got["grads"][name] - g).norm() / g.norm().clamp(min=1e-30))
        if err > worst:
            worst, worst_name = err, name
    return {"loss": loss, "norm": norm, "grad": worst, "grad_param": worst_name}
