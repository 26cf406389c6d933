"""moe.sync_free: no host synchronisation from routing to combine.

On CPU a dispatch mode records every aten op that needs the host to read device memory (item / tolist /
int(), nonzero, bincount, masked_select, unique, repeat_interleave without output_size) through a
forward and backward of the layer; on a GPU (marked gpu) the layer runs under
torch.cuda.set_sync_debug_mode("error") and inside a CUDA graph capture.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from moecore.config import Config, ConfigError, MoEConfig
from moecore.moe.layer import MoELayer

SYNC_OPS = {
    "aten::_local_scalar_dense",  # .item(), .tolist(), int(t), bool(t)
    "aten::nonzero",
    "aten::bincount",
    "aten::masked_select",
    "aten::_unique2",
    "aten::unique_consecutive",
    "aten::unique_dim",
    "aten::_assert_async.msg",
}


class _SyncSpy(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.seen: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._schema.name
        kwargs = kwargs or {}
        if name in SYNC_OPS or (name == "aten::repeat_interleave" and kwargs.get("output_size") is None):
            self.seen.append(name)
        return func(*args, **kwargs)


CASES = {
    "dropless": dict(num_experts=8, router_topk=2, ffn_hidden_size=16),
    "padded": dict(
        num_experts=8, router_topk=2, ffn_hidden_size=16, expert_capacity_factor=0.5, pad_expert_input_to_capacity=True
    ),
    "minimal": dict(num_experts=8, router_topk=3, ffn_hidden_size=16, activation_memory="minimal"),
    "losses": dict(
        num_experts=8, router_topk=2, ffn_hidden_size=16, router_load_balancing_type=["aux_loss", "seq_aux_loss"],
        aux_loss_coeff=[1e-2, 1e-3], z_loss_coeff=1e-3, router_enable_expert_bias=True,
        shared_expert_intermediate_size=16,
    ),
}  # fmt: skip


def _run(layer: MoELayer, x: torch.Tensor, mask: torch.Tensor | None):
    xi = x.clone().requires_grad_()
    y, aux = layer(xi, mask)
    (y.square().sum() + aux.loss).backward()
    return y.detach(), xi.grad, {n: p.grad.clone() for n, p in layer.named_parameters()}


@pytest.mark.parametrize("case", sorted(CASES))
def test_no_host_sync_and_same_results(case):
    torch.manual_seed(0)
    base = MoELayer(MoEConfig(**CASES[case]), 32, init_std=0.2)
    free = MoELayer(MoEConfig(sync_free=True, **CASES[case]), 32, init_std=0.2)
    free.load_state_dict(base.state_dict())
    x = torch.randn(2, 9, 32)
    mask = (torch.rand(2, 9) > 0.3).float()
    want = _run(base, x, mask)
    with _SyncSpy() as spy:
        got = _run(free, x, mask)
    assert spy.seen == []
    torch.testing.assert_close(got[0], want[0], rtol=0, atol=0)
    torch.testing.assert_close(got[1], want[1], rtol=0, atol=0)
    for n in want[2]:
        torch.testing.assert_close(got[2][n], want[2][n], rtol=0, atol=0, msg=n)


@pytest.mark.parametrize("mode", ["standard", "minimal"])
def test_gpt_oss_experts_no_host_sync_and_same_results(mode):
    """gpt-oss's block (router bias, biased clamped experts; moecore/models/biased_moe.py) with moe.sync_free: the
    per-row biases' expert ids come from the counts with a known output size, so nothing reads back; moe.sync_free
    and moe.gemm_backend reach the biased experts that replace MoELayer's."""
    from moecore.config import load_config
    from moecore.models.biased_moe import BiasedMoELayer

    layers = []
    for free in (False, True):
        cfg = load_config("tiny-gpt-oss", [f"moe.activation_memory={mode}", f"moe.sync_free={free}"])
        cfg.validate()
        torch.manual_seed(0)
        layers.append(BiasedMoELayer(cfg))
    base, free = layers
    with torch.no_grad():
        for p in base.experts.parameters():
            p.normal_(0, 0.3)
    free.load_state_dict(base.state_dict())
    assert free.experts.sync_free and free.experts.gemm_backend == free.cfg.gemm_backend
    x = torch.randn(2, 9, base.experts.hidden_size)
    mask = (torch.rand(2, 9) > 0.3).float()
    want = _run(base, x, mask)
    with _SyncSpy() as spy:
        got = _run(free, x, mask)
    assert spy.seen == []
    assert free.experts.last_path == ("grouped_mm" if mode == "standard" else mode)
    torch.testing.assert_close(got[0], want[0], rtol=0, atol=0)
    for n in want[2]:
        torch.testing.assert_close(got[2][n], want[2][n], rtol=0, atol=0, msg=n)


def test_spy_sees_the_sync_of_unpadded_drops():
    """Capacity drops without padding size the expert input by the kept count: a host read (not sync-free)."""
    torch.manual_seed(0)
    layer = MoELayer(MoEConfig(num_experts=4, router_topk=2, ffn_hidden_size=8, expert_capacity_factor=0.5), 16)
    with _SyncSpy() as spy:
        _run(layer, torch.randn(1, 8, 16), None)
    assert "aten::_local_scalar_dense" in spy.seen


@pytest.mark.parametrize(
    "field,value,match",
    [
        ("moe.expert_capacity_factor", 1.0, "moe.sync_free=True is invalid: with a capacity factor"),
        ("parallel.ep", 2, "moe.sync_free=True is invalid: needs parallel.ep=1"),
        ("model.activation", "gelu", "moe.sync_free=True is invalid: needs SwiGLU experts"),
    ],
)
def test_config_refusals(field, value, match):
    cfg = Config()
    cfg.moe.sync_free = True
    section, name = field.split(".")
    setattr(getattr(cfg, section), name, value)
    with pytest.raises(ConfigError, match=match):
        cfg.validate()


def _gpu_layer(case: str) -> MoELayer:
    torch.manual_seed(0)
    cfg = MoEConfig(sync_free=True, **CASES[case])
    return MoELayer(cfg, 64, init_std=0.05).cuda().bfloat16()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("case", sorted(CASES))
def test_gpu_no_sync_under_debug_mode(case):
    layer = _gpu_layer(case)
    x = torch.randn(2, 64, 64, device="cuda", dtype=torch.bfloat16)
    mask = (torch.rand(2, 64, device="cuda") > 0.3).float()
    _run(layer, x, mask)  # compile the Triton kernels first
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        _run(layer, x, mask)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert layer.experts.last_path in ("fused", "minimal")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("case", ["dropless", "padded", "minimal"])
def test_gpu_layer_captured_in_a_cuda_graph(case):
    """Forward and backward captured once, replayed on new inputs: the same output and gradients as eager."""
    layer = _gpu_layer(case)
    static_x = torch.randn(2, 64, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)

    def step():
        layer.zero_grad(set_to_none=True)
        y, aux = layer(static_x)
        (y.float().square().sum() + aux.loss).backward()

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    layer.zero_grad(set_to_none=True)
    with torch.cuda.graph(graph):
        static_y, static_aux = layer(static_x)
        (static_y.float().square().sum() + static_aux.loss).backward()
    static_grads = {n: p.grad for n, p in layer.named_parameters()}  # written in place by every replay
    for seed in (1, 2):
        torch.manual_seed(seed)
        new_x = torch.randn(2, 64, 64, device="cuda", dtype=torch.bfloat16)
        with torch.no_grad():
            static_x.copy_(new_x)
        graph.replay()
        got_y = static_y.clone()
        got = {n: g.clone() for n, g in static_grads.items()}
        layer.zero_grad(set_to_none=True)
        y, aux = layer(new_x.clone().requires_grad_())
        (y.float().square().sum() + aux.loss).backward()
        torch.testing.assert_close(got_y, y, rtol=0, atol=0)
        for n, p in layer.named_parameters():
            torch.testing.assert_close(got[n], p.grad, rtol=0, atol=0, msg=n)
