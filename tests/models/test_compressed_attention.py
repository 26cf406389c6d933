"""DeepSeek-V4's attention (moecore/models/compressed_attention.py) against transformers' DeepseekV4Attention.

A tiny config whose sequence (37 tokens) is no multiple of either compression rate (4 for CSA, 8 for HCA), a
sliding window of 6, a YaRN compress rope; every parameter random and non-zero (sinks, position biases and norm
weights included). Compared in fp32: the output, the input's gradient and every parameter's gradient, for each
of the three layer kinds, and the CSA indexer's selection. A set of one-detail mistakes must each change the
output, so that the comparison is not vacuous.
"""

from __future__ import annotations

import math
import types

import pytest
import torch

from moecore.config import ModelConfig
from moecore.models.compressed_attention import CompressedAttention, sink_attention

transformers = pytest.importorskip("transformers")
modeling = pytest.importorskip("transformers.models.deepseek_v4.modeling_deepseek_v4")
from transformers.masking_utils import create_sliding_window_causal_mask  # noqa: E402
from transformers.models.deepseek_v4.configuration_deepseek_v4 import DeepseekV4Config  # noqa: E402

KINDS = ["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"]
SEQ, BATCH = 37, 2
YARN = {"factor": 4.0, "original_max_position_embeddings": 16}
SHAPE = dict(
    hidden_size=64, num_attention_heads=4, head_dim=32, q_lora_rank=16, o_groups=2, o_lora_rank=16,
    index_n_heads=4, index_head_dim=16, index_topk=3, sliding_window=6, rope_theta=10000.0,
    compress_rope_theta=1000.0, max_position_embeddings=64,
)  # fmt: skip


def hf_config() -> DeepseekV4Config:
    cfg = DeepseekV4Config(
        **SHAPE,
        partial_rotary_factor=8 / 32,
        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
        num_hidden_layers=len(KINDS),
        layer_types=KINDS,
        rope_parameters={"rope_type": "yarn", **YARN},
        vocab_size=32,
        n_routed_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=16,
    )
    cfg._attn_implementation = "eager"
    return cfg


def our_config(hf: DeepseekV4Config) -> ModelConfig:
    cfg = ModelConfig()
    fields = dict(
        SHAPE,
        attention_type="compressed",
        num_layers=len(KINDS),
        layer_types=KINDS,
        qk_rope_head_dim=hf.qk_rope_head_dim,
        norm_eps=hf.rms_norm_eps,
        rope_scaling=None,  # transformers' "main" rope is always plain
        compress_rope_scaling={"type": "yarn", **YARN},  # attention_factor left out: the module makes it 1
        csa_compress_rate=4,
        hca_compress_rate=8,
    )
    for name, value in fields.items():  # setattr: works while ModelConfig still lacks a field
        setattr(cfg, name, value)
    return cfg


def our_name(hf_name: str) -> str:
    return hf_name.replace("indexer.scorer.weights_proj", "indexer.weights_proj")


def build(layer_idx: int) -> tuple[torch.nn.Module, CompressedAttention, DeepseekV4Config]:
    hf = hf_config()
    ref = modeling.DeepseekV4Attention(hf, layer_idx).float()
    gen = torch.Generator().manual_seed(100 + layer_idx)
    with torch.no_grad():
        for name, p in ref.named_parameters():
            # norm weights around 1, everything else (sinks and position biases too) random and non-zero
            noise = torch.randn(p.shape, generator=gen, dtype=p.dtype)
            p.copy_(1.0 + 0.2 * noise if "norm" in name else (0.3 if p.ndim > 1 else 0.5) * noise)
    ours = CompressedAttention(our_config(hf), layer_idx)
    ours.load_state_dict({our_name(k): v for k, v in ref.state_dict().items()})
    return ref, ours, hf


def inputs(hf: DeepseekV4Config, seed: int) -> tuple[torch.Tensor, torch.Tensor, dict, torch.Tensor]:
    x = torch.randn(BATCH, SEQ, hf.hidden_size, generator=torch.Generator().manual_seed(seed))
    pos = torch.arange(SEQ)
    rotary = modeling.DeepseekV4RotaryEmbedding(hf)
    pe = {kind: rotary(x, pos[None], kind) for kind in ("main", "compress")}
    mask = create_sliding_window_causal_mask(
        config=hf, inputs_embeds=x, attention_mask=None, cache=None, position_ids=pos[None]
    )  # [B, 1, S, S] additive: 0 where kv_idx in (q_idx - window, q_idx], dtype-min elsewhere
    return x, pos, pe, mask


@pytest.mark.parametrize("kernel", ["eager", "sparse"])
@pytest.mark.parametrize("layer_idx", range(len(KINDS)), ids=KINDS)
def test_matches_transformers(layer_idx: int, kernel: str) -> None:
    """`kernel`: the eager reference, or model.compressed_attention_kernel=sparse (each query's window and picked
    rows through the sparse MLA kernel's reference on the CPU, the sinks from its log-sum-exp)."""
    ref, ours, hf = build(layer_idx)
    if kernel == "sparse":
        ours.kernel = "sparse"
    x, pos, pe, mask = inputs(hf, layer_idx)
    x_ref, x_ours = x.clone().requires_grad_(), x.clone().requires_grad_()
    out_ref = ref(x_ref, pe, pos[None], mask)[0]
    out = ours(x_ours, pos)
    scale = out_ref.abs().max().item()
    assert scale > 1.0
    torch.testing.assert_close(out, out_ref, rtol=0, atol=1e-6 * scale)

    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(7))
    (out_ref * grad_out).sum().backward()
    (out * grad_out).sum().backward()
    g = x_ref.grad.abs().max().item()
    torch.testing.assert_close(x_ours.grad, x_ref.grad, rtol=0, atol=1e-5 * g)
    ours_params = dict(ours.named_parameters())
    assert len(ours_params) == len(list(ref.parameters()))
    for name, p_ref in ref.named_parameters():
        p = ours_params[our_name(name)]
        if ".indexer." in name:  # top-k selection: no gradient reaches the indexer, in either implementation
            assert p_ref.grad is None and p.grad is None, name
            continue
        assert p.grad is not None and p_ref.grad.abs().max() > 0, name
        torch.testing.assert_close(p.grad, p_ref.grad, rtol=0, atol=1e-5 * p_ref.grad.abs().max().item(), msg=name)


def test_indexer_selection_matches_transformers() -> None:
    layer_idx = KINDS.index("compressed_sparse_attention")
    ref, ours, hf = build(layer_idx)
    x, pos, pe, _ = inputs(hf, 11)
    with torch.no_grad():
        q_latent = ref.q_a_norm(ref.q_a_proj(x))
        picks = ref.compressor.indexer(x, q_latent, pos[None], None, layer_idx)  # [B, S, k], -1: none
        n = SEQ // 4
        expected = torch.zeros(BATCH, SEQ, n + 1, dtype=torch.bool)
        expected = expected.scatter(-1, picks.masked_fill(picks < 0, n), True)[..., :n]
        cos, sin = ours._cos_sin(pos)
        cos_e, sin_e = ours._cos_sin(torch.arange(n) * 4)
        ready = (torch.arange(n)[None, :] + 1) * 4 <= pos[:, None] + 1
        got = ours.compressor.indexer.select(x, q_latent, ready, cos, sin, cos_e, sin_e)
    assert torch.equal(got, expected)
    # every ready entry while there are at most k = 3 of them (none before the first window completes), then
    # exactly 3 of the 4..9 ready ones: the selection is not trivial
    assert torch.equal(got.sum(-1), ready.sum(-1).clamp(max=3).expand(BATCH, -1)) and ready.sum(-1).max() == n
    assert not (got & ~ready).any()


def _break_sinks(m: CompressedAttention) -> None:
    torch.nn.init.zeros_(m.sinks)


def _break_position_bias(m: CompressedAttention) -> None:
    torch.nn.init.zeros_(m.compressor.position_bias)


def _break_topk(m: CompressedAttention) -> None:
    m.compressor.indexer.topk += 1


def _break_window(m: CompressedAttention) -> None:
    m.window += 1


def _break_yarn_factor(m: CompressedAttention) -> None:  # YaRN's own cos/sin scale 0.1 ln(factor) + 1
    m.rotary.attention_factor = 0.1 * math.log(YARN["factor"]) + 1.0


@pytest.mark.parametrize(
    "kind,mistake",
    [
        ("sliding_attention", _break_sinks),
        ("sliding_attention", _break_window),
        ("compressed_sparse_attention", _break_topk),
        ("compressed_sparse_attention", _break_position_bias),
        ("heavily_compressed_attention", _break_position_bias),
        ("heavily_compressed_attention", _break_yarn_factor),
    ],
    ids=lambda v: v if isinstance(v, str) else v.__name__,
)
def test_one_wrong_detail_is_caught(kind: str, mistake) -> None:
    ref, ours, hf = build(KINDS.index(kind))
    x, pos, pe, mask = inputs(hf, 3)
    with torch.no_grad():
        out_ref = ref(x, pe, pos[None], mask)[0]
        mistake(ours)
        diff = (ours(x, pos) - out_ref).abs().max().item()
    assert diff > 1e-3 * out_ref.abs().max().item()


def test_query_that_sees_nothing_gives_zero() -> None:
    q = torch.randn(1, 3, 2, 8, requires_grad=True)
    kv = torch.randn(1, 4, 8, requires_grad=True)
    sinks = torch.randn(2, requires_grad=True)
    visible = torch.tensor([[[False] * 4, [True, False, False, False], [True, True, False, True]]])
    out = sink_attention(q, kv, visible, sinks, 8**-0.5)
    assert torch.equal(out[:, 0], torch.zeros_like(out[:, 0]))
    out.sum().backward()
    assert all(torch.isfinite(t.grad).all() for t in (q, kv, sinks))


def test_refuses_a_tensor_parallel_degree_that_splits_a_group() -> None:
    cfg = our_config(hf_config())  # 4 heads in 2 output groups
    dims = types.SimpleNamespace(tp=4, cp=1, tp_group=types.SimpleNamespace(rank=0, size=4), sequence_parallel=False)
    with pytest.raises(ValueError, match=r"parallel\.tp=4 must divide .*o_groups"):
        CompressedAttention(cfg, 0, dims)
