"""Balancing and z losses against their formulas (written out here from the papers), against Hugging
Face's Switch-style loss, and as MoELayer combines them (coefficients, padding, global batch)."""

from __future__ import annotations

import math

import pytest
import torch

from moecore.config import MoEConfig
from moecore.moe import losses
from moecore.moe.layer import MoELayer


def _switch_by_definition(probs: list[list[float]], topk: int) -> float:
    """E * sum_i f_i P_i with f_i = (#tokens with i in their top-k) / (K T), P_i = mean_t p_{t,i}."""
    T, E = len(probs), len(probs[0])
    f = [0.0] * E
    for row in probs:
        for i in sorted(range(E), key=lambda j: -row[j])[:topk]:
            f[i] += 1.0 / (topk * T)
    P = [sum(row[i] for row in probs) / T for i in range(E)]
    return E * sum(fi * pi for fi, pi in zip(f, P))


def test_switch_aux_loss_matches_definition_and_uniform_value():
    torch.manual_seed(0)
    p = torch.softmax(torch.randn(37, 6, dtype=torch.float64), -1)
    got = losses.switch_aux_loss(p, losses.topk_counts(p, 2), 37, 2)
    assert got.item() == pytest.approx(_switch_by_definition(p.tolist(), 2), rel=1e-12)
    # a perfectly uniform router gives exactly 1
    u = torch.full((8, 4), 0.25, dtype=torch.float64)
    counts = torch.full((4,), 4.0, dtype=torch.float64)  # 8 tokens * top-2 spread evenly
    assert losses.switch_aux_loss(u, counts, 8, 2).item() == pytest.approx(1.0, rel=1e-12)


@pytest.mark.parametrize("masked", [False, True])
def test_aux_loss_is_hf_switch_loss_over_k(masked):
    """HF's load_balancing_loss_func uses f_i = c_i / T (no 1/K): ours * K equals it, padding included."""
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    torch.manual_seed(1)
    logits = torch.randn(2 * 9, 8)
    mask = torch.ones(2, 9)
    if masked:
        mask[0, 6:] = 0
        mask[1, 2:] = 0
    hf = load_balancing_loss_func((logits,), num_experts=8, top_k=2, attention_mask=mask if masked else None)
    valid = mask.reshape(-1) > 0
    p = torch.softmax(logits, -1) * valid.unsqueeze(-1)
    ours = losses.switch_aux_loss(p, losses.topk_counts(p, 2, valid), valid.sum(), 2)
    torch.testing.assert_close(ours * 2, hf)


def test_sequence_aux_loss_is_mean_of_per_sequence_losses():
    torch.manual_seed(2)
    p = torch.softmax(torch.randn(3, 11, 5, dtype=torch.float64), -1)
    valid = torch.ones(3, 11, dtype=torch.bool)
    valid[1, 4:] = False
    valid[2, :] = False  # an all-padding sequence does not count
    expected = [_switch_by_definition(p[b][valid[b]].tolist(), 2) for b in range(2)]
    got = losses.sequence_aux_loss(p * valid.unsqueeze(-1), 2, valid)
    assert got.item() == pytest.approx(sum(expected) / 2, rel=1e-12)


def test_z_loss_formula_and_mask():
    torch.manual_seed(3)
    logits = torch.randn(10, 4, dtype=torch.float64)
    valid = torch.tensor([1, 1, 0, 1, 0, 1, 1, 1, 1, 0], dtype=torch.bool)
    by_hand = [math.log(sum(math.exp(v) for v in row)) ** 2 for row, ok in zip(logits.tolist(), valid) if ok]
    assert losses.z_loss(logits, valid).item() == pytest.approx(sum(by_hand) / len(by_hand), rel=1e-12)
    assert losses.z_loss(logits).item() == pytest.approx(
        sum(math.log(sum(math.exp(v) for v in r)) ** 2 for r in logits.tolist()) / 10, rel=1e-12
    )


def _layer(**kw) -> MoELayer:
    base = dict(num_experts=6, router_topk=2, ffn_hidden_size=8, router_dtype="fp64")
    base.update(kw)
    return MoELayer(MoEConfig(**base), 12)


def test_layer_combines_losses_with_coefficients():
    torch.manual_seed(4)
    layer = _layer(
        router_load_balancing_type=["aux_loss", "seq_aux_loss", "global_aux_loss"],
        aux_loss_coeff=[0.1, 0.02, 0.3],
        z_loss_coeff=0.004,
    )
    x = torch.randn(3, 7, 12)
    _, aux = layer(x)
    s = aux.stats
    expected = 0.1 * s["aux_loss"] + 0.02 * s["seq_aux_loss"] + 0.3 * s["global_aux_loss"] + 0.004 * s["z_loss"]
    torch.testing.assert_close(aux.loss, expected.float())
    # each stat is its formula on the router's logits
    logits = torch.nn.functional.linear(x.reshape(-1, 12).double(), layer.router.weight.double())
    p = torch.softmax(logits, -1)
    assert s["aux_loss"].item() == pytest.approx(_switch_by_definition(p.tolist(), 2), rel=1e-6)
    per_seq = [_switch_by_definition(p.view(3, 7, 6)[b].tolist(), 2) for b in range(3)]
    assert s["seq_aux_loss"].item() == pytest.approx(sum(per_seq) / 3, rel=1e-6)
    assert s["z_loss"].item() == pytest.approx(torch.logsumexp(logits, -1).square().mean().item(), rel=1e-6)
    # "none" puts nothing in the objective and computes no loss; the load statistics stay
    _, aux = _layer(router_load_balancing_type="none", aux_loss_coeff=0.0)(x)
    assert aux.loss.item() == 0.0
    assert set(aux.stats) == {"tokens_per_expert", "imbalance", "dropped_fraction"}
    assert aux.stats["tokens_per_expert"].sum().item() == 3 * 7 * 2
    # only the configured loss is computed, with the same value as above
    only_seq = _layer(router_load_balancing_type="seq_aux_loss", aux_loss_coeff=0.5)
    only_seq.load_state_dict(layer.state_dict())
    _, aux = only_seq(x)
    assert "aux_loss" not in aux.stats and "z_loss" not in aux.stats
    torch.testing.assert_close(aux.loss, 0.5 * s["seq_aux_loss"])


def test_padding_tokens_do_not_count():
    """Losses and stats of a padded batch equal those of the valid tokens alone."""
    torch.manual_seed(5)
    layer = _layer(
        router_load_balancing_type=["aux_loss", "seq_aux_loss"], aux_loss_coeff=[1.0, 1.0], z_loss_coeff=1e-3
    )
    x = torch.randn(1, 10, 12)
    mask = torch.zeros(1, 10)
    mask[0, :6] = 1
    _, padded = layer(x, mask)
    _, alone = layer(x[:, :6])
    for k in ("aux_loss", "seq_aux_loss", "z_loss", "tokens_per_expert", "imbalance", "dropped_fraction"):
        torch.testing.assert_close(padded.stats[k], alone.stats[k], msg=k)
    torch.testing.assert_close(padded.loss, alone.loss)


def test_global_aux_loss_accumulates_over_micro_batches_and_resets():
    torch.manual_seed(6)
    # aux_loss in the objective too (only configured losses are computed): after a reset they must agree
    layer = _layer(router_load_balancing_type=["global_aux_loss", "aux_loss"], aux_loss_coeff=[1.0, 1.0])
    xs = [torch.randn(2, 5, 12) for _ in range(3)]
    counts = torch.zeros(6, dtype=torch.float64)
    for n, x in enumerate(xs, start=1):
        _, aux = layer(x)
        p = torch.softmax(torch.nn.functional.linear(x.reshape(-1, 12).double(), layer.router.weight.double()), -1)
        counts += losses.topk_counts(p, 2)
        # E / (K T^2) * sum_i (sum_t p_ti) * (C_i / n)
        expected = 6 / (2 * 10**2) * (p.sum(0) * counts / n).sum()
        assert aux.stats["global_aux_loss"].item() == pytest.approx(expected.item(), rel=1e-6)
    layer.update_expert_bias()  # end of the optimizer step: counts reset
    _, aux = layer(xs[0])
    assert aux.stats["global_aux_loss"].item() == pytest.approx(aux.stats["aux_loss"].item(), rel=1e-6)
    # evaluation does not accumulate
    layer.eval()
    before = layer.global_tokens_per_expert.clone()
    layer(xs[1])
    assert torch.equal(before, layer.global_tokens_per_expert)


def test_global_aux_loss_gradient_survives_recomputation():
    """A checkpointed layer recomputes in backward; it must reuse the counts of its own forward, also
    when several forwards run before their backwards (pipeline schedules: backwards in forward order)."""
    from torch.utils.checkpoint import checkpoint

    torch.manual_seed(7)
    xs = [torch.randn(2, 6, 12) for _ in range(3)]
    grads, values, leftover = [], [], []
    for recompute in (False, True):
        torch.manual_seed(8)
        layer = _layer(router_load_balancing_type="global_aux_loss", aux_loss_coeff=1.0)
        if recompute:
            outs = [checkpoint(layer, x, use_reentrant=False) for x in xs]  # all forwards first ...
        else:
            outs = [layer(x) for x in xs]
        for y, aux in outs:  # ... then the backwards, in forward order
            (y.sum() * 0 + aux.loss).backward()
        grads.append(layer.router.weight.grad.clone())
        values.append(torch.stack([aux.loss.detach() for _, aux in outs]))
        leftover.append(len(layer._global_counts_used))
    torch.testing.assert_close(values[0], values[1], rtol=0, atol=0)
    torch.testing.assert_close(grads[0], grads[1], rtol=0, atol=0)
    assert leftover == [3, 0]  # recomputation consumed what each forward stored
