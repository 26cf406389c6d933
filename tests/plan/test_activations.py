"""The activation model against the H200 measurements of benchmarks/recompute_memory.py (docs/benchmarks.md).

Those runs measured, per recomputation option, the memory a forward leaves for the backward
(`activations_gb`) and the step's peak, for the Qwen3-30B-A3B proxy (8 layers) and the
DeepSeek-V2-Lite proxy (4 layers) at batch 2 x 4096, bf16 weights with bf16 AdamW state
(benchmarks/results/h200-recompute.json). The planner, given the same models and that precision,
must reproduce every activation number within 2% and every peak within 6%.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from moecore.config import load_config
from moecore.plan.layout import layout_of
from moecore.plan.memory import GiB, PlanOptions, estimate_memory
from moecore.plan.params import PrecisionMode

RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "h200-recompute.json"
CAST_BF16 = PrecisionMode("bf16 weights, bf16 AdamW state", 2, 0, 2, 4, False, 2)  # model.to(bf16)
RECIPES = {"qwen3": ("qwen3-30b-a3b", 8), "dsv2lite": ("deepseek-v2-lite", 4)}


def _records() -> list[dict]:
    return json.loads(RESULTS.read_text())


def _config(model: str, option: str):
    recipe, layers = RECIPES[model]
    option = option.split("(")[-1].rstrip(")")  # "recipe (mla_up_proj+moe_act+norm)"
    gran = option if option in ("none", "full") else "selective"
    mods = option.split("+") if gran == "selective" else []
    return load_config(
        recipe,
        [f"model.num_layers={layers}", "train.seq_length=4096", "train.micro_batch_size=2", "train.global_batch_size=2",
         "parallel.ep=1", "moe.apply_probs_on_input=true", f"model.recompute_granularity={gran}",
         f"model.recompute_modules=[{','.join(mods)}]"],
    )  # fmt: skip


@pytest.mark.parametrize("rec", _records(), ids=lambda r: f"{r['model']}-{r['option']}")
def test_activations_and_peak_match_the_h200_measurements(rec: dict) -> None:
    cfg = _config(rec["model"], rec["option"])
    est = estimate_memory(cfg, layout_of(cfg, 1), PlanOptions(mode=CAST_BF16))
    after_forward = (est.activations + est.loss) / GiB  # what the forward leaves (loss keeps dh and dW)
    assert after_forward == pytest.approx(rec["activations_gb"], rel=0.02)
    assert est.peak_allocated / GiB == pytest.approx(rec["peak_mem_gb"], rel=0.06)


TRAIN = Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "h200-train.json"


def test_peak_of_the_trainer_steps_measured_on_an_h200() -> None:
    """Run H of docs/benchmarks.md: `Trainer.train_step` of the bench proxies (`moecore bench train`: the
    Qwen3-30B-A3B proxy, 8 layers, and the DeepSeek-V3 proxy, 4 narrower layers with MLA and MTP; ep 1,
    batch 2 x 4096), mixed (fp32 masters and moments) and bf16 (no masters, bf16 moments): the planner's
    peak within 3% of torch.cuda.max_memory_allocated."""
    from moecore.bench.train import MODES, PROXIES

    recs = [r for r in json.loads(TRAIN.read_text()) if r.get("run") == "H" and r["impl"] == "moecore"]
    assert len(recs) == 4
    for r in recs:
        model = "deepseek-v3" if r["shape"].startswith("deepseek-v3") else "qwen3-30b-a3b"
        recipe, overrides = PROXIES[model]
        cfg = load_config(recipe, [*overrides, *MODES[r["precision"]]])
        est = estimate_memory(cfg, layout_of(cfg, 1))
        assert est.peak_allocated / GiB == pytest.approx(r["peak_mem_gb"], rel=0.03), (model, r["precision"])


@pytest.mark.parametrize("primary", [False, True])
def test_blockwise_fp8_keeps_the_expert_rows_padded(primary: bool) -> None:
    """fp8.recipe=blockwise pads every expert GEMM's rows to 128 (moecore/kernels/fp8_grouped.py: exactly, from the
    counts on the host: 63.5 rows per expert on average), and the FFN keeps its input and w13 output padded: the
    experts' saved bytes are bf16's times P / N; rowwise (padding only its weight-gradient operands) keeps bf16's;
    rowwise with fp8.padding=all pads to the fixed bound N + E x 15, rounded up to 16 (its GEMMs read offsets on
    the GPU)."""
    from moecore.plan.activations import ffn_modules
    from moecore.plan.memory import act_context
    from moecore.plan.params import precision_mode

    base = ["model.num_layers=2", "train.micro_batch_size=2", "train.global_batch_size=2", "parallel.ep=1"]

    def experts(extra: list[str]) -> float:
        cfg = load_config("qwen3-30b-a3b", base + extra)
        layout = layout_of(cfg, 1)
        c = act_context(cfg, layout, precision_mode(cfg, layout, 1), PlanOptions())
        return ffn_modules(cfg, True, layout, c)["experts"]

    fp8 = ["train.precision=fp8", f"fp8.primary_weights={str(primary).lower()}"]
    cfg = load_config("qwen3-30b-a3b", base)
    n = 2 * cfg.train.seq_length * cfg.moe.router_topk
    p = n + cfg.moe.num_experts * 127 / 2
    assert experts([*fp8, "fp8.recipe=blockwise"]) == pytest.approx(experts([]) * p / n, rel=1e-12)
    assert experts([*fp8, "fp8.recipe=rowwise"]) == experts([])
    p = -(-(n + cfg.moe.num_experts * 15) // 16) * 16
    assert experts([*fp8, "fp8.recipe=rowwise", "fp8.padding=all"]) == pytest.approx(experts([]) * p / n, rel=1e-12)
