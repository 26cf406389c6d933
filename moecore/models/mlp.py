"""The dense feed-forward block: SwiGLU (gate, up, down) or a plain GeLU MLP (up, down)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class MLP(nn.Module):
    """down(act(gate(x)) * up(x)) for SwiGLU; down(gelu(up(x))) for GeLU."""

    def __init__(self, hidden_size: int, ffn_hidden_size: int, activation: str = "swiglu", dims=None) -> None:
        super().__init__()
        self.activation = activation
        if activation == "swiglu":
            self.gate_proj = nn.Linear(hidden_size, ffn_hidden_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, ffn_hidden_size, bias=False)
        self.down_proj = nn.Linear(ffn_hidden_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.activation == "swiglu":
            return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        return self.down_proj(F.gelu(self.up_proj(x), approximate="tanh"))
