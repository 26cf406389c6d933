"""benchmarks/fp8_accuracy.py without a GPU: the paired comparison of each FP8 run with the bf16 run of its seed."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "fp8_accuracy.py"


@pytest.fixture(scope="module")
def fa():
    spec = importlib.util.spec_from_file_location("fp8_accuracy", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _run(losses: list[float], val: float | None) -> dict:
    return {"losses": losses, "val_losses": [[len(losses), val]] if val else [], "final_loss": sum(losses[-2:]) / 2,
            "final_val_loss": val, "tokens_per_s": 1.0}  # fmt: skip


def test_each_fp8_run_is_compared_with_the_bf16_run_of_its_seed(fa) -> None:
    runs = {
        "bf16@1": _run([4.0, 3.0, 2.0], 2.5),
        "fp8-rowwise@1": _run([4.0, 3.0, 2.2], 2.75),  # last 2 steps: 2.6 vs 2.5 (+4%); validation +10%
        "bf16@2": _run([4.0, 3.0, 3.0], 3.0),
        "fp8-rowwise@2": _run([4.0, 3.0], 3.0),  # a skipped step: compared over the same 2 logged steps
    }
    summary = fa.compare(runs, window=2)
    assert runs["fp8-rowwise@1"]["final_loss_rel_diff_vs_bf16"] == pytest.approx(0.04)
    assert runs["fp8-rowwise@1"]["final_val_loss_rel_diff_vs_bf16"] == pytest.approx(0.10)
    assert runs["fp8-rowwise@2"]["steps_logged"] == 2
    assert runs["fp8-rowwise@2"]["final_loss_rel_diff_vs_bf16"] == pytest.approx(0.0)  # (4+3)/2 against (4+3)/2
    s = summary["fp8-rowwise"]
    assert s["final_loss_rel_diff_mean"] == pytest.approx(0.02)
    assert s["final_val_loss_rel_diff_mean"] == pytest.approx(0.05)
    assert summary["bf16"]["final_loss_rel_diff"] == [0.0, 0.0]
    assert summary["bf16"]["spread_over_seeds"] == pytest.approx((3.0 - 2.5) / 2.75)


def _record(seed: int, runs: dict, **fields) -> dict:
    return {"steps": 3, "format": "e4m3", "batch": 8, "corpus_mb": 64.0, "final_window": 2, "seeds": [seed],
            "runs": runs, **fields}  # fmt: skip


def test_records_of_other_seeds_merge_into_one_comparison(fa) -> None:
    one = _record(1, {"bf16@1": _run([4.0, 3.0, 2.0], 2.5), "fp8-rowwise@1": _run([4.0, 3.0, 2.2], 2.75)})
    two = _record(2, {"bf16@2": _run([4.0, 3.0, 3.0], 3.0), "fp8-rowwise@2": _run([4.0, 3.0, 3.0], 3.0)})
    merged = fa.merge([one, two])
    assert merged["seeds"] == [1, 2]
    assert set(merged["runs"]) == {"bf16@1", "fp8-rowwise@1", "bf16@2", "fp8-rowwise@2"}
    assert merged["summary"]["fp8-rowwise"]["final_loss_rel_diff_mean"] == pytest.approx(0.02)
    assert merged["summary"]["bf16"]["spread_over_seeds"] == pytest.approx((3.0 - 2.5) / 2.75)
    with pytest.raises(SystemExit, match="differ in 'batch'"):
        fa.merge([one, _record(2, two["runs"], batch=32)])
    with pytest.raises(SystemExit, match="more than one record"):
        fa.merge([one, one])
