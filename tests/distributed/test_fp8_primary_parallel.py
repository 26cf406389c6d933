"""FP8 primary weights under data, expert and tensor parallelism, the distributed optimizer and FSDP (the training
loop on 2 or 4 forked gloo processes, `run_local`: what `moecore train` runs under torchrun, without each rank
importing torch again; emulated rowwise FP8; tensorwise under the distributed optimizer and FSDP,
whose weights are gathered as FP8 bytes): each rank rebuilds the FP8 copies of the weights it holds from its fp32
masters after every step (the distributed optimizer: from the gathered weights; FSDP: at every all-gather), so the
run must compute exactly what the same layout computes without primary weights (the same quantised weights either way: losses and gradient norms equal bit for bit), and resuming
its checkpoint (fp32 masters, as always) reproduces its next step."""

from __future__ import annotations

import shutil

import pytest
from cli_runs import read_metrics

from moecore.config import load_config
from moecore.parallel.launch import run_local
from moecore.train.loop import train

pytestmark = pytest.mark.distributed

RUN = [  # every GEMM dimension a multiple of 16
    "train.steps=3",
    "train.global_batch_size=4",
    "train.micro_batch_size=2",
    "train.seq_length=16",
    "train.eval_interval=0",
    "train.device=cpu",
    "log.interval=1",
    "log.progress=false",
    "log.tensorboard=false",
    "checkpoint.interval=2",
    "model.hidden_size=32",
    "model.num_layers=2",
    "model.num_attention_heads=2",
    "model.num_kv_heads=2",
    "model.ffn_hidden_size=64",
    "moe.num_experts=4",
    "moe.ffn_hidden_size=32",
    "moe.shared_expert_intermediate_size=32",
    "moe.first_k_dense_replace=1",
    "train.precision=fp8",
    "fp8.emulate=true",
    "fp8.recipe=rowwise",
]


def _train(rank: int, world: int, overrides: list[str]) -> None:
    train(load_config("tiny-moe", overrides))


@pytest.mark.parametrize(
    "layout",
    [
        ["parallel.ep=2"],
        ["parallel.tp=2", "parallel.sequence_parallel=true"],
        ["parallel.distributed_optimizer=true"],
        # one FP8 copy per weight: gathered as FP8 bytes (moecore/parallel/fp8_gather.py)
        ["parallel.distributed_optimizer=true", "fp8.recipe=tensorwise"],
        ["parallel.fsdp=true", "fp8.recipe=tensorwise"],  # FSDP2 gathers the FP8 copy (moecore/parallel/fsdp_fp8.py)
        # 4 processes: FSDP over dp2 of tp2 and ep2 shards (saved as their chunks of the global tensors)
        ["parallel.fsdp=true", "fp8.recipe=tensorwise", "parallel.tp=2", "parallel.ep=2", "train.global_batch_size=8"],
    ],
    ids=["ep2", "tp2-sp", "dist-opt", "dist-opt-fp8-gather", "fsdp-fp8-gather", "fsdp-tp2-ep2-fp8-gather"],
)
def test_primary_weights_equal_the_run_without_them(tmp_path, layout):
    world = 4 if "parallel.tp=2" in layout and "parallel.ep=2" in layout else 2
    runs = {}
    for name, extra in (("plain", []), ("primary", ["fp8.primary_weights=true"])):
        run_dir = tmp_path / name
        run_local(_train, world, [*RUN, *layout, *extra, f"train.run_dir={run_dir}"])
        runs[name] = read_metrics(run_dir)
    assert [m["step"] for m in runs["primary"]] == [1, 2, 3]
    for ref, got in zip(runs["plain"], runs["primary"]):
        assert got["loss"] == ref["loss"] and got["grad_norm"] == ref["grad_norm"], (ref, got)
        # the primary weights are in use: rowwise's two FP8 layouts, their scales and the placeholders outweigh
        # bf16; tensorwise's one FP8 copy (1 byte per element) weighs less. Under FSDP the parameters are the fp32
        # shards either way (the FP8 copy exists only gathered, between a layer's all-gather and its reshard)
        if "parallel.fsdp=true" in layout:
            assert got["memory/params_gb"] == ref["memory/params_gb"], (ref, got)
        elif "fp8.recipe=tensorwise" in layout:
            assert got["memory/params_gb"] < ref["memory/params_gb"], (ref, got)
        else:
            assert got["memory/params_gb"] > ref["memory/params_gb"], (ref, got)
    # resumed from the step-2 checkpoint (fp32 masters, quantised again on load): step 3 as before
    resumed = tmp_path / "resumed"
    shutil.copytree(tmp_path / "primary", resumed)
    shutil.rmtree(resumed / "checkpoints" / "step-3", ignore_errors=True)
    (resumed / "metrics.jsonl").unlink()
    primary = [*RUN, *layout, "fp8.primary_weights=true", f"train.run_dir={resumed}", "checkpoint.resume=true"]
    run_local(_train, world, primary)
    got = read_metrics(resumed)
    assert [m["step"] for m in got] == [3]
    assert got[0]["loss"] == runs["primary"][2]["loss"], (got, runs["primary"][2])
