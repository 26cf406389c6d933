"""Qwen3-Next against transformers: gated full attention, zero-centred RMSNorm, the hybrid stack.

Each test builds a tiny random transformers module, copies its weights into ours by name and
compares outputs in fp32 (tolerance 1e-4 * max(1, max |reference|), as for every family).
"""

from __future__ import annotations

import pytest
import torch

from moecore.config import Config, ModelConfig
from moecore.models.attention import Attention
from moecore.models.norms import RMSNorm
from moecore.models.transformer import MoETransformer

transformers = pytest.importorskip("transformers")
from transformers.models.qwen3_next import modeling_qwen3_next as hf  # noqa: E402

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, VOCAB = 64, 4, 2, 16, 97
LAYER_TYPES = ["linear_attention", "linear_attention", "full_attention", "linear_attention"]


def _close(ours: torch.Tensor, ref: torch.Tensor) -> None:
    tol = 1e-4 * max(1.0, ref.abs().max().item())
    err = (ours - ref).abs().max().item()
    assert err <= tol, f"max abs diff {err:.3g} > {tol:.3g}"


def _hf_config(**over) -> transformers.Qwen3NextConfig:
    kw = dict(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=96,
        num_hidden_layers=len(LAYER_TYPES),
        layer_types=LAYER_TYPES,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=16,
        linear_value_head_dim=8,
        linear_conv_kernel_dim=4,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
        rms_norm_eps=1e-6,
        max_position_embeddings=256,
        num_experts=0,
        tie_word_embeddings=False,
    )
    kw.update(over)
    cfg = transformers.Qwen3NextConfig(**kw)
    cfg._attn_implementation = "eager"
    return cfg


def _model_config(**over) -> ModelConfig:
    kw = dict(
        family="qwen3_next",
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        ffn_hidden_size=96,
        num_layers=len(LAYER_TYPES),
        layer_types=list(LAYER_TYPES),
        num_attention_heads=HEADS,
        num_kv_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=16,
        linear_value_head_dim=8,
        linear_conv_kernel_dim=4,
        linear_chunk_size=16,
        partial_rotary_factor=0.25,
        rope_theta=10000.0,
        norm_eps=1e-6,
        norm_zero_centered=True,
        qk_norm=True,
        attn_output_gate=True,
        max_position_embeddings=256,
        fused_cross_entropy=False,
    )
    kw.update(over)
    cfg = ModelConfig(**kw)
    cfg.validate()
    return cfg


def _randomise(module: torch.nn.Module, seed: int = 0) -> None:
    """Random values everywhere (norm offsets too), scaled so that activations stay O(1)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            scale = 0.1 if p.dim() >= 2 else 0.3
            p.copy_(
                torch.randn(p.shape, generator=gen) * scale + (1.0 if name.endswith("linear_attn.norm.weight") else 0.0)
            )


def test_zero_centred_rmsnorm_matches_transformers():
    ref = hf.Qwen3NextRMSNorm(HIDDEN, eps=1e-6)
    _randomise(ref)
    ours = RMSNorm(HIDDEN, 1e-6, zero_centered=True)
    ours.load_state_dict(ref.state_dict())
    x = torch.randn(3, 5, HIDDEN)
    _close(ours(x), ref(x))
    assert torch.equal(RMSNorm(8, zero_centered=True).weight, torch.zeros(8))  # identity at init


@pytest.mark.parametrize("seq", [1, 19])
def test_gated_attention_matches_transformers(seq):
    """q_proj emits query+gate per head, sigmoid(gate) * attention before o_proj, zero-centred q/k norm,
    rotary on the first quarter of each head."""
    hf_cfg = _hf_config()
    ref = hf.Qwen3NextAttention(hf_cfg, layer_idx=2)
    _randomise(ref)
    ours = Attention(_model_config(), layer_idx=2)
    ours.load_state_dict(ref.state_dict())
    x = torch.randn(2, seq, HIDDEN, generator=torch.Generator().manual_seed(1))
    pos = torch.arange(seq)
    cos, sin = hf.Qwen3NextRotaryEmbedding(hf_cfg)(x, pos[None])
    with torch.no_grad():
        _close(ours(x, pos), ref(x, (cos, sin), attention_mask=_causal(seq))[0])


def _causal(seq: int) -> torch.Tensor:
    return torch.full((seq, seq), float("-inf")).triu(1)[None, None]


def _hf_to_ours_dense(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers Qwen3NextForCausalLM names -> ours (dense layers only)."""
    out = {}
    for name, t in sd.items():
        n = name.removeprefix("model.")
        n = n.replace("embed_tokens.", "embed.").replace(".input_layernorm.", ".attn_norm.")
        n = n.replace(".post_attention_layernorm.", ".mlp_norm.")
        n = n.replace(".self_attn.", ".attn.").replace(".linear_attn.", ".attn.")
        out[n] = t
    return out


def test_dense_hybrid_stack_matches_transformers():
    """The hybrid layer layout (DeltaNet, DeltaNet, gated attention, DeltaNet) with dense MLPs, logits
    and zero-centred norms; sequence longer than the DeltaNet chunk and not a multiple of it."""
    torch.manual_seed(0)
    ref = transformers.Qwen3NextForCausalLM(_hf_config()).eval()
    _randomise(ref)
    cfg = Config(model=_model_config())
    cfg.moe.num_experts = 0
    ours = MoETransformer(cfg).eval()
    ours.load_state_dict(_hf_to_ours_dense(ref.state_dict()), strict=True)
    ids = torch.randint(0, VOCAB, (2, 37), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        _close(ours(ids).logits, ref(ids).logits)
