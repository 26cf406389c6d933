"""A run stopped with train.exit_interval and resumed with checkpoint.resume continues bit-exactly."""

from __future__ import annotations

import json

from moecore.config import load_config
from moecore.train.loop import train

TINY = [
    "model.hidden_size=32",
    "model.num_layers=2",
    "model.num_attention_heads=2",
    "model.num_kv_heads=1",
    "model.ffn_hidden_size=64",
    "moe.num_experts=4",
    "moe.ffn_hidden_size=32",
    "moe.shared_expert_intermediate_size=32",
    "moe.first_k_dense_replace=1",
    "moe.z_loss_coeff=0.001",
    "moe.router_enable_expert_bias=true",
    "train.seq_length=16",
    "train.global_batch_size=4",
    "train.micro_batch_size=2",
    "train.eval_interval=20",
    "train.eval_iters=1",
    "optim.warmup_steps=5",
    "log.interval=1",
    "log.progress=false",
    "log.tensorboard=false",
]


def _losses(run_dir) -> dict[int, float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows}


def test_exit_and_resume_is_bit_exact(tmp_path):
    full = train(load_config("tiny-moe", TINY + ["train.steps=60", f"train.run_dir={tmp_path / 'full'}"]))
    assert full.last_step == 60

    part_dir = tmp_path / "part"
    first = train(
        load_config("tiny-moe", TINY + ["train.steps=60", "train.exit_interval=30", f"train.run_dir={part_dir}"])
    )
    assert first.last_step == 30
    assert (part_dir / "checkpoints" / "step-30" / "complete").exists()
    second = train(
        load_config("tiny-moe", TINY + ["train.steps=60", "checkpoint.resume=true", f"train.run_dir={part_dir}"])
    )
    assert second.last_step == 60

    want = dict(full.losses)
    got = dict(first.losses) | dict(second.losses)
    assert sorted(got) == list(range(1, 61))
    for step in range(31, 61):
        assert got[step] == want[step], f"step {step}: resumed {got[step]!r} != uninterrupted {want[step]!r}"
    # The loss must actually move, or equality would prove nothing.
    assert want[60] < want[1] - 0.5
    # metrics.jsonl of the resumed run continues the first half's file.
    logged = _losses(part_dir)
    assert all(logged[s] == want[s] for s in range(31, 61))
