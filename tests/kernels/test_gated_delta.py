"""Chunked gated delta rule: the Triton kernels against the PyTorch chunked reference.

The reference (`gated_delta_rule_chunked`) is itself checked against transformers' token loop in
tests/models/test_linear_attention.py. Compared here: the output, the final state and the gradients of
q, k, v, g and beta, with GQA head sharing and lengths that are not a multiple of the chunk.

Tolerances are relative Frobenius errors (`rel_err`). Measured in the interpreter (fp32, exact dots):
<= 5e-7 for everything, 1.3e-6 (dq) and 2.7e-6 (dg) under decays down to e^-20 per step: 1e-5.
On CUDA: fp32 inputs (3xTF32 dots, about fp32 accuracy) against a float64 reference, 1e-4; bf16
inputs (TF32 dots, bf16 o and dv) against the float64 reference on the same bf16-rounded inputs,
2e-2: the bf16 rounding of o and dv alone is ~3e-3, and the interpreter with dot operands rounded to
TF32 measured <= 3.4e-3 for everything (S=300, D=128, weak decay). The CUDA tests print their errors.
"""

from __future__ import annotations

import pytest
import torch

from moecore.config import ModelConfig
from moecore.kernels._triton import triton_importable
from moecore.kernels.gated_delta import gated_delta_rule_triton
from moecore.models.linear_attention import (
    GatedDeltaNet,
    gated_delta_rule,
    gated_delta_rule_chunked,
    gated_delta_rule_with_state,
    l2_normalize,
)
from tests.kernels.conftest import rel_err


def _inputs(b, s, hk, hv, dk, dv, device, dtype=torch.float32, decay=1.0, seed=0):
    """Inputs as Qwen3-Next's layer makes them: unit-norm q, k; g <= 0; beta in (0, 1)."""
    gen = torch.Generator().manual_seed(seed)
    q = l2_normalize(torch.randn(b, s, hk, dk, generator=gen))
    k = l2_normalize(torch.randn(b, s, hk, dk, generator=gen))
    v = torch.randn(b, s, hv, dv, generator=gen)
    g = -torch.rand(b, s, hv, generator=gen) * decay
    beta = torch.rand(b, s, hv, generator=gen)
    return [x.to(device, dtype) for x in (q, k, v)] + [x.to(device) for x in (g, beta)]


def _run(fn, inputs, work_dtype=None):
    """Output, final state and the gradients of a fixed random loss of both, in work_dtype if given."""
    xs = [(x.to(work_dtype) if work_dtype else x).detach().requires_grad_() for x in inputs]
    o, state = fn(*xs)
    gen = torch.Generator().manual_seed(1)
    wo = torch.randn(o.shape, generator=gen).to(o.device)
    ws = torch.randn(state.shape, generator=gen).to(o.device)
    ((o.float() * wo).sum() + (state.float() * ws).sum()).backward()
    return [o.detach(), state.detach()] + [x.grad for x in xs]


NAMES = ("o", "state", "dq", "dk", "dv", "dg", "dbeta")


@pytest.mark.parametrize(
    "shape,chunk,decay",
    [((1, 40, 1, 2, 16, 32), 16, 1.0), ((2, 37, 2, 2, 32, 16), 16, 20.0), ((1, 70, 1, 2, 32, 16), 64, 1.0)],
    ids=["gqa-s40-c16", "s37-strong-decay", "gqa-s70-c64"],
)
def test_kernel_matches_reference_interpreter(backend, shape, chunk, decay):
    if backend != "interpret":
        pytest.skip("the CUDA runs use realistic shapes below")
    inputs = _inputs(*shape, "cpu", decay=decay)
    got = _run(lambda *a: gated_delta_rule_triton(*a, chunk_size=chunk), inputs)
    ref = _run(lambda *a: gated_delta_rule_chunked(*a, chunk_size=chunk), inputs)
    for name, a, b in zip(NAMES, got, ref):
        assert a.shape == b.shape and a.dtype == b.dtype, name
        assert rel_err(a, b) < 1e-5, (name, rel_err(a, b))


def test_kernel_initial_state_matches_reference_interpreter(backend):
    """An initial state (what context parallel feeds in): output, final state and every gradient, dh0 included."""
    if backend != "interpret":
        pytest.skip("the interpreter checks the maths; the CUDA runs use realistic shapes below")
    b, s, hk, hv, dk, dv = 2, 37, 1, 2, 16, 32
    h0 = torch.randn(b, hv, dk, dv, generator=torch.Generator().manual_seed(3))
    inputs = _inputs(b, s, hk, hv, dk, dv, "cpu") + [h0]
    got = _run(lambda *a: gated_delta_rule_triton(*a[:5], chunk_size=16, initial_state=a[5]), inputs)
    ref = _run(lambda *a: gated_delta_rule_chunked(*a[:5], chunk_size=16, initial_state=a[5]), inputs)
    for name, a, b in zip((*NAMES, "dh0"), got, ref):
        assert a.shape == b.shape and a.dtype == b.dtype, name
        assert rel_err(a, b) < 1e-5, (name, rel_err(a, b))


def test_context_parallel_rule_on_triton_matches_torch(backend):
    """`gated_delta_rule_cp` (two passes, one from the identity state, then the composition) on the kernel
    against the PyTorch path; a CP group of one composes the two halves of the sequence."""
    if backend != "interpret":
        pytest.skip("the GPU runs it at sequence 16384 in tests/distributed/test_cp_deltanet_gpu.py")
    from moecore.parallel.context_deltanet import gated_delta_rule_cp
    from moecore.parallel.dims import Group

    one = Group("cp", [0], 0, None)
    inputs = _inputs(1, 2 * 19, 1, 2, 16, 16, "cpu")  # halves of 19 tokens: 2 kernel chunks of 16 each
    w = torch.randn(1, 2 * 19, 2, 16, generator=torch.Generator().manual_seed(1))
    out = {}
    for b in ("triton", "torch"):
        xs = [x.detach().requires_grad_() for x in inputs]
        o = gated_delta_rule_cp(*xs, chunk_size=16, backend=b, group=one, rule=gated_delta_rule_with_state)
        out[b] = [o.detach(), *torch.autograd.grad((o * w).sum(), xs)]
    for name, a, b in zip(("o", "dq", "dk", "dv", "dg", "dbeta"), out["triton"], out["torch"]):
        assert rel_err(a, b) < 1e-5, (name, rel_err(a, b))


def test_layer_with_triton_backend_matches_torch(backend):
    """The whole Qwen3-Next layer (head dims 8 and 6: masked tiles) through the dispatcher."""
    if backend != "interpret":
        pytest.skip("covered on CUDA by the auto dispatch test")
    cfg = ModelConfig(
        hidden_size=48,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=8,
        linear_value_head_dim=6,
        linear_conv_kernel_dim=4,
        linear_chunk_size=16,
    )
    torch.manual_seed(0)
    layer = GatedDeltaNet(cfg, layer_idx=0)
    x = torch.randn(1, 21, cfg.hidden_size, requires_grad=True)
    out = {}
    for name in ("torch", "triton"):
        layer.backend = name
        y = layer(x)
        grads = torch.autograd.grad(y.pow(2).sum(), [x, *layer.parameters()])
        out[name] = (y.detach(), *grads)
    for a, b in zip(out["triton"], out["torch"]):
        assert rel_err(a, b) < 1e-5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_kernel_matches_float64_reference_cuda(backend, dtype):
    """Qwen3-Next head dims (128/128, 2 value heads per key head), S = 4000 (62.5 chunks of 64)."""
    if backend != "cuda":
        pytest.skip("realistic shapes need a GPU")
    inputs = _inputs(1, 4000, 2, 4, 128, 128, "cuda", dtype=dtype, decay=0.1)  # long memory, as Qwen3-Next
    got = _run(lambda *a: gated_delta_rule_triton(*a, chunk_size=64), inputs)
    ref = _run(lambda *a: gated_delta_rule_chunked(*a, chunk_size=64), inputs, work_dtype=torch.float64)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    errors = {name: rel_err(a, b) for name, a, b in zip(NAMES, got, ref)}
    print(f"gated delta kernel vs float64 reference ({dtype}): " + " ".join(f"{k}={v:.1e}" for k, v in errors.items()))
    assert got[0].dtype == dtype and all(torch.isfinite(x).all() for x in got)
    for name, err in errors.items():
        assert err < tol, (name, err)


def test_kernel_initial_state_matches_float64_reference_cuda(backend):
    """The initial-state path (context parallel's) at Qwen3-Next head dims, fp32, dh0 included."""
    if backend != "cuda":
        pytest.skip("realistic shapes need a GPU")
    h0 = torch.randn(1, 4, 128, 128, generator=torch.Generator().manual_seed(3)).cuda()
    inputs = _inputs(1, 1000, 2, 4, 128, 128, "cuda", decay=0.1) + [h0]
    got = _run(lambda *a: gated_delta_rule_triton(*a[:5], chunk_size=64, initial_state=a[5]), inputs)
    ref = _run(
        lambda *a: gated_delta_rule_chunked(*a[:5], chunk_size=64, initial_state=a[5]), inputs, work_dtype=torch.float64
    )
    errors = {name: rel_err(a, b) for name, a, b in zip((*NAMES, "dh0"), got, ref)}
    print("gated delta kernel with initial state vs float64: " + " ".join(f"{k}={v:.1e}" for k, v in errors.items()))
    for name, err in errors.items():
        assert err < 1e-4, (name, err)


def test_auto_dispatch_picks_triton_on_cuda(backend):
    if backend != "cuda":
        pytest.skip("auto takes the PyTorch path on CPU")
    q, k, v, g, beta = _inputs(2, 100, 2, 4, 128, 128, "cuda", dtype=torch.bfloat16)
    assert torch.equal(gated_delta_rule(q, k, v, g, beta), gated_delta_rule_triton(q, k, v, g, beta)[0])


def test_rejects_what_the_kernel_cannot_take():
    q, k, v, g, beta = _inputs(1, 4, 2, 2, 16, 16, "cpu")
    with pytest.raises(ValueError, match="multiple"):
        gated_delta_rule_triton(
            q, k, torch.zeros(1, 4, 3, 16), g[..., :1].expand(1, 4, 3), beta[..., :1].expand(1, 4, 3)
        )
    if triton_importable() and not torch.cuda.is_available():
        with pytest.MonkeyPatch.context() as mp:
            mp.delenv("TRITON_INTERPRET", raising=False)
            with pytest.raises(ValueError, match="CUDA"):
                gated_delta_rule_triton(q, k, v, g, beta)
    big = torch.zeros(1, 4, 2, 256)
    with pytest.raises(ValueError, match="128"):
        gated_delta_rule_triton(big, big, torch.zeros(1, 4, 2, 256), g, beta)
