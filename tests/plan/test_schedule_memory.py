"""The planner's reading of torch's pipeline schedule orders (moecore/plan/schedule_memory.py): played out in time
with F = I = W, 1F1B's and interleaved 1F1B's orders give their textbook bubbles, the zero-bubble and V schedules
a smaller one; the counts of micro-batches held are checked against real pipeline steps in
tests/distributed/test_pipeline.py."""

from __future__ import annotations

import pytest

from moecore.config import load_config
from moecore.plan.layout import Layout
from moecore.plan.schedule_memory import bubble_fraction, held_chunks
from moecore.plan.throughput import estimate_step


@pytest.mark.parametrize("pp, m", [(2, 4), (4, 8), (4, 16), (8, 32)])
def test_bubble_of_the_1f1b_orders_is_the_formula(pp, m):
    assert bubble_fraction("1f1b", pp, 1, m) == pytest.approx((pp - 1) / m)
    assert bubble_fraction("interleaved_1f1b", pp, 2, m) == pytest.approx((pp - 1) / (2 * m))


@pytest.mark.parametrize("schedule", ["zero_bubble", "zbv", "dualpipev"])
def test_split_backward_schedules_idle_less_and_hold_as_many_on_every_rank(schedule):
    pp, m = 4, 8
    share = bubble_fraction(schedule, pp, 2, m)
    assert 0 < share < (pp - 1) / (2 * m)  # measured 0.0625 against interleaved 1F1B's 0.1875
    held = held_chunks(schedule, pp, 2, m)
    assert len(held) == pp and all(h >= pp * 2 for h in held)  # pp micro-batches of both stages, on every rank


def test_step_estimate_takes_the_schedules_bubble():
    """The same layout under interleaved 1F1B and interleaved zero-bubble: only the bubble differs."""
    steps = {}
    for schedule in ("interleaved_1f1b", "zero_bubble"):
        cfg = load_config("qwen3-30b-a3b", [f"parallel.pp_schedule={schedule}"])
        steps[schedule] = estimate_step(cfg, Layout(pp=4, vpp=2, ep=8, dp=2))
    il, zb = steps["interleaved_1f1b"], steps["zero_bubble"]
    assert zb.bubble_s < il.bubble_s / 2
    assert zb.compute_s == il.compute_s and zb.step_s == pytest.approx(il.step_s - il.bubble_s + zb.bubble_s)
