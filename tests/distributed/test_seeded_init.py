"""Same `train.seed`, same model on every layout: each rank's shards equal the single process's tensors
bit for bit, and the first training step's loss matches (relative 1e-6, fp32), without any weights
being copied from the reference. Torch's own generator is seeded differently on every rank to show
that the initialisation does not depend on it."""

from __future__ import annotations

import copy

import pytest
import torch
from dist_parity import full_state, make_data, make_dims, tiny_config, train_steps

from moecore.models.transformer import MoETransformer
from moecore.parallel.launch import run_local
from moecore.parallel.sharding import get_shard

pytestmark = pytest.mark.distributed

SEED = 7
LAYOUTS = {
    2: {"dp2": {}, "tp2": {"tp": 2}, "ep2": {"ep": 2}, "etp2": {"etp": 2}},
    4: {"tp2xep2": {"tp": 2, "ep": 2}, "ep2xetp2": {"ep": 2, "etp": 2}},
}


def _config(par: dict):
    cfg = tiny_config()
    cfg.train.seed = SEED
    for k, v in par.items():
        setattr(cfg.parallel, k, v)
    return cfg


def _ranks(rank: int, world: int, cases: dict, ref_state: dict, data) -> dict:
    out = {}
    for name, par in cases.items():
        cfg = _config(par)
        torch.manual_seed(1000 + rank)  # a different torch stream on every rank: must not matter
        dims = make_dims(cfg, rank, world)
        model = MoETransformer(copy.deepcopy(cfg), dims)
        mismatched = [
            n for n, p in model.named_parameters() if not torch.equal(p.detach(), get_shard(p).local_of(ref_state[n]))
        ]
        out[name] = {"mismatched": mismatched, "loss": train_steps(model, dims, data, steps=1)["losses"][0]}
    return out


@pytest.fixture(scope="module")
def reference():
    data = make_data()
    torch.manual_seed(0)
    model = MoETransformer(copy.deepcopy(_config({})), None)
    state = full_state(model)
    return data, state, train_steps(model, None, data, steps=1)["losses"][0]


@pytest.mark.parametrize("world", sorted(LAYOUTS))
def test_every_layout_starts_from_the_single_process_weights(world, reference):
    data, state, ref_loss = reference
    results = run_local(_ranks, world, LAYOUTS[world], state, data)
    for rank, res in enumerate(results):
        for name, r in res.items():
            assert not r["mismatched"], f"{name} rank {rank}: shards differ from the single process: {r['mismatched']}"
            assert abs(r["loss"] - ref_loss) <= 1e-6 * abs(ref_loss), f"{name}: step-1 loss {r['loss']} != {ref_loss}"


def test_the_seed_changes_the_weights_and_torch_rng_does_not():
    cfg = _config({})
    torch.manual_seed(1)
    a = full_state(MoETransformer(copy.deepcopy(cfg), None))
    torch.manual_seed(2)
    b = full_state(MoETransformer(copy.deepcopy(cfg), None))
    cfg.train.seed = SEED + 1
    c = full_state(MoETransformer(copy.deepcopy(cfg), None))
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["layers.1.mlp.experts.w13"], c["layers.1.mlp.experts.w13"])
