""" "norm" recomputation: the norm output is not kept for backward (the consumers' saved copies are
recomputed from the norm input), and the gradients are bit-identical to keeping it."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from moecore.config import load_config
from moecore.models.recompute import recompute_output
from moecore.models.transformer import MoETransformer

OVERRIDES = [
    "model.num_layers=2",
    "model.hidden_size=32",
    "model.ffn_hidden_size=48",
    "model.num_attention_heads=2",
    "model.num_kv_heads=1",
    "moe.first_k_dense_replace=1",  # one dense layer, one MoE layer
    "model.vocab_size=64",
]


def _run(rec: list[str], granularity: str = "selective", recipe: str = "tiny-moe"):
    cfg = load_config(
        recipe,
        OVERRIDES + [f"model.recompute_modules=[{','.join(rec)}]", f"model.recompute_granularity={granularity}"],
    )
    torch.manual_seed(1)
    model = MoETransformer(cfg).train()
    outputs = []  # weak references to every norm output of the forward
    for layer in model.layers:
        for norm in (layer.attn_norm, layer.mlp_norm):
            norm.register_forward_hook(
                lambda m, i, o: outputs.append(weakref.ref(o)) if torch.is_grad_enabled() else None
            )
    ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(2))
    out = model(ids[:, :-1], labels=ids[:, 1:])
    gc.collect()
    alive = sum(r() is not None for r in outputs[:4])  # the four norm outputs of the forward itself
    out.loss.backward()
    return alive, [p.grad.clone() for p in model.parameters()], out.loss.detach()


@pytest.mark.parametrize("extra", [[], ["moe"], ["mlp", "moe_act"]])
def test_norm_outputs_are_not_kept_and_gradients_match(extra):
    alive_ref, grads_ref, loss_ref = _run(extra)
    alive, grads, loss = _run(["norm", *extra])
    assert alive_ref == 4  # without the option every norm output is held by the graph
    assert alive == 0
    assert torch.equal(loss, loss_ref)
    for a, b in zip(grads, grads_ref):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_nested_in_mla_up_proj_recompute():
    # MLA's up-projection recomputation runs inside the attention norm's consumer: its input (the norm
    # output) is saved through the norm's hooks, so neither is kept
    alive_ref, grads_ref, loss_ref = _run(["mla_up_proj"], recipe="tiny-deepseek-v2")
    alive, grads, loss = _run(["norm", "mla_up_proj", "core_attn"], recipe="tiny-deepseek-v2")
    assert alive_ref == 4 and alive == 0
    assert torch.equal(loss, loss_ref)
    for a, b in zip(grads, grads_ref):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_with_full_layer_recompute_gradients_match():
    _, grads_ref, _ = _run([], "full")
    _, grads, _ = _run(["norm"], "full")
    for a, b in zip(grads, grads_ref):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_views_of_the_output_are_rebuilt():
    x = torch.randn(3, 4, 5, requires_grad=True)
    w = torch.randn(5, 6, requires_grad=True)

    def consumer(h):
        return (h.reshape(12, 5)[2:] @ w).square().sum() + h[:, 1].exp().sum()

    recompute_output(torch.tanh, (x,), consumer).backward()
    gx, gw = x.grad.clone(), w.grad.clone()
    x.grad = w.grad = None
    consumer(torch.tanh(x)).backward()
    assert torch.equal(gx, x.grad) and torch.equal(gw, w.grad)
