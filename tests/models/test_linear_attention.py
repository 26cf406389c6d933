"""Gated DeltaNet: chunked vs token-by-token rule, and the layer against transformers' Qwen3-Next one.

References we did not write: transformers' `torch_recurrent_gated_delta_rule` (the rule) and
`Qwen3NextGatedDeltaNet` (the whole layer, weights copied by name), plus the closed form of the
rule for one step.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from moecore.config import ConfigError, ModelConfig
from moecore.models.linear_attention import (
    GatedDeltaNet,
    gated_delta_rule,
    gated_delta_rule_chunked,
    gated_delta_rule_recurrent,
    l2_normalize,
)

transformers = pytest.importorskip("transformers")
from transformers.models.qwen3_next import modeling_qwen3_next as hf  # noqa: E402

B, HK, HV, DK, DV = 2, 2, 4, 8, 6


def _inputs(seq: int, dtype=torch.float64, seed: int = 0, decay_scale: float = 1.0, requires_grad: bool = True):
    """q, k (unit norm) [B, S, HK, DK]; v [B, S, HV, DV]; g <= 0, beta in (0, 1) [B, S, HV]."""
    gen = torch.Generator().manual_seed(seed)
    q = l2_normalize(torch.randn(B, seq, HK, DK, generator=gen, dtype=dtype))
    k = l2_normalize(torch.randn(B, seq, HK, DK, generator=gen, dtype=dtype))
    v = torch.randn(B, seq, HV, DV, generator=gen, dtype=dtype)
    g = -torch.rand(B, seq, HV, generator=gen, dtype=dtype) * decay_scale
    beta = torch.rand(B, seq, HV, generator=gen, dtype=dtype)
    return [t.requires_grad_(requires_grad) for t in (q, k, v, g, beta)]


def _grads(fn, inputs, seed=1):
    """Outputs, final state and d(sum(o * w))/d(each input) for a fixed random w."""
    o, state = fn(*inputs)
    w = torch.randn(o.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).to(o.device, o.dtype)
    grads = torch.autograd.grad((o * w).sum() + state.sum(), inputs)
    return o, state, grads


@pytest.mark.parametrize("seq,chunk", [(37, 16), (32, 16), (5, 64), (50, 1), (64, 64)])
def test_chunked_matches_recurrent_outputs_and_gradients(seq, chunk):
    """Exact agreement (float64) including lengths that are not a multiple of the chunk."""
    ref = _grads(gated_delta_rule_recurrent, _inputs(seq))
    got = _grads(lambda *a: gated_delta_rule_chunked(*a, chunk_size=chunk), _inputs(seq))
    torch.testing.assert_close(got[0], ref[0], rtol=0, atol=1e-12)
    torch.testing.assert_close(got[1], ref[1], rtol=0, atol=1e-12)
    for g_got, g_ref in zip(got[2], ref[2]):
        torch.testing.assert_close(g_got, g_ref, rtol=0, atol=1e-11)


def test_chunked_with_initial_state_and_strong_decay():
    """A carried-in state and decays down to e^-40 per step stay exact and finite."""
    inputs = _inputs(29, decay_scale=40.0)
    s0 = torch.randn(B, HV, DK, DV, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    o_ref, st_ref = gated_delta_rule_recurrent(*inputs, initial_state=s0)
    o, st = gated_delta_rule_chunked(*inputs, initial_state=s0, chunk_size=8)
    assert torch.isfinite(o).all()
    torch.testing.assert_close(o, o_ref, rtol=0, atol=1e-12)
    torch.testing.assert_close(st, st_ref, rtol=0, atol=1e-12)


def test_recurrent_matches_transformers_rule():
    """Our reference loop against transformers' token-by-token function (GVA head sharing included)."""
    q, k, v, g, beta = _inputs(23, dtype=torch.float32, requires_grad=False)
    o, state = gated_delta_rule_recurrent(q, k, v, g, beta)
    o_hf, state_hf = hf.torch_recurrent_gated_delta_rule(q, k, v, g, beta, output_final_state=True)
    torch.testing.assert_close(o, o_hf, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(state, state_hf, rtol=1e-5, atol=1e-5)


def test_one_step_closed_form():
    """From a zero state one step writes beta*k v^T, so o = beta (q.k) v / sqrt(Dk)."""
    q, k, v, g, beta = _inputs(1, requires_grad=False)
    o, _ = gated_delta_rule_chunked(q, k, v, g, beta, chunk_size=4)
    rep = HV // HK
    qk = (q * k).sum(-1).repeat_interleave(rep, dim=2)  # [B, 1, HV]
    expected = (beta * qk)[..., None] * v / DK**0.5
    torch.testing.assert_close(o, expected, rtol=0, atol=1e-14)


def test_float32_chunked_close_to_float64():
    """The fp32 chunked path (chunk 64, weak decay, beta near 1: the worst conditioning) stays accurate."""
    q, k, v, g, beta = _inputs(130, decay_scale=0.01, requires_grad=False)
    beta = 0.5 + 0.5 * beta
    o_ref, _ = gated_delta_rule_recurrent(q, k, v, g, beta)
    o32, _ = gated_delta_rule_chunked(*(t.float() for t in (q, k, v, g, beta)), chunk_size=64)
    assert o32.dtype == torch.float32
    assert (o32.double() - o_ref).abs().max() < 1e-4 * max(1.0, o_ref.abs().max().item())


def _layer_configs(chunk: int = 16):
    ours = ModelConfig(
        hidden_size=48,
        linear_num_key_heads=HK,
        linear_num_value_heads=HV,
        linear_key_head_dim=DK,
        linear_value_head_dim=DV,
        linear_conv_kernel_dim=4,
        linear_chunk_size=chunk,
        norm_eps=1e-6,
    )
    ref = transformers.Qwen3NextConfig(
        hidden_size=48,
        linear_num_key_heads=HK,
        linear_num_value_heads=HV,
        linear_key_head_dim=DK,
        linear_value_head_dim=DV,
        linear_conv_kernel_dim=4,
        num_hidden_layers=1,
        layer_types=["linear_attention"],
        rms_norm_eps=1e-6,
        vocab_size=32,
    )
    return ours, ref


def _layer_pair(seed: int = 0):
    ours_cfg, ref_cfg = _layer_configs()
    torch.manual_seed(seed)
    ref = hf.Qwen3NextGatedDeltaNet(ref_cfg, layer_idx=0)
    with torch.no_grad():  # random everything (norm weight, dt_bias, A_log too), scaled to stay O(1)
        for name, p in ref.named_parameters():
            p.copy_(torch.randn_like(p) * (0.3 if "proj" in name else 0.5) + (1.0 if name == "norm.weight" else 0.0))
    ours = GatedDeltaNet(ours_cfg, layer_idx=0)
    ours.load_state_dict(ref.state_dict())  # same names: conversion only renames the `linear_attn.` prefix
    return ours, ref


@pytest.mark.parametrize("seq", [1, 21, 40])
def test_layer_matches_transformers(seq):
    ours, ref = _layer_pair()
    x = torch.randn(2, seq, 48, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        y_ref = ref(x)
        tol = 1e-5 * max(1.0, y_ref.abs().max().item())
        assert (ours(x) - y_ref).abs().max() <= tol
        assert (ours.forward_recurrent(x) - y_ref).abs().max() <= tol


def test_layer_gradients_chunked_equal_recurrent():
    """Gradients w.r.t. the input and every parameter, float64, sequence not a multiple of the chunk."""
    ours, _ = _layer_pair()
    ours = ours.double()
    x = torch.randn(2, 37, 48, dtype=torch.float64, generator=torch.Generator().manual_seed(7), requires_grad=True)
    params = [x, *ours.parameters()]
    g_chunk = torch.autograd.grad(ours(x).pow(2).sum(), params)
    g_rec = torch.autograd.grad(ours.forward_recurrent(x).pow(2).sum(), params)
    for a, b in zip(g_chunk, g_rec):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


def test_layer_is_causal_and_bf16_matches_transformers():
    ours, ref = _layer_pair()
    x = torch.randn(1, 20, 48, generator=torch.Generator().manual_seed(9))
    x2 = x.clone()
    x2[:, 12:] += 1.0
    with torch.no_grad():
        y, y2 = ours(x), ours(x2)
        torch.testing.assert_close(y[:, :12], y2[:, :12], rtol=0, atol=0)
        assert (y[:, 12:] - y2[:, 12:]).abs().max() > 1e-3
        y_bf16 = ours.to(torch.bfloat16)(x.bfloat16())
        y_ref_bf16 = ref.to(torch.bfloat16)(x.bfloat16())
    assert y_bf16.dtype == torch.bfloat16
    # bf16 rounding moves both about 5% away from fp32 here; they must agree to a few bf16 ulps.
    assert (y_bf16.float() - y_ref_bf16.float()).abs().max() <= 1e-2 * y_ref_bf16.float().abs().max()


def test_fresh_layer_init_and_backend_choice():
    cfg, _ = _layer_configs()
    layer = GatedDeltaNet(cfg, layer_idx=3)
    g = -layer.A_log.exp() * torch.nn.functional.softplus(layer.dt_bias)  # decay with a = 0
    assert (g < 0).all() and (g > -16 * 0.11).all()
    assert torch.equal(layer.norm.weight, torch.ones(DV))
    q, k, v, gg, beta = _inputs(9, dtype=torch.float32, requires_grad=False)
    torch.testing.assert_close(
        gated_delta_rule(q, k, v, gg, beta, backend="torch"), gated_delta_rule_recurrent(q, k, v, gg, beta)[0]
    )
    with pytest.raises(ValueError, match="backend"):
        gated_delta_rule(q, k, v, gg, beta, backend="cuda")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="flash-linear-attention"):
            gated_delta_rule(q, k, v, gg, beta, backend="fla")


def test_recompute_core_attn_gives_the_same_gradients():
    ours, _ = _layer_pair()
    x = torch.randn(2, 21, 48, generator=torch.Generator().manual_seed(11), requires_grad=True)
    params = [x, *ours.parameters()]
    plain = torch.autograd.grad(ours(x).pow(2).sum(), params)
    ours.recompute_core = True
    recomputed = torch.autograd.grad(ours.train()(x).pow(2).sum(), params)
    for a, b in zip(plain, recomputed):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_bad_head_counts_and_layouts_are_config_errors():
    cfg, _ = _layer_configs()
    with pytest.raises(ConfigError, match=f"parallel.tp={HK + 1} does not divide model.linear_num_key_heads={HK}"):
        GatedDeltaNet(cfg, layer_idx=0, dims=SimpleNamespace(tp=HK + 1, cp=1))
    cp_group = object()  # context parallel is supported: the layer keeps its group
    assert GatedDeltaNet(cfg, layer_idx=0, dims=SimpleNamespace(tp=1, cp=2, cp_group=cp_group)).cp_group is cp_group
    cfg.linear_num_value_heads = 3
    with pytest.raises(ConfigError, match="model.linear_num_value_heads"):
        GatedDeltaNet(cfg, layer_idx=0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_chunked_and_fla_match_float64_reference():
    """On a GPU: the PyTorch chunked path in fp32 (outputs and gradients) and, where installed,
    flash-linear-attention's forward (TF32 inside, so to 1e-2 relative) against the float64 loop."""
    xs = [t.detach().cuda().requires_grad_() for t in _inputs(150)]
    ref = _grads(gated_delta_rule_recurrent, xs)
    xs32 = [t.detach().float().requires_grad_() for t in xs]
    got = _grads(lambda *a: gated_delta_rule_chunked(*a, chunk_size=64), xs32)
    assert (got[0].double() - ref[0]).abs().max() < 1e-5
    for g_got, g_ref in zip(got[2], ref[2]):
        assert (g_got.double() - g_ref).abs().max() < 1e-5 * max(1.0, g_ref.abs().max().item())
    from moecore.models.linear_attention import _fla_chunk_fn

    if _fla_chunk_fn() is not None:
        with torch.no_grad():
            o = gated_delta_rule(*xs32, backend="fla")
        assert (o.double() - ref[0]).abs().max() < 1e-2 * ref[0].abs().max()
