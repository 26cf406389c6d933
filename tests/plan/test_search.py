"""The layout search: every candidate is a valid config, the trainer's support is asked, the ranking holds."""

from __future__ import annotations

import dataclasses

from moecore.config import load_config
from moecore.plan.layout import Layout, layout_config, layout_of, unsupported_reason
from moecore.plan.memory import estimate_memory
from moecore.plan.search import candidate_layouts, search


def test_candidates_tile_the_gpus_and_load_as_valid_configs() -> None:
    cfg = load_config("tiny-qwen3-moe")
    cfg.model.vocab_size = 512
    lays = candidate_layouts(cfg, 4)
    degrees = {(lay.tp, lay.pp, lay.ep) for lay in lays}
    assert degrees >= {(1, 1, 1), (2, 1, 2), (1, 2, 1), (1, 1, 4), (2, 2, 2)}
    assert max(lay.tp for lay in lays) == 2  # tp must divide the 2 key/value heads
    for lay in lays:
        assert lay.world == 4 and lay.edp * lay.etp * lay.ep * lay.pp == 4
        c = layout_config(cfg, lay)
        c.validate()  # degrees divide the model's sizes
        assert layout_of(c, 4) == dataclasses.replace(lay, vpp=1)  # no parallel.vpp field yet


def test_unsupported_layouts_carry_the_trainers_reason() -> None:
    cfg = load_config("tiny-deepseek-v2")
    cfg.model.vocab_size = 512
    assert unsupported_reason(cfg, Layout(ep=2, dp=2)) is None
    assert "parallel.pp" in unsupported_reason(cfg, Layout(pp=2, dp=1))
    assert "attention_type=mla" in unsupported_reason(cfg, Layout(tp=2, dp=1))
    assert "fsdp" in unsupported_reason(cfg, Layout(dp=2, fsdp=True))


def test_more_gpus_or_sharding_never_needs_more_memory() -> None:
    cfg = load_config("qwen3-30b-a3b")
    one = estimate_memory(cfg, Layout(ep=8, dp=8)).total
    zero1 = estimate_memory(cfg, Layout(ep=8, dp=8, distributed_optimizer=True)).total
    fsdp = estimate_memory(cfg, Layout(ep=8, dp=8, fsdp=True)).total
    assert fsdp < zero1 < one
    full = estimate_memory(cfg, Layout(ep=8, dp=8, recompute_granularity="full")).activations
    sel = estimate_memory(cfg, Layout(ep=8, dp=8, recompute_granularity="selective", recompute_modules=("norm",)))
    none = estimate_memory(cfg, Layout(ep=8, dp=8)).activations
    assert full < sel.activations < none


def test_pipeline_first_stage_holds_pp_micro_batches() -> None:
    cfg = load_config("qwen3-30b-a3b")
    est = estimate_memory(cfg, Layout(pp=4, dp=2, ep=1))
    assert len(est.per_stage) == 2
    from moecore.plan.memory import PlanOptions, estimate_stage

    first = estimate_stage(cfg, Layout(pp=4, dp=2), 0, PlanOptions())
    last = estimate_stage(cfg, Layout(pp=4, dp=2), 3, PlanOptions())
    assert first.in_flight == 4 and last.in_flight == 1
    assert first.activations > 3 * last.activations


def test_search_ranks_fitting_layouts_by_speed() -> None:
    cfg = load_config("qwen3-30b-a3b", ["model.num_layers=8"])
    cands = search(cfg, 8, 141)
    fits = [c for c in cands if c.fits]
    assert fits and cands[: len(fits)] == fits
    assert all(c.memory.total <= 141 * 2**30 for c in fits)
    assert all(c.memory.total > 141 * 2**30 for c in cands[len(fits) :])
    assert [c.step.tokens_per_s for c in fits] == sorted((c.step.tokens_per_s for c in fits), reverse=True)
