"""The training loop with `parallel.distributed_optimizer=true` in bf16: parity, memory metrics, resharded resume.

Three runs of the tiny-moe recipe (bf16 parameters, fp32 masters), 3 steps each:
A: one process (FusedAdamW on full fp32 masters);
B: 2 ranks (dp2) with the distributed optimizer (the master shards are the only fp32 copy),
   checkpoint after every step (the training loop's initial weights depend on ep, so B keeps ep = 1
   to start from A's weights; the optimizer tests cover ep and tp from given weights);
C: one process resuming B's step-1 checkpoint (written by 2 ranks, sharded) without the distributed
   optimizer.
D: 2 ranks (dp2) with parallel.fsdp=true (FSDP2: fp32 sharded weights, bf16 compute policy).
B's and D's losses and grad norms match A's within the bf16 tolerance of the optimizer tests; C's
steps 2-3 match B's; B's `memory/optim_gb` and `memory/grads_gb` per rank are half of A's; D holds
half of the fp32 weights and 8 / 2 bytes of moments per parameter (no separate master).
"""

from __future__ import annotations

import json
import shutil

import pytest
from test_distributed_optimizer import BF16_TOL

from moecore.config import load_config
from moecore.parallel.launch import run_local
from moecore.train.loop import train

pytestmark = pytest.mark.distributed

COMMON = [
    "train.steps=3",
    "train.global_batch_size=4",
    "train.micro_batch_size=2",
    "train.seq_length=32",
    "train.eval_interval=0",
    "train.device=cpu",
    "train.precision=bf16",
    "log.interval=1",
    "log.progress=false",
    "log.tensorboard=false",
    "checkpoint.interval=1",
    "model.hidden_size=64",
    "model.num_layers=2",
    "model.ffn_hidden_size=128",
    "moe.ffn_hidden_size=32",
    "moe.shared_expert_intermediate_size=32",
    "optim.clip_grad=0.5",
]


def _train(rank: int, world: int, overrides: list[str]) -> None:
    train(load_config("tiny-moe", [*COMMON, *overrides]))


def _metrics(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def _rel(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


def test_distributed_optimizer_trains_and_resumes_elsewhere(tmp_path):
    a, b, c = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    train(load_config("tiny-moe", [*COMMON, f"train.run_dir={a}"]))
    run_local(_train, 2, [f"train.run_dir={b}", "parallel.distributed_optimizer=true"])
    ma, mb = _metrics(a), _metrics(b)
    loss, norm = (
        _rel([m["loss"] for m in mb], [m["loss"] for m in ma]),
        _rel([m["grad_norm"] for m in mb], [m["grad_norm"] for m in ma]),
    )
    print(f"dp2 distributed optimizer vs one process (bf16): loss {loss:.1e} grad norm {norm:.1e}")
    assert loss <= BF16_TOL and norm <= BF16_TOL
    for kind in ("optim", "grads"):
        one, per_rank = ma[-1][f"memory/{kind}_gb"], mb[-1][f"memory/{kind}_gb"]
        print(f"memory/{kind}_gb: one process {one:.4e}, per rank {per_rank:.4e}")
        assert abs(per_rank - one / 2) <= 0.01 * one  # padding of the buckets, step counters
    assert mb[-1]["memory/params_gb"] == ma[-1]["memory/params_gb"]  # bf16 parameters stay whole

    d = tmp_path / "d"
    run_local(_train, 2, [f"train.run_dir={d}", "parallel.fsdp=true"])
    md = _metrics(d)
    loss, norm = (
        _rel([m["loss"] for m in md], [m["loss"] for m in ma]),
        _rel([m["grad_norm"] for m in md], [m["grad_norm"] for m in ma]),
    )
    print(f"dp2 fsdp vs one process (bf16): loss {loss:.1e} grad norm {norm:.1e}")
    assert loss <= BF16_TOL and norm <= BF16_TOL
    # One process: bf16 weights (2 bytes) + fp32 master and moments (12); fsdp dp2: fp32 weights / 2, moments / 2.
    assert abs(md[-1]["memory/params_gb"] - ma[-1]["memory/params_gb"]) <= 0.01 * ma[-1]["memory/params_gb"]
    assert abs(md[-1]["memory/optim_gb"] - ma[-1]["memory/optim_gb"] / 3) <= 0.01 * ma[-1]["memory/optim_gb"]

    shutil.copytree(b, c)
    for step in (2, 3):
        shutil.rmtree(c / "checkpoints" / f"step-{step}")
    (c / "metrics.jsonl").unlink()
    train(load_config("tiny-moe", [*COMMON, f"train.run_dir={c}", "checkpoint.resume=true"]))
    mc = _metrics(c)
    assert [m["step"] for m in mc] == [2, 3]
    loss, norm = (
        _rel([m["loss"] for m in mc], [m["loss"] for m in mb[1:]]),
        _rel([m["grad_norm"] for m in mc], [m["grad_norm"] for m in mb[1:]]),
    )
    print(f"one process resuming the dp2 distributed-optimizer checkpoint: loss {loss:.1e} grad norm {norm:.1e}")
    assert loss <= BF16_TOL and norm <= BF16_TOL
