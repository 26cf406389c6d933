"""The CLI under torchrun: a one-process run's checkpoint resumed on 2 processes with expert parallel.

Run A (one process) trains 2 steps and checkpoints after each. Run B starts from a copy of A's
folder without the step-2 checkpoint and resumes it with `torchrun --nproc-per-node 2 ... parallel.ep=2`
(gloo, 2 data-parallel replicas, experts split over 2 ranks): its step 2 must reproduce A's loss and
gradient norm, and only rank 0 may print the summary and write metrics.jsonl.
"""

from __future__ import annotations

import shutil
import sys

import pytest
from cli_runs import read_metrics, run_cli, train_forked

pytestmark = pytest.mark.distributed

COMMON = [
    "tiny-moe",
    "train.steps=2",
    "train.global_batch_size=4",
    "train.micro_batch_size=2",
    "train.seq_length=32",
    "train.eval_interval=0",
    "log.interval=1",
    "log.progress=false",
    "log.tensorboard=false",
    "checkpoint.interval=1",
    "model.hidden_size=64",
    "model.num_layers=2",
    "model.ffn_hidden_size=128",
    "moe.ffn_hidden_size=32",
    "moe.shared_expert_intermediate_size=32",
]


def test_torchrun_resumes_one_process_checkpoint_with_expert_parallel(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    train_forked([*COMMON, f"train.run_dir={a}"])
    shutil.copytree(a, b)
    shutil.rmtree(b / "checkpoints" / "step-2")
    (b / "metrics.jsonl").unlink()
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "-m", "moecore", "train"]
    proc = run_cli([*torchrun, *COMMON, f"train.run_dir={b}", "checkpoint.resume=true", "parallel.ep=2"])
    out = proc.stdout + proc.stderr
    assert out.count("done: ") == 1, out[-2000:]  # rank 0 alone reports
    ref, got = read_metrics(a), read_metrics(b)
    assert [m["step"] for m in got] == [2]  # one writer, one line per logged step
    assert abs(got[0]["loss"] - ref[1]["loss"]) <= 1e-5 * abs(ref[1]["loss"])
    assert abs(got[0]["grad_norm"] - ref[1]["grad_norm"]) <= 1e-5 * abs(ref[1]["grad_norm"])
    assert got[0]["moe/layer_1/tokens_per_expert"] == ref[1]["moe/layer_1/tokens_per_expert"]
    assert (b / "checkpoints" / "step-2" / "complete").exists()


def test_torchrun_data_parallel_with_gradient_accumulation_equals_one_process(tmp_path):
    """dp2 with two micro-batches per rank: the deferred gradient reduction must see every micro-batch once."""
    a, b = tmp_path / "a", tmp_path / "b"
    accum = [*COMMON, "train.steps=3", "train.global_batch_size=8", "checkpoint.interval=0"]
    train_forked([*accum, f"train.run_dir={a}"])
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "-m", "moecore", "train"]
    run_cli([*torchrun, *accum, f"train.run_dir={b}"])
    ref, got = read_metrics(a), read_metrics(b)
    assert [m["step"] for m in got] == [1, 2, 3]
    for r, g in zip(ref, got):
        assert abs(g["loss"] - r["loss"]) <= 1e-5 * abs(r["loss"]), (r["step"], r["loss"], g["loss"])
        assert abs(g["grad_norm"] - r["grad_norm"]) <= 1e-5 * abs(r["grad_norm"]), (
            r["step"],
            r["grad_norm"],
            g["grad_norm"],
        )


def test_torchrun_global_aux_loss_with_one_micro_batch_per_replica_equals_one_process(tmp_path):
    """global_aux_loss with the global batch in one micro-batch (1 process) or split over 2 replicas: equal."""
    a, b = tmp_path / "a", tmp_path / "b"
    # (the per-micro-batch aux_loss is a product of averages, so it depends on the split: left out here)
    loss = ["moe.router_load_balancing_type=global_aux_loss", "moe.aux_loss_coeff=1.0"]
    run = [*COMMON, *loss, "train.steps=3", "train.global_batch_size=8", "checkpoint.interval=0"]
    train_forked([*run, "train.micro_batch_size=8", f"train.run_dir={a}"])
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "-m", "moecore", "train"]
    run_cli([*torchrun, *run, "train.micro_batch_size=4", f"train.run_dir={b}"])
    for r, g in zip(read_metrics(a), read_metrics(b)):
        assert abs(g["moe/layer_1/global_aux_loss"] / r["moe/layer_1/global_aux_loss"] - 1) <= 1e-5
        assert abs(g["grad_norm"] - r["grad_norm"]) <= 1e-5 * abs(r["grad_norm"]), (
            r["step"],
            r["grad_norm"],
            g["grad_norm"],
        )


def test_torchrun_bf16_equals_one_process(tmp_path):
    """train.precision=bf16 on 2 ranks (fp32 main gradients reduced over ranks, fused AdamW on fp32 masters)
    follows the one-process bf16 run with the same global batch (two micro-batches summed in fp32).

    dp2 from the same seed: each rank computes exactly one of the one-process run's micro-batches, so only
    the order of the fp32 sums differs (measured 8.5e-8, bound 1e-6). ep2 x dp2, resumed from the one-process run's step-1
    checkpoint (its fp32 masters): the expert GEMMs see other batch shapes, whose bf16 roundings differ;
    measured: losses within 1.2e-7, grad norms within 5.3e-5 (bound 1e-3)."""
    bf16 = [*COMMON, "train.steps=3", "train.precision=bf16"]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "-m", "moecore", "train"]
    one = tmp_path / "one"
    train_forked([*bf16, f"train.run_dir={one}"])
    ref = {m["step"]: m for m in read_metrics(one)}
    dp2 = tmp_path / "dp2"
    run_cli([*torchrun, *bf16, f"train.run_dir={dp2}", "checkpoint.interval=0"])
    ep2 = tmp_path / "ep2"
    shutil.copytree(one, ep2)
    for step in (2, 3):
        shutil.rmtree(ep2 / "checkpoints" / f"step-{step}")
    (ep2 / "metrics.jsonl").unlink()
    run_cli([*torchrun, *bf16, f"train.run_dir={ep2}", "checkpoint.resume=true", "parallel.ep=2"])
    for run_dir, tol, steps in ((dp2, 1e-6, [1, 2, 3]), (ep2, 1e-3, [2, 3])):
        got = read_metrics(run_dir)
        assert [m["step"] for m in got] == steps
        for g in got:
            r = ref[g["step"]]
            for key in ("loss", "grad_norm"):
                assert abs(g[key] - r[key]) <= tol * abs(r[key]), (run_dir.name, key, r["step"], r[key], g[key])


@pytest.mark.parametrize("sharding", ["parallel.fsdp=true", "parallel.distributed_optimizer=true"])
def test_torchrun_fp16_with_sharded_state_follows_one_process(tmp_path, sharding):
    """train.precision=fp16 (autocast over fp32 parameters, dynamic loss scaling) on 2 ranks with FSDP2 or the
    distributed optimizer: the scaler unscales the sharded gradients (FSDP2's DTensors; the distributed optimizer's
    reduced shards, given to its master shards as `.grad`), and whether a step overflowed comes from the global norm.
    Against the one-process fp16 run, three steps: measured losses equal, grad norms within 1.1e-7 (fp32 sums in
    another order; plain dp2 gives the same numbers to the bit, under either), bound 1e-5."""
    fp16 = [*COMMON, "train.steps=3", "train.global_batch_size=8", "train.precision=fp16", "checkpoint.interval=0"]
    one, sharded = tmp_path / "one", tmp_path / "sharded"
    train_forked([*fp16, f"train.run_dir={one}"])
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "-m", "moecore", "train"]
    run_cli([*torchrun, *fp16, f"train.run_dir={sharded}", sharding])
    ref, got = read_metrics(one), read_metrics(sharded)
    assert [m["step"] for m in got] == [1, 2, 3] and "skipped" not in got[0]
    for r, g in zip(ref, got):
        for key in ("loss", "grad_norm"):
            assert abs(g[key] - r[key]) <= 1e-5 * abs(r[key]), (r["step"], key, r[key], g[key])


UPCYCLE_BASE = [*COMMON[:11], "model.num_layers=4", "model.ffn_hidden_size=256", "train.global_batch_size=8"]


def _upcycle_args(dense) -> list[str]:
    moe = [*UPCYCLE_BASE, "moe.ffn_hidden_size=128", "moe.shared_expert_intermediate_size=64", "checkpoint.interval=0"]
    return [*moe, f"checkpoint.upcycle_from={dense / 'checkpoints' / 'step-1'}"]


@pytest.fixture(scope="module")
def upcycled_one_process(tmp_path_factory):
    """A dense run's step-1 checkpoint and the one-process run upcycled from it (two steps): (dense folder, metrics)."""
    tmp = tmp_path_factory.mktemp("upcycle")
    dense = tmp / "dense"
    train_forked([*UPCYCLE_BASE, "moe.num_experts=0", "train.steps=1", f"train.run_dir={dense}"])
    train_forked([*_upcycle_args(dense), f"train.run_dir={tmp / 'one'}"])
    return dense, read_metrics(tmp / "one")


@pytest.mark.parametrize(
    "layout", [["parallel.pp=2", "parallel.ep=2"], ["parallel.tp=2", "parallel.etp=2"]], ids=["pp2-ep2", "tp2-etp2"]
)
def test_torchrun_upcycles_a_dense_checkpoint_like_one_process(tmp_path, upcycled_one_process, layout):
    """`checkpoint.upcycle_from` on 4 ranks: each rank upcycles the tensors it holds in their global shapes and
    keeps its shard (experts split over ep / their FFN columns over etp, attention over tp, layers over pp); two
    steps equal the one-process upcycled run (granularity 2: 8 experts of width 128 from the dense width 256)."""
    dense, ref = upcycled_one_process
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4", "-m", "moecore", "train"]
    run_cli([*torchrun, *_upcycle_args(dense), *layout, f"train.run_dir={tmp_path / 'four'}"])
    got = read_metrics(tmp_path / "four")
    assert [m["step"] for m in got] == [1, 2]
    for r, g in zip(ref, got):
        for key in ("loss", "grad_norm"):
            assert abs(g[key] - r[key]) <= 1e-5 * abs(r[key]), (r["step"], key, r[key], g[key])
