"""The distributed Muon plan without processes: every member's view of 8 ranks (tp2 x ep2 x dp2 and etp2).

From the parameters' shard descriptions of 8 ranks (built here with `set_shard`, as the model does
under tp2 and ep2 x etp2 with dp2), the plan of each member must agree: every matrix (a dense
weight, or one expert) has exactly one owner, the owner holds part of it, every rank owns work,
the Newton-Schulz load per rank is balanced within one run of matrices, and the element counts a
member sends to each peer equal what that peer expects to receive from it, in both exchanges.
"""

from __future__ import annotations

import torch

from moecore.parallel.dims import Group
from moecore.parallel.distributed_muon import MatrixPlan, _describe
from moecore.parallel.sharding import set_shard

WORLD, H, F, E = 8, 32, 16, 8


def _rank_params(rank: int) -> list[tuple[str, torch.Tensor]]:
    """tp2 x dp2 x (ep2 x etp2 for experts) on 8 ranks: rank = tp + 2 * ep_etp-ish coordinates."""
    tp, etp, ep = rank % 2, rank % 2, (rank // 2) % 2
    out = []
    for layer in range(2):
        q = torch.empty(H // 2, H)  # column-parallel: rows split over tp
        set_shard(q, "tensor_parallel", (H, H), (tp * H // 2, 0))
        o = torch.empty(H, H // 2)  # row-parallel: columns split over tp
        set_shard(o, "tensor_parallel", (H, H), (0, tp * H // 2))
        w13 = torch.empty(E // 2, 2 * F // 2, H)  # experts E/ep, each gate/up half over etp
        set_shard(w13, "expert", (E, 2 * F, H), (ep * E // 2, 0, etp * F // 2, 0), (E, 2, F, H), (E // 2, 2, F // 2, H))
        w2 = torch.empty(E // 2, H, F // 2)
        set_shard(w2, "expert", (E, H, F), (ep * E // 2, 0, etp * F // 2))
        out += [(f"l{layer}.q", q), (f"l{layer}.o", o), (f"l{layer}.w13", w13), (f"l{layer}.w2", w2)]
    return out


def test_every_member_agrees_on_one_owner_per_matrix_and_balanced_load():
    everyone = [_describe(_rank_params(r)) for r in range(WORLD)]
    plans = [MatrixPlan([], Group("stage", list(range(WORLD)), r), everyone=everyone) for r in range(WORLD)]
    units = plans[0].units
    assert plans[0].matrices == 2 * (2 + 2 * E)  # q, o and 2 x E expert matrices per layer
    for p in plans[1:]:
        assert {k: u.owner for k, u in p.units.items()} == {k: u.owner for k, u in units.items()}
    for u in units.values():
        assert u.owner in {r for _, ranks in u.blocks.values() for r in ranks}
    owned = [p.owned_matrices() for p in plans]
    assert sum(owned) == plans[0].matrices and min(owned) > 0, owned
    load = [sum(units[k].cost for k in p.owned()) for p in plans]
    assert max(load) - min(load) <= max(u.cost for u in units.values()), load
    for a in range(WORLD):
        for b in range(WORLD):
            assert plans[a].gather_send[b] == plans[b].gather_recv[a]
            assert plans[a].scatter_send[b] == plans[b].scatter_recv[a]


def test_orthogonalize_one_member_holding_everything_equals_newton_schulz():
    """A group of one: the plan is local, and the result is the batched single-process update."""
    from moecore.optim.muon import newton_schulz

    w = torch.nn.Parameter(torch.randn(4, 6, 10))
    set_shard(w, "expert", (4, 6, 10))
    plan = MatrixPlan([("w", w)], Group("stage", [0], 0))
    u = torch.randn(4, 6, 10)
    got = plan.orthogonalize({"w": u})["w"]
    torch.testing.assert_close(got, newton_schulz(u) * (0.2 * 10**0.5))
