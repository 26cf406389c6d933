"""The layout search: every candidate is a valid config, the trainer's support is asked, the ranking holds."""

from __future__ import annotations

import pytest

from moecore.config import load_config
from moecore.plan.layout import Layout, layout_config, layout_of, stage_layout_of, unsupported_reason
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
        assert layout_of(c, 4) == lay  # the config carries every degree back, vpp included
        if lay.pp > 1:  # a schedule that runs vpp stages per rank
            assert c.parallel.pp_schedule == ("1f1b" if lay.vpp == 1 else "interleaved_1f1b")
    assert any(lay.vpp == 2 for lay in lays)


def test_pipeline_layouts_follow_the_trainers_pipeline_rules() -> None:
    cfg = load_config("tiny-qwen3-moe")  # 4 layers, global batch 16, micro-batch 8 (mbs is the layout's)
    cfg.model.vocab_size = 512
    assert unsupported_reason(cfg, Layout(pp=2, dp=1)) is None
    assert unsupported_reason(cfg, Layout(pp=2, vpp=2, dp=1)) is None  # interleaved 1F1B
    assert Layout(pp=2, vpp=2, dp=1).overrides()[2:4] == ["parallel.vpp=2", "parallel.pp_schedule=interleaved_1f1b"]
    # an uneven split is written as the planner models it (extra layers first) and the trainer runs it
    three = Layout(pp=3, dp=1)
    assert stage_layout_of(cfg, three) == "Ett|t|tL" and unsupported_reason(cfg, three) is None
    assert load_config("tiny-qwen3-moe", three.overrides("Ett|t|tL")).parallel.pp_layout == "Ett|t|tL"
    mtp = load_config("tiny-deepseek-v3")  # 4 layers and one MTP layer, which sits with the loss
    mtp.model.vocab_size = 512
    assert stage_layout_of(mtp, three) == "Ett|t|tmL" and unsupported_reason(mtp, three) is None
    # 4 layers cannot fill pp * vpp = 8 stages
    assert "model.num_layers=4" in unsupported_reason(cfg, Layout(pp=4, vpp=2, dp=1))
    # 1F1B needs at least pp micro-batches per step: 16 / (4 x 2) = 2 < pp = 4
    assert "at least pp=4 micro-batches" in unsupported_reason(cfg, Layout(pp=4, dp=2, micro_batch_size=4))
    assert unsupported_reason(cfg, Layout(pp=2, dp=2, distributed_optimizer=True)) is None  # ZeRO-1 per stage
    # the config's own stage layout and schedule are kept only where they fit the candidate
    cfg.parallel.pp, cfg.parallel.vpp, cfg.parallel.pp_schedule = 2, 2, "zbv"
    cfg.parallel.pp_layout = "Et|t|t|tL"
    c = layout_config(cfg, Layout(pp=2, vpp=2, dp=1))
    assert (c.parallel.pp_layout, c.parallel.pp_schedule) == ("Et|t|t|tL", "zbv")
    c = layout_config(cfg, Layout(pp=4, dp=1))
    assert (c.parallel.pp_layout, c.parallel.pp_schedule) == (None, "1f1b")


def test_unsupported_layouts_carry_the_trainers_reason() -> None:
    cfg = load_config("tiny-deepseek-v2")
    cfg.model.vocab_size = 512
    assert unsupported_reason(cfg, Layout(ep=2, dp=2)) is None
    assert unsupported_reason(cfg, Layout(pp=2, dp=1)) is None  # pipeline parallel runs MLA
    assert unsupported_reason(cfg, Layout(pp=2, dp=2, distributed_optimizer=True)) is None
    assert unsupported_reason(cfg, Layout(cp=2, dp=2, fsdp=True)) is None  # FSDP2 over dp x cp
    assert unsupported_reason(cfg, Layout(cp=2, dp=1)) is None  # context parallel runs MLA
    assert unsupported_reason(cfg, Layout(tp=2, dp=1)) is None  # tensor parallel runs MLA
    assert unsupported_reason(cfg, Layout(dp=2, fsdp=True)) is None  # FSDP2 over dp runs
    assert unsupported_reason(cfg, Layout(pp=2, dp=2, fsdp=True)) is None  # ... and with pipeline stages (1F1B)
    assert unsupported_reason(cfg, Layout(pp=2, vpp=2, dp=2, fsdp=True)) is None  # interleaved 1F1B
    dsa = load_config("tiny-deepseek-v32")
    dsa.model.vocab_size = 512
    assert unsupported_reason(dsa, Layout(pp=2, dp=1)) is None  # pipeline parallel runs DSA's sparse stage
    dsa.model.dsa_stage = "dense_warmup"  # and its dense warm-up, under both
    assert unsupported_reason(dsa, Layout(pp=2, dp=1)) is None and unsupported_reason(dsa, Layout(cp=2, dp=1)) is None
    assert "model.attention_dropout" in unsupported_reason(
        load_config("tiny-moe", ["model.attention_dropout=0.1"]), Layout(cp=2)
    )
    oss = load_config("tiny-gpt-oss")
    oss.model.vocab_size = 512
    assert unsupported_reason(oss, Layout(ep=2, dp=2)) is None
    assert unsupported_reason(oss, Layout(tp=2, dp=1)) is None  # attention sinks split by head
    assert unsupported_reason(oss, Layout(ep=2, etp=2, dp=4)) is None  # the down bias splits its hidden columns


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


def test_chunked_expert_activations_are_offered_with_their_cost() -> None:
    """moe.activation_memory=chunked as a planner lever: offered without MoE or full recomputation, it keeps fewer
    activation bytes and costs FC1 once more (4 K H F FLOPs per token and MoE layer), and the trainer runs it."""
    from moecore.plan.throughput import Hardware, estimate_step

    cfg = load_config("tiny-qwen3-moe")
    cfg.model.vocab_size = 512
    lays = candidate_layouts(cfg, 2)
    chunked = [lay for lay in lays if lay.activation_memory == "chunked"]
    assert chunked and all(
        lay.recompute_granularity != "full" and "moe" not in lay.recompute_modules for lay in chunked
    )
    assert any(lay.ep == 2 for lay in chunked)  # under expert parallelism too
    lay = next(lay for lay in chunked if lay.ep == 2 and lay.recompute_granularity == "none" and not lay.fsdp)
    std = Layout(**{**lay.__dict__, "activation_memory": ""})
    assert std in lays
    assert estimate_memory(cfg, lay).activations < estimate_memory(cfg, std).activations
    e, m = cfg.moe, cfg.model
    moe_layers = sum(e.is_moe_layer(i, m.num_layers) for i in range(m.num_layers))
    hw = Hardware()
    seconds = estimate_step(cfg, lay, hw).compute_s - estimate_step(cfg, std, hw).compute_s
    tokens = cfg.train.global_batch_size * cfg.train.seq_length
    extra = seconds * lay.world * hw.peak_tflops * 1e12 * hw.efficiency / tokens  # FLOPs per token
    assert extra == pytest.approx(4 * e.router_topk * m.hidden_size * e.ffn_hidden_size * moe_layers, rel=1e-9)
    # and CHUNK_S per chunk of routed rows, per MoE layer (of the stage) and micro-batch
    from moecore.plan.activations import routed_rows
    from moecore.plan.memory import PlanOptions, act_context, micro_batches_per_step
    from moecore.plan.params import precision_mode
    from moecore.plan.throughput import CHUNK_S

    micro = micro_batches_per_step(cfg, lay)
    opts = PlanOptions()
    c = act_context(cfg, lay, precision_mode(cfg, lay, micro, opts.device), opts)
    chunks = -(-routed_rows(cfg, lay, c) // e.activation_chunk_rows)
    step = estimate_step(cfg, lay, hw)
    assert step.chunks_s == pytest.approx(CHUNK_S * chunks * moe_layers / lay.pp * micro) and step.chunks_s > 0
    assert estimate_step(cfg, std, hw).chunks_s == 0.0
    assert "moe.activation_memory=chunked" in lay.overrides() and "moe=chunked" in lay.label()
    assert unsupported_reason(cfg, lay) is None
    cfg.moe.sync_free = True  # the layer cannot run chunked sync-free: not offered
    assert not any(lay.activation_memory for lay in candidate_layouts(cfg, 2))
