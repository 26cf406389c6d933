"""parallel.fsdp=true on one process: FSDP2 over a one-rank mesh trains exactly as the plain run does.

`moecore train ... parallel.fsdp=true` without torchrun initialises a one-rank process group and applies
FSDP2 (nothing is split). The same weights and batches must give the same losses and grad norms as the run
without FSDP, the parameters must be FSDP2's DTensors, and the checkpoint it writes must resume a run without
FSDP (layout-free files).
"""

from __future__ import annotations

import pytest
from cli_runs import metrics_by_step, train_forked

TINY = [
    "tiny-moe",
    "train.device=cpu",
    "train.steps=3",
    "log.progress=false",
    "train.eval_interval=0",
    "log.interval=1",
    "train.seq_length=64",
    "train.global_batch_size=4",
    "train.micro_batch_size=2",
]


def _train(run_dir, *extra: str) -> dict[int, dict]:
    train_forked([*TINY, f"train.run_dir={run_dir}", *extra])  # `moecore train ...` without re-importing torch
    return metrics_by_step(run_dir, having="loss")


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_one_process_fsdp_trains_like_the_plain_run(tmp_path, precision):
    plain = _train(tmp_path / "plain", f"train.precision={precision}", "checkpoint.interval=3")
    fsdp = _train(tmp_path / "fsdp", f"train.precision={precision}", "parallel.fsdp=true", "checkpoint.interval=3")
    assert sorted(plain) == sorted(fsdp) == [1, 2, 3]
    for step in plain:
        for key in ("loss", "grad_norm"):
            a, b = fsdp[step][key], plain[step][key]
            # The same arithmetic: FSDP2's copy-in / copy-out moves bytes only; under bf16 both runs compute with
            # the bf16 rounding of the same fp32 masters, sum the gradients in fp32 and update with the fused
            # AdamW (measured: equal to the last bit in both precisions).
            assert abs(a - b) <= 1e-6 * abs(b), (step, key, a, b)
    if precision == "fp32":  # the same tensors per rank (under bf16 FSDP's fp32 shards are the masters instead)
        for key in ("memory/params_gb", "memory/grads_gb", "memory/optim_gb"):
            assert fsdp[3][key] == pytest.approx(plain[3][key], rel=1e-6), key
    if precision == "fp32":  # the FSDP checkpoint resumes a run without FSDP as the plain run's checkpoint does
        resumed = {
            name: _train(
                tmp_path / f"resumed-{name}", "train.steps=4", f"checkpoint.load={tmp_path / name}/checkpoints/step-3"
            )
            for name in ("plain", "fsdp")
        }
        assert resumed["fsdp"][4]["loss"] == pytest.approx(resumed["plain"][4]["loss"], rel=1e-6)


def test_one_process_fsdp_parameters_are_dtensors(tmp_path):
    from torch.distributed.tensor import DTensor

    from moecore.config import load_config
    from moecore.train.loop import Trainer

    cfg = load_config(TINY[0], [*TINY[1:], "parallel.fsdp=true", f"train.run_dir={tmp_path}"])
    trainer = Trainer(cfg)
    try:
        assert all(isinstance(p, DTensor) for p in trainer.model.parameters())
        assert {p.device_mesh.size() for p in trainer.model.parameters()} == {1}
        trainer.train_step()
        assert all(p.grad is not None for p in trainer.model.parameters())
    finally:
        trainer.rt.shutdown()  # the one-rank process group this run initialised
