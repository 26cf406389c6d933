"""The planner's DSA terms (moecore/plan/activations.py `dsa_modules`) against the bytes a DSA attention block
saves on the CPU (`moecore.bench.saved_memory.saved_bytes`: distinct storages, parameters and the block input
excluded), tiny DeepSeek-V3.2 / GLM-5 layers, fp32 and bf16.

The CPU's RMSNorm is the unfused reference (fp32 copies of its input); the planner models the fused kernel, which
keeps the input and fp32 1/rms (moecore/kernels/rmsnorm.py `_RMSNorm`), so the test runs the norms through a
Function that saves exactly those. The measurement must equal the planner's count plus what it leaves out on
purpose, computed here, not a tolerance: the rotary cos/sin tables ([S, dr] each, per call of the rotary
embedding) and the [B, 1, 1] batch index of the main attention's gather (8 B bytes).
"""

from __future__ import annotations

import pytest
import torch

from moecore.bench.saved_memory import saved_bytes
from moecore.config import load_config
from moecore.models import norms
from moecore.models.decoder_layer import build_attention
from moecore.plan.activations import ActContext, attention_modules
from moecore.plan.layout import layout_of

B, S = 2, 64


class _FusedLikeNorm(torch.autograd.Function):
    """The fused RMSNorm's saves (its input and fp32 1/rms) with the reference's maths."""

    @staticmethod
    def forward(ctx, x, weight, eps, zero_centered):
        rstd = torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)
        ctx.save_for_backward(x, weight, rstd)
        ctx.zero_centered = zero_centered
        w = weight.float() + 1.0 if zero_centered else weight.float()
        return (x.float() * rstd * w).to(x.dtype)

    @staticmethod
    def backward(ctx, dy):
        x, weight, rstd = ctx.saved_tensors
        w = weight.float() + 1.0 if ctx.zero_centered else weight.float()
        h = x.float() * rstd
        g = dy.float() * w
        dx = rstd * (g - h * (g * h).mean(-1, keepdim=True))
        return dx.to(x.dtype), (dy.float() * h).reshape(-1, h.shape[-1]).sum(0).to(weight.dtype), None, None


def _measure(recipe: str, over: list[str], layer: int, dtype: torch.dtype, monkeypatch) -> tuple[int, object]:
    monkeypatch.setattr(norms, "rms_norm", lambda x, w, eps, zc=False: _FusedLikeNorm.apply(x, w, eps, zc))
    cfg = load_config(recipe, [*over, f"train.seq_length={S}", f"train.micro_batch_size={B}"])
    torch.manual_seed(0)
    attn = build_attention(cfg.model, layer).to(dtype).train()
    frozen = cfg.model.dsa_stage == "dense_warmup"  # the model trains only the indexers (transformer.py)
    if frozen:
        for name, p in attn.named_parameters():
            p.requires_grad_(name.startswith("indexer."))
    x = torch.randn(B, S, cfg.model.hidden_size, dtype=dtype, requires_grad=not frozen)
    args: tuple = (x, torch.arange(S))
    if attn.passes_topk:
        args += (torch.randint(0, S, (B, S, min(cfg.model.index_topk, S))),)  # the full layer's top-k
    out, saved = saved_bytes(lambda: attn(*args), exclude=[*attn.parameters(), *args])
    y = out[0] if isinstance(out, tuple) else out
    loss = attn.pop_indexer_loss()
    (loss if frozen else y.float().square().mean() + (loss if loss is not None else 0)).backward()  # usable
    return sum(t.untyped_storage().nbytes() for t in saved), cfg


def _planned(cfg, layer: int, dtype: torch.dtype) -> dict[str, float]:
    b = torch.finfo(dtype).bits // 8
    mods = attention_modules(cfg, layer, layout_of(cfg, 1), ActContext(B * S, b, b, False, 1.0))
    return {k: v for k, v in mods.items() if k not in ("norm_in", "norm_out")}  # the block input is excluded


def _rotary(cfg, dtype: torch.dtype) -> int:
    return 2 * S * cfg.model.qk_rope_head_dim * torch.finfo(dtype).bits // 8


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sparse_stage_layer_with_an_indexer(dtype, monkeypatch) -> None:
    """DeepSeek-V3.2's sparse stage: the absorbed MLA over the top-k (CPU reference) and the indexer's sparse KL."""
    measured, cfg = _measure("tiny-deepseek-v32", [], 0, dtype, monkeypatch)
    planned = _planned(cfg, 0, dtype)
    assert {"indexer", "sparse_attn"} <= planned.keys() and "mla_up" not in planned and "core_attn" not in planned
    assert measured == sum(planned.values()) + _rotary(cfg, dtype) + 8 * B  # the main attention's batch index


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_glm5_shared_layer_has_no_indexer_term(dtype, monkeypatch) -> None:
    """GLM-5's shared layer attends to the given top-k: the sparse attention's tensors, nothing of an indexer."""
    measured, cfg = _measure("tiny-glm-5", [], 1, dtype, monkeypatch)
    planned = _planned(cfg, 1, dtype)
    assert "indexer" not in planned
    assert measured == sum(planned.values()) + _rotary(cfg, dtype) + 8 * B


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dense_warmup_indexer_term(dtype, monkeypatch) -> None:
    """dense_warmup, as the model runs it (everything but the indexer frozen, the input without gradient): the
    block keeps the indexer term, the q latent the indexer reads (part of mla_latent; its other input, the block
    input, is the planner's norm_out and excluded here) and the rotary tables of its own rotary call."""
    measured, cfg = _measure("tiny-deepseek-v32", ["model.dsa_stage=dense_warmup"], 0, dtype, monkeypatch)
    planned = _planned(cfg, 0, dtype)
    b, m = torch.finfo(dtype).bits // 8, cfg.model
    assert measured == planned["indexer"] + B * S * m.q_lora_rank * b + _rotary(cfg, dtype)
    # the planner counts the dense MLA on top (an upper bound of the frozen warm-up)
    assert {"mla_up", "core_attn", "mla_latent"} <= planned.keys()


def test_sparse_terms_on_gpus_follow_the_kernel() -> None:
    """The fused (GPU) count: the Triton kernel keeps q~, kv~, the top-k, its output and lse
    (moecore/kernels/sparse_mla.py `_SparseMLA`) instead of the reference's gathered [T, K, D] rows."""
    cfg = load_config("tiny-deepseek-v32", [f"train.seq_length={S}", f"train.micro_batch_size={B}"])
    m, t = cfg.model, B * S
    n, big_d, r, k = m.num_attention_heads, m.kv_lora_rank + m.qk_rope_head_dim, m.kv_lora_rank, m.index_topk
    gpu = attention_modules(cfg, 0, layout_of(cfg, 1), ActContext(t, 2, 2, True, 1.0))
    kernel = t * (n * big_d * 2 + big_d * 2 + 8 * k + n * r * 2 + 4 * n)
    assert gpu["sparse_attn"] == t * n * (m.qk_nope_head_dim + m.qk_rope_head_dim) * 2 + t * n * r * 2 + kernel


def test_stage_estimate_counts_shared_and_full_indexer_layers_apart() -> None:
    """A GLM-5 stage holds layers with and without an indexer: the memory estimate counts each kind, so marking
    a layer's indexer shared lowers the activations by exactly what that layer then no longer keeps."""
    from moecore.plan.activations import dsa_modules
    from moecore.plan.memory import PlanOptions, estimate_memory

    cfg = load_config("tiny-glm-5", [f"train.seq_length={S}", f"train.micro_batch_size={B}"])
    kinds = cfg.model.indexer_types
    assert kinds is not None and "shared" in kinds and "full" in kinds
    full = load_config("tiny-glm-5", [f"train.seq_length={S}", f"train.micro_batch_size={B}"])
    full.model.indexer_types = ["full"] * len(kinds)
    lay = layout_of(cfg, 1)
    est, est_full = estimate_memory(cfg, lay, PlanOptions()), estimate_memory(full, lay, PlanOptions())
    opts = PlanOptions()
    from moecore.plan.memory import act_context, micro_batches_per_step
    from moecore.plan.params import precision_mode

    c = act_context(cfg, lay, precision_mode(cfg, lay, micro_batches_per_step(cfg, lay), opts.device), opts)

    def kept(config, layer: int) -> float:
        return sum(v for v in dsa_modules(config, layer, lay, c).values() if v is not None)

    shared = kinds.index("shared")
    per_layer = kept(full, shared) - kept(cfg, shared)  # its indexer, and on GPUs its top-k (the full layer's)
    assert per_layer > dsa_modules(full, shared, lay, c)["indexer"] > 0
    assert est_full.activations - est.activations == pytest.approx(kinds.count("shared") * per_layer, rel=1e-9)
