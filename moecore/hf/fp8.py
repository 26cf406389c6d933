"""Block-wise FP8 checkpoints (DeepSeek-V3 / V3.2, GLM-4.5 FP8 uploads): dequantized to the model's dtype on import.

Such a checkpoint stores a linear weight W [N, K] as `<name>` in float8 (e4m3) plus `<name>_scale_inv`
[ceil(N / bn), ceil(K / bk)] in fp32, and announces `quantization_config: {quant_method: fp8,
weight_block_size: [bn, bk]}`. The weight is W = fp8 value * scale_inv of its (bn x bk) block. Tensors
without a `_scale_inv` sibling (norms, embeddings, router, head) are stored unquantized. Export never
quantizes.
"""

from __future__ import annotations

import torch

SCALE_SUFFIX = "_scale_inv"


def fp8_block_size(hf: dict) -> tuple[int, int] | None:
    """(bn, bk) when config.json announces block-wise FP8 weights; None when it announces no quantization.

    Any other quantization_config raises a ValueError naming it.
    """
    q = hf.get("quantization_config")
    if q is None:
        return None
    block = q.get("weight_block_size") if isinstance(q, dict) else None
    ok = (
        isinstance(q, dict)
        and q.get("quant_method") == "fp8"
        and q.get("activation_scheme", "dynamic") == "dynamic"
        and isinstance(block, (list, tuple))
        and len(block) == 2
        and all(isinstance(b, int) and b > 0 for b in block)
    )
    if not ok:
        raise ValueError(
            f"config.json field quantization_config={q!r} is not supported: only block-wise fp8 weights "
            "(quant_method: fp8, weight_block_size: [n, k]) are dequantized on import"
        )
    return int(block[0]), int(block[1])


def dequantize_fp8(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """fp32 W [..., N, K] from FP8 values and per-(bn x bk)-block scales [..., ceil(N/bn), ceil(K/bk)]."""
    bn, bk = block
    n, k = weight.shape[-2:]
    scale = scale_inv.float().repeat_interleave(bn, dim=-2)[..., :n, :].repeat_interleave(bk, dim=-1)[..., :k]
    return weight.float() * scale
