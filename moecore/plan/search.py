"""Every valid layout of a model on N GPUs, estimated and ranked.

Candidates: tp in powers of two up to the GPUs of one node that divide the heads (and key/value
heads, and the sequence); pp up to the layer count; vpp 1 or 2 with pp > 1 (1F1B, or
interleaved 1F1B with two chunks per stage); cp 1 or 2 (cp 4 from 16k
tokens); ep dividing the expert count with etp x ep x pp dividing N; etp 1 or tp; dp the rest;
optimizer state replicated, distributed (ZeRO-1) or fsdp; recomputation none / the recipe's /
the light selective set / + moe / full; for MoE models whose config keeps the standard expert
activations, also `moe.activation_memory=chunked` (without MoE or full recomputation, which it
replaces: it keeps only the experts' input and computes FC1 again, +22% of the expert FLOPs;
`chunked_modes`); micro-batch sizes 1, 2, 4 that divide the global batch over dp. A layout is
`valid` when its degrees tile the GPUs and divide the model; `supported` when this version's
trainer runs it (moecore.parallel.layout.check_layout); layouts that are valid but not
supported stay in the table, marked.

When no layout fits with the config's precision, the bf16 optimizer-state options (bf16 Adam moments;
bf16 master weights and moments) are searched too and shown with their label.

Ranking: layouts that fit first (estimated total <= GPU memory), by estimated tokens/s (among
equals, supported before unsupported, then less memory); then the others by the memory they need.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from moecore.config import Config
from moecore.plan.activations import low_memory_experts_run
from moecore.plan.layout import Layout, stage_layout_of, unsupported_reason
from moecore.plan.memory import GiB, MemoryEstimate, PlanOptions, estimate_memory
from moecore.plan.params import PRECISIONS
from moecore.plan.throughput import Hardware, StepEstimate, estimate_step

LIGHT = ("core_attn", "mla_up_proj", "moe_act", "norm", "shared_experts", "mlp")


@dataclass
class Candidate:
    """One layout with its estimates."""

    layout: Layout
    memory: MemoryEstimate
    step: StepEstimate
    fits: bool
    unsupported: str | None
    pp_layout: str | None = None  # the stage layout the overrides give (uneven splits; layout.stage_layout_of)

    def to_dict(self) -> dict:
        return {
            "layout": self.layout.label(),
            "overrides": self.layout.overrides(self.pp_layout),
            "fits": self.fits,
            "supported": self.unsupported is None,
            "unsupported_reason": self.unsupported,
            "memory_gib": {k: round(v, 3) for k, v in self.memory.by_kind().items()},
            "peak_allocated_gib": round(self.memory.peak_allocated / GiB, 3),
            "peak_phase": self.memory.phase,
            "worst_stage": self.memory.stage,
            "micro_batches": self.memory.micro_batches,
            "in_flight": self.memory.in_flight,
            "step": {k: round(v, 6) for k, v in self.step.to_dict().items()},
        }


def _pow2_upto(n: int) -> list[int]:
    out, v = [], 1
    while v <= n:
        out.append(v)
        v *= 2
    return out


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def applicable_light(cfg: Config) -> tuple[str, ...]:
    """The cheap selective options that do something for this model."""
    m, e = cfg.model, cfg.moe
    out = ["core_attn", "norm"]
    if m.attention_type in ("mla", "dsa"):
        out.insert(1, "mla_up_proj")
    if e.num_experts:
        out.append("moe_act")
    if e.shared_expert_intermediate_size:
        out.append("shared_experts")
    if any(not e.is_moe_layer(i, m.num_layers) for i in range(m.num_layers)):
        out.append("mlp")
    return tuple(sorted(out, key=LIGHT.index))


def recompute_options(cfg: Config) -> list[tuple[str, tuple]]:
    """(granularity, modules) pairs searched: none, the recipe's, the light set, light + moe, full."""
    light = applicable_light(cfg)
    opts = [("none", ()), ("selective", light)]
    if cfg.moe.num_experts:
        opts.append(("selective", light + ("moe",)))
    opts.append(("full", ()))
    m = cfg.model
    if m.recompute_granularity == "selective" and m.recompute_modules:
        mine = ("selective", tuple(m.recompute_modules))
        if mine not in opts:
            opts.insert(1, mine)
    return opts


def chunked_modes(cfg: Config) -> tuple[str, ...]:
    """The expert activation modes searched besides the config's: chunked where the layer can run it (dropless
    SwiGLU grouped experts, not sync-free, not FP8 experts) and the config keeps the standard
    activations."""
    e = cfg.moe
    ok = e.num_experts and e.activation_memory == "standard" and not e.sync_free
    return ("chunked",) if ok and low_memory_experts_run(cfg) else ()


def _memory_options(cfg: Config) -> list[tuple[str, str, tuple]]:
    """(activation memory mode, recompute granularity, modules): the config's mode with every recomputation
    option, chunked with those that leave the MoE block's forward alone (none, the light set)."""
    rec = recompute_options(cfg)
    own = "" if cfg.moe.activation_memory == "standard" else cfg.moe.activation_memory  # as `layout_of` reads it
    out = [(own, gran, mods) for gran, mods in rec]
    for mode in chunked_modes(cfg):
        out += [(mode, gran, mods) for gran, mods in rec if gran != "full" and "moe" not in mods]
    return out


def candidate_layouts(cfg: Config, gpus: int, gpus_per_node: int = 8, precisions: tuple = ("",)) -> list[Layout]:
    """Every valid layout of cfg on `gpus` GPUs (supported by the trainer or not), for each Layout.precision."""
    m, e, t = cfg.model, cfg.moe, cfg.train
    out = []
    tps = [
        tp
        for tp in _pow2_upto(min(gpus_per_node, gpus))
        if gpus % tp == 0
        and m.num_attention_heads % tp == 0
        and m.kv_heads % tp == 0
        and t.seq_length % tp == 0
        and (not m.vocab_size or m.vocab_size % tp == 0)
    ]
    cps = [1, 2] + ([4] if t.seq_length >= 16384 else [])
    offload = tuple(getattr(m, "offload_modules", ()) or ())  # the config's offloading, in every candidate
    eps = [d for d in _divisors(e.num_experts)] if e.num_experts else [1]
    memory_options = _memory_options(cfg)
    for tp, cp in itertools.product(tps, cps):
        if gpus % (tp * cp) or t.seq_length % (2 * cp * tp) and cp > 1:
            continue
        for pp in _divisors(gpus // (tp * cp)):
            if pp > m.num_layers:
                continue
            dp = gpus // (tp * cp * pp)
            vpps = [1] + ([2] if pp > 1 and m.num_layers % (2 * pp) == 0 else [])
            for vpp, ep in itertools.product(vpps, eps):
                for etp in sorted({1, tp}):
                    if e.num_experts and e.ffn_hidden_size % etp:
                        continue
                    if gpus % (etp * ep * pp) or (not e.num_experts and (ep > 1 or etp > 1)):
                        continue
                    for mbs in (1, 2, 4):
                        if t.global_batch_size % (mbs * dp):
                            continue
                        edp = gpus // (etp * ep * pp)
                        shardings = [(False, False)]
                        if dp * cp > 1 or edp > 1:
                            shardings.append((True, False))
                        if dp * cp > 1:
                            shardings.append((False, True))
                        combos = itertools.product(shardings, memory_options, precisions)
                        for (dist, fsdp), (act, gran, mods), prec in combos:
                            out.append(
                                Layout(tp, pp, vpp, cp, ep, etp, dp, dist, fsdp, gran, mods, mbs, offload, prec, act)
                            )
    return out


def search(
    cfg: Config,
    gpus: int,
    gpu_mem_gib: float,
    hw: Hardware | None = None,
    opts: PlanOptions | None = None,
) -> list[Candidate]:
    """Every candidate layout with its estimates, ranked (module docstring)."""
    hw = hw or Hardware()
    opts = opts or PlanOptions()
    out = _evaluate(cfg, candidate_layouts(cfg, gpus, hw.gpus_per_node), gpu_mem_gib, hw, opts)
    bf16 = cfg.train.precision in ("bf16", "auto", "fp8") and cfg.optim.name == "adamw" and opts.device == "cuda"
    if bf16 and not any(c.fits for c in out):  # what bf16 optimizer state would make fit
        # FP8 primary weights are quantised from fp32 masters: bf16 moments only
        extra = PRECISIONS[1:2] if cfg.train.precision == "fp8" and cfg.fp8.primary_weights else PRECISIONS[1:]
        out += _evaluate(cfg, candidate_layouts(cfg, gpus, hw.gpus_per_node, extra), gpu_mem_gib, hw, opts)
    out.sort(key=rank_key)
    return out


def rank_key(c: Candidate) -> tuple:
    """Fitting layouts by tokens/s (supported first among equals); the others by how much memory they need."""
    if c.fits:
        return (0, -c.step.tokens_per_s, c.unsupported is not None, c.memory.total)
    return (1, c.memory.total, -c.step.tokens_per_s, c.unsupported is not None)


def _evaluate(cfg: Config, layouts: list[Layout], gpu_mem_gib: float, hw: Hardware, opts: PlanOptions) -> list:
    reasons: dict = {}
    out = []
    for lay in layouts:
        mem = estimate_memory(cfg, lay, opts)
        step = estimate_step(cfg, lay, hw, opts)
        key = (lay.pp, lay.vpp, lay.cp, lay.fsdp, lay.tp > 1, lay.ep > 1, lay.etp > 1, lay.distributed_optimizer)
        key += (lay.precision, lay.offload_modules, lay.recompute_granularity, lay.activation_memory)
        if lay.pp > 1:  # the schedule's rules count micro-batches per step: global batch / (micro-batch x dp)
            key += (lay.micro_batch_size, lay.dp)
        if key not in reasons:
            reasons[key] = unsupported_reason(cfg, lay)
        fits = mem.total <= gpu_mem_gib * GiB
        out.append(Candidate(lay, mem, step, fits, reasons[key], stage_layout_of(cfg, lay)))
    return out


def best_supported(cands: list[Candidate]) -> Candidate | None:
    """The highest-ranked candidate that fits and that this version's trainer runs."""
    return next((c for c in cands if c.fits and c.unsupported is None), None)
