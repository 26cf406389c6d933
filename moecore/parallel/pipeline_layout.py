"""Pipeline stage layouts: which modules each pipeline stage holds, and which rank runs each stage (torch-free).

A layout is a list of `StageSpec`, one per pipeline stage (`parallel.pp * parallel.vpp` stages). It
comes from `parallel.pp_layout`, a string in Megatron-Core's notation, or by default from an even
split of the decoder layers:

    E  the token embedding            t  one decoder layer (in order: layer 0, 1, ...)
    m  one MTP layer (depth 1, 2, ...) L  final norm + output head + LM loss
    |  stage boundary                  X*N, (...)*N  repeat a symbol or a group N times
    ,  and spaces are ignored (readability)

so `Et*3|(tt|)*29,m|L` is 32 stages: the embedding and layers 0-2, then 29 stages of two layers,
the MTP layer alone, and the loss alone. Rules (each broken rule is one line naming it): the stage
count equals pp * vpp; every stage holds something; `E` opens the first stage and `L` closes the
last; the number of `t` equals `model.num_layers` and of `m` equals `model.mtp_num_layers`; the MTP
layers sit together in one stage after every decoder layer (they read the final hidden states).

Placement of stages on pipeline ranks: "loop" (stage s on rank s % pp; 1F1B, interleaved 1F1B and
interleaved zero-bubble) or "v" (two stages per rank, rank r holding r and 2*pp - 1 - r; the V-shaped
schedules ZBV and DualPipeV), so with V the first and last stage share a rank.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from moecore.config import Config, ConfigError

V_SCHEDULES = ("zbv", "dualpipev")


@dataclass(frozen=True)
class StageSpec:
    """What one pipeline stage holds: the embedding, decoder layers (global indices), MTP, the loss."""

    index: int
    embed: bool
    layers: tuple[int, ...]
    mtp: bool
    loss: bool

    @property
    def symbols(self) -> str:
        return (
            ("E" if self.embed else "")
            + "t" * len(self.layers)
            + ("m" if self.mtp else "")
            + ("L" if self.loss else "")
        )


_REPEAT = re.compile(r"(\([^()]*\)|[EtmL|])\*(\d+)")


def expand_layout(text: str) -> str:
    """Expand repetitions and drop separators: 'Et*2|(tt|)*2,L' -> 'Ett|tt|tt|L'."""
    s = re.sub(r"[,\s]", "", text)
    bad = set(s) - set("EtmL|()*0123456789")
    if bad:
        raise ConfigError(
            f"parallel.pp_layout={text!r} is invalid: unknown symbol {sorted(bad)[0]!r}; allowed: E t m L | ( ) *N ,"
        )
    while True:
        new = _REPEAT.sub(lambda mo: mo.group(1).strip("()") * int(mo.group(2)), s)
        if new == s:
            break
        s = new
    if set(s) & set("()*0123456789"):
        raise ConfigError(
            f"parallel.pp_layout={text!r} is invalid: unbalanced '(' or a '*N' without a symbol before it"
        )
    return s


def parse_layout(text: str, num_stages: int, num_layers: int, mtp_layers: int) -> list[StageSpec]:
    """Stages of a layout string; ConfigError naming the broken rule (see the module docstring)."""
    s = expand_layout(text)
    parts = s.split("|")

    def fail(why: str) -> None:
        raise ConfigError(f"parallel.pp_layout={text!r} is invalid: {why}")

    if len(parts) != num_stages:
        fail(f"it has {len(parts)} stages, parallel.pp * parallel.vpp = {num_stages}")
    for i, p in enumerate(parts):
        if not p:
            fail(f"stage {i} is empty")
    if s.count("E") != 1 or not parts[0].startswith("E"):
        fail("'E' (embedding) must appear once, first in stage 0")
    if s.count("L") != 1 or not parts[-1].endswith("L"):
        fail("'L' (norm + head + loss) must appear once, last in the last stage")
    if s.count("t") != num_layers:
        fail(f"it has {s.count('t')} decoder layers 't', model.num_layers = {num_layers}")
    if s.count("m") != mtp_layers:
        fail(f"it has {s.count('m')} MTP layers 'm', model.mtp_num_layers = {mtp_layers}")
    if mtp_layers:
        stages_m = [i for i, p in enumerate(parts) if "m" in p]
        if len(stages_m) > 1:
            fail("the MTP layers 'm' must sit together in one stage")
        if "t" in s[s.index("m") :]:
            fail("an MTP layer 'm' comes before a decoder layer 't'; MTP reads the final hidden states")
    stages, layer = [], 0
    for i, p in enumerate(parts):
        n = p.count("t")
        stages.append(StageSpec(i, "E" in p, tuple(range(layer, layer + n)), "m" in p, "L" in p))
        layer += n
    return stages


def default_layout(num_stages: int, num_layers: int, mtp_layers: int) -> list[StageSpec]:
    """Decoder layers split evenly; the embedding on the first stage, MTP + loss on the last."""
    if num_layers % num_stages:
        raise ConfigError(
            f"model.num_layers={num_layers} is not divisible by parallel.pp * parallel.vpp = {num_stages}; "
            "give an uneven split with parallel.pp_layout (e.g. 'Ettt|tt|L')"
        )
    per = num_layers // num_stages
    return [
        StageSpec(
            i,
            i == 0,
            tuple(range(i * per, (i + 1) * per)),
            bool(mtp_layers) and i == num_stages - 1,
            i == num_stages - 1,
        )
        for i in range(num_stages)
    ]


def stage_layout(cfg: Config) -> list[StageSpec]:
    """The run's stages: `parallel.pp_layout` when given, else the even split."""
    p, m = cfg.parallel, cfg.model
    n = p.pp * p.vpp
    if p.pp_layout:
        return parse_layout(p.pp_layout, n, m.num_layers, m.mtp_num_layers)
    return default_layout(n, m.num_layers, m.mtp_num_layers)


def stage_ranks(num_stages: int, pp: int, schedule: str) -> list[int]:
    """Pipeline rank of every stage: looped (s % pp) or V-shaped for the V schedules."""
    if schedule in V_SCHEDULES:
        return [s if s < pp else 2 * pp - 1 - s for s in range(num_stages)]
    return [s % pp for s in range(num_stages)]


def check_pipeline(cfg: Config, micro_batches: int | None = None) -> list[StageSpec]:
    """Refuse a pipeline layout the schedules cannot run (one line); returns the stages.

    `micro_batches`: micro-batches per pipeline per step (global batch / (micro batch * dp)), when known.
    """
    p = cfg.parallel
    stages = stage_layout(cfg)
    sched = p.pp_schedule
    if sched == "1f1b" and p.vpp > 1:
        raise ConfigError(
            f"parallel.pp_schedule='1f1b' runs one stage per rank, parallel.vpp={p.vpp}; use interleaved_1f1b or zero_bubble"
        )
    if sched in V_SCHEDULES and p.vpp != 2:
        raise ConfigError(f"parallel.pp_schedule={sched!r} needs parallel.vpp=2 (two stages per rank, V-shaped)")
    if micro_batches is not None and p.pp > 1:
        n = len(stages)
        if sched == "1f1b" and micro_batches < p.pp:
            raise ConfigError(
                f"parallel.pp_schedule='1f1b' needs at least pp={p.pp} micro-batches per step, got {micro_batches} "
                "(train.global_batch_size / (train.micro_batch_size * data-parallel size))"
            )
        if sched in ("interleaved_1f1b", "zero_bubble") and micro_batches % p.pp:
            raise ConfigError(
                f"parallel.pp_schedule={sched!r} needs micro-batches per step divisible by pp={p.pp}, got {micro_batches} "
                "(train.global_batch_size / (train.micro_batch_size * data-parallel size))"
            )
        if sched in V_SCHEDULES and micro_batches < n:
            raise ConfigError(
                f"parallel.pp_schedule={sched!r} needs at least pp*vpp={n} micro-batches per step, got {micro_batches}"
            )
    return stages


def weights_shared_on_a_rank(cfg: Config, stages: list[StageSpec]) -> str | None:
    """The first weight two stages of one pipeline rank both use ('embed' or 'lm_head'), or None.

    The embedding serves the first stage, the MTP stage (its token embeddings) and, tied, the loss stage; the
    untied head the loss and MTP stages. Under FSDP2 each stage module is a root of its own, and one weight
    cannot be sharded by two roots."""
    p, tied = cfg.parallel, cfg.model.tie_embeddings
    ranks = stage_ranks(len(stages), p.pp, p.pp_schedule)
    users = {
        "embed": [s for s in stages if s.embed or s.mtp or (s.loss and tied)],
        "lm_head": [] if tied else [s for s in stages if s.loss or s.mtp],
    }
    for name, using in users.items():
        on = [ranks[s.index] for s in using]
        if len(on) != len(set(on)):
            return name
    return None
