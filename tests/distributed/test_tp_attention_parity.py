"""Tensor parallel for multi-latent and sparse attention, gated DeltaNet, MTP and attention sinks trains like
the one-process run.

3 steps' losses, grad norms and every first-step gradient (relative 1e-5, fp32, gloo on CPU) of the
shared harness (dist_parity.py) on the tiny models of attn_variants.py:
- `mla`: DeepSeek-V3 style MLA with the q LoRA (q_a_proj + norm, q_b_proj) and one MTP layer;
- `mla-noq`: MLA without the q LoRA (a column-parallel q_proj straight from the hidden states), with the
  up-projection, attention core and norms recomputed in backward;
- `dsa`: DeepSeek-V3.2 sparse attention (top-3 of 8 tokens) in the sparse stage, its indexer loss included
  (and one forward/backward of the dense_warmup stage, where only the indexers learn);
- `glm5`: GLM-5's sparse attention (interleaved indexer RoPE, a shared layer reusing the top-k of the one before);
- `deltanet`: Qwen3-Next style gated DeltaNet + gated attention layers and one MTP layer;
- `oss`: gpt-oss's attention sinks (sharded by head), sliding windows and biased experts;
- `minimax`: MiniMax-M2's q/k norms over the whole projection (weights split with the heads, the mean of squares
  all-reduced over TP, forward and backward).
Each layout's own seeded initialisation is also checked to give every rank its shard of the one-process
weights bit for bit, and the planner to count each rank's parameters exactly. Layouts: tp2 with and without sequence parallel, and tp2 x ep2 (4 processes) for MLA + MTP.
The harness's objective is the LM loss plus `aux_loss`; the MTP and indexer losses are folded into it here.
"""

from __future__ import annotations

import copy

import pytest
import torch
from attn_variants import (
    deltanet_config,
    dsa_config,
    glm5_config,
    minimax_config,
    mla_config,
    oss_config,
    with_indexer_in_aux,
)
from dist_parity import build, compare, make_data, make_dims, reference, run_layout

from moecore.models.transformer import MoETransformer
from moecore.parallel.launch import run_local
from moecore.parallel.layout import check_layout
from moecore.parallel.sharding import get_shard
from moecore.plan.layout import layout_of
from moecore.plan.params import param_entries

pytestmark = pytest.mark.distributed

TOL = 1e-5


def _recompute(cfg):
    cfg.model.recompute_modules = ["mla_up_proj", "core_attn", "norm"]  # recomputed in backward, same maths
    return cfg


VARIANTS = {
    "mla": mla_config,
    "mla-noq": lambda: _recompute(mla_config(q_lora=False, mtp=False)),
    "dsa": dsa_config,
    "glm5": glm5_config,
    "deltanet": deltanet_config,
    "oss": oss_config,
    "minimax": minimax_config,
}

# world -> name -> (parallel overrides, variant)
LAYOUTS = {
    2: {
        "mla-tp2-sp": ({"tp": 2}, "mla"),
        "mla-noq-tp2-nosp": ({"tp": 2, "sequence_parallel": False}, "mla-noq"),
        "dsa-tp2-sp": ({"tp": 2}, "dsa"),
        "glm5-tp2-sp": ({"tp": 2}, "glm5"),
        "deltanet-tp2-sp": ({"tp": 2}, "deltanet"),
        "deltanet-tp2-nosp": ({"tp": 2, "sequence_parallel": False}, "deltanet"),
        "oss-tp2-sp": ({"tp": 2}, "oss"),
        "minimax-tp2-sp": ({"tp": 2}, "minimax"),
    },
    4: {"mla-tp2xep2-sp": ({"tp": 2, "ep": 2}, "mla")},
}


def _config(variant: str, par: dict | None = None):
    cfg = VARIANTS[variant]()
    for k, v in (par or {}).items():
        setattr(cfg.parallel, k, v)
    cfg.validate()
    return cfg


@pytest.fixture(scope="module", autouse=True)
def _mtp_objective():
    with pytest.MonkeyPatch.context() as mp:  # forked workers inherit the patched class
        mp.setattr(MoETransformer, "forward", with_indexer_in_aux(MoETransformer.forward))
        yield


def _seeded_mismatches(rank: int, world: int, cfg, full: dict) -> tuple[list[str], int, int]:
    """Parameters whose seeded initialisation on this rank differs from its shard of the one-process init; the
    rank's parameter count and the planner's (moecore/plan/params.py)."""
    torch.manual_seed(1000 + rank)  # torch's own stream differs per rank: the seeded init must not use it
    model = MoETransformer(copy.deepcopy(cfg), make_dims(cfg, rank, world))
    bad = [n for n, p in model.named_parameters() if not torch.equal(p.detach(), get_shard(p).local_of(full[n]))]
    planned = sum(e.numel for e in param_entries(cfg, layout_of(cfg, world)))
    return bad, sum(p.numel() for p in model.parameters()), planned


def _dsa_warmup(dims, init: dict, data) -> tuple[float, dict]:
    """DSA's dense_warmup stage, one forward/backward: (the objective = the indexer loss, the indexers' gradients).
    Every other parameter is frozen; the indexers are whole on every rank, so their gradients need no reduction."""
    cfg = dsa_config("dense_warmup")
    if dims is not None:
        cfg.parallel.tp = dims.tp
    model = build(cfg, dims, init)
    ids, labels, mask = data[0]
    out = model(ids[:2], labels=labels[:2], loss_mask=mask[:2])
    out.loss.backward()
    return float(out.loss.detach()), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


def _run_all(rank: int, world: int, cases: dict, refs: dict, data) -> dict:
    out = {}
    if world == 2:
        out["dsa-warmup"] = _dsa_warmup(make_dims(_config("dsa", {"tp": 2}), rank, world), refs["dsa"][0], data)
    for name, (par, v) in cases.items():
        cfg = _config(v, par)
        out[name] = run_layout(rank, world, cfg, refs[v][0], data)
        out[name]["seeded_mismatches"] = _seeded_mismatches(rank, world, cfg, refs[v][0])
    return out


@pytest.fixture(scope="module")
def refs():
    data = make_data()
    return data, {v: reference(_config(v), data) for v in VARIANTS}


def test_layouts_are_accepted():
    for cases in LAYOUTS.values():
        for par, variant in cases.values():
            check_layout(_config(variant, par))


@pytest.mark.parametrize("world", sorted(LAYOUTS))
def test_tp_matches_single_process(world, refs):
    data, ref = refs
    results = run_local(_run_all, world, LAYOUTS[world], ref, data)
    report = {}
    if "dsa-warmup" in results[0]:
        want_loss, want_grads = _dsa_warmup(None, ref["dsa"][0], data)
        for got in results:
            loss, grads = got.pop("dsa-warmup")
            assert abs(loss - want_loss) <= TOL * abs(want_loss) and grads.keys() == want_grads.keys()
            for n, g in grads.items():
                assert float((g - want_grads[n]).norm() / want_grads[n].norm()) <= TOL, n
    for name, got in results[0].items():
        r = report[name] = compare(ref[LAYOUTS[world][name][1]][1], got)
        print(f"{name}: loss {r['loss']:.1e} norm {r['norm']:.1e} grad {r['grad']:.1e} ({r['grad_param']})")
    bad = {n: r for n, r in report.items() if max(r["loss"], r["norm"], r["grad"]) > TOL}
    assert not bad, bad
    for rank, got in enumerate(results):
        for name in report:  # every rank reports the same losses
            assert got[name]["losses"] == pytest.approx(results[0][name]["losses"], rel=1e-12)
            # seeded init (moecore/models/init.py) gives every rank its shard of the one-process weights
            bad, held, planned = got[name]["seeded_mismatches"]
            assert not bad, (name, rank, bad)
            assert held == planned, (name, rank, held, planned)  # the planner's count of this rank's parameters
