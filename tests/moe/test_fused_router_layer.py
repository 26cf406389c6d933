"""MoELayer through the fused router path equals the unfused path: outputs, routing losses, statistics,
gradients and the expert-bias counts, for every balancing loss, the z-loss, expert bias and padding."""

from __future__ import annotations

import copy
import os

import pytest
import torch

from moecore.config import MoEConfig
from moecore.kernels._triton import triton_importable
from moecore.moe.layer import MoELayer

CONFIGS = {
    "aux": dict(router_pre_softmax=True, router_load_balancing_type="aux_loss", aux_loss_coeff=0.01),
    "seq_aux_z": dict(
        router_pre_softmax=True, router_load_balancing_type="seq_aux_loss", aux_loss_coeff=0.02, z_loss_coeff=1e-3
    ),
    "global_aux": dict(router_pre_softmax=True, router_load_balancing_type="global_aux_loss", aux_loss_coeff=0.01),
    "combined": dict(
        router_pre_softmax=True,
        router_load_balancing_type=["aux_loss", "seq_aux_loss", "global_aux_loss"],
        aux_loss_coeff=[0.01, 0.02, 0.03],
    ),
    "softmax_after_topk": dict(router_load_balancing_type="aux_loss", aux_loss_coeff=0.01),
    "sigmoid_bias": dict(
        router_score_function="sigmoid",
        router_enable_expert_bias=True,
        router_topk_scaling_factor=2.5,
        router_load_balancing_type="seq_aux_loss",
        aux_loss_coeff=1e-3,
    ),
    "no_loss": dict(router_pre_softmax=True, router_load_balancing_type="none", aux_loss_coeff=0.0),
    "deepseek_v3_groups": dict(
        router_score_function="sigmoid",
        router_enable_expert_bias=True,
        router_topk_scaling_factor=2.5,
        router_num_groups=4,
        router_group_topk=2,
        router_group_score="top2_sum",
        router_load_balancing_type="seq_aux_loss",
        aux_loss_coeff=1e-3,
    ),
}


def _impls() -> list[str]:
    impls = ["torch"]
    if os.environ.get("TRITON_INTERPRET") == "1" and triton_importable():
        impls.append("triton")
    return impls


def _run(layer: MoELayer, x, mask):
    y, aux = layer(x, mask)
    (y.square().sum() + aux.loss * 100).backward()
    grads = {n: p.grad.clone() for n, p in layer.named_parameters()}
    return y, aux, grads


@pytest.mark.parametrize("impl", _impls())
@pytest.mark.parametrize("name", list(CONFIGS))
def test_fused_path_equals_unfused(name, impl):
    torch.manual_seed(0)
    cfg = MoEConfig(num_experts=8, router_topk=3, ffn_hidden_size=12, **CONFIGS[name])
    base = MoELayer(cfg, 16).train()
    with torch.no_grad():
        base.router.weight.normal_(std=0.5)
        if base.router.expert_bias is not None:
            base.router.expert_bias.normal_(std=0.05)
    fused = copy.deepcopy(base)
    fused.fused_router_impl = impl
    B, S = 3, 8
    x = torch.randn(B, S, 16)
    mask = (torch.rand(B, S) > 0.2).float()
    mask[1] = 0.0  # a sequence without valid tokens
    for step in range(2):  # two micro-batches: global_aux_loss accumulates its counts
        y0, a0, g0 = _run(base, x + step, mask)
        y1, a1, g1 = _run(fused, x + step, mask)
        torch.testing.assert_close(y1, y0, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(a1.loss, a0.loss, rtol=1e-5, atol=1e-9)
        assert a1.stats.keys() == a0.stats.keys()
        for k in a0.stats:
            torch.testing.assert_close(a1.stats[k], a0.stats[k], rtol=1e-5, atol=1e-9)
        for n in g0:
            torch.testing.assert_close(g1[n], g0[n], rtol=1e-4, atol=1e-7)
        if base.router.local_tokens_per_expert is not None:
            assert torch.equal(fused.router.local_tokens_per_expert, base.router.local_tokens_per_expert)
    if name != "no_loss":
        assert a0.loss.item() != 0.0


def test_not_fused_where_the_kernel_does_not_cover_the_options():
    grouped = MoELayer(MoEConfig(num_experts=8, router_topk=2, router_num_groups=4, router_group_topk=2), 16)
    assert grouped.router.fusable()
    odd = MoELayer(MoEConfig(num_experts=12, router_topk=2, router_num_groups=4, router_group_topk=2), 16)
    assert not odd.router.fusable()  # group-limited routing needs a power-of-two expert count
    off = MoELayer(MoEConfig(num_experts=8, router_topk=2, router_fusion=False), 16)
    assert not off.router.fusable()
    fp64 = MoELayer(MoEConfig(num_experts=8, router_topk=2, router_dtype="fp64"), 16)
    assert not fp64.router.fusable()
    plain = MoELayer(MoEConfig(num_experts=8, router_topk=2), 16)
    assert plain.router.fusable() and not plain._use_fused_router(torch.randn(4, 16))  # CPU: not launched


@pytest.mark.gpu
@pytest.mark.skipif(not (torch.cuda.is_available() and triton_importable()), reason="needs CUDA and triton")
@pytest.mark.parametrize("name", ["aux", "seq_aux_z", "sigmoid_bias", "deepseek_v3_groups"])
def test_cuda_kernel_path_equals_unfused(name):
    torch.manual_seed(0)
    kw = dict(num_experts=64, router_topk=6, ffn_hidden_size=64, **CONFIGS[name])
    base = MoELayer(MoEConfig(router_fusion=False, **kw), 128).cuda().train()
    fused = MoELayer(MoEConfig(**kw), 128).cuda().train()
    fused.load_state_dict(base.state_dict())
    assert fused._use_fused_router(torch.empty(1, device="cuda"))
    x = torch.randn(4, 256, 128, device="cuda")
    mask = (torch.rand(4, 256, device="cuda") > 0.1).float()
    y0, a0, g0 = _run(base, x, mask)
    y1, a1, g1 = _run(fused, x, mask)
    torch.testing.assert_close(y1, y0, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(a1.loss, a0.loss, rtol=1e-4, atol=1e-8)
    for k in a0.stats:
        torch.testing.assert_close(a1.stats[k], a0.stats[k], rtol=1e-4, atol=1e-8)
    for n in g0:
        torch.testing.assert_close(g1[n], g0[n], rtol=1e-3, atol=1e-5)


@pytest.mark.parametrize("name", ["aux", "seq_aux_z", "global_aux", "sigmoid_bias"])
def test_fused_path_with_no_valid_token_gives_zero_losses(name):
    torch.manual_seed(0)
    cfg = MoEConfig(num_experts=8, router_topk=3, ffn_hidden_size=12, **CONFIGS[name])
    base = MoELayer(cfg, 16).train()
    fused = copy.deepcopy(base)
    fused.fused_router_impl = "torch"
    x = torch.randn(2, 4, 16)
    mask = torch.zeros(2, 4)
    y0, a0, g0 = _run(base, x, mask)
    y1, a1, g1 = _run(fused, x, mask)
    assert torch.isfinite(a1.loss) and a1.loss.item() == 0.0 == a0.loss.item()
    for k in a0.stats:
        assert torch.isfinite(a1.stats[k]).all()
        torch.testing.assert_close(a1.stats[k], a0.stats[k])
    for n in g0:
        torch.testing.assert_close(g1[n], g0[n], rtol=1e-5, atol=1e-7)
