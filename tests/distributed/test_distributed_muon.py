"""Distributed Muon: each matrix orthogonalised once, on one rank, from its whole update; parity with one process.

Against the one-process Muon run of the tiny MoE of dist_parity (fp32, 3 steps, clipping active,
same initial weights and batches), these layouts give the same losses and grad norms (relative
<= 1e-5): tp2 x ep2, ep2 x etp2, fsdp dp2 x tp2 (4 ranks), fsdp dp2, dp2 (2 ranks). Also:

- every matrix (a dense weight, or one expert of a grouped weight) has exactly one owner over the
  ranks of the stage, and every rank owns some;
- the plan of a single process is local (no exchange) and its update is the previous Muon's
  (`newton_schulz` of the whole batched matrix);
- a checkpoint written by a Muon run at tp2 x ep2 after step 1 (momentum buffers sharded like the
  parameters) resumes at fsdp dp2 and on one process with the unchanged run's steps 2-3.
"""

from __future__ import annotations

import copy

import pytest
import torch
import zero_harness as zh
from dist_parity import full_state, make_data, tiny_config

from moecore.models.transformer import MoETransformer
from moecore.parallel.launch import run_local

pytestmark = pytest.mark.distributed

TOL = 1e-5


def _rel(got: list[float], want: list[float]) -> float:
    return max(abs(a - b) / abs(b) for a, b in zip(got, want))


def _world4(rank: int, world: int, init: dict, data, d: dict) -> dict:
    return {
        "tp2xep2": zh.train(rank, world, {"tp": 2, "ep": 2}, init, data, dist_opt=False, muon=True, ckpt=d["M"]),
        "ep2xetp2": zh.train(rank, world, {"ep": 2, "etp": 2}, init, data, dist_opt=False, muon=True),
        "fsdp-dp2xtp2": zh.train(rank, world, {"tp": 2}, init, data, fsdp=True, muon=True),
    }


def _world2(rank: int, world: int, init: dict, data, d: dict) -> dict:
    return {
        "fsdp-dp2": zh.train(rank, world, {}, init, data, fsdp=True, muon=True),
        "dp2": zh.train(rank, world, {}, init, data, dist_opt=False, muon=True),
        "M->fsdp-dp2": zh.resume(rank, world, {}, d["M"], data, dist_opt=False, fsdp=True, muon=True),
    }


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("muon")
    d = {"M": str(tmp / "M")}
    data = make_data()
    torch.manual_seed(0)
    init = full_state(MoETransformer(copy.deepcopy(tiny_config()), None))
    res = {"ref": zh.train(0, 1, {}, init, data, dist_opt=False, muon=True)}
    res["world4"] = run_local(_world4, 4, init, data, d)
    res["world2"] = run_local(_world2, 2, init, data, d)
    res["M->single"] = zh.resume(0, 1, {}, d["M"], data, dist_opt=False, muon=True)
    return res


@pytest.mark.parametrize(
    ("world", "name"), [(4, "tp2xep2"), (4, "ep2xetp2"), (4, "fsdp-dp2xtp2"), (2, "fsdp-dp2"), (2, "dp2")]
)
def test_parity_fp32(results, world, name):
    ref, ranks = results["ref"], results[f"world{world}"]
    got = ranks[0][name]
    loss, norm = _rel(got["losses"], ref["losses"]), _rel(got["norms"], ref["norms"])
    print(f"muon {name}: loss {loss:.1e} grad norm {norm:.1e}")
    assert loss <= TOL and norm <= TOL, (name, loss, norm)
    # each matrix once: the owners' counts over the ranks add up to the number of matrices
    owned = [r[name]["muon_owned"] for r in ranks]
    assert sum(owned) == got["muon_matrices"] and min(owned) > 0, owned


def test_single_process_plan_is_local(results):
    ref = results["ref"]
    assert ref["muon_owned"] == ref["muon_matrices"] == 0  # one process: no plan, every matrix whole


@pytest.mark.parametrize(("where", "name"), [("world2", "M->fsdp-dp2"), (None, "M->single")])
def test_muon_checkpoint_reshards(results, where, name):
    ref = results["ref"]
    got = results[where][0][name] if where else results[name]
    assert got["step"] == 1
    loss, norm = _rel(got["losses"], ref["losses"][1:]), _rel(got["norms"], ref["norms"][1:])
    print(f"muon {name}: loss {loss:.1e} grad norm {norm:.1e}")
    assert loss <= TOL and norm <= TOL, (name, loss, norm)
