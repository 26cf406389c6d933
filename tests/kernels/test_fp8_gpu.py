"""FP8 on a GPU (marked gpu; skipped without an FP8-capable CUDA device): torch's scaled GEMMs against the
emulated maths, and FP8 layers against bf16 within documented relative errors.

Documented bounds (relative Frobenius error against the bf16 layer, random Gaussian data, std-0.02 weights):
FP8 linear forward and gradients < 5% (e4m3) / 8% (e5m2 gradients, hybrid); the MoE layer (router, two
expert GEMMs, SwiGLU) < 9% / 12%. The scaled GEMMs and the emulation of the same quantised operands agree
to bf16 rounding (< 1%). The quantisation kernels themselves are compared bit for bit with their references
by tests/kernels/test_fp8_quant.py (its `cuda` cases).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from moecore.config import ConfigError
from moecore.kernels import fp8_quant as fq
from moecore.kernels.fp8_gemm import E4M3, E5M2, SCALINGS, Fp8Recipe, fp8_linear, fp8_unsupported_reason
from moecore.kernels.fp8_grouped import fp8_expert_ffn

pytestmark = pytest.mark.gpu

BOUND_LINEAR = {E4M3: 0.05, E5M2: 0.08}
BOUND_MOE = {E4M3: 0.09, E5M2: 0.12}
FORMATS = pytest.mark.parametrize("grad_dtype", [E4M3, E5M2], ids=["e4m3", "hybrid"])


def _skip_unless_fp8(scaling: str = "rowwise") -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    reason = fp8_unsupported_reason("cuda", scaling)
    if reason:
        pytest.skip(reason)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


NO_E5M2 = (
    "tensorwise FP8 is refused on GPUs (its training went non-finite); its e5m2 GEMMs are torch's, not kept working"
)


def _hybrid_known_failure(grad_dtype, scaling: str) -> None:
    """Rowwise and blockwise run the hybrid format's e5m2 GEMMs in moecore's Triton kernels (cuBLAS rejects them)."""
    if grad_dtype == E5M2 and scaling == "tensorwise":
        pytest.xfail(NO_E5M2)


@pytest.mark.parametrize(
    "granularity",
    ["tensorwise", "rowwise", "1x128", "128x128"],
)  # fmt: skip
def test_quant_kernels_match_reference_on_cuda(granularity):
    _skip_unless_fp8()
    fns = {
        "tensorwise": (fq.quantize_tensorwise, fq.quantize_tensorwise_reference),
        "rowwise": (fq.quantize_rowwise, fq.quantize_rowwise_reference),
        "1x128": (fq.quantize_1x128, fq.quantize_1x128_reference),
        "128x128": (fq.quantize_128x128, fq.quantize_128x128_reference),
    }[granularity]
    torch.manual_seed(0)
    x = (torch.randn(1000, 768, device="cuda") * torch.logspace(-3, 2, 768, device="cuda")).bfloat16()
    for dtype in (E4M3, E5M2):
        for pow2 in (False, True):
            q, s = fns[0](x, dtype, pow2, impl="triton")
            qr, sr = fns[1](x, dtype, pow2)
            assert torch.equal(s.reshape(sr.shape), sr)
            assert torch.equal(q.view(torch.uint8), qr.view(torch.uint8))


@pytest.mark.parametrize("scaling", SCALINGS)
@FORMATS
def test_fp8_linear_matches_emulation_and_bf16(scaling, grad_dtype):
    _skip_unless_fp8(scaling)
    _hybrid_known_failure(grad_dtype, scaling)
    torch.manual_seed(1)
    x = torch.randn(3, 300, 512, device="cuda", dtype=torch.bfloat16)  # 900 tokens: padded inside
    w = torch.randn(768, 512, device="cuda", dtype=torch.bfloat16) * 0.02
    g = torch.randn(3, 300, 768, device="cuda", dtype=torch.bfloat16)
    res = {}
    for name, recipe in (
        ("real", Fp8Recipe(scaling, grad_dtype)),
        ("emulated", Fp8Recipe(scaling, grad_dtype, emulate=True)),
    ):
        xx, ww = x.clone().requires_grad_(), w.clone().requires_grad_()
        y = fp8_linear(xx, ww, None, recipe)
        y.backward(g)
        res[name] = (y, xx.grad, ww.grad)
    xx, ww = x.clone().requires_grad_(), w.clone().requires_grad_()
    y = F.linear(xx, ww)
    y.backward(g)
    res["bf16"] = (y, xx.grad, ww.grad)
    for got, emu in zip(res["real"], res["emulated"]):
        assert rel(got, emu) < 1e-2
    assert rel(res["real"][0], res["bf16"][0]) < BOUND_LINEAR[E4M3]
    assert rel(res["real"][1], res["bf16"][1]) < BOUND_LINEAR[grad_dtype]
    assert rel(res["real"][2], res["bf16"][2]) < BOUND_LINEAR[grad_dtype]


def _expert_ffn_problem(seed: int):
    """(counts, x, w13, w2, probs, dy) of an 8-expert FFN on the GPU, experts of 0 to 260 rows (none aligned)."""
    torch.manual_seed(seed)
    E, H, Fh = 8, 256, 384
    counts = torch.tensor([100, 0, 37, 260, 1, 128, 50, 24], device="cuda")
    n = int(counts.sum())
    x = torch.randn(n, H, device="cuda", dtype=torch.bfloat16)
    w13 = torch.randn(E, 2 * Fh, H, device="cuda", dtype=torch.bfloat16) * 0.02
    w2 = torch.randn(E, H, Fh, device="cuda", dtype=torch.bfloat16) * 0.02
    p = torch.rand(n, device="cuda")
    g = torch.randn(n, H, device="cuda", dtype=torch.bfloat16)
    return counts, x, w13, w2, p, g


@pytest.mark.parametrize("scaling", SCALINGS)
@FORMATS
def test_fp8_expert_ffn_matches_emulation(scaling, grad_dtype):
    """The FP8 expert FFN on the GPU against its emulation (the same quantisation, fp32 products). They differ where
    h (bf16 on the GPU, fp32 emulated) or a gradient lands on the other side of an FP8 rounding boundary, which
    moves that element by one FP8 step: 2^-3 relative for e4m3, 2^-2 for e5m2 (2 mantissa bits). So the bound on
    what is computed from the gradients is twice as wide in the hybrid format (measured 1.06e-2 for one of them)."""
    _skip_unless_fp8(scaling)
    _hybrid_known_failure(grad_dtype, scaling)
    counts, x, w13, w2, p, g = _expert_ffn_problem(seed=2)
    res = []
    for emulate in (False, True):
        ts = [t.clone().requires_grad_() for t in (x, w13, w2, p)]
        y = fp8_expert_ffn(ts[0], ts[1], ts[2], counts, ts[3], Fp8Recipe(scaling, grad_dtype, emulate=emulate))
        y.backward(g)
        res.append([y] + [t.grad for t in ts])
    for name, got, emu in zip(("y", "dx", "dw13", "dw2", "dprobs"), *res):
        bound = 1e-2 if name == "y" or grad_dtype == E4M3 else 2e-2
        assert rel(got, emu) < bound, (name, rel(got, emu))


@pytest.mark.parametrize("scaling", SCALINGS)
def test_fp8_expert_ffn_with_gpt_oss_biases_matches_emulation(scaling):
    """gpt-oss's experts (both biases, the clamped SwiGLU through the two-kernel path) in the FP8 expert FFN on the
    GPU against its emulation, every gradient the biases' included, with the same bounds as the unbiased case."""
    _skip_unless_fp8(scaling)
    counts, x, w13, w2, p, g = _expert_ffn_problem(seed=3)
    b13 = torch.randn(w13.shape[0], w13.shape[1], device="cuda") * 0.02
    b2 = torch.randn(w2.shape[0], w2.shape[1], device="cuda") * 0.02
    form = {"limit": 0.5, "alpha": 1.702}  # h ~ N(0, 0.32^2): the clamp reaches ~6% of the gates, ~12% of the ups
    res = []
    for emulate in (False, True):
        ts = [t.clone().requires_grad_() for t in (x, w13, w2, p, b13, b2)]
        recipe = Fp8Recipe(scaling, emulate=emulate)
        y = fp8_expert_ffn(ts[0], ts[1], ts[2], counts, ts[3], recipe, b13=ts[4], b2=ts[5], **form)
        y.backward(g)
        res.append([y] + [t.grad for t in ts])
    for name, got, emu in zip(("y", "dx", "dw13", "dw2", "dprobs", "db13", "db2"), *res):
        assert rel(got, emu) < 1e-2, (name, rel(got, emu))


@pytest.mark.parametrize("primary", [False, True], ids=["bf16-weights", "primary-weights"])
def test_fp8_expert_ffn_padding_only_wgrad_operands(primary):
    """Fp8Recipe(padding="wgrad"): torch's grouped FP8 GEMMs for the forward and input gradient on expert row
    offsets that are not multiples of 16 (only the weight-gradient operands padded) give what padding every
    operand gives. The outputs and dx can differ only by the GEMMs' own per-row rounding, and the weight
    gradients see the same padded operands."""
    _skip_unless_fp8("rowwise")
    from moecore.models.fp8 import quantize_primary

    counts, x, w13, w2, p, g = _expert_ffn_problem(seed=4)
    res = []
    for padding in ("all", "wgrad"):
        recipe = Fp8Recipe("rowwise", padding=padding)
        ts = [t.clone().requires_grad_() for t in (x, w13, w2, p)]
        if primary:
            for w in ts[1:3]:
                quantize_primary(w, w.detach(), recipe, grouped=True)
        y = fp8_expert_ffn(ts[0], ts[1], ts[2], counts, ts[3], recipe)
        y.backward(g)
        res.append([y] + [t.grad for t in ts])
    for got, want in zip(*res):
        assert rel(got, want) < 1e-3


def _moe_layer(scaling: str | None, grad_dtype=E4M3):
    from moecore.config import MoEConfig
    from moecore.models.fp8 import apply_fp8
    from moecore.moe.layer import MoELayer

    cfg = MoEConfig(num_experts=8, router_topk=2, ffn_hidden_size=256, shared_expert_intermediate_size=512)
    cfg.validate()
    torch.manual_seed(3)
    with torch.device("cuda"):
        layer = MoELayer(cfg, 512).to(torch.bfloat16)
    if scaling is not None:
        done = apply_fp8(layer, Fp8Recipe(scaling, grad_dtype), ["experts", "shared_experts"])
        assert "experts" in done["fp8"] and len(done["fp8"]) == 4 and not done["bf16"]
    return layer


@pytest.mark.parametrize("scaling", SCALINGS)
@FORMATS
def test_fp8_moe_layer_close_to_bf16(scaling, grad_dtype):
    _skip_unless_fp8(scaling)
    _hybrid_known_failure(grad_dtype, scaling)
    torch.manual_seed(4)
    x = torch.randn(2, 1024, 512, device="cuda", dtype=torch.bfloat16)
    g = torch.randn_like(x)
    res = []
    for s in (None, scaling):
        layer = _moe_layer(s, grad_dtype)
        xx = x.clone().requires_grad_()
        y, _ = layer(xx)
        y.backward(g)
        grads = {n: p.grad for n, p in layer.named_parameters()}
        res.append((y, xx.grad, grads))
        if s is not None:
            assert layer.experts.last_path == "fp8"
    (yb, dxb, gb), (yf, dxf, gf) = res
    assert rel(yf, yb) < BOUND_MOE[E4M3]
    assert rel(dxf, dxb) < BOUND_MOE[grad_dtype]
    for name in ("experts.w13", "experts.w2", "shared_experts.up_proj.weight", "router.weight"):
        assert rel(gf[name], gb[name]) < BOUND_MOE[grad_dtype], name


GPU_TINY = [  # every GEMM dimension a multiple of 128 (blockwise)
    "model.hidden_size=256",
    "model.num_layers=2",
    "model.num_attention_heads=2",
    "model.num_kv_heads=2",
    "model.head_dim=128",
    "model.ffn_hidden_size=512",
    "moe.num_experts=8",
    "moe.ffn_hidden_size=256",
    "moe.shared_expert_intermediate_size=256",
    "moe.first_k_dense_replace=1",
    "train.seq_length=256",
    "train.global_batch_size=4",
    "train.micro_batch_size=2",
    "train.steps=4",
    "train.eval_interval=0",
    "optim.warmup_steps=1",
    "log.interval=1",
    "log.progress=false",
    "log.tensorboard=false",
    "log.oom_snapshot=false",
    "checkpoint.async_save=false",
]


def _losses(tmp_path, name: str, *extra: str) -> list[float]:
    import json

    from moecore.config import load_config
    from moecore.train.loop import train

    train(load_config("tiny-moe", GPU_TINY + [f"train.run_dir={tmp_path / name}", *extra]))
    rows = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows if "loss" in r]


@pytest.mark.parametrize("scaling", SCALINGS)
def test_fp8_training_tracks_bf16_on_gpu(tmp_path, scaling):
    """`moecore train` with train.precision=fp8, in both formats: four steps within 1% of the bf16 run's losses,
    every FP8 path (experts, shared experts, dense MLP, attention) exercised; the tensorwise recipe, refused on
    GPUs, is refused in one line."""
    _skip_unless_fp8(scaling)
    # fp8.wgrad=fp8: the default (auto) computes these tiny weights' gradients in bf16
    fp8 = ["train.precision=fp8", f"fp8.recipe={scaling}", "fp8.wgrad=fp8"]
    if scaling == "tensorwise":
        with pytest.raises(ConfigError, match="fp8.recipe='tensorwise'"):
            _losses(tmp_path, "fp8-e4m3", *fp8)
        return
    ref = _losses(tmp_path, "bf16", "train.precision=bf16")
    for fmt in ("e4m3", "hybrid"):
        got = _losses(tmp_path, f"fp8-{fmt}", *fp8, f"fp8.format={fmt}")
        assert len(got) == len(ref) == 4
        for a, b in zip(got, ref):
            assert abs(a - b) / b < 1e-2, (fmt, got, ref)


@pytest.mark.parametrize(
    "scaling,layout",
    [("rowwise", []), ("blockwise", []), ("blockwise", ["parallel.fsdp=true"])],
    ids=["rowwise", "blockwise", "blockwise-fsdp"],
)  # tensorwise: refused on GPUs (test above); under FSDP the blockwise weights are all-gathered as FP8
def test_fp8_primary_weights_on_gpu(tmp_path, scaling, layout):
    """FP8 primary weights compute exactly what the run without them computes (same quantised weights)."""
    _skip_unless_fp8(scaling)
    base = ["train.precision=fp8", f"fp8.recipe={scaling}", *layout]
    ref = _losses(tmp_path, "plain", *base)
    got = _losses(tmp_path, "primary", *base, "fp8.primary_weights=true")
    assert got == ref


def test_blockwise_gemms_compile_once_for_any_routing():
    """The padded row count changes with the routing every training step; the blockwise kernels must not be
    recompiled for each new count (a compile-time program count did that: seconds per step)."""
    _skip_unless_fp8("blockwise")
    from moecore.kernels import fp8_block_gemm as fbg
    from moecore.kernels.fp8_gemm import quant_rows
    from moecore.kernels.fp8_grouped import quant_cols, quant_weights
    from tests.compiled_kernels import compiled_variants

    recipe, dev = Fp8Recipe("blockwise"), torch.device("cuda")
    w = quant_weights(torch.randn(4, 256, 256, device=dev) * 0.02, recipe)
    seen = []
    for blocks in ([1, 0, 2, 1], [3, 1, 0, 2], [2, 2, 2, 5]):  # 128-row blocks per expert: P = 512, 768, 1408
        counts = torch.tensor(blocks, device=dev) * 128
        P = int(counts.sum())
        a = quant_rows(torch.randn(P, 256, device=dev), recipe, E4M3)
        fbg.block_gemm_nt(a.q, a.s, w.q, w.s, counts, torch.bfloat16)
        cols = quant_cols(torch.randn(P, 256, device=dev), counts, recipe, E4M3)
        fbg.block_gemm_tn(cols.q, cols.s, cols.q, cols.s, counts, torch.bfloat16)
        seen.append((compiled_variants(fbg._block_nt_kernel), compiled_variants(fbg._block_tn_kernel)))
    assert seen[1] == seen[2], seen
