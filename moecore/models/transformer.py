"""The decoder-only MoE transformer, written for one device.

    input_ids -> embed -> [DecoderLayer] x L -> norm -> lm_head -> logits / loss
    DecoderLayer: x + attn(attn_norm(x)); then x + mlp(mlp_norm(x)), mlp = dense MLP or MoELayer

The layers are `DecoderLayer`s (`decoder_layer.py`: which attention, dense MLP or MoE, recomputation).
Parallel-aware pieces receive `dims` (a ParallelDims or None).

The forward returns a `ModelOutput` carrying the LM loss, the MoE routing losses and statistics
(returned, never stored in globals) and the MTP loss when multi-token prediction is on.

`ModelParts` builds only some modules (a pipeline stage's share, moecore/parallel/pipeline.py); the
others are left out (None, or `Absent` in `layers`) so built modules keep the full model's names.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from moecore.config import Config
from moecore.kernels.cross_entropy import linear_cross_entropy
from moecore.models.decoder_layer import DecoderLayer, layer_args
from moecore.models.init import seeded_init_
from moecore.models.norms import RMSNorm
from moecore.models.recompute import checkpoint_module
from moecore.moe.experts import GroupedExperts
from moecore.parallel import tensor_parallel as tpl
from moecore.parallel.context import cp_position_ids, cp_size


@dataclass
class ModelOutput:
    """What a forward pass returns. `loss` is what to backpropagate (None without labels).

    Under context parallel (parallel.cp > 1) the sums (`lm_loss_sum`, `num_tokens`) and the objective
    terms (`aux_loss`, `mtp_loss`) are this rank's shares: summed over the CP ranks they give the values
    of the whole sequences; `mtp_losses` and `moe_stats` are already those of the whole sequences;
    `lm_loss` and `loss` are means over this rank's tokens (the training loop uses the shares).
    """

    logits: torch.Tensor | None = None
    loss: torch.Tensor | None = None
    lm_loss: torch.Tensor | None = None  # mean over tokens with loss_mask 1
    lm_loss_sum: torch.Tensor | None = None  # sum over those tokens (for exact accumulation)
    num_tokens: torch.Tensor | None = None
    aux_loss: torch.Tensor | None = None  # sum over MoE layers of their weighted routing losses
    mtp_loss: torch.Tensor | None = None  # already scaled by model.mtp_loss_scaling_factor
    mtp_losses: list = field(default_factory=list)  # per depth, unscaled, detached
    moe_stats: list = field(default_factory=list)  # one dict per MoE layer (layer index under "layer")
    indexer_loss: torch.Tensor | None = None  # DSA: weighted KL loss of the lightning indexers (moecore/models/dsa.py)
    hidden_states: torch.Tensor | None = None  # final hidden states before the norm


@dataclass(frozen=True)
class ModelParts:
    """Which modules to build; the default is the whole model."""

    embed: bool = True
    layers: tuple[int, ...] | None = None  # decoder layer indices; None: every layer
    norm: bool = True
    lm_head: bool = True  # the untied output head (a tied head is `embed`)
    mtp: bool = True


class Absent(nn.Module):
    """Placeholder for a decoder layer built elsewhere (another pipeline stage); holds no parameters."""

    is_moe = False
    passes_topk = False
    needs_token_ids = False

    def forward(self, *args, **kwargs):
        raise RuntimeError("this layer is held by another pipeline stage")


class MoETransformer(nn.Module):
    """A causal language model with MoE layers; `forward` returns a `ModelOutput`."""

    def __init__(self, cfg: Config, dims=None, parts: ModelParts | None = None) -> None:
        super().__init__()
        if cfg.model.vocab_size <= 0:
            raise ValueError("model.vocab_size must be set (> 0) before building the model")
        self.cfg = cfg
        self.dims = dims
        m = cfg.model
        parts = parts or ModelParts()
        # Tensor parallel: embedding rows and head columns split along the vocabulary.
        self.embed = tpl.VocabParallelEmbedding(m.vocab_size, m.hidden_size, dims) if parts.embed else None
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, i, dims) if parts.layers is None or i in parts.layers else Absent()
            for i in range(m.num_layers)
        )
        self.hc_head = None  # DeepSeek-V4: collapses the hyper-connection streams (moecore/models/hyper_connections.py)
        if m.hc_mult > 1 and parts.norm:
            from moecore.models.hyper_connections import HyperHead

            self.hc_head = HyperHead(m.hidden_size, m.hc_mult, m.hc_eps, m.norm_eps)
            tpl.mark_sequence_parallel(self.hc_head, dims)
        self.norm = RMSNorm(m.hidden_size, m.norm_eps, m.norm_zero_centered) if parts.norm else None
        if self.norm is not None:
            tpl.mark_sequence_parallel(self.norm, dims)
        self.lm_head = (
            None
            if m.tie_embeddings or not parts.lm_head
            else tpl.ColumnParallelLinear(m.hidden_size, m.vocab_size, False, dims, name="model.vocab_size")
        )
        self.mtp = None
        if m.mtp_num_layers > 0 and parts.mtp:
            from moecore.models.mtp import MTPStack

            self.mtp = MTPStack(cfg, dims)
        self.full_recompute = m.recompute_granularity == "full"
        for name, module in self.named_modules():  # names for the experts' one-line slow-path warning
            if isinstance(module, GroupedExperts):
                module.name = name
        self.reset_parameters()
        if m.offload_modules:  # saved activations of these modules wait in host memory (models/offload.py)
            from moecore.models.offload import apply_offload

            apply_offload(self, m.offload_modules)
        if m.attention_type == "dsa" and m.dsa_stage == "dense_warmup":
            from moecore.models.dsa import freeze_all_but_indexers

            freeze_all_but_indexers(self)

    # ------------------------------------------------------------------ initialisation
    def reset_parameters(self) -> None:
        """Normal(0, init_std) for every matrix; norms to identity; biases to zero.

        The random values come from `train.seed` and each element's position in its global tensor
        (moecore/models/init.py), not from torch's generator: every parallel layout starts from the
        single process's weights. The modules' own initialisation below sets the deterministic parts.
        """
        std = self.cfg.model.init_std
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, mean=0.0, std=std)
                if getattr(module, "bias", None) is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, RMSNorm):
                module.reset_parameters()
            elif module is not self and hasattr(module, "reset_parameters") and not isinstance(module, nn.ModuleList):
                # Modules with parameters of their own (grouped experts, routers, DeltaNet) initialise them.
                if any(True for _ in module.parameters(recurse=False)):
                    module.reset_parameters()
        seeded_init_(self, self.cfg.train.seed, std)

    # ------------------------------------------------------------------ forward
    def output_weight(self) -> torch.Tensor:
        return self.embed.weight if self.lm_head is None else self.lm_head.weight

    def logits_from_hidden(self, h: torch.Tensor, gather: bool = True) -> torch.Tensor:
        """Logits [B, S, V]; under tensor parallel `gather=False` keeps this rank's vocabulary shard."""
        logits = F.linear(tpl.tp_region_input(h, self.dims), self.output_weight())
        return tpl.gather_vocab(logits, self.dims) if gather else logits

    def decoder(
        self, input_ids: torch.Tensor, loss_mask: torch.Tensor | None, position_ids: torch.Tensor | None = None
    ):
        """Embedding and decoder layers; returns (hidden states before the final norm, MoE aux list)."""
        if position_ids is None:
            # under context parallel input_ids are this rank's chunks (moecore/parallel/context.py)
            cp = cp_size(self.dims)
            if cp > 1:
                position_ids = cp_position_ids(input_ids.shape[1] * cp, self.dims, input_ids.device)
            else:
                position_ids = torch.arange(input_ids.shape[1], device=input_ids.device)
        x = self.embed(input_ids)
        hc = self.cfg.model.hc_mult
        if hc > 1:  # DeepSeek-V4: the embedding enters every hyper-connection stream
            from moecore.models.hyper_connections import expand_streams

            x = expand_streams(x, hc)
        auxes = []
        topk = None  # DSA with shared indexer layers: the top-k indices the last layer used (moecore/models/dsa.py)
        for layer in self.layers:
            args = layer_args(layer, x, position_ids, loss_mask, topk, input_ids)
            if self.full_recompute and self.training and torch.is_grad_enabled():
                out = checkpoint_module(layer, *args)
            else:
                out = layer(*args)
            if layer.passes_topk:
                x, aux, topk = out
            else:
                x, aux = out
            if aux is not None:
                auxes.append((layer.layer_idx, aux))
        if self.hc_head is not None:
            x = self.hc_head(x)
        return x, auxes, position_ids

    def forward(
        self,
        input_ids: torch.Tensor,
        labels: torch.Tensor | None = None,
        loss_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
    ) -> ModelOutput:
        x, auxes, position_ids = self.decoder(input_ids, loss_mask, position_ids)
        out = ModelOutput(hidden_states=x)
        h = self.norm(x)
        out.moe_stats = [dict(aux.stats, layer=i) for i, aux in auxes]
        if auxes:
            out.aux_loss = sum(aux.loss for _, aux in auxes)
        if labels is None:
            out.logits = self.logits_from_hidden(h)
            return out
        mask = torch.ones_like(labels, dtype=torch.float32) if loss_mask is None else loss_mask.float()
        out.logits, loss_sum = self.lm_loss(h, labels, mask)
        out.num_tokens = mask.sum()
        out.lm_loss_sum = loss_sum
        out.lm_loss = loss_sum / out.num_tokens.clamp(min=1)
        total = out.lm_loss
        if out.aux_loss is not None:
            total = total + out.aux_loss
        if self.mtp is not None:
            # MTP starts from the final-normed hidden states (DeepSeek-V3, Megatron-Core, transformers).
            out.mtp_loss, out.mtp_losses, mtp_auxes = self.mtp(h, input_ids, labels, mask, position_ids, self)
            total = total + out.mtp_loss
            for i, aux in mtp_auxes:  # routing losses of the MTP blocks' MoE layers count like the others
                out.moe_stats.append(dict(aux.stats, layer=i))
                out.aux_loss = aux.loss if out.aux_loss is None else out.aux_loss + aux.loss
                total = total + aux.loss
        out.loss = total
        if self.cfg.model.attention_type == "dsa":
            self._add_indexer_loss(out)
        return out

    def _add_indexer_loss(self, out: ModelOutput) -> None:
        """DSA: the indexers' KL loss joins the objective; in dense_warmup it is the whole objective (the other
        losses are returned detached, so only the indexers learn)."""
        from moecore.models.dsa import collect_indexer_losses

        loss = collect_indexer_losses(self)
        if loss is None:
            return
        out.indexer_loss = loss * self.cfg.model.dsa_indexer_loss_coeff
        if self.cfg.model.dsa_stage == "dense_warmup":
            for name in ("lm_loss", "lm_loss_sum", "aux_loss", "mtp_loss"):
                value = getattr(out, name)
                if value is not None:
                    setattr(out, name, value.detach())
            out.loss = out.indexer_loss
        else:
            out.loss = out.loss + out.indexer_loss

    def lm_loss(
        self, h: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor
    ) -> tuple[torch.Tensor | None, torch.Tensor]:
        """(logits or None, sum over masked tokens of the cross-entropy); fp32 logits.

        Under tensor parallel the logits are this rank's vocabulary shard and the cross-entropy is
        vocabulary-parallel (moecore.parallel.tensor_parallel).
        """
        if self.cfg.model.fused_cross_entropy and h.is_cuda and getattr(self.dims, "tp", 1) == 1:
            # Chunked LM head + loss (moecore/kernels/cross_entropy.py): same maths, no full logits.
            loss_sum = linear_cross_entropy(h.flatten(0, 1), self.output_weight(), labels.flatten(), mask.flatten())
            return None, loss_sum
        logits = self.logits_from_hidden(h, gather=False)
        ce = tpl.vocab_parallel_cross_entropy(logits, labels, self.dims)
        return logits, (ce.flatten() * mask.flatten()).sum()

    # ------------------------------------------------------------------ helpers
    def moe_layers(self) -> list[nn.Module]:
        blocks = list(self.layers) + ([mod.block for mod in self.mtp.layers] if self.mtp is not None else [])
        return [layer.mlp for layer in blocks if layer.is_moe]  # Absent layers (other stages) are not MoE

    def num_params(self) -> tuple[int, int]:
        """(total parameters, parameters active per token)."""
        total = sum(p.numel() for p in self.parameters())
        moe = self.cfg.moe
        inactive = 0
        for mlp in self.moe_layers():
            experts = getattr(mlp, "experts", None)
            if experts is not None and moe.num_experts:
                n = sum(p.numel() for p in experts.parameters())
                inactive += n - n * moe.router_topk // moe.num_experts
        return total, total - inactive
