"""Distributed Muon: each matrix orthogonalised once, on one rank, from its whole update; parity with one process.

Against the one-process Muon run of the tiny MoE of dist_parity (fp32, 3 steps, clipping active,
same initial weights and batches), these layouts give the same losses and grad norms (relative
<= 1e-5): tp2 x ep2, ep2 x etp2, fsdp dp2 x tp2 (4 ranks), fsdp dp2, dp2 (2 ranks). Also:

- every matrix (a dense weight, or one expert of a grouped weight) has exactly one owner over the
  ranks of the stage, and every rank owns some;
- the distributed optimizer with Muon (dp2, dp4 x ep2, tp2 x ep2; bf16 compute weights on fp32
  master shards at dp2 against plain dp2 Muon in bf16, and within BF16_TOL of the one-process bf16 Muon)
  gives the same; per rank it keeps 1/dp of
  the fp32 masters, the momentum and the AdamW moments (up to one bucket);
- MuonClip's QK-Clip (tau below the model's logits) under tp2 x ep2, fsdp dp2 x tp2 and the
  distributed optimizer dp4 x ep2: the same losses, grad norms and recorded max logits;
- a single process has no plan (every matrix whole, the previous Muon's batched update);
- checkpoints with Muon state reshard: tp2 x ep2 -> fsdp dp2, -> one process; distributed optimizer
  dp4 x ep2 -> tp2 x ep2 (plain), -> distributed optimizer dp2; steps 2-3 equal the unchanged run's.
"""

from __future__ import annotations

import copy

import pytest
import torch
import zero_harness as zh
from dist_parity import full_state, make_data, tiny_config

from moecore.config import OptimConfig
from moecore.models.transformer import MoETransformer
from moecore.optim.muon import build_muon
from moecore.parallel.launch import run_local

pytestmark = pytest.mark.distributed

TOL = 1e-5
BF16_TOL = 5e-3  # bf16 runs against one process (see test_distributed_optimizer_bf16_masters)
TAU = 0.02  # QK-Clip threshold below the tiny model's max logits (1.25 at step 1): every step clips


def _rel(got: list[float], want: list[float]) -> float:
    return max(abs(a - b) / abs(b) for a, b in zip(got, want))


def _world4(rank: int, world: int, init: dict, data, d: dict) -> dict:
    out = {
        "tp2xep2": zh.train(rank, world, {"tp": 2, "ep": 2}, init, data, dist_opt=False, muon=True, ckpt=d["M"]),
        "ep2xetp2": zh.train(rank, world, {"ep": 2, "etp": 2}, init, data, dist_opt=False, muon=True),
        "fsdp-dp2xtp2": zh.train(rank, world, {"tp": 2}, init, data, fsdp=True, muon=True),
        "dist-tp2xep2": zh.train(rank, world, {"tp": 2, "ep": 2}, init, data, muon=True),
        "dist-dp4xep2": zh.train(rank, world, {"ep": 2}, init, data, muon=True, ckpt=d["D"]),
    }
    for name, par, kw in (
        ("clip-tp2xep2", {"tp": 2, "ep": 2}, {"dist_opt": False}),
        ("clip-fsdp-dp2xtp2", {"tp": 2}, {"fsdp": True}),
        ("clip-dist-dp4xep2", {"ep": 2}, {}),
    ):
        out[name] = zh.train(rank, world, par, init, data, muon=True, qk_clip=TAU, **kw)
    out["D->tp2xep2"] = zh.resume(rank, world, {"tp": 2, "ep": 2}, d["D"], data, dist_opt=False, muon=True)
    return out


def _world2(rank: int, world: int, init: dict, data, d: dict) -> dict:
    return {
        "fsdp-dp2": zh.train(rank, world, {}, init, data, fsdp=True, muon=True),
        "dp2": zh.train(rank, world, {}, init, data, dist_opt=False, muon=True),
        "dist-dp2": zh.train(rank, world, {}, init, data, muon=True),
        "dist-dp2-bf16": zh.train(rank, world, {}, init, data, muon=True, bf16=True),
        "dp2-bf16": zh.train(rank, world, {}, init, data, dist_opt=False, muon=True, bf16=True),
        "M->fsdp-dp2": zh.resume(rank, world, {}, d["M"], data, dist_opt=False, fsdp=True, muon=True),
        "D->dist-dp2": zh.resume(rank, world, {}, d["D"], data, dist_opt=True, muon=True),
    }


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("muon")
    d = {"M": str(tmp / "M"), "D": str(tmp / "D")}
    data = make_data()
    torch.manual_seed(0)
    init = full_state(MoETransformer(copy.deepcopy(tiny_config()), None))
    res = {"ref": zh.train(0, 1, {}, init, data, dist_opt=False, muon=True)}
    res["ref-clip"] = zh.train(0, 1, {}, init, data, dist_opt=False, muon=True, qk_clip=TAU)
    res["ref-bf16"] = zh.train(0, 1, {}, init, data, dist_opt=False, muon=True, bf16=True)
    res["world4"] = run_local(_world4, 4, init, data, d)
    res["world2"] = run_local(_world2, 2, init, data, d)
    res["M->single"] = zh.resume(0, 1, {}, d["M"], data, dist_opt=False, muon=True)
    return res


@pytest.mark.parametrize(
    ("world", "name"),
    [
        (4, "tp2xep2"),
        (4, "ep2xetp2"),
        (4, "fsdp-dp2xtp2"),
        (4, "dist-tp2xep2"),
        (4, "dist-dp4xep2"),
        (2, "fsdp-dp2"),
        (2, "dp2"),
        (2, "dist-dp2"),
    ],
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


@pytest.mark.parametrize("name", ["clip-tp2xep2", "clip-fsdp-dp2xtp2", "clip-dist-dp4xep2"])
def test_qk_clip_parity(results, name):
    """MuonClip under tp (each rank its heads), fsdp (row shards) and the distributed optimizer (master shards)."""
    ref, got = results["ref-clip"], results["world4"][0][name]
    assert max(ref["max_logit"]) > TAU and ref["losses"][1] != results["ref"]["losses"][1]  # it clipped
    loss, norm = _rel(got["losses"], ref["losses"]), _rel(got["norms"], ref["norms"])
    logit = _rel(got["max_logit"], ref["max_logit"])
    print(f"muon {name}: loss {loss:.1e} grad norm {norm:.1e} max logit {logit:.1e}")
    assert loss <= TOL and norm <= TOL and logit <= TOL, (name, loss, norm, logit)


def test_single_process_plan_is_local(results):
    ref = results["ref"]
    assert ref["muon_owned"] == ref["muon_matrices"] == 0  # one process: no plan, every matrix whole


def test_distributed_optimizer_bf16_masters(results):
    """bf16 compute weights, fp32 master shards: as plain dp2 Muon in bf16 (the same layout) exactly, and near the
    one-process bf16 Muon. Against one process the dp2 gradients are averaged over two ranks (another fp32 sum
    order, 1e-7 at step 1); Muon's orthogonalised update carries that into the fp32 masters, and the bf16 compute
    weights cast from them differ in the odd last bit, which moves later steps. Measured: within 1e-5 on the CI
    machines of earlier runs, loss 1.9e-4 and grad norm 1.1e-3 on a CPU with AVX-512 and AMX (where AdamW's dp2
    run stays within 1e-7: test_distributed_optimizer.py), hence BF16_TOL against one process."""
    ref, got = results["ref-bf16"], results["world2"][0]["dist-dp2-bf16"]
    plain = results["world2"][0]["dp2-bf16"]
    loss, norm = _rel(got["losses"], plain["losses"]), _rel(got["norms"], plain["norms"])
    print(f"muon dist-dp2-bf16 against plain dp2: loss {loss:.1e} grad norm {norm:.1e}")
    assert loss <= TOL and norm <= TOL, (loss, norm)
    loss, norm = _rel(got["losses"], ref["losses"]), _rel(got["norms"], ref["norms"])
    print(f"muon dist-dp2-bf16 against one process: loss {loss:.1e} grad norm {norm:.1e}")
    assert loss <= BF16_TOL and norm <= BF16_TOL, (loss, norm)


def test_distributed_optimizer_shards_muon_state(results):
    """Per rank, 1/dp of: an fp32 master (4 B) + Muon momentum (4 B) or AdamW moments (8 B) per parameter.

    Up to one bucket (padding to the group size and the AdamW step counters).
    """
    model = MoETransformer(copy.deepcopy(tiny_config()), None)
    opt = build_muon(model, OptimConfig(name="muon"))
    muon = sum(p.numel() for g in opt.optimizers[0].param_groups for p in g["params"])
    total = sum(p.numel() for p in model.parameters())
    want = (4 * total + 4 * muon + 8 * (total - muon)) / 2
    for r in results["world2"]:
        got = r["dist-dp2"]["memory"]["optim"]
        print(f"muon dist-dp2 optimizer state: {got} B per rank, 1/dp of the total: {want:.0f} B")
        assert abs(got - want) <= zh.BUCKET_MB * 2**20, (got, want)
        assert r["dist-dp2"]["memory"]["grads"] <= 4 * total / 2 + zh.BUCKET_MB * 2**20  # reduced shards


@pytest.mark.parametrize(
    ("where", "name"),
    [("world2", "M->fsdp-dp2"), (None, "M->single"), ("world4", "D->tp2xep2"), ("world2", "D->dist-dp2")],
)
def test_muon_checkpoint_reshards(results, where, name):
    ref = results["ref"]
    got = results[where][0][name] if where else results[name]
    assert got["step"] == 1
    loss, norm = _rel(got["losses"], ref["losses"][1:]), _rel(got["norms"], ref["norms"][1:])
    print(f"muon {name}: loss {loss:.1e} grad norm {norm:.1e}")
    assert loss <= TOL and norm <= TOL, (name, loss, norm)
