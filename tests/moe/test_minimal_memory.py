"""moe.activation_memory=minimal: the same outputs and gradients as the standard path, and a saved state
that does not grow with expert granularity (counted with saved-tensor hooks, moecore/bench/saved_memory.py)."""

from __future__ import annotations

import pytest
import torch

from moecore.bench.saved_memory import moe_saved_bytes
from moecore.config import Config, ConfigError, MoEConfig
from moecore.moe.layer import MoELayer
from moecore.moe.minimal import minimal_experts, sort_by_expert


def _pair(**kw) -> tuple[MoELayer, MoELayer]:
    torch.manual_seed(0)
    std = MoELayer(MoEConfig(**kw), 32, init_std=0.2)
    mini = MoELayer(MoEConfig(activation_memory="minimal", **kw), 32, init_std=0.2)
    mini.load_state_dict(std.state_dict())
    return std, mini


@pytest.mark.parametrize(
    "kw",
    [
        dict(num_experts=8, router_topk=2, ffn_hidden_size=24),
        dict(num_experts=6, router_topk=3, ffn_hidden_size=16, apply_probs_on_input=True),
        dict(
            num_experts=8, router_topk=4, ffn_hidden_size=8, router_score_function="sigmoid",
            router_topk_scaling_factor=2.5, shared_expert_intermediate_size=20, z_loss_coeff=1e-3,
        ),
    ],
)  # fmt: skip
def test_minimal_equals_standard(kw):
    std, mini = _pair(**kw)
    x = torch.randn(3, 11, 32)
    mask = (torch.rand(3, 11) > 0.2).float()
    results = []
    for layer in (std, mini):
        xi = x.clone().requires_grad_()
        y, aux = layer(xi, mask)
        (y.square().sum() + aux.loss).backward()
        grads = {n: p.grad for n, p in layer.named_parameters()}
        results.append((y.detach(), xi.grad, grads, aux.stats))
    assert mini.experts.last_path == "minimal" and std.experts.last_path != "minimal"
    (y0, dx0, g0, s0), (y1, dx1, g1, s1) = results

    # fp32 throughout; the two paths sum in different orders, so the absolute tolerance is relative to
    # each tensor's largest entry (1e-6 of it: a few ulps of the sums)
    def close(a, b, name):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6 * b.abs().max().item(), msg=name)

    close(y1, y0, "y")
    close(dx1, dx0, "dx")
    assert g0.keys() == g1.keys()
    for n in g0:
        close(g1[n], g0[n], n)
    torch.testing.assert_close(s1["tokens_per_expert"], s0["tokens_per_expert"])


def test_minimal_equals_standard_with_the_clipped_swiglu():
    """DeepSeek-V4's clipped SwiGLU (experts.swiglu_limit): the minimal Function's SwiGLU kernel against the
    standard path's clamps through autograd."""
    std, mini = _pair(num_experts=8, router_topk=2, ffn_hidden_size=24)
    std.experts.swiglu_limit = mini.experts.swiglu_limit = 0.4
    x = torch.randn(3, 11, 32)
    results = []
    for layer in (std, mini):
        xi = x.clone().requires_grad_()
        y, _ = layer(xi)
        y.square().sum().backward()
        results.append([y.detach(), xi.grad] + [p.grad for p in layer.parameters()])
    assert mini.experts.last_path == "minimal"
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6 * b.abs().max().item())
    std.experts.swiglu_limit = None  # the clip is active: without it the output moves
    assert not torch.allclose(std(x)[0], results[1][0], atol=1e-3)


def test_minimal_function_matches_autograd_loop():
    """The Function's backward against autograd through a plain per-assignment loop (fp32 grouped_mm)."""
    torch.manual_seed(1)
    T, H, E, K, F = 7, 8, 4, 2, 8  # rows 16-byte aligned (torch._grouped_mm)
    x = torch.randn(T, H, requires_grad=True)
    w13 = torch.randn(E, 2 * F, H, requires_grad=True)
    w2 = torch.randn(E, H, F, requires_grad=True)
    idx = torch.stack([torch.randperm(E)[:K] for _ in range(T)])
    w = torch.rand(T, K, requires_grad=True)
    out, counts = minimal_experts(x, idx, w, w13, w2)
    assert counts.tolist() == torch.bincount(idx.reshape(-1), minlength=E).tolist()
    ref = torch.zeros(T, H)
    for t in range(T):
        for k in range(K):
            e = idx[t, k]
            g, u = (w13[e] @ x[t]).chunk(2)
            ref = ref.index_add(0, torch.tensor([t]), (w[t, k] * (w2[e] @ (torch.nn.functional.silu(g) * u)))[None])
    dout = torch.randn(T, H)
    got = torch.autograd.grad(out, (x, w13, w2, w), dout)
    want = torch.autograd.grad(ref, (x, w13, w2, w), dout)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_sort_by_expert_counts_with_empty_experts():
    idx = torch.tensor([[3, 0], [3, 0], [0, 3]])
    order, inv, bounds = sort_by_expert(idx, 5)
    assert bounds.tolist() == [0, 3, 3, 3, 6, 6]
    assert torch.equal(order[inv], torch.arange(6))


def test_saved_bytes_do_not_grow_with_granularity():
    """8 experts top-2 FFN 64 vs 32 experts top-8 FFN 16 (same active and total expert parameters)."""
    coarse = moe_saved_bytes(8, 2, 64, hidden=128, tokens=128, mode="minimal")
    fine = moe_saved_bytes(32, 8, 16, hidden=128, tokens=128, mode="minimal")
    assert coarse["activations"] == fine["activations"] == 128 * 8 * 16 * 2 * 4  # h: T x K x 2F fp32
    assert abs(fine["total"] - coarse["total"]) <= max(fine["routing"], coarse["routing"])
    # the standard (fused) path keeps top-k copies of hidden-sized rows: it grows with K
    std_coarse = moe_saved_bytes(8, 2, 64, hidden=128, tokens=128, mode="standard")
    std_fine = moe_saved_bytes(32, 8, 16, hidden=128, tokens=128, mode="standard")
    assert std_fine["activations"] - std_coarse["activations"] == 2 * 128 * (8 - 2) * 128 * 4
    assert fine["activations"] < std_coarse["activations"]


def test_config_refuses_minimal_with_capacity_and_expert_parallel():
    cfg = Config()
    cfg.moe.activation_memory = "minimal"
    cfg.moe.expert_capacity_factor = 1.0
    with pytest.raises(ConfigError, match="moe.activation_memory"):
        cfg.validate()
    cfg = Config()
    cfg.moe.activation_memory = "fast"
    with pytest.raises(ConfigError, match="standard | minimal"):
        cfg.validate()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_saved_bytes_do_not_grow_with_granularity():
    """The same on the GPU's real paths (bf16: fused router, Triton permute, fused expert FFN)."""
    kw = dict(hidden=256, tokens=1024, device="cuda", dtype=torch.bfloat16)
    coarse = moe_saved_bytes(8, 2, 64, mode="minimal", **kw)
    fine = moe_saved_bytes(32, 8, 16, mode="minimal", **kw)
    assert coarse["activations"] == fine["activations"] == 1024 * 8 * 16 * 2 * 2  # h: T x K x 2F bf16
    std_coarse = moe_saved_bytes(8, 2, 64, mode="standard", **kw)
    std_fine = moe_saved_bytes(32, 8, 16, mode="standard", **kw)
    print(
        f"bf16 saved activations, 8x top-2 / 32x top-8: standard {std_coarse} / {std_fine}, minimal {coarse} / {fine}"
    )
    assert std_fine["activations"] > std_coarse["activations"] > fine["activations"]


def test_planner_counts_the_minimal_mode():
    """`moecore plan`'s activation model: with minimal, the MoE block's activations (beyond routing indices)
    do not grow with top-k at fixed top-k x expert FFN, and are below the standard path's."""
    from moecore.config import load_config
    from moecore.plan.activations import ActContext, ffn_modules
    from moecore.plan.layout import layout_of

    def moe_bytes(mode: str, k: int, f: int) -> dict:
        over = [f"moe.activation_memory={mode}", f"moe.router_topk={k}", f"moe.ffn_hidden_size={f}",
                "moe.num_experts=64", "parallel.ep=1"]  # fmt: skip
        cfg = load_config("tiny-moe", over)
        out = ffn_modules(cfg, True, layout_of(cfg, 1), ActContext(4096, 2, 2, True, 1.0))
        return out

    coarse, fine = moe_bytes("minimal", 2, 256), moe_bytes("minimal", 16, 32)
    assert coarse["experts"] == fine["experts"] == 4096 * 2 * 2 * 256 * 2
    std = moe_bytes("standard", 16, 32)
    assert std["experts"] + std["permute"] - fine["experts"] - fine["permute"] >= 2 * 4096 * 16 * 128 * 2
