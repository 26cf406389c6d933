"""A candidate parallel layout for the planner, and the trainer-independent facts derived from it.

`Layout` holds every degree the planner searches over (tp, pp, vpp, cp, ep, etp, dp), the
optimizer sharding (distributed optimizer = ZeRO-1, fsdp = parameters, gradients and optimizer state
sharded), the recomputation options, the MoE layer's activation memory mode and the micro-batch size.
`layout_config(cfg, layout)` writes a layout into a copy of a Config (what `moecore train` would be
given); `unsupported_reason` asks the
trainer's own check (`moecore.parallel.layout.check_layout`) whether this version runs it, so the
planner's "supported" column follows the code as other features land.

Rank order follows `moecore.parallel.dims.ParallelDims`: dense groups tp (innermost), cp, dp, pp;
expert groups etp, ep, edp, pp. `group_span` is the number of consecutive ranks a group reaches,
which decides whether it stays inside one node.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

from moecore.config import Config, ConfigError
from moecore.parallel.layout import validate_layout
from moecore.parallel.pipeline_layout import V_SCHEDULES


@dataclass(frozen=True)
class Layout:
    """One way to lay a model out over `world` GPUs; dp is derived from the others."""

    tp: int = 1
    pp: int = 1
    vpp: int = 1  # virtual pipeline chunks per stage (interleaved 1F1B)
    cp: int = 1
    ep: int = 1
    etp: int = 1
    dp: int = 1
    distributed_optimizer: bool = False
    fsdp: bool = False
    recompute_granularity: str = "none"  # none | selective | full
    recompute_modules: tuple = ()
    micro_batch_size: int = 1
    offload_modules: tuple = field(default=())
    precision: str = ""  # "": the config's; adam_bf16: bf16 Adam moments; master_bf16: bf16 master weights and moments
    activation_memory: str = ""  # "": the config's moe.activation_memory; else that mode (the planner offers chunked)

    @property
    def world(self) -> int:
        return self.tp * self.pp * self.cp * self.dp

    @property
    def edp(self) -> int:
        """Data-parallel replicas of an expert shard: world / (etp * ep * pp)."""
        return self.world // (self.etp * self.ep * self.pp)

    @property
    def dp_cp(self) -> int:
        return self.dp * self.cp

    def recompute_label(self) -> str:
        if self.recompute_granularity == "full":
            return "full"
        if self.recompute_granularity == "none" or not self.recompute_modules:
            return "none"
        return "+".join(self.recompute_modules)

    def label(self) -> str:
        """A compact name: tp2 pp4(v2) ep8 dp4 zero1 mbs1 rc=moe_act+norm."""
        parts = [f"tp{self.tp}"]
        if self.pp > 1:
            parts.append(f"pp{self.pp}" + (f"v{self.vpp}" if self.vpp > 1 else ""))
        if self.cp > 1:
            parts.append(f"cp{self.cp}")
        if self.ep > 1:
            parts.append(f"ep{self.ep}")
        if self.etp > 1:
            parts.append(f"etp{self.etp}")
        parts.append(f"dp{self.dp}")
        if self.fsdp:
            parts.append("fsdp")
        elif self.distributed_optimizer:
            parts.append("zero1")
        parts.append(f"mbs{self.micro_batch_size}")
        parts.append(f"rc={self.recompute_label()}")
        if self.offload_modules:
            parts.append("off=" + "+".join(self.offload_modules))
        if self.precision:
            parts.append(self.precision)
        if self.activation_memory:
            parts.append(f"moe={self.activation_memory}")
        return " ".join(parts)

    def overrides(self, pp_layout: str | None = None) -> list[str]:
        """`moecore train` overrides that select this layout (`pp_layout`: its stages, `stage_layout_of`)."""
        rec = ",".join(self.recompute_modules)
        out = [
            f"parallel.tp={self.tp}",
            f"parallel.pp={self.pp}",
            f"parallel.cp={self.cp}",
            f"parallel.ep={self.ep}",
            f"parallel.etp={self.etp}",
            f"parallel.distributed_optimizer={str(self.distributed_optimizer).lower()}",
            f"parallel.fsdp={str(self.fsdp).lower()}",
            f"model.recompute_granularity={self.recompute_granularity}",
            f"model.recompute_modules=[{rec}]",
            f"train.micro_batch_size={self.micro_batch_size}",
        ]
        if self.pp > 1:
            out.insert(2, f"parallel.pp_schedule={pp_schedule(self.vpp)}")
            out.insert(2, f"parallel.vpp={self.vpp}")
            if pp_layout:
                out.insert(4, f"parallel.pp_layout={pp_layout}")
        if self.offload_modules:
            out.append(f"model.offload_modules=[{','.join(self.offload_modules)}]")
        if self.precision in ("adam_bf16", "master_bf16"):
            out.append("optim.state_dtype=bf16")
        if self.precision == "master_bf16":
            out.append("optim.master_weights=bf16")
        if self.activation_memory:
            out.append(f"moe.activation_memory={self.activation_memory}")
        return out


def layout_of(cfg: Config, world: int) -> Layout:
    """The layout a config asks for on `world` GPUs (dp derived; 1 when the degrees do not tile)."""
    p, m = cfg.parallel, cfg.model
    dense = p.tp * p.pp * p.cp
    return Layout(
        tp=p.tp,
        pp=p.pp,
        vpp=p.vpp,
        cp=p.cp,
        ep=p.ep,
        etp=p.etp,
        dp=max(1, world // dense),
        distributed_optimizer=bool(p.distributed_optimizer),
        fsdp=bool(p.fsdp),
        recompute_granularity=m.recompute_granularity,
        recompute_modules=tuple(m.recompute_modules),
        micro_batch_size=cfg.train.micro_batch_size,
        offload_modules=tuple(getattr(m, "offload_modules", ()) or ()),
        activation_memory="" if cfg.moe.activation_memory == "standard" else cfg.moe.activation_memory,
    )


def pp_schedule(vpp: int) -> str:
    """The schedule the planner's pipeline model describes: 1F1B, or interleaved 1F1B with vpp > 1 chunks."""
    return "1f1b" if vpp == 1 else "interleaved_1f1b"


def schedule_fits(schedule: str, vpp: int) -> bool:
    """Whether a config's `parallel.pp_schedule` runs `vpp` stages per rank (moecore.parallel.pipeline_layout)."""
    if schedule == "1f1b":
        return vpp == 1
    if schedule in ("zbv", "dualpipev"):
        return vpp == 2
    return True


def run_schedule(cfg: Config, layout: Layout) -> str:
    """The pipeline schedule a candidate runs: the config's where it runs the layout's vpp, else `pp_schedule`'s
    (as `layout_config` sets it)."""
    schedule = cfg.parallel.pp_schedule
    return schedule if schedule_fits(schedule, layout.vpp) else pp_schedule(layout.vpp)


def head_rank(cfg: Config, layout: Layout) -> int:
    """The pipeline rank that holds the last stage (final norm, head, loss, MTP): the last rank, or rank 0 under the
    V schedules, whose rank r holds stages r and 2 * pp - 1 - r (moecore.parallel.pipeline_layout.stage_ranks)."""
    return 0 if run_schedule(cfg, layout) in V_SCHEDULES else layout.pp - 1


def stage_layout_of(cfg: Config, layout: Layout) -> str | None:
    """`parallel.pp_layout` for a candidate: the config's own when it has the candidate's stage count; else,
    when the layers do not split evenly over pp x vpp stages, the planner's split (the extra layers on
    the first stages, as moecore.plan.params.stage_layers) in the trainer's notation; else None (even split)."""
    p, m = cfg.parallel, cfg.model
    if layout.pp == 1:
        return None
    if p.pp_layout and (p.pp, p.vpp) == (layout.pp, layout.vpp):
        return p.pp_layout
    n = layout.pp * layout.vpp
    if m.num_layers % n == 0 or m.num_layers < n:
        return None  # the trainer's even split (or its one-line refusal of too few layers)
    base, extra = divmod(m.num_layers, n)
    stages = ["t" * (base + (s < extra)) for s in range(n)]
    stages[0] = "E" + stages[0]
    stages[-1] += "m" * m.mtp_num_layers + "L"
    return "|".join(stages)


def layout_config(cfg: Config, layout: Layout) -> Config:
    """A copy of cfg with the layout's degrees, optimizer sharding, recomputation and micro-batch size."""
    out = copy.deepcopy(cfg)
    p, m = out.parallel, out.model
    p.pp_layout = stage_layout_of(cfg, layout)
    if layout.pp > 1 and not schedule_fits(p.pp_schedule, layout.vpp):
        p.pp_schedule = pp_schedule(layout.vpp)
    p.tp, p.pp, p.cp, p.ep, p.etp = layout.tp, layout.pp, layout.cp, layout.ep, layout.etp
    p.vpp = layout.vpp
    p.distributed_optimizer, p.fsdp = layout.distributed_optimizer, layout.fsdp
    m.recompute_granularity = layout.recompute_granularity
    m.recompute_modules = list(layout.recompute_modules)
    m.offload_modules = list(layout.offload_modules)
    if layout.precision:
        out.optim.state_dtype = "bf16"
        if layout.precision == "master_bf16":
            out.optim.master_weights = "bf16"
    if layout.activation_memory:
        out.moe.activation_memory = layout.activation_memory
    out.train.micro_batch_size = layout.micro_batch_size
    return out


def unsupported_reason(cfg: Config, layout: Layout) -> str | None:
    """None when this version's trainer runs the layout, else the one-line reason it gives."""
    try:
        c = layout_config(cfg, layout)
        # the rules that span sections (e.g. bf16 Adam moments without the distributed optimizer), the tiling of
        # the GPUs and the pipeline schedule's micro-batch counts (validate_layout calls check_layout)
        validate_layout(c, layout.world)
    except ConfigError as e:
        return str(e)
    return None


def group_span(layout: Layout, group: str) -> int:
    """How many consecutive ranks one group of this kind spans (its stride times its size)."""
    t, c, d, p = layout.tp, layout.cp, layout.dp, layout.pp
    e, et, ed = layout.ep, layout.etp, layout.edp
    spans = {
        "tp": t,
        "cp": t * c,
        "dp": t * c * d,
        "dp_cp": t * c * d,
        "pp": t * c * d * p,
        "etp": et,
        "ep": et * e,
        "edp": et * e * ed,
    }
    return spans[group]
