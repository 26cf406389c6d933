"""One decoder layer: pre-norm attention then feed-forward (dense MLP or MoE), each with a residual.

    x + attn(attn_norm(x));  then  x + mlp(mlp_norm(x))

`build_attention` picks the layer's attention from the config: grouped-query attention (`attention.py`),
multi-latent attention (`mla.py`), DeepSeek sparse attention (`dsa.py`) or gated DeltaNet
(`linear_attention.py`). The main model (`transformer.py`) and the MTP blocks (`mtp.py`) stack these layers.
In a DSA model with shared indexer layers (GLM-5, `passes_topk`) a layer also takes the previous layer's top-k
indices and returns the ones it used: `(x, aux, topk_idx)` (dsa.py).
"""

from __future__ import annotations

import torch
from torch import nn

from moecore.config import Config, ModelConfig
from moecore.models.attention import Attention
from moecore.models.mlp import MLP
from moecore.models.norms import RMSNorm
from moecore.models.recompute import checkpoint_module, recompute_output
from moecore.parallel import tensor_parallel as tpl


def build_attention(cfg: ModelConfig, layer_idx: int, dims=None) -> nn.Module:
    """The attention module of layer `layer_idx` as the config describes it."""
    if cfg.layer_types is not None and cfg.layer_types[layer_idx] == "linear_attention":
        from moecore.models.linear_attention import GatedDeltaNet

        return GatedDeltaNet(cfg, layer_idx, dims)
    if cfg.attention_type == "dsa":
        from moecore.models.dsa import DSAttention

        return DSAttention(cfg, layer_idx, dims)
    if cfg.attention_type == "mla":
        from moecore.models.mla import MLAttention

        return MLAttention(cfg, layer_idx, dims)
    return Attention(cfg, layer_idx, dims)


class DecoderLayer(nn.Module):
    """Pre-norm attention + feed-forward (dense or MoE) with residual connections."""

    def __init__(self, cfg: Config, layer_idx: int, dims=None) -> None:
        super().__init__()
        m = cfg.model
        self.layer_idx = layer_idx
        self.attn_norm = RMSNorm(m.hidden_size, m.norm_eps, m.norm_zero_centered)
        self.attn = build_attention(m, layer_idx, dims)
        self.mlp_norm = RMSNorm(m.hidden_size, m.norm_eps, m.norm_zero_centered)
        tpl.mark_sequence_parallel(self.attn_norm, dims)  # norms see sequence shards under SP
        tpl.mark_sequence_parallel(self.mlp_norm, dims)
        self.is_moe = cfg.moe.is_moe_layer(layer_idx, m.num_layers)
        if self.is_moe and (m.router_logit_bias or m.expert_linear_bias):  # gpt-oss (moecore/models/biased_moe.py)
            from moecore.models.biased_moe import BiasedMoELayer

            rec = set(m.recompute_modules)
            self.mlp = BiasedMoELayer(cfg, dims, "moe_act" in rec, "shared_experts" in rec)
        elif self.is_moe:
            from moecore.moe.layer import MoELayer

            rec = set(m.recompute_modules)
            self.mlp = MoELayer(
                cfg.moe, m.hidden_size, m.activation, m.init_std, dims,
                recompute_act="moe_act" in rec, recompute_shared="shared_experts" in rec,
            )  # fmt: skip
        else:
            if m.activation not in ("swiglu", "gelu"):
                raise ValueError(
                    f"model.activation={m.activation!r} is for routed experts only; layer {layer_idx} is dense"
                )
            self.mlp = MLP(m.hidden_size, m.ffn_hidden_size, m.activation, dims)
        rec = set(m.recompute_modules)
        self.recompute_norm = "norm" in rec
        self.recompute_mlp = ("moe" in rec) if self.is_moe else ("mlp" in rec)
        self.cuda_graphs = None  # LayerGraphs with train.cuda_graphs (moecore/models/cuda_graphs.py)
        self.passes_topk = getattr(self.attn, "passes_topk", False)  # DSA top-k shared across layers (dsa.py)

    def _maybe_checkpoint(self, enabled: bool, fn, *args):
        if enabled and self.training and torch.is_grad_enabled():
            return checkpoint_module(fn, *args)
        return fn(*args)

    def _norm_then(self, norm: nn.Module, x: torch.Tensor, consumer):
        """consumer(norm(x)); with "norm" recomputation the norm output is not kept for backward
        (moecore/models/recompute.py: the consumer's saved copies of it are recomputed from x)."""
        if self.recompute_norm and self.training and torch.is_grad_enabled():
            return recompute_output(norm, (x,), consumer)
        return consumer(norm(x))

    def forward(
        self,
        x: torch.Tensor,
        position_ids: torch.Tensor,
        loss_mask: torch.Tensor | None,
        topk_idx: torch.Tensor | None = None,
    ):
        g = self.cuda_graphs
        if g is not None and g.whole is not None:
            return g.layer_forward(x, position_ids, loss_mask)
        return self.eager_forward(x, position_ids, loss_mask, topk_idx)

    def eager_forward(
        self,
        x: torch.Tensor,
        position_ids: torch.Tensor,
        loss_mask: torch.Tensor | None,
        topk_idx: torch.Tensor | None = None,
    ):
        """The layer op by op, except the parts `train.cuda_graphs` captured (attention, MoE routing).
        Returns (x, MoE aux or None), and with `passes_topk` the DSA top-k indices this layer used as well."""
        if self.passes_topk:  # train.cuda_graphs refuses DSA: no captured parts here
            out, topk_idx = self._norm_then(self.attn_norm, x, lambda h: self.attn(h, position_ids, topk_idx))
            return (*self._feed_forward(x + out, loss_mask), topk_idx)
        g = self.cuda_graphs
        if g is not None and g.attention is not None:
            x = x + g.attention(x, position_ids)[0]
        else:
            x = x + self._norm_then(self.attn_norm, x, lambda h: self.attn(h, position_ids))
        return self._feed_forward(x, loss_mask)

    def _feed_forward(self, x: torch.Tensor, loss_mask: torch.Tensor | None):
        """x + mlp(mlp_norm(x)) and the MoE aux (None for a dense layer)."""
        g = self.cuda_graphs
        if self.is_moe and g is not None and g.moe_head is not None:
            h, routed = g.routed(x, loss_mask)
            out, aux = self._maybe_checkpoint(self.recompute_mlp, self.mlp, h, loss_mask, routed)
            return x + out, aux
        if self.is_moe:
            out, aux = self._norm_then(
                self.mlp_norm, x, lambda h: self._maybe_checkpoint(self.recompute_mlp, self.mlp, h, loss_mask)
            )
            return x + out, aux
        return x + self._norm_then(
            self.mlp_norm, x, lambda h: self._maybe_checkpoint(self.recompute_mlp, self.mlp, h)
        ), None
