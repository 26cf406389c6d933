"""Qwen3-Next against transformers: gated full attention, zero-centred RMSNorm, the hybrid stack,
import/export of whole MoE checkpoints, one training step, and the recipes.

Each test builds a tiny random transformers module, copies its weights into ours (by name, or through
`moecore.hf`) and compares outputs in fp32 (tolerance 1e-4 * max(1, max |reference|), as for every family).
"""

from __future__ import annotations

import json

import pytest
import torch

from moecore.config import Config, ModelConfig, load_config
from moecore.hf import load_pretrained, save_pretrained
from moecore.hf.families import qwen3_next as family
from moecore.models.attention import Attention
from moecore.models.norms import RMSNorm
from moecore.models.transformer import MoETransformer

transformers = pytest.importorskip("transformers")
from hf_parity import build_hf, import_export_parity, tokens, train_step_parity  # noqa: E402
from transformers.models.qwen3_next import modeling_qwen3_next as hf  # noqa: E402

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, VOCAB = 64, 4, 2, 16, 97
LAYER_TYPES = ["linear_attention", "linear_attention", "full_attention", "linear_attention"]
# Gated DeltaNet shape: the same field names in transformers' config and ours.
LINEAR = dict(
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=16,
    linear_value_head_dim=8,
    linear_conv_kernel_dim=4,
)


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
        **LINEAR,
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
        **LINEAR,
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


# --------------------------------------------------------------------------------------------------
# Whole checkpoints through moecore.hf (MoE with gated shared expert)
# --------------------------------------------------------------------------------------------------


def _moe_config(**over) -> transformers.Qwen3NextConfig:
    kw = dict(num_experts=6, num_experts_per_tok=2, moe_intermediate_size=24, shared_expert_intermediate_size=40)
    kw.update(over)
    return _hf_config(**kw)


def test_import_export_hybrid_moe(tmp_path):
    """Layer 1 dense (mlp_only_layers), the rest MoE; imported logits also match on a sequence longer than a
    DeltaNet chunk and not a multiple of it; the export loads in transformers with the same logits."""
    ref = build_hf(_moe_config(mlp_only_layers=[1]))
    ours, out = import_export_parity(ref, tmp_path)
    m, e = ours.cfg.model, ours.cfg.moe
    assert m.layer_types == LAYER_TYPES and m.partial_rotary_factor == 0.25 and m.head_dim == HEAD_DIM
    assert m.norm_zero_centered and m.attn_output_gate and m.qk_norm and not m.qkv_bias
    assert (m.linear_num_key_heads, m.linear_num_value_heads, m.linear_key_head_dim, m.linear_value_head_dim) == (
        2,
        4,
        16,
        8,
    )
    assert e.shared_expert_gate and e.shared_expert_intermediate_size == 40 and e.norm_topk_prob
    assert [int(layer.is_moe) for layer in ours.layers] == [1, 0, 1, 1]
    written = json.loads((out / "config.json").read_text())
    assert written["full_attention_interval"] == 3 or written["layer_types"] == LAYER_TYPES
    ids = tokens(VOCAB, seq=80, seed=4)
    with torch.no_grad():
        _close(ours(ids).logits, ref(ids).logits)


def test_import_export_options(tmp_path):
    """full_attention_interval instead of layer_types, q/k/v/o biases, tied embeddings, no renormalisation,
    every second layer MoE, half the head rotated with linear rope scaling, GVA ratio 1."""
    cfg = _moe_config(
        layer_types=None,
        full_attention_interval=2,
        attention_bias=True,
        tie_word_embeddings=True,
        norm_topk_prob=False,
        decoder_sparse_step=2,
        linear_num_value_heads=2,
        rope_parameters={"rope_type": "linear", "rope_theta": 5000.0, "factor": 2.0, "partial_rotary_factor": 0.5},
    )
    ours, _ = import_export_parity(build_hf(cfg), tmp_path)
    m, e = ours.cfg.model, ours.cfg.moe
    assert m.layer_types == ["linear_attention", "full_attention"] * 2
    assert (m.qkv_bias, m.attn_out_bias, m.tie_embeddings, m.partial_rotary_factor) == (True, True, True, 0.5)
    assert m.rope_scaling == {"type": "linear", "factor": 2.0} and m.rope_theta == 5000.0
    assert not e.norm_topk_prob and [int(layer.is_moe) for layer in ours.layers] == [0, 1, 0, 1]


def test_config_announcing_mtp_without_its_tensors(tmp_path):
    """config.json announcing the MTP module (mtp_* fields) while the weights lack it imports without MTP
    (the MTP module itself: tests/hf/test_qwen3_next_mtp.py)."""
    ref = build_hf(_moe_config(num_hidden_layers=2, layer_types=["linear_attention", "full_attention"]))
    ref.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config.update(mtp_num_hidden_layers=1, mtp_use_dedicated_embeddings=False)
    (tmp_path / "config.json").write_text(json.dumps(config))
    ours = load_pretrained(tmp_path)
    assert ours.mtp is None
    ids = tokens(VOCAB)
    with torch.no_grad():
        _close(ours(ids).logits, ref(ids).logits)


def test_train_step(tmp_path):
    """LM loss, aux loss and every gradient (DeltaNet parameters included) against transformers."""
    two = ["linear_attention", "full_attention"]
    ref = build_hf(_moe_config(num_hidden_layers=2, layer_types=two, router_aux_loss_coef=0.3))
    ref.save_pretrained(tmp_path)
    train_step_parity(load_pretrained(tmp_path), ref)


def test_refusals():
    with pytest.raises(ValueError, match="linear_num_key_heads"):
        family.config_from_hf({**_moe_config().to_dict(), "linear_num_key_heads": 0})
    with pytest.raises(ValueError, match="layer_types"):
        family.config_from_hf({**_moe_config().to_dict(), "layer_types": ["sliding_attention"] * 4})
    with pytest.raises(ValueError, match="mamba_ssm_dtype"):
        family.config_from_hf({**_moe_config().to_dict(), "mamba_ssm_dtype": "float32"})
    cfg = load_config("tiny-qwen3-next")
    cfg.moe.shared_expert_gate = False
    with pytest.raises(ValueError, match="moe.shared_expert_gate"):
        family.config_to_hf(cfg)
    cfg = load_config("tiny-qwen3-next")
    cfg.model.norm_zero_centered = False
    with pytest.raises(ValueError, match="model.norm_zero_centered"):
        family.config_to_hf(cfg)


# --------------------------------------------------------------------------------------------------
# Recipes
# --------------------------------------------------------------------------------------------------

QWEN3_NEXT_80B_A3B = {  # Qwen/Qwen3-Next-80B-A3B-Instruct config.json (model fields)
    "architectures": ["Qwen3NextForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "decoder_sparse_step": 1,
    "eos_token_id": 151645,
    "full_attention_interval": 4,
    "head_dim": 256,
    "hidden_act": "silu",
    "hidden_size": 2048,
    "initializer_range": 0.02,
    "intermediate_size": 5120,
    "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 128,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 32,
    "linear_value_head_dim": 128,
    "max_position_embeddings": 262144,
    "mlp_only_layers": [],
    "model_type": "qwen3_next",
    "moe_intermediate_size": 512,
    "norm_topk_prob": True,
    "num_attention_heads": 16,
    "num_experts": 512,
    "num_experts_per_tok": 10,
    "num_hidden_layers": 48,
    "num_key_value_heads": 2,
    "output_router_logits": False,
    "partial_rotary_factor": 0.25,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 10000000,
    "router_aux_loss_coef": 0.001,
    "shared_expert_intermediate_size": 512,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": 151936,
}

_RECIPE_FIELDS = {
    "model": "family vocab_size hidden_size num_layers layer_types num_attention_heads num_kv_heads resolved_head_dim "
    "ffn_hidden_size max_position_embeddings rope_theta rope_scaling partial_rotary_factor norm_eps "
    "norm_zero_centered qkv_bias attn_out_bias qk_norm attn_output_gate tie_embeddings linear_num_key_heads "
    "linear_num_value_heads linear_key_head_dim linear_value_head_dim linear_conv_kernel_dim".split(),
    "moe": "num_experts router_topk router_score_function router_pre_softmax norm_topk_prob ffn_hidden_size "
    "shared_expert_intermediate_size shared_expert_gate aux_loss_coeffs".split(),
}


def test_real_size_recipe_is_the_hub_model():
    """The shipped 80B-A3B recipe is what the Hub config.json describes, and has transformers' parameter count."""
    ours = load_config("qwen3-next-80b-a3b").validate()
    ref = family.config_from_hf(QWEN3_NEXT_80B_A3B)
    for section, fields in _RECIPE_FIELDS.items():
        for f in fields:
            assert getattr(getattr(ours, section), f) == getattr(getattr(ref, section), f), f"{section}.{f}"
    n = ours.model.num_layers
    assert all(ours.moe.is_moe_layer(i, n) for i in range(n))
    with torch.device("meta"):
        total, _ = MoETransformer(ours).num_params()
        hf_cfg = {k: v for k, v in QWEN3_NEXT_80B_A3B.items() if k not in ("architectures", "model_type")}
        hf_total = sum(
            p.numel() for p in transformers.Qwen3NextForCausalLM(transformers.Qwen3NextConfig(**hf_cfg)).parameters()
        )
    assert total == hf_total, (total, hf_total)
    assert 79e9 < total < 81e9


def test_tiny_recipe_round_trips_through_transformers(tmp_path):
    """The tiny recipe exports to a folder transformers loads, with our logits."""
    cfg = load_config("tiny-qwen3-next").validate()
    cfg.model.vocab_size = VOCAB
    cfg.model.fused_cross_entropy = False
    torch.manual_seed(0)
    ours = MoETransformer(cfg).eval()
    with torch.no_grad():
        for name, p in ours.named_parameters():
            if name.endswith(("A_log", "dt_bias")):
                continue
            p.add_(torch.randn_like(p) * (0.3 if p.dim() == 1 else 0.02))
    save_pretrained(ours, tmp_path)
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").eval()
    assert isinstance(back, transformers.Qwen3NextForCausalLM)
    ids = tokens(VOCAB, seq=70)
    with torch.no_grad():
        _close(back(ids).logits, ours(ids).logits)
