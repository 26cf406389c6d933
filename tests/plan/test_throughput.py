"""The step-time model: compute from the model's FLOPs, communication only where a layout has it, the bubble."""

from __future__ import annotations

import pytest

from moecore.config import load_config
from moecore.plan.layout import Layout
from moecore.plan.throughput import Hardware, estimate_step
from moecore.train.logger import flops_per_token


def test_one_gpu_is_pure_compute_at_the_stated_efficiency() -> None:
    cfg = load_config("qwen3-30b-a3b", ["model.num_layers=4"])
    hw = Hardware(peak_tflops=1000.0, efficiency=0.5)
    s = estimate_step(cfg, Layout(), hw)
    tokens = cfg.train.global_batch_size * cfg.train.seq_length
    assert s.compute_s == pytest.approx(flops_per_token(cfg) * tokens / 500e12)
    assert s.tp_s == s.ep_s == s.cp_s == s.pp_s == s.bubble_s == s.dp_exposed_s == 0
    assert s.step_s == pytest.approx(s.compute_s) and s.mfu == pytest.approx(0.5)


def test_communication_appears_with_its_degree_and_slows_across_nodes() -> None:
    cfg = load_config("qwen3-30b-a3b", ["model.num_layers=4"])
    intra = estimate_step(cfg, Layout(ep=8, dp=8), Hardware(gpus_per_node=8))
    inter = estimate_step(cfg, Layout(ep=8, dp=8), Hardware(gpus_per_node=4))
    assert 0 < intra.ep_s < inter.ep_s
    tp = estimate_step(cfg, Layout(tp=2, dp=4))
    assert tp.tp_s > 0 and tp.ep_s == 0


def test_bubble_shrinks_with_micro_batches_and_virtual_stages() -> None:
    cfg = load_config("qwen3-30b-a3b", ["model.num_layers=8", "train.global_batch_size=8"])
    few = estimate_step(cfg, Layout(pp=4, dp=2))  # 4 micro-batches per step
    inter = estimate_step(cfg, Layout(pp=4, vpp=2, dp=2))
    assert few.bubble_s > inter.bubble_s > 0
    pipelined = few.compute_s + few.pp_s
    assert few.bubble_s == pytest.approx(3 / 4 * pipelined)


def test_recomputation_costs_forward_flops() -> None:
    cfg = load_config("qwen3-30b-a3b", ["model.num_layers=4"])
    none = estimate_step(cfg, Layout())
    full = estimate_step(cfg, Layout(recompute_granularity="full"))
    moe = estimate_step(cfg, Layout(recompute_granularity="selective", recompute_modules=("moe",)))
    assert none.compute_s < moe.compute_s < full.compute_s
    assert full.compute_s < none.compute_s * 4 / 3 * 1.001  # at most one extra forward
    assert none.mfu > full.mfu
