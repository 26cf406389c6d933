"""The CPU-testable parts of `moecore bench`: kernel-name phases, per-kernel rows, bad command lines."""

from __future__ import annotations

import pytest
import torch

from moecore.bench import main, moe_layer, train
from moecore.bench.common import kernel_rows, phase_of


class _Event:
    def __init__(self, key: str, us: float, count: int) -> None:
        self.key, self.device_time_total, self.count = key, us, count


class _Profile:
    def __init__(self, events: list[_Event]) -> None:
        self.events = events

    def key_averages(self) -> list[_Event]:
        return self.events


def test_phases_first_match_wins_and_other_is_the_rest():
    assert phase_of("_router_fwd_kernel", moe_layer.PHASES) == "router"
    assert phase_of("_swiglu_bwd_kernel", moe_layer.PHASES) == "SwiGLU"
    assert phase_of("nvjet_sm90_tst_256x128", moe_layer.PHASES) == "expert GEMMs"
    assert phase_of("cudnn_generated_fort_native_sdpa_sm90_flash_bprop", train.PHASES) == "attention"
    assert phase_of("multi_tensor_apply_kernel<FusedOptimizerTensorListMetadata>", train.PHASES) == "optimizer"
    assert phase_of("some_unknown_kernel", train.PHASES) == "other"


def test_kernel_rows_per_step_longest_first_and_skip_host_only_events():
    prof = _Profile([_Event("_rms_fwd_kernel", 3000.0, 6), _Event("nvjet_gemm", 9000.0, 12), _Event("cpu_op", 0.0, 3)])
    rows = kernel_rows(prof, steps=3, phases=train.PHASES)
    assert [r["kernel"] for r in rows] == ["nvjet_gemm", "_rms_fwd_kernel"]
    assert rows[0]["ms"] == pytest.approx(3.0) and rows[0]["calls"] == 4
    assert rows[1]["phase"] == "RMSNorm / RoPE"


@pytest.mark.parametrize(
    "argv, message",
    [
        (["moe-layer", "--variants", "moecore,nope"], "--variants 'nope' is unknown"),
        (["moe-layer", "--shapes", "gpt4"], "--shapes 'gpt4' is unknown"),
        (["train", "--variants", "moecore-all-grouped"], "--variants 'moecore-all-grouped' is unknown"),
        (["train", "--shapes", "qwen3_30b_a3b"], "--shapes applies to moe-layer only"),
        (["train", "--iters", "0"], "--iters must be >= 1"),
        (["train", "--model", "gpt4"], "--model 'gpt4' is unknown"),
        (["train", "--precision", "bf16,fp64"], "--precision 'fp64' is unknown"),
        (["train", "model.nope=1"], "model.nope is not a known field"),
        (["train", "train.steps=x"], "train.steps='x' is invalid"),
        (["moe-layer", "train.steps=2"], "overrides apply to train only"),
    ],
)
def test_bad_arguments_give_one_line_and_exit_2(capsys, argv, message):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1


@pytest.mark.parametrize("model", list(train.PROXIES))
def test_bench_train_builds_the_config_moecore_train_would(model):
    """Each proxy is a shipped recipe plus overrides; the precision modes set what `moecore train` reads."""
    mixed = train.bench_config(model, "mixed").validate()
    bf16 = train.bench_config(model, "bf16").validate()
    assert (mixed.train.precision, mixed.optim.master_weights, mixed.optim.state_dtype) == ("bf16", "fp32", "fp32")
    assert (bf16.optim.master_weights, bf16.optim.state_dtype) == ("bf16", "bf16")
    assert mixed.model.family and mixed.moe.num_experts >= 128 and mixed.parallel.ep == 1
    assert not mixed.log.progress and not mixed.log.tensorboard


def test_optimizer_bytes_counts_each_tensor_the_update_touches():
    from moecore.train.loop import Trainer

    cfg = train.bench_config("qwen3-30b-a3b", "mixed", extra=[
        "model.num_layers=1", "model.hidden_size=64", "model.num_attention_heads=2", "model.num_kv_heads=1",
        "model.head_dim=32", "moe.num_experts=8", "moe.ffn_hidden_size=32", "model.vocab_size=32768",
        "train.seq_length=16", "train.global_batch_size=1", "train.micro_batch_size=1", "train.device=cpu",
    ])  # fmt: skip
    trainer = Trainer(cfg)
    trainer.train_step(with_moe_metrics=False)
    n = sum(p.numel() for p in trainer.model.parameters())
    # bf16 gradient 2 + fp32 master read and written 8 + bf16 weight written 2 + two fp32 moments 16
    assert train.optimizer_bytes(trainer) == n * 28


def test_skewed_routing_concentrates_tokens_and_random_does_not():
    import torch

    torch.manual_seed(0)
    x, gate = torch.randn(1, 2048, 256), torch.randn(64, 256) * 0.02
    even = moe_layer.expert_load(x, gate, k=4)
    skewed = moe_layer.expert_load(*moe_layer.skew_routing(x, gate), k=4)
    assert even["max_over_mean"] < 1.5 and even["top10pct_share"] < 0.2
    assert skewed["max_over_mean"] > 5 and skewed["top10pct_share"] > 0.5
    x2, _ = moe_layer.skew_routing(x, gate)
    assert torch.equal(x2, moe_layer.skew_routing(x, gate)[0])  # deterministic: every implementation sees it


def test_unknown_routing_is_one_line(capsys):
    assert main(["moe-layer", "--routing", "zipf"]) == 2
    assert "--routing 'zipf' is unknown" in capsys.readouterr().err


def test_moe_layer_variants_build_on_cpu():
    """Every moe-layer variant builds (tiny shape, CPU); the FP8 ones carry the recipe their name spells, and
    otherwise `moecore train`'s defaults."""
    from moecore.config.fp8 import FP8Config

    for name in moe_layer.VARIANTS:
        layer = moe_layer._moecore_layer(32, 32, 4, 2, name, tokens=64)
        recipe = getattr(layer.experts, "fp8_recipe", None)
        assert (recipe is not None) == name.startswith("moecore-fp8-")
        assert (layer.experts.load_spread is None) == (name == "moecore-spread-blind")
        at_combine = name in ("moecore-probs-at-combine", "moecore-minimal-swiglu-epilogue")
        assert layer.cfg.apply_probs_on_input != at_combine
        if recipe is not None:
            assert recipe.scaling == name.split("-")[2]
            options = name.split("-")[3:]
            default = FP8Config(recipe=recipe.scaling)
            padding = (
                "wgrad" if "wgradpad" in options else "all" if "allpad" in options else default.resolved("padding")
            )
            gemm = {"triton": "triton", "torchgemm": "torch"}
            gemm = next((gemm[o] for o in options if o in gemm), default.resolved("grouped_gemm"))
            assert (recipe.padding, recipe.grouped_gemm) == (padding, gemm), name
            wgrad = "bf16" if "bf16wgrad" in options else "fp8" if "fp8wgrad" in options else default.wgrad
            assert recipe.wgrad == wgrad, name


def test_chunked_variants_carry_their_chunk_rows():
    assert moe_layer.is_variant("moecore-chunked-2048") and not moe_layer.is_variant("moecore-chunked-0")
    for name, rows in (("moecore-chunked", 8192), ("moecore-chunked-2048", 2048)):
        cfg = moe_layer._moecore_layer(32, 32, 4, 2, name, tokens=64).cfg
        assert (cfg.activation_memory, cfg.activation_chunk_rows) == ("chunked", rows), name


def test_fp8_variants_compose_options():
    assert moe_layer.is_variant("moecore-fp8-rowwise-primary-triton")
    assert moe_layer.is_variant("moecore-fp8-rowwise-allpad-torchgemm")
    assert not moe_layer.is_variant("moecore-fp8-blockwise-triton")  # fp8.grouped_gemm=triton needs rowwise
    assert not moe_layer.is_variant("moecore-fp8-rowwise-fast")
    assert not moe_layer.is_variant("moecore-fp9")
    recipe = moe_layer._moecore_layer(32, 32, 4, 2, "moecore-fp8-rowwise-primary-triton", tokens=64).experts.fp8_recipe
    assert (recipe.grouped_gemm, recipe.padding) == ("triton", "wgrad")


def test_records_carry_the_gpu_state_where_nvml_answers(monkeypatch):
    from moecore.bench import common

    monkeypatch.setattr(torch.cuda, "clock_rate", lambda: 1755)
    monkeypatch.setattr(torch.cuda, "power_draw", lambda: 612_345)  # milliwatts

    def no_sensor():
        raise RuntimeError("not supported")

    monkeypatch.setattr(torch.cuda, "temperature", no_sensor)
    assert common.gpu_state() == {"sm_clock_mhz": 1755, "power_w": 612}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    rec = common.record("s", "moecore", 2.0, 4e9, 1.0)
    assert rec["tflops"] == 2.0 and rec["gpu"] == "cpu" and "sm_clock_mhz" not in rec


def test_quack_choices_report_the_fastest_candidate_per_gemm_of_this_layer(monkeypatch):
    from moecore.kernels import quack_gemm

    times = {
        ("fwd13", 256, 7168, 4096, torch.bfloat16, 9, 1, ""): {"128x256": 7.7, "64x256": 7.1, "torch": 8.2},
        ("wgrad13", 256, 4096, 7168, torch.bfloat16, 9, 1, "t"): {"128x192": 7.1},
        ("wgrad13", 256, 4096, 7168, torch.bfloat16, 9, 6, "t"): {"128x192": 9.9, "128x256+dyn": 9.1},
        ("fwd13", 512, 2048, 1024, torch.bfloat16, 9, 1, ""): {"torch": 1.5},  # another layer's
    }
    monkeypatch.setattr(quack_gemm, "CHOICE_TIMES", times)
    got = moe_layer.quack_choices(256)
    assert got == {
        "fwd13": {"choice": "64x256", "ms": {"128x256": 7.7, "64x256": 7.1, "torch": 8.2}},
        "wgrad13/t": {"choice": "128x192", "ms": {"128x192": 7.1}},
        "wgrad13/t spread=6": {"choice": "128x256+dyn", "ms": {"128x192": 9.9, "128x256+dyn": 9.1}},
    }
    monkeypatch.setattr(quack_gemm, "CHOICE_TIMES", {})
    assert moe_layer.quack_choices(256) == {}
