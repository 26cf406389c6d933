"""Pipeline parallel: build this rank's stages of the model and run a step through torch's schedules.

Entered from outside the single-device model (torchtitan style):

    pipe = parallelize_pipeline(cfg, dims, device)   # builds pipe.model: only this rank's modules
    ...                                              # wrap for data parallel, build the optimizer on pipe.model
    out = pipe.step(input_ids, labels, loss_mask, global_tokens)   # forward + backward of one global batch

`pipe.model` is a `MoETransformer` built with `ModelParts` (moecore/models/transformer.py): the
modules of this rank's stages only, under the full model's parameter names, so checkpoints stay
layout-free and the optimizer, data-parallel reduction and grad norm work on it unchanged. Each stage
(`parallel.pp * parallel.vpp` of them, `moecore.parallel.pipeline_layout`) is a `StageModule` viewing
its part of `pipe.model`, wrapped in a `torch.distributed.pipelining.PipelineStage`; the schedule is
torch's `Schedule1F1B`, `ScheduleInterleaved1F1B`, `ScheduleInterleavedZeroBubble`,
`ScheduleZBVZeroBubble` or `ScheduleDualPipeV` (`parallel.pp_schedule`).

What torch's API does not express, and how it is solved here:
- Losses besides the last stage's output. torch backpropagates only what the last stage returns;
  routing (aux / z / sequence-aux) losses of MoE layers on any stage and the MTP loss are returned
  values of their stage. `_InjectLossGrad` (Megatron's MoEAuxLossAutoScaler technique) passes the
  stage's activations through unchanged and, in backward, gives the stage's extra loss the gradient
  of its weight in the objective, so it reaches the routers and experts of that stage.
- Statistics and metrics. Stage modules append the LM loss sums, MTP losses and per-layer MoE
  statistics of each micro-batch to `StepRecord` (an explicit collector, no globals); after the step
  each pipeline rank's metrics are gathered over the pipeline group.
- Weights on several stages. The embedding (first stage; the MTP stage's token embeddings; a tied
  head on the last stage) and the untied head (last stage and a separate MTP stage) have one copy per
  stage that uses them; `sync_shared_grads` sums their gradients over those stages, so the copies
  stay equal; the grad norm counts one copy (`clip_grad_norm_pipeline`; under the distributed optimizer
  from its shards).
- FSDP2. torch's PipelineStage drives a stage whose module is an FSDP root: with `parallel.fsdp` each
  `StageModule` is sharded as a root of its own (moecore/parallel/fsdp.py `roots`), the decoder layers and
  experts inside it as units; the stage keeps its weights gathered and its gradients unsharded until the last
  micro-batch's backward, then reduce-scatters.
- DSA. Each stage adds its indexers' KL losses (weighted by the coefficient over the model's count of
  indexers) to the loss it injects; a shared DSA layer's top-k comes from the layer before it on its stage.
  In the dense warm-up only the indexers train and they read detached inputs, so the other losses, though
  backpropagated, reach no trainable weight: the indexer loss is the objective, as in one process.
- Positions under context parallel. A stage receives token ids or hidden states of this rank's share of
  each sequence; the global positions of that share, the same for every micro-batch, travel in the
  `StepRecord` rather than through the schedule (which would cut every argument along the batch).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from moecore.config import Config, ConfigError
from moecore.models.decoder_layer import layer_args
from moecore.models.dsa import DSAttention, indexer_count
from moecore.models.hyper_connections import expand_streams
from moecore.models.recompute import checkpoint_module
from moecore.models.transformer import ModelParts, MoETransformer
from moecore.optim.mixed_precision import grad_of, set_grad
from moecore.parallel import comm
from moecore.parallel.data_parallel import apply_clip, squared_norm
from moecore.parallel.dims import Group, ParallelDims
from moecore.parallel.pipeline_layout import StageSpec, check_pipeline, stage_ranks
from moecore.parallel.sharding import get_shard, replication_factor


class _InjectLossGrad(torch.autograd.Function):
    """Identity on `x`; in backward the scalar `loss` receives gradient `scale` (it joins the objective)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, loss: torch.Tensor, scale: float | torch.Tensor) -> torch.Tensor:
        ctx.scale = scale  # a float, or a 0-dim tensor (fp16: it carries the loss scale)
        ctx.loss_meta = (loss.shape, loss.dtype, loss.device)
        # A contiguous copy, not a view: torch sends it as is and its zero-bubble backward detaches stage
        # outputs in place.
        return x.clone(memory_format=torch.contiguous_format)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        shape, dtype, device = ctx.loss_meta
        # as_tensor + expand, not torch.full: a tensor scale stays on the device (full would read it on the host)
        return grad, torch.as_tensor(ctx.scale, dtype=dtype, device=device).expand(shape).clone(), None


class _CountInFlight(torch.autograd.Function):
    """Identity that counts a stage's micro-batches between forward and the backward through its input
    (those whose activations are held): +1 now, -1 when backward reaches this point."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, record: StepRecord, stage: int) -> torch.Tensor:
        ctx.record, ctx.stage = record, stage
        record.enter(stage)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        ctx.record.leave(ctx.stage)
        return grad, None, None


@dataclass
class StepRecord:
    """What the stage modules of this rank record during one step (per micro-batch, in forward order)."""

    global_tokens: torch.Tensor | None = None  # loss tokens of the whole global batch
    lm_scale: float = 1.0  # objective = LM loss sum / global tokens * lm_scale + extra losses * extra_scale
    extra_scale: float = 1.0
    position_ids: torch.Tensor | None = None  # context parallel: the global positions of this rank's tokens
    lm_sums: list = field(default_factory=list)
    tokens: list = field(default_factory=list)
    mtp_losses: list = field(default_factory=list)  # scaled MTP loss per micro-batch
    mtp_depths: list = field(default_factory=list)  # per micro-batch: per-depth unscaled losses
    indexer_losses: list = field(default_factory=list)  # DSA: this rank's stages' share of the indexer loss, per mb
    moe_stats: dict = field(default_factory=dict)  # stage index -> [per micro-batch list of layer dicts]
    live: dict = field(default_factory=dict)  # stage index -> micro-batches forwarded, not yet backpropagated
    peak_live: int = 0  # most micro-batches held at once, summed over this rank's stages

    def enter(self, stage: int) -> None:
        self.live[stage] = self.live.get(stage, 0) + 1
        self.peak_live = max(self.peak_live, sum(self.live.values()))

    def leave(self, stage: int) -> None:
        self.live[stage] -= 1


class StageModule(nn.Module):
    """One pipeline stage: a view of some modules of the rank's model, run as the full model would."""

    def __init__(self, model: MoETransformer, spec: StageSpec, applies_norm: bool, record: StepRecord) -> None:
        super().__init__()
        self.spec, self.applies_norm, self.record = spec, applies_norm, record
        self._model = (model,)  # a tuple: a reference, not a registered submodule (its names are the model's)
        # Registered: exactly the modules this stage's forward uses (the zero-bubble weight pass reads them).
        self.embed = model.embed if spec.embed or spec.mtp or (spec.loss and model.lm_head is None) else None
        self.layers = nn.ModuleList(model.layers[i] for i in spec.layers)
        self.norm = model.norm if applies_norm else None
        self.hc_head = model.hc_head if applies_norm else None  # DeepSeek-V4: the streams collapse before the norm
        self.mtp = model.mtp if spec.mtp else None
        self.lm_head = model.lm_head if (spec.loss or spec.mtp) else None
        # DSA: the objective's indexer term is the mean of every indexer's KL loss in the model (times its
        # coefficient); this stage adds its indexers' share.
        m = model.cfg.model
        self.indexer_weight = m.dsa_indexer_loss_coeff / max(indexer_count(m), 1)

    def forward(
        self, x: torch.Tensor, input_ids: torch.Tensor, labels: torch.Tensor, loss_mask: torch.Tensor
    ) -> torch.Tensor:
        """x: token ids (first stage) or the previous stage's hidden states; returns hidden states, or on
        the last stage the micro-batch's objective as a [1] tensor."""
        model, spec, rec = self._model[0], self.spec, self.record
        position_ids = rec.position_ids  # context parallel: this rank's share of the positions
        if position_ids is None:
            position_ids = torch.arange(input_ids.shape[1], device=input_ids.device)
        if spec.embed:
            x = model.embed(x)
            if model.cfg.model.hc_mult > 1:  # DeepSeek-V4: the embedding enters every hyper-connection stream
                x = expand_streams(x, model.cfg.model.hc_mult)
        if torch.is_grad_enabled() and x.requires_grad:
            x = _CountInFlight.apply(x, rec, spec.index)
        extra, stats = None, []
        # DSA with shared indexer layers: the top-k the last layer used (a stage never opens on a shared layer)
        topk = None
        for layer in self.layers:
            args = layer_args(layer, x, position_ids, loss_mask, topk, input_ids)
            if model.full_recompute and self.training and torch.is_grad_enabled():
                out = checkpoint_module(layer, *args)
            else:
                out = layer(*args)
            x, aux = out[:2]
            if layer.passes_topk:
                topk = out[2]
            if aux is not None:
                stats.append(dict(aux.stats, layer=layer.layer_idx))
                extra = aux.loss if extra is None else extra + aux.loss
        if self.hc_head is not None:
            x = self.hc_head(x)
        if self.norm is not None:
            x = self.norm(x)  # final-normed hidden states: what MTP and the head read
        mask = loss_mask.float()
        if spec.mtp:
            mtp_loss, depth_losses, mtp_auxes = model.mtp(x, input_ids, labels, mask, position_ids, model)
            rec.mtp_losses.append(mtp_loss.detach())
            rec.mtp_depths.append([float(v) for v in depth_losses])
            for i, aux in mtp_auxes:
                stats.append(dict(aux.stats, layer=i))
                mtp_loss = mtp_loss + aux.loss
            extra = mtp_loss if extra is None else extra + mtp_loss
        indexer = self._indexer_loss()
        if indexer is not None:
            rec.indexer_losses.append(indexer.detach())
            extra = indexer if extra is None else extra + indexer
        rec.moe_stats.setdefault(spec.index, []).append(stats)
        if spec.loss:
            _, loss_sum = model.lm_loss(x, labels, mask)
            rec.lm_sums.append(loss_sum.detach())
            rec.tokens.append(mask.sum().detach())
            objective = loss_sum / rec.global_tokens.to(loss_sum.dtype) * rec.lm_scale
            if extra is not None:
                objective = objective + extra * rec.extra_scale
            return objective.float().reshape(1)
        if extra is not None and torch.is_grad_enabled():
            return _InjectLossGrad.apply(x, extra, rec.extra_scale)
        return x.contiguous()  # point-to-point sends need contiguous tensors

    def _indexer_loss(self) -> torch.Tensor | None:
        """DSA: this stage's indexers' KL losses of the last forward, summed and weighted (None without any)."""
        losses = [m.pop_indexer_loss() for m in self.modules() if isinstance(m, DSAttention)]
        losses = [loss for loss in losses if loss is not None]
        return torch.stack(losses).sum() * self.indexer_weight if losses else None


# --------------------------------------------------------------------------------------------------
# Building
# --------------------------------------------------------------------------------------------------


def _norm_stage(stages: list[StageSpec]) -> int:
    """The stage that applies the final norm: the MTP stage if MTP is on, else the loss stage."""
    return next(s.index for s in stages if s.mtp or s.loss)


class Pipeline:
    """This rank's stages, their model and the schedule; see the module docstring."""

    def __init__(
        self, cfg: Config, dims: ParallelDims, device: torch.device, activation_dtype: torch.dtype | None = None
    ) -> None:
        self.cfg, self.dims, self.device = cfg, dims, torch.device(device)
        self.activation_dtype = activation_dtype  # None: the dtype most parameters have (see _activation_dtype)
        p = cfg.parallel
        self.all_stages = check_pipeline(cfg)
        self.placement = stage_ranks(len(self.all_stages), p.pp, p.pp_schedule)
        me = dims.pp_group.rank
        self.local_stages = [s for s in self.all_stages if self.placement[s.index] == me]
        norm_at = _norm_stage(self.all_stages)
        tied = cfg.model.tie_embeddings
        local = self.local_stages
        parts = ModelParts(
            embed=any(s.embed or s.mtp or (s.loss and tied) for s in local),
            layers=tuple(i for s in local for i in s.layers),
            norm=any(s.index == norm_at for s in local),
            lm_head=any(s.loss or s.mtp for s in local),
            mtp=any(s.mtp for s in local),
        )
        self.model = MoETransformer(cfg, dims, parts)
        self.record = StepRecord()
        self.stage_modules = [StageModule(self.model, s, s.index == norm_at, self.record) for s in local]
        self.shared = self._shared_params(tied)
        self.schedule = None
        self._n_microbatches = None

    # ------------------------------------------------------------------ weights on several stages
    def _shared_params(self, tied: bool) -> list[tuple[str, Group, bool]]:
        """(parameter name, group of the pipeline ranks holding a copy, whether this rank's copy is the one
        the grad norm counts) for each weight this rank shares with other pipeline ranks."""
        users = {
            "embed.weight": [s for s in self.all_stages if s.embed or s.mtp or (s.loss and tied)],
            "lm_head.weight": [] if tied else [s for s in self.all_stages if s.loss or s.mtp],
        }
        out = []
        for name, stages in users.items():
            ranks = sorted({self.placement[s.index] for s in stages})
            if len(ranks) > 1:
                group = self.dims.pp_subgroup(tuple(ranks))  # collective: every rank creates it, same order
                if self.dims.pp_group.rank in ranks:
                    out.append((name, group, self.dims.pp_group.rank == ranks[0]))
        return out

    def broadcast_shared(self) -> None:
        """Make every copy of a shared weight equal to the first stage's (after a fresh initialisation)."""
        params = dict(self.model.named_parameters())
        for name, group, _ in self.shared:
            if group.pg is not None:
                with torch.no_grad():
                    dist.broadcast(params[name].data, src=group.ranks[0], group=group.pg)

    def sync_shared_grads(self) -> None:
        """Sum the gradients of every copy of a shared weight over the stages holding it (under FSDP2: their
        local shards, which hold the same rows on every stage: each stage shards the weight over the same
        data-parallel mesh)."""
        params = dict(self.model.named_parameters())
        for name, group, _ in self.shared:
            p = params[name]
            if not p.requires_grad:  # frozen (DSA's dense warm-up): no gradient on any stage
                continue
            if grad_of(p) is None:
                set_grad(p, torch.zeros_like(p, dtype=torch.float32 if hasattr(p, "main_grad") else p.dtype))
            g = grad_of(p)
            comm.all_reduce_(g.to_local() if hasattr(g, "to_local") else g, group, "sum")

    def uncounted_params(self) -> set[int]:
        """ids of this rank's copies of shared weights that the global norm does not count (another stage's does)."""
        skip = {name for name, _, first in self.shared if not first}
        return {id(p) for n, p in self.model.named_parameters() if n in skip}

    def norm_params(self) -> list[torch.nn.Parameter]:
        """Parameters whose gradients count in the global norm here: one copy of each shared weight."""
        skip = self.uncounted_params()
        return [p for p in self.model.parameters() if id(p) not in skip and grad_of(p) is not None]

    def _fold_weight_grads(self) -> None:
        """Zero-bubble schedules compute weight gradients in a separate pass that writes `.grad` directly
        (no post-accumulate hooks); where the run sums gradients in fp32 main gradients (bf16 training),
        add what landed in `.grad` there, as the hook would have."""
        with torch.no_grad():
            for p in self.model.parameters():
                if hasattr(p, "main_grad") and p.grad is not None:
                    p.main_grad = p.grad.float() if p.main_grad is None else p.main_grad.add_(p.grad)
                    p.grad = None

    def num_params(self) -> int:
        return sum(p.numel() for p in self.model.parameters())

    # ------------------------------------------------------------------ the schedule
    def _activation_dtype(self) -> torch.dtype:
        """The dtype of the hidden states stages pass on: the one given, else most parameters' (bf16 parameters
        compute in bf16). Under FSDP2 the parameters are fp32 masters that compute in bf16, so the runner gives it."""
        if self.activation_dtype is not None:
            return self.activation_dtype
        counts: dict[torch.dtype, int] = {}
        for prm in self.model.parameters():
            if prm.is_floating_point():
                counts[prm.dtype] = counts.get(prm.dtype, 0) + prm.numel()
        return max(counts, key=counts.get) if counts else torch.float32

    def _hidden_shape(self, micro_batch: int, seq_local: int) -> tuple[int, ...]:
        """What one stage sends the next: [B, S, H], or [B, S, hc_mult, H] hyper-connection streams (DeepSeek-V4)."""
        m = self.cfg.model
        return (micro_batch, seq_local) + ((m.hc_mult,) if m.hc_mult > 1 else ()) + (m.hidden_size,)

    def _build_schedule(self, n_microbatches: int, micro_batch: int, seq: int) -> None:
        from torch.distributed.pipelining import PipelineStage
        from torch.distributed.pipelining import schedules as S

        cfg, dims = self.cfg, self.dims
        seq_local = seq // dims.tp if dims.sequence_parallel else seq
        # Static shapes (torch would otherwise infer them by running the stage on meta tensors, which the
        # data-dependent MoE dispatch cannot do); requires_grad marks what carries gradients between stages.
        shape = self._hidden_shape(micro_batch, seq_local)
        hidden = torch.empty(shape, dtype=self._activation_dtype(), device=self.device, requires_grad=True)
        ids = torch.empty(micro_batch, seq, dtype=torch.long, device=self.device)
        objective = torch.empty(1, dtype=torch.float32, device=self.device, requires_grad=True)
        n = len(self.all_stages)
        stages = [
            PipelineStage(
                mod,
                mod.spec.index,
                n,
                self.device,
                input_args=(ids if mod.spec.embed else hidden,),
                output_args=(objective if mod.spec.loss else hidden,),
                group=dims.pp_group.pg,
            )
            for mod in self.stage_modules
        ]
        name = cfg.parallel.pp_schedule
        classes = {
            "1f1b": "Schedule1F1B",
            "interleaved_1f1b": "ScheduleInterleaved1F1B",
            "zero_bubble": "ScheduleInterleavedZeroBubble",
            "zbv": "ScheduleZBVZeroBubble",
            "dualpipev": "ScheduleDualPipeV",
        }
        cls = getattr(S, classes[name], None)
        if cls is None:
            raise ConfigError(
                f"parallel.pp_schedule={name!r} is not available in torch {torch.__version__}; use 1f1b or interleaved_1f1b"
            )
        kwargs = {"n_microbatches": n_microbatches, "loss_fn": _objective, "scale_grads": False}
        kwargs = {k: v for k, v in kwargs.items() if k in inspect.signature(cls.__init__).parameters}
        self.schedule = cls(stages[0] if name == "1f1b" else stages, **kwargs)
        self._n_microbatches = n_microbatches

    def step(
        self,
        input_ids: torch.Tensor,
        labels: torch.Tensor,
        loss_mask: torch.Tensor,
        global_tokens: torch.Tensor,
        lm_scale: float,
        extra_scale: float,
        n_microbatches: int,
        position_ids: torch.Tensor | None = None,
    ) -> StepRecord:
        """Forward + backward of this pipeline's share of the global batch ([n_microbatches * mb, S] tensors).

        Objective per micro-batch (as the one-process loop): LM loss sum / global_tokens * lm_scale +
        (routing losses + MTP loss) * extra_scale. Gradients accumulate in the model's `.grad`.
        `position_ids`: under context parallel, the global positions of this rank's share of every sequence
        (`split_batch_for_cp`; the tensors are that share)."""
        if self.schedule is None or self._n_microbatches != n_microbatches:
            self._build_schedule(n_microbatches, input_ids.shape[0] // n_microbatches, input_ids.shape[1])
        rec = self.record
        rec.__init__(global_tokens=global_tokens, lm_scale=lm_scale, extra_scale=extra_scale, position_ids=position_ids)
        for mod in self.stage_modules:
            mod.train()
        kwargs = {"input_ids": input_ids, "labels": labels, "loss_mask": loss_mask}
        first = any(m.spec.embed for m in self.stage_modules)
        last = any(m.spec.loss for m in self.stage_modules)
        args = (input_ids,) if first else ()
        self.schedule.step(*args, target=labels if last else None, **kwargs)
        self._fold_weight_grads()
        return rec

    @torch.no_grad()
    def evaluate_batch(
        self,
        input_ids: torch.Tensor,
        labels: torch.Tensor,
        loss_mask: torch.Tensor,
        position_ids: torch.Tensor | None = None,
    ) -> tuple:
        """(LM loss sum, tokens) of one batch on the loss stage's ranks, zeros elsewhere; forward only,
        stage after stage (point-to-point over the pipeline group)."""
        rec = self.record
        rec.__init__(global_tokens=torch.ones((), dtype=torch.float64, device=self.device), position_ids=position_ids)
        pp = self.dims.pp_group
        me = pp.rank
        local = {m.spec.index: m for m in self.stage_modules}
        seq_local = input_ids.shape[1] // self.dims.tp if self.dims.sequence_parallel else input_ids.shape[1]
        shape = self._hidden_shape(input_ids.shape[0], seq_local)
        x = input_ids
        for s in range(len(self.all_stages)):
            if self.placement[s] != me:
                continue
            mod = local[s]
            mod.eval()
            if s > 0 and self.placement[s - 1] != me:
                x = torch.empty(shape, dtype=self._activation_dtype(), device=self.device)
                dist.recv(x, src=pp.ranks[self.placement[s - 1]], group=pp.pg)
            x = mod(x, input_ids=input_ids, labels=labels, loss_mask=loss_mask)
            if s + 1 < len(self.all_stages) and self.placement[s + 1] != me:
                dist.send(x.contiguous(), dst=pp.ranks[self.placement[s + 1]], group=pp.pg)
        if rec.lm_sums:
            return rec.lm_sums[0].double(), rec.tokens[0].double()
        zero = torch.zeros((), dtype=torch.float64, device=self.device)
        return zero, zero.clone()

    # ------------------------------------------------------------------ across stages
    def sum_over_stages(self, t: torch.Tensor) -> torch.Tensor:
        """Sum a tensor over this rank's pipeline (a value that lives on one stage reaches all); a new tensor."""
        t = t.detach().clone()
        comm.all_reduce_(t, self.dims.pp_group, "sum")
        return t

    def gather_over_stages(self, obj: object) -> list:
        """Every pipeline rank's `obj` (picklable), in pipeline-rank order."""
        out: list = [None] * self.dims.pp_group.size
        dist.all_gather_object(out, obj, group=self.dims.pp_group.pg)
        return out

    def summary(self, run_dir=None) -> list[dict]:
        """Per pipeline rank: its stages (layout symbols), parameters held, peak memory; written to
        `run_dir/pipeline_stages.json` when a folder is given."""
        if self.device.type == "cuda":
            peak = torch.cuda.max_memory_allocated(self.device) / 2**30
            kind = "cuda_max_allocated"
        else:
            import resource

            peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux
            kind = "process_max_rss"
        mine = {
            "pp_rank": self.dims.pp_group.rank,
            "stages": [f"{m.spec.index}:{m.spec.symbols}" for m in self.stage_modules],
            "params": self.num_params(),
            "peak_in_flight_microbatches": self.record.peak_live,
            "peak_mem_gb": round(peak, 3),
            "peak_mem_kind": kind,
        }
        rows = self.gather_over_stages(mine)
        if run_dir is not None:
            import json
            from pathlib import Path

            (Path(run_dir) / "pipeline_stages.json").write_text(json.dumps(rows, indent=1) + "\n")
        return rows


def _objective(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """The schedule's loss function: the last stage already returns the micro-batch's objective."""
    return output.sum()


def parallelize_pipeline(
    cfg: Config, dims: ParallelDims, device: torch.device | str, activation_dtype: torch.dtype | None = None
) -> Pipeline:
    """Build this rank's pipeline stages (its modules of the model, initialised; copies of shared weights equal).
    `activation_dtype`: the hidden states' dtype between stages (default: most parameters' dtype)."""
    if dims.pp_group.size != cfg.parallel.pp:
        raise ValueError(f"dims has pp={dims.pp_group.size}, config parallel.pp={cfg.parallel.pp}")
    # Each stage draws its initial weights from its own stream (the same on every rank of the stage), so
    # equal-shaped layers of different stages do not start equal; copies of shared weights are then synced.
    torch.manual_seed(cfg.train.seed + 7919 * dims.pp_group.rank)
    with torch.device(device):
        pipe = Pipeline(cfg, dims, torch.device(device), activation_dtype)
    pipe.broadcast_shared()
    return pipe


def pipeline_grad_norm(pipe: Pipeline) -> torch.Tensor:
    """L2 norm of the full gradient over every stage: each parameter once (replicas within a stage once,
    shards from every shard, the copies of a shared weight once). Collective over the world, on every
    rank even where no counted parameter has a gradient (a loss-only stage whose head is counted elsewhere)."""
    total = torch.zeros((), dtype=torch.float64, device=pipe.device)
    for prm in pipe.norm_params():
        # Each copy within the stage contributes 1/copies of its square, so the world sum counts it once.
        total += squared_norm(grad_of(prm).detach()) / replication_factor(get_shard(prm), pipe.dims)
    comm.all_reduce_(total, pipe.dims.world_group, "sum")
    return total.sqrt().float()


def clip_grad_norm_pipeline(
    pipe: Pipeline, max_norm: float, optimizer: object = None, reducer: object = None
) -> torch.Tensor:
    """Global grad norm over every stage (`pipeline_grad_norm`), then gradients scaled to at most max_norm:
    by the optimizer's fused update where it takes a coefficient (`grad_scale`), else in place. Where the
    gradients are sharded (the distributed optimizer's shards, FSDP2's `reducer`), the norm is their owner's,
    each shared weight counted once."""
    for owner in (optimizer, reducer):
        if hasattr(owner, "clip_grad_norm"):
            return owner.clip_grad_norm(max_norm, uncounted=pipe.uncounted_params())
    norm = pipeline_grad_norm(pipe)
    grads = [g for g in (grad_of(p) for p in pipe.model.parameters()) if g is not None]
    apply_clip(grads, norm, max_norm, optimizer)
    return norm
