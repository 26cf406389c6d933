"""Which parameters get weight decay: matrices only.

Norm weights, biases (also grouped expert biases and DeepSeek-V4's per-slot `position_bias` of its compressors),
embeddings (and the output head when it is tied to them) and any 1-D parameter are excluded from weight decay, as is customary for transformer language models.
"""

from __future__ import annotations

from torch import nn


def no_decay(name: str, param: nn.Parameter) -> bool:
    """True for parameters trained without weight decay (norms, biases, embeddings, vectors)."""
    leaf = name.rsplit(".", 1)[-1]
    # b13 / b2: gpt-oss's per-expert biases, stored [E, ...] (2-D) beside the expert weights; position_bias:
    # DeepSeek-V4's compressor gate bias per window slot [m, channels] (moecore/models/compressed_attention.py).
    biases = ("bias", "b13", "b2", "position_bias")
    return param.ndim < 2 or leaf in biases or "embed" in name or "norm" in name


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Two groups: decayed matrices and everything else. Each parameter appears once."""
    decay, plain = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (plain if no_decay(name, p) else decay).append(p)
    return [
        {"params": decay, "weight_decay": weight_decay, "group": "decay"},
        {"params": plain, "weight_decay": 0.0, "group": "no_decay"},
    ]
