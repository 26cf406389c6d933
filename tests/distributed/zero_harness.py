"""Machinery of the reduce-scatter distributed optimizer tests: set up a run, take steps, resume a checkpoint.

A "run" is the training loop's step (moecore/train/loop.py) on the tiny MoE of dist_parity: the
micro-batches of this data-parallel rank, gradient reduction by `GradSync` (hooks, small buckets so
there are many), clipping by the global norm, the optimizer step, the expert-bias update. Three
optimizers: torch's AdamW (fp32), `FusedAdamW` on `MixedPrecision` masters (bf16), and the
`DistributedOptimizer` (either precision). Every rank returns its losses, grad norms, the global
parameters (rank 0) and its memory by kind.
"""

from __future__ import annotations

import contextlib
import copy

import torch
from dist_parity import CLIP, GLOBAL_BATCH, MICRO_BATCH, build, make_dims, tiny_config

from moecore.checkpoint import load_training_state, save_training_state
from moecore.config import OptimConfig
from moecore.models.qk_clip import QKClip
from moecore.models.transformer import MoETransformer
from moecore.optim.adamw import param_groups
from moecore.optim.fused_adamw import FusedAdamW
from moecore.optim.mixed_precision import MasterWeightOptimizer, MixedPrecision, grad_of
from moecore.optim.muon import build_muon
from moecore.parallel.data_parallel import clip_grad_norm_, wrap_model_for_data_parallel
from moecore.parallel.distributed_muon import distributed_muon
from moecore.parallel.distributed_optimizer import DistributedOptimizer
from moecore.parallel.fsdp import FullyShardedModel
from moecore.parallel.sharding import _ATTR, get_shard, global_state_dict, global_tensor
from moecore.train.memory import tensor_bytes

BUCKET_MB = 0.02  # several buckets per domain in the tiny model
LR, BETAS, WD = 1e-2, (0.9, 0.95), 0.1


def layout(par: dict, dist_opt: bool):
    cfg = tiny_config()
    for k, v in par.items():
        setattr(cfg.parallel, k, v)
    cfg.parallel.distributed_optimizer = dist_opt
    return cfg


class Run:
    """Model, optimizer and gradient reduction of one layout on this rank."""

    def __init__(
        self,
        cfg,
        dims,
        init: dict | None,
        dist_opt: bool,
        bf16: bool = False,
        seed: int = 0,
        bf16_states: bool = False,
        fsdp: bool = False,
        muon: bool = False,
        master_bf16: bool = False,
        qk_clip: float = 0.0,
    ) -> None:
        self.cfg, self.dims, self.bf16 = cfg, dims, bf16
        if init is not None:
            self.model = build(cfg, dims, init)
        else:  # weights to be replaced by a checkpoint: anything but the reference's
            torch.manual_seed(seed)
            self.model = MoETransformer(copy.deepcopy(cfg), dims)
        self.fsdp = fsdp
        states = torch.bfloat16 if bf16_states else torch.float32
        if fsdp:  # FSDP2 keeps fp32 sharded parameters (bf16 ones with master_bf16) and computes in bf16 itself
            self.mixed = None
            if master_bf16:
                for p in self.model.parameters():
                    p.data = p.data.to(torch.bfloat16)
            compute = torch.bfloat16 if bf16 and not master_bf16 else None
            self.sync = FullyShardedModel(self.model, dims, compute, torch.float32 if bf16 else None)
        else:
            mixed = MixedPrecision(self.model, torch.bfloat16, not master_bf16, sum_in_fp32=True) if bf16 else None
            self.mixed = mixed
            self.sync = None if dims is None else wrap_model_for_data_parallel(self.model, dims, bucket_mb=BUCKET_MB)
        groups = param_groups(self.model, WD)
        if muon:  # Muon's matrices orthogonalised once each over the ranks (moecore.parallel.distributed_muon)
            o = OptimConfig(name="muon", lr=LR, beta1=BETAS[0], beta2=BETAS[1], weight_decay=WD)
            base = build_muon(self.model, o, distributed_muon(dims))
            if dist_opt:
                self.opt = DistributedOptimizer(
                    self.model, base, dims, grad_sync=self.sync, mixed=self.mixed, state_dtype=states
                )
            elif self.mixed is not None:
                self.opt = MasterWeightOptimizer(base, self.mixed)
            else:
                self.opt = base
        elif dist_opt:
            base = torch.optim.AdamW(groups, lr=LR, betas=BETAS)
            self.opt = DistributedOptimizer(
                self.model, base, dims, grad_sync=self.sync, mixed=self.mixed, state_dtype=states
            )
        elif (bf16 and not fsdp) or (fsdp and (bf16_states or master_bf16)):
            self.opt = FusedAdamW(groups, self.mixed, lr=LR, betas=BETAS, weight_decay=WD, state_dtype=states)
        else:
            self.opt = torch.optim.AdamW(groups, lr=LR, betas=BETAS)

        self.qk_clip = QKClip(self.model, qk_clip, dims) if qk_clip else None

    def _clip(self) -> float:
        for owner in (self.opt, self.sync):
            if hasattr(owner, "clip_grad_norm"):
                return float(owner.clip_grad_norm(CLIP))
        if self.dims is not None:
            return float(clip_grad_norm_(self.model, CLIP, self.dims))
        grads = [grad_of(p) for p in self.model.parameters() if grad_of(p) is not None]
        norm = torch.nn.utils.get_total_norm(grads)
        coef = float((CLIP / (norm + 1e-6)).clamp(max=1.0))
        if isinstance(self.opt, FusedAdamW):
            self.opt.grad_scale = coef
        else:
            torch._foreach_mul_(grads, coef)
        return float(norm)

    def steps(self, data, first: int, steps: int) -> dict:
        dims, model = self.dims, self.model
        dp = 1 if dims is None else dims.dp
        dp_rank = 0 if dims is None else dims.dp_group.rank
        n_mb = GLOBAL_BATCH // MICRO_BATCH
        per_rank = n_mb // dp
        out = {"losses": [], "norms": []}
        for step in range(first, first + steps):
            ids, labels, mask = data[step]
            global_tokens = mask.sum().double()
            self.opt.zero_grad(set_to_none=True)
            lm_sum = torch.zeros((), dtype=torch.float64)
            for i in range(per_rank):
                sl = slice((dp_rank * per_rank + i) * MICRO_BATCH, (dp_rank * per_rank + i + 1) * MICRO_BATCH)
                last = i == per_rank - 1
                ctx = self.sync.no_sync() if self.sync is not None and not last else contextlib.nullcontext()
                with ctx:
                    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.bf16):
                        o = model(ids[sl], labels=labels[sl], loss_mask=mask[sl])
                        obj = o.lm_loss_sum / global_tokens.to(o.lm_loss_sum.dtype) * dp + o.aux_loss * (dp / n_mb)
                    obj.backward()
                lm_sum += o.lm_loss_sum.detach().double()
            if self.sync is not None and not self.fsdp:
                # Overlap: buckets complete before the end of backward were launched from the hooks.
                out.setdefault("launched", []).append((self.sync._next_launch, len(self.sync.buckets)))
            if self.sync is not None:
                self.sync.finish_grad_sync()
                lm_sum = dims.all_reduce_dp(lm_sum)
            out["norms"].append(self._clip())
            self.opt.step()
            if self.qk_clip is not None:  # MuonClip: after the step, through the master weights
                out.setdefault("max_logit", []).append(self.qk_clip.apply(self.weights_context))
            pending = getattr(self.opt, "_pending", {})
            out.setdefault("pending", []).append(len(pending))
            # what the parameter all-gathers move: (dtype, bytes) of each gathered bucket (groups of > 1 rank)
            out["gathered"] = sorted(
                (str(g[1].dtype), g[1].numel() * g[1].element_size()) for g in pending.values() if g[0] is not None
            )
            for layer in model.moe_layers():
                layer.update_expert_bias()
            out["losses"].append(float(lm_sum / global_tokens))
        out["memory"] = tensor_bytes(model, self.opt, self.mixed)
        return out

    def weights_context(self):
        ctx = getattr(self.opt, "master_weights_in_model", None)
        return ctx() if ctx is not None else contextlib.nullcontext()

    def save(self, path: str, step: int) -> None:
        with self.weights_context():
            save_training_state(path, self.model, self.opt, {"step": step}, self.cfg.to_yaml())

    def load(self, path: str) -> int:
        with self.weights_context():
            return load_training_state(path, self.model, self.opt)["step"]

    def global_params(self) -> dict | None:
        if self.dims is None:
            return {k: v.detach().clone() for k, v in self.model.named_parameters()}
        with self.weights_context():
            if self.fsdp:  # gather the FSDP shards, then the EP shards
                full = {}
                for name, p in self.model.named_parameters():
                    carrier = p.full_tensor()
                    setattr(carrier, _ATTR, get_shard(p))
                    full[name] = global_tensor(carrier, self.dims)
            else:
                full = global_state_dict(self.model, self.dims)  # collective
        return full if self.dims.rank == 0 else None


def train(
    rank,
    world,
    par,
    init,
    data,
    dist_opt=True,
    bf16=False,
    ckpt=None,
    steps=3,
    bf16_states=False,
    fsdp=False,
    muon=False,
    master_bf16=False,
    qk_clip=0.0,
) -> dict:
    """`steps` steps of one layout from the reference's weights; save after step 1 when `ckpt`."""
    cfg = layout(par, dist_opt and not fsdp)
    cfg.parallel.fsdp = fsdp
    dims = None if world == 1 else make_dims(cfg, rank, world)
    run = Run(
        cfg,
        dims,
        init,
        dist_opt and not fsdp,
        bf16,
        bf16_states=bf16_states,
        fsdp=fsdp,
        muon=muon,
        master_bf16=master_bf16,
        qk_clip=qk_clip,
    )
    out = run.steps(data, 0, 1)
    if ckpt is not None:
        run.save(ckpt, 1)
    rest = run.steps(data, 1, steps - 1)
    out = {k: out[k] + rest.get(k, []) for k in ("losses", "norms", "launched", "pending", "max_logit") if k in out} | {
        "memory": rest["memory"],
        "gathered": rest.get("gathered", []),
    }
    out["params"] = run.global_params()
    out["param_numel"] = sum(p.numel() for p in run.model.parameters())
    out["muon_owned"], out["muon_matrices"] = muon_work(run.opt)
    if dims is not None and not fsdp:
        out["buckets"] = len(run.sync.buckets)
    if dims is not None:
        run.sync.remove()
    return out


def muon_work(opt) -> tuple[int, int]:
    """(matrices this rank orthogonalises, matrices of its stage) of a distributed Muon; (0, 0) otherwise."""
    inner = getattr(opt, "inner", opt)
    ortho = getattr(opt, "orthogonalize", None) or getattr(
        getattr(inner, "optimizers", [None])[0], "orthogonalize", None
    )
    plan = getattr(ortho, "plan", None)
    return (0, 0) if plan is None else (plan.owned_matrices(), plan.matrices)


def resume(rank, world, par, ckpt, data, dist_opt, seed=100, fsdp=False, muon=False) -> dict:
    """Resume `ckpt` (written after step 1 under another layout) with fresh weights; steps 2-3."""
    cfg = layout(par, dist_opt)
    cfg.parallel.fsdp = fsdp
    dims = None if world == 1 else make_dims(cfg, rank, world)
    run = Run(cfg, dims, None, dist_opt, seed=seed + rank, fsdp=fsdp, muon=muon)
    step = run.load(ckpt)
    out = run.steps(data, step, 3 - step)
    out["step"] = step
    out["params"] = run.global_params()
    if dims is not None:
        run.sync.remove()
    return out
