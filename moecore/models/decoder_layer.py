"""One decoder layer: pre-norm attention then feed-forward (dense MLP or MoE), each with a residual.

    x + attn(attn_norm(x));  then  x + mlp(mlp_norm(x))

`build_attention` picks the layer's attention from the config: grouped-query attention (`attention.py`),
multi-latent attention (`mla.py`), DeepSeek sparse attention (`dsa.py`) or gated DeltaNet
(`linear_attention.py`). The main model (`transformer.py`) and the MTP blocks (`mtp.py`) stack these layers.
In a DSA model with shared indexer layers (GLM-5, `passes_topk`) a layer also takes the previous layer's top-k
indices and returns the ones it used: `(x, aux, topk_idx)` (dsa.py).

DeepSeek-V4: with `model.hc_mult` = n > 1 the residual is n streams [B, S, n, H], read and written by the layer's
hyper-connections `attn_hc` / `mlp_hc` around each block (moecore/models/hyper_connections.py); a hash-routed MoE
layer (`moe.num_hash_layers`, `needs_token_ids`) takes the input's token ids as well.
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
    if cfg.attention_type == "compressed":
        from moecore.models.compressed_attention import CompressedAttention

        return CompressedAttention(cfg, layer_idx, dims)
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
        if self.is_moe and (m.router_logit_bias or m.expert_linear_bias or m.activation == "swiglu_clipped"):
            # gpt-oss, DeepSeek-V4 (moecore/models/biased_moe.py)
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
        self.needs_token_ids = self.is_moe and _moe_ordinal(cfg, layer_idx) < cfg.moe.num_hash_layers
        if self.needs_token_ids:
            self._use_hash_router(cfg, dims)
        self.attn_hc = self.mlp_hc = None
        if m.hc_mult > 1:
            from moecore.models.hyper_connections import HyperConnection

            hc = (m.hidden_size, m.hc_mult, m.hc_sinkhorn_iters, m.hc_eps, m.norm_eps)
            self.attn_hc, self.mlp_hc = HyperConnection(*hc), HyperConnection(*hc)
            tpl.mark_sequence_parallel(self.attn_hc, dims)  # per token, on sequence shards under SP
            tpl.mark_sequence_parallel(self.mlp_hc, dims)
        rec = set(m.recompute_modules)
        self.recompute_norm = "norm" in rec
        self.recompute_mlp = ("moe" in rec) if self.is_moe else ("mlp" in rec)
        self.cuda_graphs = None  # LayerGraphs with train.cuda_graphs (moecore/models/cuda_graphs.py)
        self.passes_topk = getattr(self.attn, "passes_topk", False)  # DSA top-k shared across layers (dsa.py)

    def _use_hash_router(self, cfg: Config, dims) -> None:
        """This MoE layer routes by token id (DeepSeek-V4's first layers; moecore/moe/router.py HashRouter)."""
        from moecore.moe import expert_parallel as ep_util
        from moecore.moe.router import HashRouter

        m = cfg.model
        self.mlp.router = HashRouter(cfg.moe, m.hidden_size, m.vocab_size, cfg.train.seed, m.init_std)
        ep_util.mark_replicated_moe_params([self.mlp.router], dims)

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
        token_ids: torch.Tensor | None = None,
    ):
        g = self.cuda_graphs
        if g is not None and g.whole is not None:
            return g.layer_forward(x, position_ids, loss_mask)
        return self.eager_forward(x, position_ids, loss_mask, topk_idx, token_ids)

    def eager_forward(
        self,
        x: torch.Tensor,
        position_ids: torch.Tensor,
        loss_mask: torch.Tensor | None,
        topk_idx: torch.Tensor | None = None,
        token_ids: torch.Tensor | None = None,
    ):
        """The layer op by op, except the parts `train.cuda_graphs` captured (attention, MoE routing).
        Returns (x, MoE aux or None), and with `passes_topk` the DSA top-k indices this layer used as well.
        `token_ids` [B, S]: the input's ids, read by a hash-routed MoE layer (`needs_token_ids`)."""
        if self.attn_hc is not None:
            return self._hyper_forward(x, position_ids, loss_mask, token_ids)
        if self.passes_topk:  # train.cuda_graphs refuses DSA: no captured parts here
            out, topk_idx = self._norm_then(self.attn_norm, x, lambda h: self.attn(h, position_ids, topk_idx))
            return (*self._feed_forward(x + out, loss_mask), topk_idx)
        g = self.cuda_graphs
        if g is not None and g.attention is not None:
            x = x + g.attention(x, position_ids)[0]
        else:
            x = x + self._norm_then(self.attn_norm, x, lambda h: self.attn(h, position_ids))
        return self._feed_forward(x, loss_mask, token_ids)

    def _hyper_forward(
        self, x: torch.Tensor, position_ids: torch.Tensor, loss_mask: torch.Tensor | None, token_ids
    ) -> tuple[torch.Tensor, object]:
        """Both blocks on hyper-connected streams x [B, S, n, H] (moecore/models/hyper_connections.py)."""
        post, comb, h = self.attn_hc(x)
        out = self._norm_then(self.attn_norm, h, lambda n: self.attn(n, position_ids))
        x = self.attn_hc.merge(x, out, post, comb)
        post, comb, h = self.mlp_hc(x)
        out, aux = self._mlp_output(h, loss_mask, token_ids)
        return self.mlp_hc.merge(x, out, post, comb), aux

    def _feed_forward(self, x: torch.Tensor, loss_mask: torch.Tensor | None, token_ids: torch.Tensor | None = None):
        """x + mlp(mlp_norm(x)) and the MoE aux (None for a dense layer)."""
        g = self.cuda_graphs
        if self.is_moe and g is not None and g.moe_head is not None:
            h, routed = g.routed(x, loss_mask)
            out, aux = self._maybe_checkpoint(self.recompute_mlp, self.mlp, h, loss_mask, routed)
            return x + out, aux
        out, aux = self._mlp_output(x, loss_mask, token_ids)
        return x + out, aux

    def _mlp_output(self, x: torch.Tensor, loss_mask: torch.Tensor | None, token_ids: torch.Tensor | None):
        """(mlp(mlp_norm(x)), the MoE aux or None for a dense layer)."""
        if self.is_moe:
            args = (loss_mask,) if token_ids is None else (loss_mask, None, token_ids)
            return self._norm_then(
                self.mlp_norm, x, lambda h: self._maybe_checkpoint(self.recompute_mlp, self.mlp, h, *args)
            )
        return self._norm_then(
            self.mlp_norm, x, lambda h: self._maybe_checkpoint(self.recompute_mlp, self.mlp, h)
        ), None


def layer_args(layer: nn.Module, x: torch.Tensor, position_ids: torch.Tensor, loss_mask, topk, input_ids) -> tuple:
    """The positional arguments of `layer(...)` in a decoder loop (the model's, a pipeline stage's): the previous
    layer's DSA top-k for a layer that `passes_topk`, the token ids for one that `needs_token_ids` (hash routing).
    Explicit arguments, so a checkpointed layer's recomputation sees what its forward saw."""
    if layer.needs_token_ids:
        return (x, position_ids, loss_mask, topk if layer.passes_topk else None, input_ids)
    return (x, position_ids, loss_mask) + ((topk,) if layer.passes_topk else ())


def _moe_ordinal(cfg: Config, layer_idx: int) -> int:
    """How many MoE layers come before decoder layer `layer_idx`."""
    return sum(cfg.moe.is_moe_layer(i, cfg.model.num_layers) for i in range(layer_idx))
