"""Multi-token prediction (MTP) as in DeepSeek-V3: D extra modules, depth k predicts token t+k+1.

Module k (k = 1..D) sees, at position i, the representation h^{k-1}_i of the previous depth (the main
model's final-normed hidden states for k = 1) and the embedding of token i+k:

    x_i   = eh_proj([enorm(Emb(t_{i+k})) ; hnorm(h^{k-1}_i)])      eh_proj: 2H -> H, no bias
    h^k   = head_norm(Block_k(x))                                  Block_k: one decoder layer (attention + FFN)
    loss_k = mean over valid i of CE(OutHead(h^k_i), t_{i+k+1})

The embedding and the output head are the main model's (shared, as in DeepSeek-V3). With labels
already shifted (labels[:, i] = t_{i+1}), depth k's inputs are input_ids rolled left by k and its
targets labels rolled left by k; positions that roll past the end of the sequence are masked, as is
any position whose target the loss mask excludes. The objective adds
mtp_loss_scaling_factor * mean_k(loss_k); each loss_k is also returned (detached) for logging.
RoPE positions are left as they are: attention sees only position differences, which the roll keeps.
Under context parallel the roll crosses chunk boundaries through a one-token halo from the rank holding
the next chunk (`moecore.parallel.context.cp_roll_left`), and each depth's loss is this rank's share:
its loss sum divided by the depth's token count over the whole sequence.

The block of module k is a regular DecoderLayer; it is an MoE layer whenever the model has experts
(DeepSeek-V3's MTP layer is), whatever `moe.layer_freq` / `moe.first_k_dense_replace` say for the
main layers, and always uses full attention. Its routing losses and statistics are returned like
those of the main layers.

Tensor parallel: the norms and eh_proj are replicated and act on the residual stream (sequence shards
under sequence parallel, where their gradients are partial sums over TP); the block's attention and
FFN split as the main layers' do; the shared embedding and head are vocabulary-parallel, as the main
model's. No further communication is needed: the shifted ids and labels are whole on every rank.

Parameter names: mtp.layers.{k-1}.{enorm, hnorm, eh_proj, block.*, head_norm}; a DeepSeek-V3
checkpoint stores them as model.layers.{num_hidden_layers + k - 1}.{enorm, hnorm, eh_proj, <block>,
shared_head.norm} plus copies of the shared embedding and head (moecore/hf/families/deepseek_v3.py).
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

from moecore.config import Config
from moecore.models.decoder_layer import DecoderLayer
from moecore.models.norms import RMSNorm
from moecore.parallel.context import cp_roll_left, cp_size, sum_over_cp
from moecore.parallel.tensor_parallel import mark_sequence_parallel


def roll_left(t: torch.Tensor, shift: int, fill: float | int = 0) -> torch.Tensor:
    """t[:, i] -> t[:, i + shift] along dim 1; the last `shift` positions become `fill`."""
    if shift == 0:
        return t
    pad = t.new_full((t.shape[0], shift, *t.shape[2:]), fill)
    return torch.cat((t[:, shift:], pad), dim=1)


def mtp_block_config(cfg: Config) -> Config:
    """The config an MTP block is built from: MoE whenever the model has experts, full attention (and, with DSA,
    its own indexer)."""
    block = copy.deepcopy(cfg)
    block.moe.layer_freq = 1
    block.moe.first_k_dense_replace = 0
    block.model.layer_types = None
    block.model.indexer_types = None  # DSA: an MTP block runs its own indexer (GLM-5's shared layers are main layers)
    return block


class MTPModule(nn.Module):
    """One prediction depth: input norms, the 2H -> H projection, a decoder layer, the head norm."""

    def __init__(self, cfg: Config, depth: int, dims: Any = None) -> None:
        super().__init__()

        m = cfg.model
        self.depth = depth  # 1-based
        self.layer_idx = m.num_layers + depth - 1  # its index in a DeepSeek-V3 checkpoint
        self.enorm = RMSNorm(m.hidden_size, m.norm_eps, m.norm_zero_centered)
        self.hnorm = RMSNorm(m.hidden_size, m.norm_eps, m.norm_zero_centered)
        self.eh_proj = nn.Linear(2 * m.hidden_size, m.hidden_size, bias=False)
        self.block = DecoderLayer(mtp_block_config(cfg), self.layer_idx, dims)
        self.head_norm = RMSNorm(m.hidden_size, m.norm_eps, m.norm_zero_centered)
        for mod in (self.enorm, self.hnorm, self.eh_proj, self.head_norm):  # applied to sequence shards under SP
            mark_sequence_parallel(mod, dims)

    def forward(
        self, hidden: torch.Tensor, embeds: torch.Tensor, position_ids: torch.Tensor, loss_mask: torch.Tensor
    ) -> tuple[torch.Tensor, Any]:
        """(this depth's final-normed hidden states [B, S, H], the block's MoE aux or None)."""
        x = self.eh_proj(torch.cat((self.enorm(embeds), self.hnorm(hidden)), dim=-1))
        x, aux = self.block(x, position_ids, loss_mask)
        return self.head_norm(x), aux


class MTPStack(nn.Module):
    """`model.mtp_num_layers` MTP modules chained depth after depth; see the module docstring."""

    def __init__(self, cfg: Config, dims: Any = None) -> None:
        super().__init__()
        m = cfg.model
        if m.mtp_num_layers < 1:
            raise ValueError(f"model.mtp_num_layers={m.mtp_num_layers} is invalid for an MTP stack: must be >= 1")
        self.scaling_factor = m.mtp_loss_scaling_factor
        self.dims = dims
        self.layers = nn.ModuleList(MTPModule(cfg, k + 1, dims) for k in range(m.mtp_num_layers))

    def forward(
        self,
        hidden: torch.Tensor,
        input_ids: torch.Tensor,
        labels: torch.Tensor,
        loss_mask: torch.Tensor,
        position_ids: torch.Tensor,
        model: nn.Module,
    ) -> tuple[torch.Tensor, list[torch.Tensor], list[tuple[int, Any]]]:
        """Run every depth on the main model's final-normed `hidden` [B, S, H].

        `model` supplies the shared embedding (`model.embed`) and output head + cross-entropy
        (`model.lm_loss(h, labels, mask) -> (logits, summed loss)`). Returns (scaling factor * mean
        of the per-depth losses, the per-depth losses detached, [(layer index, MoE aux)] of the blocks).
        """
        mask = loss_mask.float()
        ids, targets = input_ids, labels
        losses, auxes = [], []
        cp = cp_size(self.dims)
        if cp > 1:
            # Context parallel: this rank holds two chunks of the sequence; the token after a chunk's last
            # comes from the neighbouring chunk (a one-token halo, moecore/parallel/context.py). Each depth's
            # loss is this rank's share: its loss sum over the tokens counted on every CP rank, so the
            # shares add up over CP to the loss of the whole sequence.
            def roll(t):
                return cp_roll_left(t, self.dims)
        else:

            def roll(t):
                return roll_left(t, 1)

        logged = []
        for layer in self.layers:
            ids, targets, mask = roll(ids), roll(targets), roll(mask)
            hidden, aux = layer(hidden, model.embed(ids), position_ids, mask)
            if aux is not None:
                auxes.append((layer.layer_idx, aux))
            _, loss_sum = model.lm_loss(hidden, targets, mask)
            count = mask.sum() if cp == 1 else sum_over_cp(mask.sum(), self.dims)
            losses.append(loss_sum / count.clamp(min=1))
            logged.append(losses[-1].detach() if cp == 1 else sum_over_cp(losses[-1], self.dims))
        total = torch.stack(losses).mean() * self.scaling_factor
        return total, logged, auxes
