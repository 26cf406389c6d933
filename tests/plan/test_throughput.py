"""The step-time model: compute from the model's FLOPs, communication only where a layout has it, the bubble."""

from __future__ import annotations

import pytest

from moecore.config import load_config
from moecore.plan.layout import Layout
from moecore.plan.params import total_params
from moecore.plan.throughput import Hardware, estimate_step
from moecore.train.logger import flops_per_token


def test_one_gpu_is_pure_compute_at_the_stated_efficiency() -> None:
    cfg = load_config("qwen3-30b-a3b", ["model.num_layers=4", "train.global_batch_size=1"])
    hw = Hardware(peak_tflops=1000.0, efficiency=0.5)
    s = estimate_step(cfg, Layout(), hw)
    tokens = cfg.train.global_batch_size * cfg.train.seq_length
    assert s.compute_s == pytest.approx(flops_per_token(cfg) * tokens / 500e12)
    assert s.tp_s == s.ep_s == s.cp_s == s.pp_s == s.bubble_s == s.dp_exposed_s == 0
    assert s.step_s == pytest.approx(s.compute_s + s.optimizer_s)
    # mixed precision, one micro-batch: bf16 gradient 2 + fp32 master read and written 8 + bf16 weight 2
    # + fp32 moments read and written 16 = 28 bytes per parameter at the memory bandwidth
    n = total_params(cfg)[0]
    assert s.optimizer_s == pytest.approx(n * 28 / (hw.hbm_gbps * 1e9))
    assert s.mfu == pytest.approx(0.5 * s.compute_s / s.step_s)


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


def test_the_trainer_steps_measured_on_an_h200() -> None:
    """docs/benchmarks.md runs G / H: the Qwen3 proxy (8 layers, batch 2 x 4096) took 150.1-162.1 ms per
    step with fp32 masters and moments, 133.9-136.0 ms with bf16 ones; the model's defaults must land
    within 5% of those ranges."""
    base = ["model.num_layers=8", "parallel.ep=1", "train.micro_batch_size=2", "train.global_batch_size=2"]
    for extra, (lo, hi) in (
        ([], (150.1, 162.1)),
        (["optim.master_weights=bf16", "optim.state_dtype=bf16"], (133.9, 136.0)),
    ):
        cfg = load_config("qwen3-30b-a3b", base + extra)
        ms = estimate_step(cfg, Layout()).step_s * 1000
        assert 0.95 * lo <= ms <= 1.05 * hi, (extra, ms)


def test_fsdp_gathers_frozen_parameters_in_forward_only() -> None:
    """Under fsdp every parameter is gathered for forward and backward and reduce-scatters its gradient; a frozen
    one (DSA's dense_warmup: the indexers alone train) is gathered for forward only and has no gradient."""
    from moecore.plan.layout import layout_of
    from moecore.plan.params import param_summary, precision_mode
    from moecore.plan.throughput import data_parallel_bytes

    moved, frozen = {}, {}
    for stage in ("sparse", "dense_warmup"):
        cfg = load_config(
            "tiny-deepseek-v32", [f"model.dsa_stage={stage}", "model.vocab_size=64", "parallel.fsdp=true"]
        )
        lay = layout_of(cfg, 4)
        mode = precision_mode(cfg, lay, micro_batches=1, device="cpu")
        s = param_summary(cfg, lay)
        moved[stage] = data_parallel_bytes(lay, s, mode, "dp_cp")
        frozen[stage] = s.frozen[False]
        if stage == "sparse":
            n = s.total - s.expert
            assert moved[stage] == 3 / 4 * n * (2 * mode.param + mode.grad) and frozen[stage] == 0
    assert frozen["dense_warmup"] > 0
    saved = 3 / 4 * frozen["dense_warmup"] * (mode.param + mode.grad)  # one gather and one reduce-scatter each
    assert moved["dense_warmup"] == pytest.approx(moved["sparse"] - saved)
