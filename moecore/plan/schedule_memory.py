"""How many micro-batches each pipeline rank holds activations for, read from torch's own schedule order.

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
"""

from __future__ import annotations

from functools import lru_cache

# parallel.pp_schedule -> (torch class name, V-shaped: rank r holds stages r and 2 * pp - 1 - r)
_TORCH_SCHEDULES = {
    "1f1b": ("Schedule1F1B", False),
    "interleaved_1f1b": ("ScheduleInterleaved1F1B", False),
    "zero_bubble": ("ScheduleInterleavedZeroBubble", False),
    "zbv": ("ScheduleZBVZeroBubble", True),
    "dualpipev": ("ScheduleDualPipeV", True),
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
    if schedule == "1f1b" or vpp == 1:  # one stage per rank: rank r runs pp - 1 - r forwards before its first B
        return tuple(min(m, pp - r) for r in range(pp))
    from torch.distributed.pipelining import schedules

    name, v_shape = _TORCH_SCHEDULES[schedule]
    n = pp * vpp
    mine = [0, n - 1] if v_shape else list(range(0, n, pp))
    stages = [_StandInStage(i, pp, n) for i in mine]
    try:
        order = getattr(schedules, name)(stages, m, loss_fn=lambda out, target: out).pipeline_order
    except (AttributeError, TypeError, ValueError, KeyError):  # a torch without the schedule, or an m it refuses
        return ()
    return tuple(_peak_held(order[r], until_weight) for r in range(pp))


def _peak_held(actions: list, until_weight: bool) -> int:
    from torch.distributed.pipelining.schedules import _ComputationType as Kind

    ends = (Kind.FULL_BACKWARD, Kind.BACKWARD_WEIGHT if until_weight else Kind.BACKWARD_INPUT)
    live: set[tuple[int, int]] = set()
    peak = 0
    for action in actions:
        if action is None:
            continue
        for a in getattr(action, "sub_actions", None) or (action,):  # DualPipeV's overlapped F + B
            key = (a.stage_index, a.microbatch_index)
            if a.computation_type == Kind.FORWARD:
                live.add(key)
            elif a.computation_type in ends:
                live.discard(key)
            peak = max(peak, len(live))
    return peak
