"""Mixtral against transformers: import/export logits parity, options off the defaults, one training step."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("transformers")

from hf_parity import (  # noqa: E402
    assert_close,
    build_hf,
    check_real_size_recipe,
    check_tiny_recipe_exports,
    import_export_parity,
    tiny_config,
    tokens,
    train_step_parity,
)
from safetensors.torch import save_file  # noqa: E402
from transformers import MixtralConfig  # noqa: E402

from moecore.hf import load_pretrained  # noqa: E402


def mixtral_config(**over) -> MixtralConfig:
    fields = dict(
        vocab_size=96, intermediate_size=24, num_local_experts=4, max_position_embeddings=64, rope_theta=10000.0
    )
    return tiny_config(MixtralConfig, fields, over)


def test_import_export_sharded(tmp_path):
    """Defaults (GQA, softmax top-2 renormalised); the source is sharded, and so is the export."""
    hf = build_hf(mixtral_config())
    ours, out = import_export_parity(hf, tmp_path, {"max_shard_size": "20KB"})
    assert (tmp_path / "hf" / "model.safetensors.index.json").is_file()
    assert ours.cfg.moe.norm_topk_prob and ours.cfg.moe.router_pre_softmax
    assert ours.cfg.moe.apply_probs_on_input  # the parity above ran with the weights inside the activation
    # Our own writer shards too; transformers must read that index.
    from transformers import AutoModelForCausalLM

    from moecore.hf import save_pretrained

    save_pretrained(ours, tmp_path / "sharded", max_shard_bytes=16 * 1024)
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    back = AutoModelForCausalLM.from_pretrained(tmp_path / "sharded").eval()
    ids = tokens(96)
    with torch.no_grad():
        assert_close(back(ids).logits, hf(ids).logits, "sharded export")


def test_options_head_dim_window_tied_yarn(tmp_path):
    """head_dim != hidden/heads, a sliding window shorter than the sequence, tied embeddings, YaRN, top-1."""
    cfg = mixtral_config(
        head_dim=16,
        sliding_window=5,
        tie_word_embeddings=True,
        num_experts_per_tok=1,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 16,
        },
    )
    hf = build_hf(cfg)
    ours, _ = import_export_parity(hf, tmp_path)
    m = ours.cfg.model
    assert (m.head_dim, m.sliding_window, m.tie_embeddings, m.rope_scaling["type"]) == (16, 5, True, "yarn")


def test_fused_expert_layout(tmp_path):
    """transformers' in-memory layout (fused 3-D gate_up_proj / down_proj) is accepted on disk as well."""
    hf = build_hf(mixtral_config())
    hf.save_pretrained(tmp_path)
    state = {k: v.contiguous() for k, v in hf.state_dict().items()}
    assert any(k.endswith("experts.gate_up_proj") for k in state)
    (tmp_path / "model.safetensors").unlink()
    save_file(state, tmp_path / "model.safetensors", metadata={"format": "pt"})
    ours = load_pretrained(tmp_path)
    ids = tokens(96)
    with torch.no_grad():
        assert_close(ours(ids).logits, hf(ids).logits)


def test_train_step(tmp_path):
    hf = build_hf(mixtral_config(router_aux_loss_coef=0.5))
    hf.save_pretrained(tmp_path)
    train_step_parity(load_pretrained(tmp_path), hf)


def test_native_model_exports_as_mixtral(tmp_path):
    """A model built by moecore (family "moecore") whose options fit Mixtral is written as Mixtral."""
    from transformers import AutoModelForCausalLM, MixtralForCausalLM

    from moecore.config import Config
    from moecore.hf import save_pretrained
    from moecore.models.transformer import MoETransformer

    cfg = Config()
    cfg.model.vocab_size, cfg.model.hidden_size, cfg.model.num_layers = 96, 32, 2
    cfg.moe.num_experts, cfg.moe.router_topk, cfg.moe.ffn_hidden_size = 4, 2, 24
    cfg.moe.router_pre_softmax = False  # softmax over the top-k: the same weights as Mixtral's renormalisation
    torch.manual_seed(0)
    ours = MoETransformer(cfg).eval()
    with torch.no_grad():
        for p in ours.parameters():
            p.copy_(torch.randn_like(p) / p.shape[-1] ** 0.5 if p.dim() > 1 else 1 + 0.3 * torch.randn_like(p))
    save_pretrained(ours, tmp_path)
    back = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert isinstance(back, MixtralForCausalLM)
    ids = tokens(96)
    with torch.no_grad():
        assert_close(back(ids).logits, ours(ids).logits)


MIXTRAL_8X7B = {  # mistralai/Mixtral-8x7B-v0.1 config.json
    "architectures": ["MixtralForCausalLM"],
    "attention_dropout": 0.0,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "hidden_act": "silu",
    "hidden_size": 4096,
    "initializer_range": 0.02,
    "intermediate_size": 14336,
    "max_position_embeddings": 32768,
    "model_type": "mixtral",
    "num_attention_heads": 32,
    "num_experts_per_tok": 2,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "num_local_experts": 8,
    "output_router_logits": False,
    "rms_norm_eps": 1e-05,
    "rope_theta": 1000000.0,
    "router_aux_loss_coef": 0.02,
    "sliding_window": None,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.36.0.dev0",
    "use_cache": True,
    "vocab_size": 32000,
}
MIXTRAL_8X22B = {  # mistralai/Mixtral-8x22B-v0.1 config.json
    "architectures": ["MixtralForCausalLM"],
    "attention_dropout": 0.0,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "hidden_act": "silu",
    "hidden_size": 6144,
    "initializer_range": 0.02,
    "intermediate_size": 16384,
    "max_position_embeddings": 65536,
    "model_type": "mixtral",
    "num_attention_heads": 48,
    "num_experts_per_tok": 2,
    "num_hidden_layers": 56,
    "num_key_value_heads": 8,
    "num_local_experts": 8,
    "rms_norm_eps": 1e-05,
    "rope_theta": 1000000,
    "router_aux_loss_coef": 0.001,
    "router_jitter_noise": 0.0,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.40.0.dev0",
    "vocab_size": 32000,
}


@pytest.mark.parametrize("recipe, hf_config", [("mixtral-8x7b", MIXTRAL_8X7B), ("mixtral-8x22b", MIXTRAL_8X22B)])
def test_real_size_recipes(recipe, hf_config):
    check_real_size_recipe(recipe, hf_config)


def test_tiny_recipe_exports():
    check_tiny_recipe_exports("tiny-mixtral", "mixtral")


def test_router_jitter_refused(tmp_path):
    """transformers jitters the experts' input as well as the router's; ours only the router's: refuse, don't guess."""
    build_hf(mixtral_config()).save_pretrained(tmp_path)
    data = json.loads((tmp_path / "config.json").read_text())
    data["router_jitter_noise"] = 0.01
    (tmp_path / "config.json").write_text(json.dumps(data))
    with pytest.raises(ValueError, match="router_jitter_noise=0.01"):
        load_pretrained(tmp_path)
