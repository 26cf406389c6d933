"""Block-wise FP8 checkpoints (as DeepSeek-V3.2 and GLM-4.5 ship their FP8 weights) import dequantized: every
quantized linear weight equals transformers' own dequantization of it, so our logits equal those of the
transformers model holding the dequantized weights; block sizes that do not divide the shapes included."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("transformers")

from hf_parity import assert_close, tokens  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402
from test_deepseek_v32 import V, build, v32_config  # noqa: E402

try:  # transformers' own block-wise FP8 dequantizer (5.24); older releases lack it
    from transformers.integrations.finegrained_fp8 import _dequantize_fp8_weight  # noqa: E402
except ImportError:
    pytest.skip("this transformers has no _dequantize_fp8_weight to compare against", allow_module_level=True)

from moecore.hf import load_pretrained  # noqa: E402
from moecore.hf.fp8 import fp8_block_size  # noqa: E402

BLOCK = [8, 16]  # rows, columns: does not divide several tiny shapes


def _quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8 values, fp32 scale_inv per block) with the block's max magnitude mapped to e4m3's 448."""
    bn, bk = BLOCK
    n, k = w.shape
    scales = torch.empty((n + bn - 1) // bn, (k + bk - 1) // bk)
    q = torch.empty(n, k, dtype=torch.float8_e4m3fn)
    for i in range(scales.shape[0]):
        for j in range(scales.shape[1]):
            blk = w[i * bn : (i + 1) * bn, j * bk : (j + 1) * bk]
            scales[i, j] = blk.abs().max().clamp(min=1e-12) / 448.0
            q[i * bn : (i + 1) * bn, j * bk : (j + 1) * bk] = (blk / scales[i, j]).to(torch.float8_e4m3fn)
    return q, scales


def _is_quantized(name: str, t: torch.Tensor) -> bool:
    """What DeepSeek's FP8 uploads quantize: the 2-D projection weights (not embeddings, head, router, norms)."""
    skip = ("embed_tokens", "lm_head", "mlp.gate.weight", "norm")
    return t.dim() == 2 and name.endswith(".weight") and not any(s in name for s in skip)


def test_fp8_checkpoint_imports_dequantized(tmp_path):
    ref = build(v32_config())
    src = tmp_path / "fp8"
    ref.save_pretrained(src)
    tensors = load_file(src / "model.safetensors")
    dequantized = {}
    for name in [n for n, t in tensors.items() if _is_quantized(n, t)]:
        q, s = _quantize(tensors[name])
        tensors[name], tensors[name + "_scale_inv"] = q, s
        dequantized[name] = _dequantize_fp8_weight(q, s, BLOCK, torch.float32)  # transformers' dequantization
    assert any(".indexer." in n for n in dequantized) and any(".experts." in n for n in dequantized)
    save_file(tensors, src / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": BLOCK}
    (src / "config.json").write_text(json.dumps(config))
    with torch.no_grad():  # the reference model holds the dequantized weights (transformers' own, fused experts aside)
        params = dict(ref.named_parameters())
        for name, w in dequantized.items():
            if name in params:
                params[name].copy_(w)
            else:  # per-expert tensors on disk, fused [E, 2F, H] / [E, H, F] in transformers' memory
                prefix, j, proj = name.rsplit(".", 3)[0], int(name.split(".")[-3]), name.split(".")[-2]
                fused = params[f"{prefix}.{'down_proj' if proj == 'down_proj' else 'gate_up_proj'}"]
                f = fused.shape[1] // 2
                rows = {"gate_proj": slice(0, f), "up_proj": slice(f, 2 * f), "down_proj": slice(None)}[proj]
                fused[j, rows].copy_(w)
    ours = load_pretrained(src)
    ids = tokens(V, seq=12)
    with torch.no_grad():
        assert_close(ours(ids).logits, ref(ids).logits, "logits of the dequantized import")


def test_other_quantization_is_refused():
    for q in ({"quant_method": "mxfp4"}, {"quant_method": "fp8"}, {"quant_method": "fp8", "weight_block_size": [128]}):
        with pytest.raises(ValueError, match="quantization_config"):
            fp8_block_size({"quantization_config": q})
    assert fp8_block_size({}) is None
