"""Per-GPU peak memory of a training step for one layout: the planner's memory model.

For every pipeline stage the estimate adds, per rank:
- `params`, `grads`, `optimizer`: exact bytes from moecore.plan.params (precision mode, sharding);
- `activations`: what one micro-batch's decoder layers keep for backward (moecore.plan.activations),
  times the micro-batches in flight on that stage (1F1B: stage s holds min(m, pp - s); interleaved
  with vpp chunks: ((vpp - 1) * pp + 2 * (pp - 1 - s) + 1) / vpp; the zero-bubble and V schedules from torch's
  order of the schedule, each micro-batch held until its weight pass: `in_flight`); under autocast on fp32
  parameters, the bf16 weight copies the matmuls keep are counted here too, and under FP8 (tensorwise,
  blockwise) without primary weights the FP8 weight copies the forward saves for the backward;
- `loss`: the logits / loss chunk of the last stage (one micro-batch);
- `workspace`: the largest transient of backward: a layer's activation gradients (routed rows with
  the load-imbalance margin and the all-to-all buffers under ep), the activations a recomputed layer
  rebuilds, or the loss backward's fp32 head gradient;
- the step's transients after backward: the embedding gradient's fp32 accumulation, the distributed
  optimizer's fp32 gradient shard and all-gather buffers (moecore/parallel/distributed_optimizer.py).

The peak is params + optimizer + the largest of three phases: start of backward (activations +
workspace, plus the gradients when they accumulate over micro-batches), end of backward (all
gradients + the embedding transient) and the optimizer step (all gradients + its buffers).
`framework` (CUDA context, cuBLAS / NCCL workspaces, allocator fragmentation) is added for the fit
decision only: `peak_allocated` is what torch.cuda.max_memory_allocated would report.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from moecore.config import Config
from moecore.plan.activations import (
    ActContext,
    layer_backward_workspace,
    layer_modules,
    layer_saved,
    loss_bytes,
)
from moecore.plan.layout import Layout, head_rank, run_schedule
from moecore.plan.params import ParamSummary, PrecisionMode, param_summary, precision_mode, stage_layers, state_bytes
from moecore.plan.schedule_memory import SPLIT_BACKWARD_SCHEDULES, held_chunks

GiB = float(2**30)
IMBALANCE_MARGIN = 1.25  # routed rows on the busiest expert rank / the mean, under ep > 1 (dropless)
FRAMEWORK_BASE_GIB = 1.0  # CUDA context and cuBLAS workspaces (outside torch's allocator counters)
NCCL_PER_GROUP_GIB = 0.25  # NCCL buffers per communicator kind in use
FRAGMENTATION = 0.05  # allocator reserve beyond the allocated peak


@dataclass
class PlanOptions:
    """The stated assumptions of an estimate."""

    imbalance: float = IMBALANCE_MARGIN
    device: str = "cuda"  # cuda: fused kernels, bf16 by default; cpu: unfused ops, fp32 by default
    mode: PrecisionMode | None = None  # force a precision mode (e.g. a model cast to bf16 with bf16 AdamW state)
    cache: dict = field(default_factory=dict, repr=False)  # memoised per-layout pieces (one model per cache)


@dataclass
class MemoryEstimate:
    """Bytes per rank on the worst pipeline stage; `by_kind` holds the table's columns."""

    stage: int
    micro_batches: int
    in_flight: float
    params: float
    grads: float
    optimizer: float
    activations: float
    loss: float
    workspace: float
    step_transient: float
    peak_allocated: float
    framework: float
    phase: str  # which phase sets the peak: backward_start | backward_end | optimizer_step
    mode: str
    per_stage: list = field(default_factory=list)  # peak_allocated of the first and the last stage

    @property
    def total(self) -> float:
        return self.peak_allocated + self.framework

    def by_kind(self) -> dict[str, float]:
        """GiB per kind (as the table prints them)."""
        other = self.loss + self.workspace + self.step_transient
        return {
            "params": self.params / GiB,
            "grads": self.grads / GiB,
            "optimizer": self.optimizer / GiB,
            "activations": self.activations / GiB,
            "other": other / GiB,
            "framework": self.framework / GiB,
            "total": self.total / GiB,
        }

    def to_dict(self) -> dict:
        out = asdict(self)
        out["total"] = self.total
        return out


def micro_batches_per_step(cfg: Config, layout: Layout) -> int:
    """m: micro-batches each data-parallel rank runs per optimizer step (at least 1)."""
    return max(1, cfg.train.global_batch_size // (layout.micro_batch_size * layout.dp))


def in_flight(layout: Layout, stage: int, m: int, schedule: str | None = None) -> float:
    """Micro-batches whose activations pipeline rank `stage` holds at once, in units of the rank's whole share of
    the layers for one micro-batch; `schedule`: parallel.pp_schedule (None: 1F1B, or interleaved with vpp > 1).

    1F1B: rank s runs pp - 1 - s forwards before its first backward, so it holds pp - s. Interleaved (torch's
    ScheduleInterleaved1F1B, Megatron's order): rank s runs (vpp - 1) * pp + 2 * (pp - 1 - s) chunk forwards
    first (each chunk 1 / vpp of the rank's layers), so it holds one more than that, in chunks. Both are capped by
    the step's m micro-batches. Measured by benchmarks/pipeline_schedules.py (pp 4, 8 micro-batches): 4 / 3 / 2 / 1
    under 1F1B and 11 / 9 / 7 / 5 chunks under interleaved 1F1B, the formulas' values on every rank. The
    zero-bubble and V schedules keep each micro-batch until its deferred weight pass: their counts come from
    torch's own order of the schedule (moecore/plan/schedule_memory.py)."""
    pp, vpp = layout.pp, layout.vpp
    if pp == 1:
        return 1.0
    held = held_chunks(schedule, pp, vpp, m) if schedule in SPLIT_BACKWARD_SCHEDULES and vpp > 1 else None
    if held:
        return held[stage] / vpp
    if vpp > 1:
        chunks = (vpp - 1) * pp + 2 * (pp - 1 - stage) + 1
        return min(float(m), chunks / vpp)
    return float(min(m, pp - stage))


def act_context(cfg: Config, layout: Layout, mode: PrecisionMode, opts: PlanOptions) -> ActContext:
    tokens = layout.micro_batch_size * cfg.train.seq_length // layout.cp
    residual = 4 if mode.autocast else mode.act_bytes
    align = _expert_row_alignment(cfg, mode)
    cuda = opts.device == "cuda"
    # kernels/fp8_grouped.py _device_offsets_only: every recipe's GEMMs but blockwise's read offsets on the GPU
    bound = bool(align) and cuda and mode.fp8 != "blockwise"
    return ActContext(tokens, mode.act_bytes, residual, cuda, opts.imbalance, align, bound)


def _expert_row_alignment(cfg: Config, mode: PrecisionMode) -> int:
    """The alignment FP8 pads every expert GEMM's rows to (fp8.padding=all), when the experts run in FP8; else 0."""
    f8 = cfg.fp8
    if not mode.fp8 or "experts" not in f8.modules or f8.resolved("padding") != "all":
        return 0
    return f8.alignment  # apply_fp8 makes every SwiGLU expert FFN FP8 (the config refuses unaligned widths)


def _optimizer_step_transient(layout: Layout, summary: ParamSummary) -> float:
    """The distributed optimizer's step: fp32 gradient and master slices of a shard, then the all-gather
    of the largest flat buffer (every rank's shard, and their concatenation)."""
    if not layout.distributed_optimizer or layout.fsdp:
        return 0.0
    worst = 0.0
    for (_, expert), n in summary.groups.items():
        g = layout.edp if expert else layout.dp_cp
        if n and g > 1:
            shard = -(-n // g)
            worst = max(worst, 2 * shard * 4 + 2 * shard * g * 4)
    return worst


def _weight_copies(layout: Layout, summary: ParamSummary, mode: PrecisionMode) -> float:
    """The weight copies the kept matmuls saved for backward (one micro-batch): under autocast on fp32 parameters
    the bf16 casts of the matrices; under FP8 without primary weights the one-byte recipes' FP8 copies."""
    if layout.recompute_granularity == "full":
        return 0.0
    moe_recomputed = layout.recompute_granularity == "selective" and "moe" in layout.recompute_modules
    if mode.autocast:
        return 2.0 * (summary.matmuls - (summary.moe_matmuls if moe_recomputed else 0))
    if mode.fp8_kept_per_micro_batch:
        kept = sum(b for _, b in summary.fp8_weights.values())
        return float(kept - (summary.fp8_moe_copy if moe_recomputed else 0))
    return 0.0


def _layer_kind(cfg: Config, i: int) -> tuple[bool, bool, bool]:
    """What sets decoder layer i's activations apart: (linear attention, MoE, a shared DSA indexer: GLM-5's layers
    that reuse another layer's top-k keep no indexer tensors)."""
    m = cfg.model
    linear = m.layer_types is not None and m.layer_types[i] == "linear_attention"
    shared = m.indexer_types is not None and m.indexer_types[i] == "shared"
    return linear, cfg.moe.is_moe_layer(i, m.num_layers), shared


def _stage_kinds(cfg: Config, pp: int, stage: int, cache: dict) -> list[tuple[int, int]]:
    """[(a representative layer index, how many layers of that kind)] of one stage; kind = `_layer_kind`."""
    key = ("kinds", pp, stage)
    if key not in cache:
        kinds: dict[tuple[bool, bool, bool], list[int]] = {}
        for i in stage_layers(cfg.model.num_layers, pp)[stage]:
            kinds.setdefault(_layer_kind(cfg, i), []).append(i)
        cache[key] = [(idx[0], len(idx)) for idx in kinds.values()]
    return cache[key]


def _layer_terms(cfg: Config, i: int, layout: Layout, c: ActContext, cache: dict) -> tuple[float, float, float]:
    """(saved on the GPU, recomputed, backward workspace incl. offloaded groups back on the GPU) bytes of
    decoder layer i, memoised per layer kind."""
    kind = _layer_kind(cfg, i)
    key = ("layer", kind, layout.tp, layout.ep, layout.etp, layout.recompute_granularity,
           layout.recompute_modules, layout.offload_modules, c)  # fmt: skip
    if key not in cache:
        saved, recomputed, offloaded = layer_saved(cfg, i, kind[1], layout, c)
        ws = layer_backward_workspace(cfg, kind[1], layout, c)
        cache[key] = (saved, recomputed, ws + 2 * offloaded)  # offloaded: the group in use and the one prefetched
    return cache[key]


def estimate_stage(cfg: Config, layout: Layout, stage: int, opts: PlanOptions) -> MemoryEstimate:
    """The memory estimate of one rank of pipeline stage `stage`."""
    m_cfg = cfg.model
    cache = opts.cache
    m = micro_batches_per_step(cfg, layout)
    mode = opts.mode or precision_mode(cfg, layout, m, opts.device)
    c = act_context(cfg, layout, mode, opts)
    summary = param_summary(cfg, layout, stage, cache)
    state = state_bytes(cfg, layout, stage, mode, cache)
    first, last = stage == 0, stage == head_rank(cfg, layout)
    per_mb = 0.0
    workspace = 0.0
    for i, count in _stage_kinds(cfg, layout.pp, stage, cache):
        saved, recomputed, ws = _layer_terms(cfg, i, layout, c, cache)
        per_mb += saved * count
        workspace = max(workspace, ws + recomputed)
    loss_kept, loss_bwd = (0.0, 0.0)
    if last:
        h = m_cfg.hidden_size
        per_mb += c.tokens / layout.tp * (h * c.residual_bytes + 4)  # the final norm's input and 1/rms
        loss_kept, loss_bwd = loss_bytes(cfg, layout, c, mode.param)
        for _ in range(m_cfg.mtp_num_layers):  # MTP depth: input norms, projection input, an MoE block, its loss
            blk = sum(layer_modules(cfg, 0, cfg.moe.num_experts > 0, layout, c).values())
            per_mb += blk + c.tokens * h * c.act_bytes * 4
            loss_kept += loss_bytes(cfg, layout, c, mode.param)[0]
    if first:
        per_mb += c.tokens * 8  # token ids kept by the embedding
    flight = in_flight(layout, stage, m, run_schedule(cfg, layout))
    activations = (per_mb + _weight_copies(layout, summary, mode)) * flight
    grads_during_forward = state["grads"] if m > 1 else 0.0
    if layout.fsdp:  # one layer gathered unsharded, and its unsharded gradient before the reduce-scatter
        workspace += summary.largest_layer * (mode.param + mode.grad)
    # Start of backward: the loss backward (its fp32 head gradient) with everything kept, then the
    # first layer's backward: its gradient workspace, its weight gradients and the head's already made.
    head_grad = (m_cfg.vocab_size / layout.tp * m_cfg.hidden_size * mode.grad) if last else 0.0
    fresh_grads = 0.0 if m > 1 else head_grad + summary.largest_layer * mode.grad
    backward_start = grads_during_forward + activations + max(loss_kept + loss_bwd, fresh_grads + workspace)
    embed_tmp = m_cfg.vocab_size / layout.tp * m_cfg.hidden_size * 4 if first and mode.param == 2 else 0.0
    backward_end = state["grads"] + embed_tmp
    opt_tmp = _optimizer_step_transient(layout, summary)
    optimizer_step = state["grads"] + opt_tmp
    phases = {"backward_start": backward_start, "backward_end": backward_end, "optimizer_step": optimizer_step}
    phase = max(phases, key=phases.get)
    static = state["params"] + state["optimizer"]
    peak = static + phases[phase]
    degrees = (layout.tp, layout.pp, layout.cp, layout.ep, layout.etp, layout.dp_cp, layout.edp)
    groups = sum(1 for d in degrees if d > 1)
    framework = (FRAMEWORK_BASE_GIB + NCCL_PER_GROUP_GIB * groups) * GiB + FRAGMENTATION * peak
    return MemoryEstimate(
        stage=stage,
        micro_batches=m,
        in_flight=flight,
        params=state["params"],
        grads=state["grads"],
        optimizer=state["optimizer"],
        activations=activations,
        loss=loss_kept,
        workspace=max(loss_bwd, workspace + fresh_grads),
        step_transient=max(embed_tmp, opt_tmp),
        peak_allocated=peak,
        framework=framework,
        phase=phase,
        mode=mode.name,
    )


def estimate_memory(cfg: Config, layout: Layout, opts: PlanOptions | None = None) -> MemoryEstimate:
    """The worst pipeline stage's estimate (`per_stage`: the peaks of the first and the last rank).

    Only those two can be the worst: stages get contiguous layers with the extra ones first, the
    first rank holds the most micro-batches in flight (or, under the zero-bubble and V schedules, as many as any)
    and the embedding, the last the head and loss (under the V schedules rank 0 holds both: `head_rank`).
    """
    opts = opts or PlanOptions()
    stages = [estimate_stage(cfg, layout, s, opts) for s in sorted({0, layout.pp - 1})]
    worst = max(stages, key=lambda e: e.peak_allocated)
    worst.per_stage = [s.peak_allocated for s in stages]
    return worst
