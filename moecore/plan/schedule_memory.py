"""What torch's own order of a pipeline schedule implies: the micro-batches each rank holds, and the bubble.

A stage keeps a micro-batch's saved tensors from its forward until the backward pass that frees them: the full
backward (1F1B, interleaved 1F1B), or, under the zero-bubble and V schedules, the weight pass, which they defer
past the input-gradient pass (the autograd graph is kept for it). torch.distributed.pipelining builds every
schedule's per-rank order of actions (F, B, I, W, and DualPipeV's overlapped F + B) when the schedule is built;
`held_chunks` builds it for stand-in stage objects (the order depends only on pp, the stages per rank and the
micro-batch count) and walks each rank's actions, counting the (stage, micro-batch) pairs between their F and
the B or W that ends them. Its counts up to the input-gradient pass equal what a pipeline step held
(moecore.parallel.pipeline's count: tests/distributed/test_pipeline.py), and they are what docs/parallel.md's
table of held bytes shows the later ranks keep under the zero-bubble schedules.

Units: stage micro-batches ("chunks"): one stage's share of the layers for one micro-batch; a rank holds vpp
stages, so its count over vpp is in the planner's unit (the rank's whole share of the layers).

`bubble_fraction` plays the same orders out in time: each rank runs its actions in order, an action starting
when its rank is free and its inputs exist (a stage's forward after the previous stage's forward of that
micro-batch, its input-gradient or full backward after the next stage's, its weight pass after its own input
gradient), with F = I = W = 1 per chunk (a full backward 2) and no communication time. The step's length over
each rank's work, less one, is the bubble: (pp - 1) / m for 1F1B and (pp - 1) / (vpp m) for interleaved 1F1B,
as their formulas say (tests/plan/test_schedule_memory.py), and what it is for the zero-bubble and V schedules.
"""

from __future__ import annotations

from functools import lru_cache

from moecore.parallel.pipeline_layout import V_SCHEDULES

# The schedules that split each backward into an input-gradient and a deferred weight pass
SPLIT_BACKWARD_SCHEDULES = ("zero_bubble", *V_SCHEDULES)
# parallel.pp_schedule -> torch's class (V_SCHEDULES: rank r holds stages r and 2 * pp - 1 - r)
_TORCH_SCHEDULES = {
    "interleaved_1f1b": "ScheduleInterleaved1F1B",
    "zero_bubble": "ScheduleInterleavedZeroBubble",
    "zbv": "ScheduleZBVZeroBubble",
    "dualpipev": "ScheduleDualPipeV",
}


class _StandInStage:
    """The attributes torch's multi-stage schedules read from their stages while building the order."""

    def __init__(self, index: int, pp: int, stages: int) -> None:
        self.stage_index, self.group_size, self.group_rank, self.num_stages = index, pp, 0, stages
        self.is_first, self.is_last = index == 0, index == stages - 1
        self.has_backward = True
        self.submod = None


@lru_cache(maxsize=256)
def held_chunks(schedule: str, pp: int, vpp: int, m: int, until_weight: bool = True) -> tuple[int, ...]:
    """Per pipeline rank, the most (stage, micro-batch) pairs whose activations it holds at once under `schedule`
    with pp ranks, vpp stages per rank and m micro-batches per step (module docstring); () where this torch cannot
    build the schedule's order (the caller then estimates it as interleaved 1F1B). `until_weight=False` ends each
    pair at its input-gradient pass instead, which is what moecore.parallel.pipeline counts."""
    order = _torch_order(schedule, pp, vpp, m)
    if order is None:
        return ()
    return tuple(_peak_held(order[r], until_weight) for r in range(pp))


def _torch_order(schedule: str, pp: int, vpp: int, m: int) -> dict[int, list] | None:
    """Per rank, the schedule's computations in order (None slots dropped, DualPipeV's overlapped F + B as its two
    parts, run one after the other as torch does without an overlap function), built by torch on stand-in
    stages; None where this torch cannot build it."""
    from torch.distributed.pipelining import schedules

    if schedule == "1f1b":  # torch's Schedule1F1B runs one stage per rank without an order table: its order here
        return {r: _one_stage_order(schedules, pp, m, r) for r in range(pp)}
    n = pp * vpp
    mine = [0, n - 1] if schedule in V_SCHEDULES else list(range(0, n, pp))
    stages = [_StandInStage(i, pp, n) for i in mine]
    try:
        order = getattr(schedules, _TORCH_SCHEDULES[schedule])(stages, m, loss_fn=lambda out, t: out).pipeline_order
    except (AttributeError, TypeError, ValueError, KeyError):  # a torch without the schedule, or an m it refuses
        return None
    return {
        r: [a for act in acts if act is not None for a in (getattr(act, "sub_actions", None) or (act,))]
        for r, acts in order.items()
    }


def _one_stage_order(schedules, pp: int, m: int, rank: int) -> list:
    """1F1B's order on `rank` (stage `rank`): pp - 1 - rank forwards, then one forward and one backward in turn."""
    F, B = schedules._ComputationType.FORWARD, schedules._ComputationType.FULL_BACKWARD
    warm = min(m, pp - 1 - rank)
    acts = [schedules._Action(rank, F, i) for i in range(warm)]
    for i in range(m):
        if warm + i < m:
            acts.append(schedules._Action(rank, F, warm + i))
        acts.append(schedules._Action(rank, B, i))
    return acts


@lru_cache(maxsize=256)
def bubble_fraction(schedule: str, pp: int, vpp: int, m: int) -> float | None:
    """The idle share of a step under `schedule` relative to each rank's work (module docstring); None where this
    torch cannot build the schedule's order."""
    vpp = 1 if schedule == "1f1b" else vpp
    order = _torch_order(schedule, pp, vpp, m)
    if order is None:
        return None
    from torch.distributed.pipelining.schedules import _ComputationType as Kind

    cost = {Kind.FORWARD: 1.0, Kind.BACKWARD_INPUT: 1.0, Kind.BACKWARD_WEIGHT: 1.0, Kind.FULL_BACKWARD: 2.0}
    last = pp * vpp - 1
    lists = {r: [a for a in acts if a.computation_type in cost] for r, acts in order.items()}
    done: dict[tuple, float] = {}  # (kind, stage, micro-batch) -> finish time
    free = dict.fromkeys(lists, 0.0)
    pos = dict.fromkeys(lists, 0)
    while any(pos[r] < len(lists[r]) for r in lists):
        moved = False
        for r in lists:
            while pos[r] < len(lists[r]):
                a = lists[r][pos[r]]
                ready = _inputs_ready(a, done, last, Kind)
                if ready is None:
                    break
                start = max(free[r], ready)
                free[r] = start + cost[a.computation_type]
                kind = Kind.BACKWARD_INPUT if a.computation_type == Kind.FULL_BACKWARD else a.computation_type
                done[(kind, a.stage_index, a.microbatch_index)] = free[r]
                pos[r] += 1
                moved = True
        if not moved:  # an order whose dependencies never resolve (not one of torch's)
            return None
    return max(free.values()) / (3.0 * m * vpp) - 1.0


def _inputs_ready(a, done: dict, last: int, Kind) -> float | None:
    """When action `a`'s inputs exist (module docstring), or None if one is not computed yet."""
    s, mb, t = a.stage_index, a.microbatch_index, a.computation_type
    if t == Kind.FORWARD:
        need = [(Kind.FORWARD, s - 1, mb)] if s > 0 else []
    elif t in (Kind.BACKWARD_INPUT, Kind.FULL_BACKWARD):
        need = [(Kind.FORWARD, s, mb)] + ([(Kind.BACKWARD_INPUT, s + 1, mb)] if s < last else [])
    else:  # the weight pass after this stage's input gradient
        need = [(Kind.BACKWARD_INPUT, s, mb)]
    times = [done.get(k) for k in need]
    return None if any(x is None for x in times) else max(times, default=0.0)


def _peak_held(actions: list, until_weight: bool) -> int:
    from torch.distributed.pipelining.schedules import _ComputationType as Kind

    ends = (Kind.FULL_BACKWARD, Kind.BACKWARD_WEIGHT if until_weight else Kind.BACKWARD_INPUT)
    live: set[tuple[int, int]] = set()
    peak = 0
    for a in actions:
        key = (a.stage_index, a.microbatch_index)
        if a.computation_type == Kind.FORWARD:
            live.add(key)
        elif a.computation_type in ends:
            live.discard(key)
        peak = max(peak, len(live))
    return peak
