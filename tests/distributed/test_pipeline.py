"""Pipeline parallel: layouts and refusals (no processes), and every layout trains like the one-process run.

Parity cases (tests/distributed/pipeline_parity.py): 3 steps from the reference's initial weights,
fp32, gloo on CPU; losses and grad norms within relative 1e-5 of the one-process run, first-step
gradients of every parameter on every rank within relative 1e-5 (norm-wise). The cases of one world
size run in one launch (process start-up is the cost). Models: the tiny MoE of dist_parity with 4
layers (dense layer 0), a DeltaNet hybrid, tied embeddings, and a DeepSeek-V3-style model (MLA,
sigmoid router with expert bias and sequence aux loss, one MTP layer) with MTP in its own stage and
an uneven layout.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from attn_variants import v4_config
from dist_parity import make_data, make_dims, tiny_config
from pipeline_parity import reference, resume_same_layout, run_pipeline, worst

from moecore.config import Config, ConfigError
from moecore.parallel.launch import run_local
from moecore.parallel.layout import validate_layout
from moecore.parallel.pipeline import parallelize_pipeline
from moecore.parallel.pipeline_layout import expand_layout, parse_layout, stage_layout, stage_ranks
from moecore.plan.layout import Layout
from moecore.plan.memory import in_flight
from moecore.plan.params import param_summary
from moecore.plan.schedule_memory import held_chunks

pytestmark = pytest.mark.distributed

STEPS = 3


# ------------------------------------------------------------------ layouts (no processes)
def test_layout_grammar_expands_megatron_notation():
    assert expand_layout("Et*3|(tt|)*2,m|L") == "Ettt|tt|tt|m|L"
    assert expand_layout("E, t | ((t)*2|)*2 L") == "Et|tt|tt|L"
    stages = parse_layout("Et*3|(tt|)*2,m|L", 5, 7, 1)
    assert [s.symbols for s in stages] == ["Ettt", "tt", "tt", "m", "L"]
    assert stages[2].layers == (5, 6) and stages[3].mtp and stages[4].loss and stages[0].embed


@pytest.mark.parametrize(
    "layout, stages, layers, mtp, message",
    [
        ("Ett|tt|L", 3, 5, 0, "it has 4 decoder layers 't', model.num_layers = 5"),
        ("Ett||ttL", 3, 4, 0, "stage 1 is empty"),
        ("Ett|mt|tL", 3, 4, 1, "an MTP layer 'm' comes before a decoder layer 't'"),
        ("tEt|ttL", 2, 4, 0, "'E' (embedding) must appear once, first in stage 0"),
        ("Ett|tLt", 2, 4, 0, "'L' (norm + head + loss) must appear once, last in the last stage"),
        ("Ett|ttL", 4, 4, 0, "it has 2 stages, parallel.pp * parallel.vpp = 4"),
        ("Ett|m|tt|m|L", 5, 4, 2, "the MTP layers 'm' must sit together in one stage"),
        ("Ett|tx|L", 3, 4, 0, "unknown symbol 'x'"),
        ("Ett|(tt|L", 3, 4, 0, "unbalanced"),
    ],
)
def test_bad_layouts_are_refused_in_one_line(layout, stages, layers, mtp, message):
    with pytest.raises(ConfigError, match="parallel.pp_layout=") as err:
        parse_layout(layout, stages, layers, mtp)
    assert message in str(err.value) and "\n" not in str(err.value)


def _cfg(**parallel) -> Config:
    cfg = tiny_config()
    cfg.model.num_layers = 4
    if "m" in parallel.get("pp_layout", ""):
        cfg.model.mtp_num_layers = 1
    for k, v in parallel.items():
        setattr(cfg.parallel, k, v)
    return cfg


@pytest.mark.parametrize(
    "parallel, world, message",
    [
        ({"pp": 3}, 3, "model.num_layers=4 is not divisible by parallel.pp * parallel.vpp = 3"),
        ({"pp": 2, "vpp": 2}, 2, "parallel.pp_schedule='1f1b' runs one stage per rank"),
        ({"pp": 2, "pp_schedule": "zbv"}, 2, "parallel.pp_schedule='zbv' needs parallel.vpp=2"),
        ({"pp": 2, "vpp": 2, "pp_schedule": "interleaved_1f1b"}, 8, "needs micro-batches per step divisible by pp=2"),
        ({"pp": 4}, 8, "parallel.pp_schedule='1f1b' needs at least pp=4 micro-batches per step, got 2"),
        ({"vpp": 2}, 1, "parallel.vpp=2 is invalid: needs parallel.pp > 1"),
        ({"pp": 2, "pp_schedule": "gpipe"}, 2, "parallel.pp_schedule='gpipe' is invalid"),
        (
            {"pp": 2, "vpp": 2, "pp_schedule": "zbv", "pp_layout": "Ett|t|t|mL", "fsdp": True},
            2,
            "puts two stages that use the embed weight on one pipeline rank",  # V: stages 0 and 3 on rank 0
        ),
        (
            {"pp": 2, "vpp": 2, "pp_schedule": "interleaved_1f1b", "pp_layout": "Ett|tt|m|L", "fsdp": True},
            2,
            "puts two stages that use the embed weight on one pipeline rank",
        ),
    ],
)
def test_schedules_refuse_what_they_cannot_run(parallel, world, message):
    cfg = _cfg(**parallel)  # global batch 8 of micro-batches of 2: 4 / data-parallel size per pipeline
    with pytest.raises(ConfigError) as err:
        validate_layout(cfg, world)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_pipeline_groups_join_one_rank_per_stage():
    from moecore.parallel.dims import _mesh_groups

    # world 8 = tp 2 x dp 2 x pp 2 (dense mesh tp, cp, dp, pp): stage 0 is ranks 0-3, stage 1 ranks 4-7.
    assert _mesh_groups(8, [2, 1, 2, 2], 3) == [[0, 4], [1, 5], [2, 6], [3, 7]]  # pp
    assert _mesh_groups(8, [2, 1, 2, 2], (0, 1, 2)) == [[0, 1, 2, 3], [4, 5, 6, 7]]  # stage
    # The expert mesh (etp 1, ep 2, edp 2, pp 2) has the same stages: pp is outermost in both.
    assert _mesh_groups(8, [1, 2, 2, 2], (0, 1, 2)) == [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_default_split_and_stage_placement():
    cfg = _cfg(pp=2, vpp=2, pp_schedule="interleaved_1f1b")
    assert [s.symbols for s in stage_layout(cfg)] == ["Et", "t", "t", "tL"]
    assert stage_ranks(4, 2, "interleaved_1f1b") == [0, 1, 0, 1]
    assert stage_ranks(4, 2, "zbv") == [0, 1, 1, 0]  # V: the first and last stage share rank 0


# ------------------------------------------------------------------ parity
def _deepseek_v3(layout: str, **parallel) -> Config:
    cfg = tiny_config(
        router_score_function="sigmoid",
        router_enable_expert_bias=True,
        router_bias_update_rate=0.05,
        router_load_balancing_type=["aux_loss", "seq_aux_loss"],
        aux_loss_coeff=[1e-2, 1e-2],
    )
    m = cfg.model
    m.num_layers, m.num_kv_heads, m.attention_type = 3, 4, "mla"
    m.q_lora_rank, m.kv_lora_rank, m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim = 24, 16, 12, 8, 10
    m.mtp_num_layers, m.mtp_loss_scaling_factor = 1, 0.3
    cfg.parallel.pp_layout = layout
    for k, v in parallel.items():
        setattr(cfg.parallel, k, v)
    return cfg


def _hybrid(**parallel) -> Config:
    cfg = _cfg(**parallel)
    m = cfg.model
    m.layer_types = ["linear_attention", "full_attention", "linear_attention", "full_attention"]
    m.linear_num_key_heads, m.linear_num_value_heads, m.linear_key_head_dim, m.linear_value_head_dim = 2, 4, 8, 8
    m.linear_chunk_size = 4
    return cfg


def _recompute(granularity: str, modules: list[str], **parallel) -> Config:
    cfg = _cfg(**parallel)
    cfg.model.recompute_granularity, cfg.model.recompute_modules = granularity, modules
    return cfg


def _global_aux(**parallel) -> Config:
    """Full recomputation with global_aux_loss: a recomputed layer must use the averaged counts its forward used."""
    cfg = _recompute("full", [], **parallel)
    cfg.moe.router_load_balancing_type, cfg.moe.aux_loss_coeff = "global_aux_loss", 0.5
    return cfg


def _tied(**parallel) -> Config:
    cfg = _cfg(**parallel)
    cfg.model.tie_embeddings = True
    return cfg


def _v4(**parallel) -> Config:
    """DeepSeek-V4's layers (hyper-connection streams between stages, a hash-routed first layer reading the token
    ids, the streams' collapse on the last stage)."""
    cfg = v4_config(num_layers=4)
    for k, v in parallel.items():
        setattr(cfg.parallel, k, v)
    return cfg


ZB, IL, V = "zero_bubble", "interleaved_1f1b", "zbv"
# Every schedule runs on several layouts; each layout named in docs/parallel.md runs under at least one schedule.
CASES = {
    2: {
        "pp2-vpp2-interleaved": _cfg(pp=2, vpp=2, pp_schedule=IL),
        "pp2-vpp2-dualpipev": _cfg(pp=2, vpp=2, pp_schedule="dualpipev"),
        "pp2-vpp2-tied-embeddings-zbv": _tied(pp=2, vpp=2, pp_schedule=V),  # head and embedding on one rank
        "pp2-tied-embeddings-1f1b": _tied(pp=2),  # head and embedding on two ranks: gradients summed
        "pp2-vpp2-deltanet-hybrid-interleaved": _hybrid(pp=2, vpp=2, pp_schedule=IL),
        "pp2-zero_bubble-full-recompute": _recompute("full", [], pp=2, pp_schedule=ZB),
        "pp2-vpp2-zbv-full-recompute-global-aux-loss": _global_aux(pp=2, vpp=2, pp_schedule=V),
        "pp2-vpp2-zbv-selective-recompute": _recompute(
            "selective", ["moe", "norm", "core_attn"], pp=2, vpp=2, pp_schedule=V
        ),
        "deepseek-v3-mtp-stage-pp2-vpp2-zero_bubble": _deepseek_v3("Et|tt|m|L", pp=2, vpp=2, pp_schedule=ZB),
        "deepseek-v4-pp2-vpp2-zbv": _v4(pp=2, vpp=2, pp_schedule=V),
    },
    4: {
        "pp4-1f1b": _cfg(pp=4),
        "pp2-ep2-zero_bubble": _cfg(pp=2, ep=2, pp_schedule=ZB),
        "pp2-tp2-vpp2-interleaved": _cfg(pp=2, tp=2, vpp=2, pp_schedule=IL),
        "pp2-dp2-1f1b": _cfg(pp=2),
        "deepseek-v3-mtp-stage-pp4-1f1b": _deepseek_v3("Et|tt|m|L", pp=4),
        "deepseek-v3-pp2-ep2-vpp2-interleaved": _deepseek_v3("Et|t|t|mL", pp=2, ep=2, vpp=2, pp_schedule=IL),
        "deepseek-v4-pp2-ep2-1f1b": _v4(pp=2, ep=2),
    },
}


def _run_cases(rank: int, world: int, cases: list) -> list[dict]:
    out = []
    for cfg, init, data, grads in cases:
        out.append(run_pipeline(rank, world, cfg, init, data, STEPS, grads))
        dist.barrier()
    return out


@pytest.mark.parametrize("world", sorted(CASES))
def test_pipeline_layouts_train_like_one_process(world):
    data = make_data()
    names, refs, cases = [], [], []
    for name, cfg in CASES[world].items():
        cfg = copy.deepcopy(cfg)
        validate_layout(cfg, world)
        init, ref = reference(cfg, data, STEPS)
        names.append(name)
        refs.append(ref)
        cases.append((cfg, init, data, ref["grads"]))
    results = run_local(_run_cases, world, cases, timeout_s=600)
    failures = []
    for i, (name, ref) in enumerate(zip(names, refs)):
        w = worst(ref, [r[i] for r in results])
        if not (w["loss"] <= 1e-5 and w["norm"] <= 1e-5 and w["grad"] <= 1e-5):
            failures.append(f"{name}: {w}")
    assert not failures, "\n".join(failures)
    # Stages hold different parts: parameter counts differ between pipeline ranks of one layout.
    assert len({r[0]["params"] for r in results}) > 1


def _peak_in_flight(rank: int, world: int, schedule: str, vpp: int, microbatches: int) -> int:
    """The most stage micro-batches this rank held at once in one step (moecore.parallel.pipeline's count)."""
    cfg = tiny_config()
    cfg.model.num_layers = 8
    cfg.parallel.pp, cfg.parallel.vpp, cfg.parallel.pp_schedule = world, vpp, schedule
    cfg.train.global_batch_size = microbatches * cfg.train.micro_batch_size
    pipe = parallelize_pipeline(cfg, make_dims(cfg, rank, world), "cpu")
    n = cfg.train.global_batch_size
    ids = torch.randint(0, cfg.model.vocab_size, (n, cfg.train.seq_length), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(n, cfg.train.seq_length)
    return pipe.step(ids, ids, mask, mask.sum().double(), 1.0, 1.0 / microbatches, microbatches).peak_live


@pytest.mark.parametrize("schedule, vpp", [("1f1b", 1), ("interleaved_1f1b", 2)])
def test_planner_in_flight_is_what_the_schedule_holds(schedule, vpp):
    """`moecore plan`'s micro-batches in flight per pipeline rank (moecore/plan/memory.py `in_flight`, in units of the
    rank's share of the layers) times vpp: the stage micro-batches each rank of a real pipeline step held at once
    (pp 2, 4 micro-batches: 1F1B 2 / 1, interleaved 5 / 3 chunks; the earlier formula, exact on the first rank
    only, said 2 chunks for the last)."""
    pp, m = 2, 4
    held = run_local(_peak_in_flight, pp, schedule, vpp, m)
    assert held == [in_flight(Layout(pp=pp, vpp=vpp), r, m) * vpp for r in range(pp)]


@pytest.mark.parametrize("schedule", ["interleaved_1f1b", "zero_bubble", "zbv", "dualpipev"])
def test_schedule_order_walk_counts_what_the_pipeline_held(schedule):
    """moecore/plan/schedule_memory.py walks torch's order of a schedule; ended at the input-gradient pass (what
    moecore.parallel.pipeline counts) its per-rank counts are what a real step held (pp 2, vpp 2, 4 micro-batches),
    and ended at the weight pass, as the planner uses them, they are never fewer."""
    pp, m = 2, 4
    held = run_local(_peak_in_flight, pp, schedule, 2, m)
    assert list(held_chunks(schedule, pp, 2, m, until_weight=False)) == held
    until_weight = held_chunks(schedule, pp, 2, m)
    assert all(w >= i for w, i in zip(until_weight, held))
    assert [in_flight(Layout(pp=pp, vpp=2), r, m, schedule) * 2 for r in range(pp)] == list(until_weight)


def _rank_params(rank: int, world: int, schedule: str, vpp: int) -> int:
    cfg = tiny_config()
    cfg.model.num_layers = 8
    cfg.parallel.pp, cfg.parallel.vpp, cfg.parallel.pp_schedule = world, vpp, schedule
    return parallelize_pipeline(cfg, make_dims(cfg, rank, world), "cpu").num_params()


@pytest.mark.parametrize("schedule, vpp", [("1f1b", 1), ("interleaved_1f1b", 2), ("zbv", 2)])
def test_planner_places_the_stages_as_the_schedule_does(schedule, vpp):
    """`moecore plan`'s parameters per pipeline rank equal a built pipeline's: the embedding on rank 0 and the head on
    the last rank, or both on rank 0 under the V schedules (rank r holds stages r and 2 * pp - 1 - r)."""
    pp = 2
    built = run_local(_rank_params, pp, schedule, vpp)
    cfg = tiny_config()
    cfg.model.num_layers = 8
    cfg.parallel.pp_schedule = schedule
    assert [param_summary(cfg, Layout(pp=pp, vpp=vpp), r).total for r in range(pp)] == built


def test_pipeline_checkpoint_resumes_under_the_same_layout(tmp_path):
    """pp2 x ep2 x vpp2 (stages holding different parameters, optimizer state per parameter name)."""
    cfg = _deepseek_v3("Et|t|t|mL", pp=2, ep=2, vpp=2, pp_schedule=IL)
    data = make_data()
    init = reference(cfg, data, 0)[0]
    results = run_local(resume_same_layout, 4, cfg, init, data, str(tmp_path / "ckpt"))
    for r in results:
        assert r["run"] == r["resumed"]


@pytest.mark.parametrize(
    "recipe, overrides, message",
    [
        (
            "tiny-glm-5",  # layers full / shared / full / shared, one MTP block
            ["parallel.pp=2", "parallel.pp_layout=Et|tttmL"],
            "opens stage 1 with layer 1, which is shared in model.indexer_types",
        ),
    ],
)
def test_pipeline_refuses_a_stage_opening_on_a_shared_indexer_layer(recipe, overrides, message):
    from moecore.config import load_config

    cfg = load_config(recipe, ["model.vocab_size=64", *overrides])
    with pytest.raises(ConfigError) as err:
        validate_layout(cfg, 2)
    assert message in str(err.value) and "\n" not in str(err.value)
    validate_layout(load_config(recipe, ["model.vocab_size=64", "parallel.pp=2"]), 2)  # the even split runs
