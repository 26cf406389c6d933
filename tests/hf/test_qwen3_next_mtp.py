"""Qwen3-Next's multi-token-prediction module (Hub checkpoints' `mtp.*`): imported, its loss equal to the same
module built from transformers' pieces (MtpLayer around a Qwen3Next gated-attention MoE decoder layer with
zero-centred norms), every tensor written back unchanged, the export loading in transformers."""

from __future__ import annotations

import copy
import json

import pytest
import torch

pytest.importorskip("transformers")

from hf_parity import assert_close, build_hf, randomize, tokens  # noqa: E402
from lm_parity import reference_mtp_losses  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402
from transformers import AutoModelForCausalLM, Qwen3NextConfig  # noqa: E402
from transformers.modeling_layers import MtpLayer  # noqa: E402
from transformers.models.qwen3_next import modeling_qwen3_next as hf_next  # noqa: E402

from moecore.config import load_config  # noqa: E402
from moecore.hf import load_pretrained, save_pretrained  # noqa: E402
from moecore.hf.families import qwen3_next as family  # noqa: E402

V, H = 97, 32
TYPES = ["linear_attention", "full_attention"]


def next_config(**over) -> Qwen3NextConfig:
    kw = dict(
        vocab_size=V,
        hidden_size=H,
        intermediate_size=48,
        num_hidden_layers=2,
        layer_types=TYPES,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=8,
        linear_value_head_dim=8,
        linear_conv_kernel_dim=4,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
        max_position_embeddings=128,
        num_experts=6,
        num_experts_per_tok=2,
        moe_intermediate_size=16,
        shared_expert_intermediate_size=24,
    )
    kw.update(over)
    return Qwen3NextConfig(**kw)


def _zero_centred_randomize(model: torch.nn.Module, seed: int) -> None:
    """hf_parity.randomize, with Qwen3-Next's zero-centred norms (stored as an offset from 1) drawn around 0."""
    randomize(model, seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1 and "norm" in name and not name.endswith("linear_attn.norm.weight"):
                p.sub_(1.0)


def _mtp_layer(ref) -> MtpLayer:
    """transformers' MtpLayer around a full-attention MoE Qwen3Next decoder layer."""
    cfg = copy.deepcopy(ref.config)
    cfg.layer_types, cfg.num_hidden_layers, cfg.mlp_only_layers = ["full_attention"], 1, []
    cfg._attn_implementation = "eager"
    layer = MtpLayer(cfg, hf_next.Qwen3NextDecoderLayer, hf_next.Qwen3NextRMSNorm, 0).eval()
    _zero_centred_randomize(layer, 3)
    return layer


# MtpLayer names -> Qwen3-Next Hub names.
_HUB_NAMES = (("enorm.", "pre_fc_norm_embedding."), ("hnorm.", "pre_fc_norm_hidden."), ("eh_proj.", "fc."),
              ("post_norm.", "norm."), ("mtp_block.", "layers.0."))  # fmt: skip


def _write_mtp(folder, layer) -> None:
    """Add the MTP module to a saved checkpoint as the Hub stores it (per-expert tensors) and announce it."""
    tensors = load_file(folder / "model.safetensors")
    for name, t in layer.state_dict().items():
        for a, b in _HUB_NAMES:
            if name.startswith(a):
                name = b + name[len(a) :]
                break
        if name.endswith("experts.gate_up_proj"):
            f = t.shape[1] // 2
            for j in range(t.shape[0]):
                tensors[f"mtp.layers.0.mlp.experts.{j}.gate_proj.weight"] = t[j, :f].clone()
                tensors[f"mtp.layers.0.mlp.experts.{j}.up_proj.weight"] = t[j, f:].clone()
        elif name.endswith("experts.down_proj"):
            for j in range(t.shape[0]):
                tensors[f"mtp.layers.0.mlp.experts.{j}.down_proj.weight"] = t[j].clone()
        else:
            tensors[f"mtp.{name}"] = t.clone()
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    config.update(mtp_num_hidden_layers=1, mtp_use_dedicated_embeddings=False)
    (folder / "config.json").write_text(json.dumps(config))


def test_mtp_module_import_export(tmp_path):
    cfg = next_config()
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    ref = AutoModelForCausalLM.from_config(cfg).eval()
    _zero_centred_randomize(ref, 0)
    src = tmp_path / "hf"
    ref.save_pretrained(src)
    layer = _mtp_layer(ref)
    _write_mtp(src, layer)

    ours = load_pretrained(src)
    assert ours.cfg.model.mtp_num_layers == 1 and ours.mtp.layers[0].block.is_moe
    ids = tokens(V, seq=19, seed=4)
    s = ids.shape[1] - 1
    with torch.no_grad():
        out = ours(ids[:, :s], labels=ids[:, 1:])
        assert_close(out.logits, ref(ids[:, :s]).logits)
        (want,) = reference_mtp_losses(ref, [layer], ids)
    torch.testing.assert_close(out.mtp_losses[0], want, rtol=1e-5, atol=1e-5)

    exported = save_pretrained(ours, tmp_path / "export")
    written = json.loads((exported / "config.json").read_text())
    assert written["mtp_num_hidden_layers"] == 1 and written["mtp_use_dedicated_embeddings"] is False
    before, after = load_file(src / "model.safetensors"), load_file(exported / "model.safetensors")
    assert sorted(before) == sorted(after)
    for name, t in before.items():
        assert torch.equal(after[name], t), name
    back = AutoModelForCausalLM.from_pretrained(exported, attn_implementation="eager").eval()
    with torch.no_grad():
        assert_close(back(ids[:, :s]).logits, ref(ids[:, :s]).logits)


def test_mtp_gradients_reach_the_mtp_module(tmp_path):
    """One training step with MTP: the MTP loss is in the objective and reaches every MTP parameter."""
    ref = build_hf(next_config())
    src = tmp_path / "hf"
    ref.save_pretrained(src)
    _write_mtp(src, _mtp_layer(ref))
    ours = load_pretrained(src).train()
    ids = tokens(V, seq=17, seed=5)
    out = ours(ids[:, :-1], labels=ids[:, 1:])
    assert out.mtp_loss is not None and torch.isfinite(out.loss)
    out.loss.backward()
    for name, p in ours.mtp.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name


def test_mtp_refusals():
    base = next_config().to_dict()
    for field, value in (("mtp_num_hidden_layers", 2), ("mtp_use_dedicated_embeddings", True)):
        with pytest.raises(ValueError, match=field):
            family.config_from_hf({**base, field: value})
    cfg = load_config("tiny-qwen3-next", ["model.mtp_num_layers=2"])
    with pytest.raises(ValueError, match="model.mtp_num_layers"):
        family.config_to_hf(cfg)
