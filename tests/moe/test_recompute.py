"""Fine-grained recomputation of the MoE layer ("moe_act", "shared_experts"): same gradients, and the
recomputation really runs (the activation / shared MLP is evaluated again in backward)."""

from __future__ import annotations

import pytest
import torch

from moecore.config import MoEConfig, load_config
from moecore.models.transformer import MoETransformer
from moecore.moe import experts as experts_mod
from moecore.moe.layer import MoELayer


def _cfg(**kw) -> MoEConfig:
    base = dict(num_experts=4, router_topk=2, ffn_hidden_size=8, shared_expert_intermediate_size=6)
    base.update(kw)
    return MoEConfig(**base)


def _grads(layer: MoELayer, x: torch.Tensor) -> list[torch.Tensor]:
    x = x.clone().requires_grad_()
    out, aux = layer(x)
    (out.square().sum() + aux.loss).backward()
    return [x.grad] + [p.grad for p in layer.parameters()]


@pytest.mark.parametrize("probs_on_input", [False, True])
@pytest.mark.parametrize("grouped", [True, False])
def test_moe_act_and_shared_experts_give_same_gradients(monkeypatch, grouped, probs_on_input):
    torch.manual_seed(0)
    cfg = _cfg(apply_probs_on_input=probs_on_input, grouped_gemm=grouped, shared_expert_gate=True)
    dt = torch.float32 if grouped else torch.float64  # grouped_mm runs fp32 on CPU, the loop any dtype
    x = torch.randn(2, 5, 12, dtype=dt)
    base = MoELayer(cfg, 12).to(dt)
    ref = _grads(base, x)
    calls = {"act": 0, "shared": 0}
    real_act = experts_mod.activation_fn

    def counting_act(h, activation, limit=None):
        calls["act"] += 1
        return real_act(h, activation, limit)

    monkeypatch.setattr(experts_mod, "activation_fn", counting_act)
    for act, shared in ((False, False), (True, False), (False, True), (True, True)):
        layer = MoELayer(cfg, 12, recompute_act=act, recompute_shared=shared).to(dt)
        layer.load_state_dict(base.state_dict())
        calls.update(act=0, shared=0)
        handle = layer.shared_experts.register_forward_pre_hook(
            lambda *_: calls.__setitem__("shared", calls["shared"] + 1)
        )
        got = _grads(layer, x)
        handle.remove()
        for a, b in zip(got, ref):  # the recomputation repeats the same ops on the same inputs: bit-identical
            torch.testing.assert_close(a, b, rtol=0, atol=0)
        assert layer.experts.uses_grouped_mm(x.reshape(-1, 12)) == grouped
        idx = layer.router(x.reshape(-1, 12)).topk_idx_TK.flatten()
        segments = 1 if grouped else int((idx.bincount(minlength=4) > 0).sum())
        assert calls["act"] == segments * (2 if act else 1), (act, shared, calls)
        assert calls["shared"] == (2 if shared else 1), (act, shared, calls)


def test_decoder_layer_passes_the_flags_and_model_gradients_match():
    overrides = [
        "model.num_layers=2",
        "model.hidden_size=32",
        "model.ffn_hidden_size=48",
        "model.num_attention_heads=2",
        "model.num_kv_heads=1",
        "moe.first_k_dense_replace=0",
        "model.vocab_size=64",
    ]
    grads = []
    for rec in ([], ["moe_act", "shared_experts"], ["moe_act", "shared_experts", "moe"]):
        cfg = load_config("tiny-moe", overrides + [f"model.recompute_modules=[{','.join(rec)}]"])
        torch.manual_seed(1)
        model = MoETransformer(cfg)
        layer = model.layers[0].mlp
        assert layer.experts.recompute_act == ("moe_act" in rec)
        assert layer.recompute_shared == ("shared_experts" in rec)
        ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(2))
        out = model(ids[:, :-1], labels=ids[:, 1:])
        out.loss.backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    for other in grads[1:]:
        for a, b in zip(other, grads[0]):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
