"""Mismatches stop an import or export with an error naming the tensor or field, never a wrong model."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

pytest.importorskip("transformers")

from hf_parity import build_hf, tiny_config  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402
from transformers import Qwen2MoeConfig, Qwen3MoeConfig  # noqa: E402

from moecore.config import Config  # noqa: E402
from moecore.hf import load_pretrained, save_pretrained  # noqa: E402
from moecore.hf.convert import main  # noqa: E402
from moecore.models.transformer import MoETransformer  # noqa: E402

# Qwen2/3-MoE fields on top of hf_parity.TINY_GQA.
_FIELDS = dict(vocab_size=64, intermediate_size=40, num_experts=4, moe_intermediate_size=16)


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory):
    cfg = tiny_config(Qwen3MoeConfig, _FIELDS)
    path = tmp_path_factory.mktemp("qwen3")
    build_hf(cfg).save_pretrained(path)
    return path


@pytest.fixture
def folder(qwen3_dir, tmp_path):
    dst = tmp_path / "hf"
    shutil.copytree(qwen3_dir, dst)
    return dst


def _edit_config(folder, **changes):
    data = json.loads((folder / "config.json").read_text())
    for k, v in changes.items():
        if v is None:
            data.pop(k, None)
        else:
            data[k] = v
    (folder / "config.json").write_text(json.dumps(data))


def _edit_tensors(folder, fn):
    path = folder / "model.safetensors"
    state = load_file(path)
    fn(state)
    save_file(state, path, metadata={"format": "pt"})


def test_missing_tensor(folder):
    name = "model.layers.1.mlp.experts.3.up_proj.weight"
    _edit_tensors(folder, lambda s: s.pop(name))
    with pytest.raises(ValueError, match=f"tensor '{name}' is missing"):
        load_pretrained(folder)


def test_extra_tensor(folder):
    name = "model.layers.0.mlp.experts.4.up_proj.weight"  # a fifth expert the config does not have
    _edit_tensors(folder, lambda s: s.__setitem__(name, torch.zeros(16, 32)))
    with pytest.raises(ValueError, match=f"unexpected tensor '{name}'"):
        load_pretrained(folder)


def test_wrong_shape(folder):
    name = "model.layers.0.self_attn.k_norm.weight"
    _edit_tensors(folder, lambda s: s.__setitem__(name, torch.ones(4)))
    with pytest.raises(ValueError, match=rf"tensor '{name}' has shape \[4\], expected \[8\]"):
        load_pretrained(folder)


@pytest.mark.parametrize(
    "changes, match",
    [
        (dict(model_type="llama"), "model_type='llama' is not supported"),
        (dict(hidden_act="gelu"), "hidden_act='gelu'"),
        (
            dict(rope_parameters={"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}),
            "rope_parameters.rope_type='dynamic'",
        ),
        (
            dict(rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}),
            "partial_rotary_factor=0.5",
        ),
        (dict(qk_layernorm_scale=2.0), "qk_layernorm_scale are not understood"),
        (dict(quantization_config={"quant_method": "fp8"}), "quantization_config"),
        (dict(num_experts=8), "num_local_experts=4 .* disagrees with num_experts=8"),
        (dict(mlp_only_layers=[5]), "mlp_only_layers=\\[5\\]"),
        (dict(norm_topk_prob="yes"), "norm_topk_prob='yes'"),
        (dict(num_experts_per_tok=9), "moe.router_topk=9"),
        (dict(attention_dropout=0.1), "attention_dropout=0.1"),
    ],
)
def test_config_refused(folder, changes, match):
    _edit_config(folder, **changes)
    with pytest.raises(ValueError, match=match):
        load_pretrained(folder)


def test_qwen2_mixed_sliding_layers_refused(tmp_path):
    """transformers' default Qwen2-MoE window pattern (every other layer) cannot be expressed; refuse it."""
    over = dict(shared_expert_intermediate_size=16, use_sliding_window=True, sliding_window=4)
    cfg = tiny_config(Qwen2MoeConfig, _FIELDS, over)
    build_hf(cfg).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="layer_types=.*mixed across layers"):
        load_pretrained(tmp_path)


def test_no_safetensors(folder):
    (folder / "model.safetensors").rename(folder / "pytorch_model.bin")
    with pytest.raises(ValueError, match="found pytorch_model.bin"):
        load_pretrained(folder)


def test_export_refusals(folder, tmp_path):
    model = load_pretrained(folder)
    with pytest.raises(ValueError, match="model.qk_norm=True cannot be exported as mixtral"):
        save_pretrained(model, tmp_path / "out", model_type="mixtral")
    cfg = Config()
    cfg.model.vocab_size = 64
    cfg.moe.router_score_function = "sigmoid"
    with pytest.raises(ValueError, match="no Hugging Face family can express this model.*router_score_function"):
        save_pretrained(MoETransformer(cfg), tmp_path / "out2")


def test_cli_bad_input(tmp_path, capsys):
    assert main(["--from-hf", str(tmp_path / "absent"), str(tmp_path / "out"), "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "is not a folder" in err[0]
    assert main(["--to-hf", str(tmp_path), str(tmp_path / "out"), "--no-progress"]) == 2
    assert "not a moecore checkpoint folder" in capsys.readouterr().err
    # Through the top-level command line as well.
    from moecore.cli import main as cli_main

    assert cli_main(["convert", "--from-hf", str(tmp_path / "absent"), str(tmp_path / "out"), "--no-progress"]) == 2
    assert "is not a folder" in capsys.readouterr().err


def test_corrupt_safetensors(folder):
    (folder / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not json at all!")
    with pytest.raises(ValueError, match="model.safetensors is not a safetensors file"):
        load_pretrained(folder)
