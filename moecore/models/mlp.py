"""The dense feed-forward block: SwiGLU (gate, up, down) or a plain GeLU MLP (up, down)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from moecore.parallel.tensor_parallel import ColumnParallelLinear, RowParallelLinear, tp_region_input


class MLP(nn.Module):
    """down(act(gate(x)) * up(x)) for SwiGLU; down(gelu(up(x))) for GeLU."""

    def __init__(self, hidden_size: int, ffn_hidden_size: int, activation: str = "swiglu", dims=None) -> None:
        super().__init__()
        self.activation = activation
        self.dims = dims
        # Tensor parallel: gate/up split by columns, down by rows (see moecore.parallel.tensor_parallel).
        name = "model.ffn_hidden_size"
        if activation == "swiglu":
            self.gate_proj = ColumnParallelLinear(hidden_size, ffn_hidden_size, False, dims, name=name)
        self.up_proj = ColumnParallelLinear(hidden_size, ffn_hidden_size, False, dims, name=name)
        self.down_proj = RowParallelLinear(ffn_hidden_size, hidden_size, False, dims, name=name)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = tp_region_input(x, self.dims)
        if self.activation == "swiglu":
            return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        return self.down_proj(F.gelu(self.up_proj(x), approximate="tanh"))
