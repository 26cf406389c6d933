"""The CLI under torchrun with pipeline x expert parallel; checkpoints move between pp1 and pp2 x ep2.

Run A (one process, tiny-deepseek-v3 with 2 layers and its MTP layer) trains 4 steps, evaluating and
checkpointing after each. Run B resumes A's step-2 checkpoint with `torchrun --nproc-per-node 4 ...
parallel.pp=2 parallel.ep=2` (2 stages x 2 expert-parallel ranks, 2 micro-batches per pipeline) and
stops at `train.exit_interval=3`: its step 3 (loss, grad norm, MTP loss, MoE statistics, validation
loss) must equal A's, it writes its checkpoint and the per-stage summary. Run C resumes B's step-3
checkpoint in one process: its step 4 must equal A's. Optimizer state crosses both ways.
"""

from __future__ import annotations

import json
import shutil
import sys

import pytest
import torch
from cli_runs import read_metrics, run_cli

pytestmark = pytest.mark.distributed

COMMON = [
    "tiny-deepseek-v3",
    "model.num_layers=2",
    "train.steps=4",
    "train.global_batch_size=8",
    "train.micro_batch_size=2",
    "train.seq_length=32",
    "train.eval_interval=1",
    "train.eval_iters=1",
    "log.interval=1",
    "log.progress=false",
    "log.tensorboard=false",
    "checkpoint.interval=1",
]
KEYS = ("loss", "grad_norm", "mtp_loss", "val_loss", "moe/mean_imbalance", "moe/layer_1/seq_aux_loss")


def _resume_copy(src, dst, keep: int) -> None:
    shutil.copytree(src, dst)
    for ckpt in (dst / "checkpoints").iterdir():
        if int(ckpt.name.split("-")[1]) > keep:
            shutil.rmtree(ckpt)
    (dst / "metrics.jsonl").unlink()


def _same(ref: dict, got: dict, keys: tuple[str, ...] = KEYS) -> None:
    assert set(got) - {"tokens_per_s", "step_time_s", "tflops_per_device", "mfu"} <= set(ref), set(got) - set(ref)
    for key in keys:
        assert abs(got[key] - ref[key]) <= 1e-5 * abs(ref[key]), (ref["step"], key, ref[key], got[key])
    assert got["moe/layer_1/tokens_per_expert"] == ref["moe/layer_1/tokens_per_expert"]
    assert got["moe/layer_2/tokens_per_expert"] == ref["moe/layer_2/tokens_per_expert"]  # the MTP block


MOECORE = [sys.executable, "-m", "moecore", "train"]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4", "-m", "moecore", "train"]


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """Run A: its folder and its records by step."""
    a = tmp_path_factory.mktemp("pipeline-cli") / "a"
    run_cli([*MOECORE, *COMMON, f"train.run_dir={a}"])
    return a, {m["step"]: m for m in read_metrics(a)}


def test_torchrun_pipeline_expert_parallel_resumes_across_layouts(tmp_path, one_process):
    b, c = tmp_path / "b", tmp_path / "c"
    a, ref = one_process
    moecore, torchrun = MOECORE, TORCHRUN

    _resume_copy(a, b, keep=2)
    pp = ["parallel.pp=2", "parallel.ep=2", "train.exit_interval=3", "checkpoint.resume=true"]
    proc = run_cli([*torchrun, *COMMON, f"train.run_dir={b}", *pp])
    out = proc.stdout + proc.stderr
    assert out.count("done: ") == 1 and "pipeline rank 1: stages 1:tmL" in out, out[-2000:]
    got = read_metrics(b)
    assert [m["step"] for m in got] == [3]
    _same(ref[3], got[0])
    stages = json.loads((b / "pipeline_stages.json").read_text())
    assert [s["stages"] for s in stages] == [["0:Et"], ["1:tmL"]] and stages[0]["params"] < stages[1]["params"]
    assert (b / "checkpoints" / "step-3" / "complete").exists() and not (b / "checkpoints" / "step-4").exists()

    _resume_copy(b, c, keep=3)
    run_cli([*moecore, *COMMON, f"train.run_dir={c}", "checkpoint.resume=true"])
    got = read_metrics(c)
    assert [m["step"] for m in got] == [4]
    _same(ref[4], got[0])


def _round_trip(tmp_path, one_process, layout: list[str]) -> None:
    """A's step-1 checkpoint resumed under `layout` by torchrun, stopping after step 3: steps 2 and 3 must equal
    A's (step 3 trains, and then evaluates, on the weights this layout's previous step updated); its step-3
    checkpoint resumed in one process: step 4 must equal A's."""
    first, second = tmp_path / "first", tmp_path / "second"
    a, ref = one_process
    _resume_copy(a, first, keep=1)
    # no checkpoint and no evaluation after step 2: either would finish the distributed optimizer's all-gathers
    # that step 3's forwards must wait for themselves
    resume = ["train.exit_interval=3", "checkpoint.interval=3", "train.eval_interval=3", "checkpoint.resume=true"]
    run_cli([*TORCHRUN, *COMMON, f"train.run_dir={first}", *layout, *resume])
    got = read_metrics(first)
    assert [m["step"] for m in got] == [2, 3]
    _same(ref[2], got[0], keys=tuple(k for k in KEYS if k != "val_loss"))
    _same(ref[3], got[1])
    _resume_copy(first, second, keep=3)
    run_cli([*MOECORE, *COMMON, f"train.run_dir={second}", "checkpoint.resume=true"])
    got = read_metrics(second)
    assert [m["step"] for m in got] == [4]
    _same(ref[4], got[0])


def test_torchrun_pipeline_with_the_distributed_optimizer_resumes_across_layouts(tmp_path, one_process):
    """pp2 x dp2 with the distributed optimizer (each stage's AdamW state sharded over its 2 data-parallel ranks;
    the norm from the optimizer's shards, the embedding shared with the MTP block counted once)."""
    _round_trip(tmp_path, one_process, ["parallel.pp=2", "parallel.distributed_optimizer=true"])


def test_torchrun_pipeline_with_context_parallel_resumes_across_layouts(tmp_path, one_process):
    """pp2 x cp2: each stage's sequences split over 2 ranks, MLA over the ring, the MTP block's next-token halo
    over CP."""
    _round_trip(tmp_path, one_process, ["parallel.pp=2", "parallel.cp=2"])


def test_torchrun_pipeline_with_fsdp_resumes_across_layouts(tmp_path, one_process):
    """pp2 x dp2 with FSDP2: each stage module an FSDP root over its 2 data-parallel ranks (its layers and experts
    units of their own), gradients reduce-scattered after the last micro-batch, the embedding's shards summed
    with the MTP block's copy on the other stage."""
    _round_trip(tmp_path, one_process, ["parallel.pp=2", "parallel.fsdp=true"])


def test_torchrun_interleaved_pipeline_with_fsdp_resumes_across_layouts(tmp_path, one_process):
    """Interleaved 1F1B, pp2 x vpp2 x dp2 with FSDP2: two stage roots per rank (E|t|t|mL: the embedding on
    rank 0's first stage, the MTP block and head on rank 1's second)."""
    layout = ["parallel.pp=2", "parallel.vpp=2", "parallel.pp_schedule=interleaved_1f1b", "parallel.pp_layout=E|t|t|mL"]
    _round_trip(tmp_path, one_process, [*layout, "parallel.fsdp=true"])


def test_torchrun_interleaved_zero_bubble_pipeline_with_fsdp_resumes_across_layouts(tmp_path, one_process):
    """Interleaved zero-bubble, pp2 x vpp2 x dp2 with FSDP2: each micro-batch's weight pass split from its
    input-gradient pass, the reduce-scatter after the last weight pass."""
    layout = ["parallel.pp=2", "parallel.vpp=2", "parallel.pp_schedule=zero_bubble", "parallel.pp_layout=E|t|t|mL"]
    _round_trip(tmp_path, one_process, [*layout, "parallel.fsdp=true"])


def test_torchrun_v_pipeline_with_fsdp_trains_like_one_process(tmp_path):
    """zbv (the V-shaped zero-bubble schedule: rank 0 holds stages 0 and 3), pp2 x vpp2 x dp2 with FSDP2, the MTP
    block on rank 1 (E|t|tm|L: with E|t|t|mL rank 0 would hold the embedding in two roots). Two steps against one
    process: losses, grad norms and routing to fp32 rounding."""
    a, b = tmp_path / "a", tmp_path / "b"
    run = [*COMMON, "train.steps=2", "train.global_batch_size=16", "train.eval_interval=0", "checkpoint.interval=0"]
    run_cli([*MOECORE, *run, f"train.run_dir={a}"])
    v = ["parallel.pp=2", "parallel.vpp=2", "parallel.pp_schedule=zbv", "parallel.pp_layout=E|t|tm|L"]
    run_cli([*TORCHRUN, *run, f"train.run_dir={b}", *v, "parallel.fsdp=true"])
    ref, got = read_metrics(a), read_metrics(b)
    assert [m["step"] for m in got] == [1, 2]
    for r, g in zip(ref, got):
        _same(r, g, keys=("loss", "grad_norm", "mtp_loss", "moe/mean_imbalance"))


@pytest.mark.parametrize(
    "model",
    [
        ["tiny-glm-5"],
        ["tiny-deepseek-v32", "model.num_layers=2", "model.dsa_stage=dense_warmup"],
    ],
    ids=["glm5-shared-indexers", "dsv32-dense-warmup"],
)
def test_torchrun_pipeline_runs_deepseek_sparse_attention(tmp_path, model):
    """DSA over pp2 from a one-process checkpoint: steps 2 and 3 equal the one-process run's, the indexer loss
    included (each stage adds its indexers' share of the mean). tiny-glm-5: layers full / shared / full / shared
    (the shared layers take the top-k of the full layer before them, on the same stage) and an MTP block with its
    own indexer. tiny-deepseek-v32's dense warm-up: only the indexers train, the indexer loss is the objective."""
    a, b = tmp_path / "a", tmp_path / "b"
    glm = [*model, *COMMON[2:], "train.steps=3", "train.eval_interval=3"]
    run_cli([*MOECORE, *glm, f"train.run_dir={a}"])
    ref = {m["step"]: m for m in read_metrics(a)}
    _resume_copy(a, b, keep=1)
    run_cli([*TORCHRUN[:4], "2", *TORCHRUN[5:], *glm, f"train.run_dir={b}", "parallel.pp=2", "checkpoint.resume=true"])
    got = read_metrics(b)
    assert [m["step"] for m in got] == [2, 3]
    keys = ("loss", "grad_norm", "mtp_loss", "indexer_loss")
    _same(ref[2], got[0], keys=keys)
    _same(ref[3], got[1], keys=(*keys, "val_loss"))


def test_torchrun_pipeline_with_fsdp_trains_in_bf16(tmp_path):
    """pp2 x dp2 with FSDP2 in bf16: the stages pass bf16 hidden states (FSDP2's fp32 masters compute in bf16; with
    fp32 receive buffers the step's gradients were NaN). Step 1 against one process in bf16: the same loss, the
    grad norm within 1e-3 (measured 7.5e-5: bf16 gradients summed in another order)."""
    a, b = tmp_path / "a", tmp_path / "b"
    bf16 = [*COMMON, "train.steps=1", "train.precision=bf16", "checkpoint.interval=0"]
    run_cli([*MOECORE, *bf16, f"train.run_dir={a}"])
    run_cli([*TORCHRUN, *bf16, f"train.run_dir={b}", "parallel.pp=2", "parallel.fsdp=true"])
    (ref,), (got,) = read_metrics(a), read_metrics(b)
    assert abs(got["loss"] - ref["loss"]) <= 1e-5 * ref["loss"], (ref["loss"], got["loss"])
    assert abs(got["grad_norm"] - ref["grad_norm"]) <= 1e-3 * ref["grad_norm"], (ref["grad_norm"], got["grad_norm"])


def test_torchrun_pipeline_records_and_replays_the_routing(tmp_path):
    """Router replay over pp2 x vpp2 (zbv, full recomputation: each layer runs again in both backward passes).
    Recorded, each rank's file holds its stages' routers with the one-process recording's choices, forward by forward
    (training and evaluation). Replayed with other initial weights, every router picks the recorded experts: the
    per-expert counts of every step equal the recording run's, while the same run without replay routes
    differently."""
    run = [
        *COMMON[:2],
        "model.num_layers=4",
        *COMMON[2:],
        "train.steps=2",
        "train.eval_interval=2",
        "checkpoint.interval=0",
        "model.recompute_granularity=full",
    ]
    pp = ["parallel.pp=2", "parallel.vpp=2", "parallel.pp_schedule=zbv"]
    two = [*TORCHRUN[:4], "2", *TORCHRUN[5:]]
    routes = tmp_path / "routes.pt"
    run_cli([*MOECORE, *run, f"train.run_dir={tmp_path / 'one'}", "moe.router_replay_mode=record",
             f"moe.router_replay_path={tmp_path / 'one.pt'}"])  # fmt: skip
    record = ["moe.router_replay_mode=record", f"moe.router_replay_path={routes}"]
    run_cli([*two, *run, *pp, f"train.run_dir={tmp_path / 'rec'}", *record])
    one = torch.load(tmp_path / "one.pt")["layers"]
    ranks = [torch.load(f"{routes}.rank-{r}")["layers"] for r in (0, 1)]
    assert sorted(k for r in ranks for k in r) == sorted(one) and all(ranks), [sorted(r) for r in ranks]
    for recorded in ranks:
        for key, forwards in recorded.items():
            assert len(forwards) == len(one[key]) == 2 * 4 + 4  # 4 micro-batches a step, 4 in the evaluation
            assert all(torch.equal(a, b) for a, b in zip(forwards, one[key])), key

    def counts(run_dir):
        return [[m[k] for k in sorted(m) if k.endswith("tokens_per_expert")] for m in read_metrics(run_dir)]

    other = [*run, *pp, "model.init_std=0.04"]
    run_cli([*two, *other, f"train.run_dir={tmp_path / 'rep'}", "moe.router_replay_mode=replay",
             f"moe.router_replay_path={routes}"])  # fmt: skip
    run_cli([*two, *other, f"train.run_dir={tmp_path / 'free'}"])
    recorded, replayed, free = counts(tmp_path / "rec"), counts(tmp_path / "rep"), counts(tmp_path / "free")
    assert len(recorded) == 2 and len(recorded[0]) == 4  # three MoE layers and the MTP block
    assert replayed == recorded and free != recorded
    losses = [m["loss"] for m in read_metrics(tmp_path / "rep")], [m["loss"] for m in read_metrics(tmp_path / "rec")]
    assert losses[0] != losses[1]  # other weights, the same experts


def test_torchrun_pipeline_trains_in_fp16(tmp_path):
    """pp2 in fp16 with dynamic loss scaling, 4 layers so that both stages hold MoE layers (routing losses weighted 1.0,
    so that their gradients count): the last stage's objective and the routing losses the first stage injects carry
    the scale, the gradients are unscaled before the norm. Step 1 against one process in fp16: the same loss, the
    grad norm within 5e-5 (measured 5.3e-7; with the first stage's injected gradient left unscaled it is 2% off)."""
    a, b = tmp_path / "a", tmp_path / "b"
    fp16 = [*COMMON, "model.num_layers=4", "moe.aux_loss_coeff=1.0", "train.steps=1", "train.precision=fp16"]
    fp16.append("checkpoint.interval=0")
    run_cli([*MOECORE, *fp16, f"train.run_dir={a}"])
    run_cli([*TORCHRUN[:4], "2", *TORCHRUN[5:], *fp16, f"train.run_dir={b}", "parallel.pp=2"])
    (ref,), (got,) = read_metrics(a), read_metrics(b)
    assert abs(got["loss"] - ref["loss"]) <= 1e-5 * ref["loss"], (ref["loss"], got["loss"])
    assert abs(got["grad_norm"] - ref["grad_norm"]) <= 5e-5 * ref["grad_norm"], (ref["grad_norm"], got["grad_norm"])
