"""DeepSeek Sparse Attention (DSA, DeepSeek-V3.2): a lightning indexer picks, for every query, the `index_topk`
past tokens that multi-latent attention (moecore/models/mla.py) then attends to.

Lightning indexer (its own small heads; `model.index_n_heads` = nh, `model.index_head_dim` = d):

    qI_{t,h} = wq_b(cq_t)_h                      cq_t = q_a_layernorm(q_a_proj(x_t)), MLA's query latent
    kI_s     = LayerNorm(wk(x_s))                one key per token, shared by the indexer heads
    (RoPE on the first qk_rope_head_dim channels of qI and kI, the main attention's cos/sin: half-split pairs
     for DeepSeek-V3.2, interleaved pairs with `model.indexer_rope_interleave` for GLM-5)
    w_{t,h}  = weights_proj(x_t)_h / sqrt(nh)
    I_{t,s}  = sum_h w_{t,h} * ReLU(qI_{t,h} . kI_s / sqrt(d))          in fp32, for s <= t

The selection S_t = top-`index_topk` of I_{t, s<=t} (every visible token when t < index_topk). Scores are
computed a block of queries at a time ([B, block, nh, S] at most), never as one [B, S, nh, S] tensor.

Main attention, sparse: MLA restricted to s in S_t, computed in the absorbed (multi-query) form: with the
normalised latent c_s and the rotated shared key kr_s,

    q~_{t,h} = [q_nope_{t,h} W_UK_h ; RoPE(q_rope_{t,h})]     kv~_s = [c_s ; RoPE(kr_s)]
    o_{t,h}  = W_UV_h sum_{s in S_t} softmax_s(q~_{t,h} . kv~_s * scale) c_s

which equals attending to the per-head keys k = [W_UK_h c ; kr] and values W_UV_h c (kv_b_proj = [W_UK; W_UV]
per head), but gathers one shared [kv_lora_rank + qk_rope_head_dim] row per selected token for all heads.
`sparse_mqa_attention_reference` gathers the rows with PyTorch ([B, S, topk, D]); on CUDA the Triton kernel
moecore/kernels/sparse_mla.py does the same without any [S, S] or [S, topk, D] tensor.

Training (`model.dsa_stage`), as DeepSeek-V3.2 was trained:
- `dense_warmup`: the main attention is dense MLA; only the indexer learns, from the KL loss
  KL(P_t || softmax(I_{t, s<=t})) with P_t the main attention's probabilities summed over heads and
  L1-normalised (target detached). Every other parameter is frozen (`requires_grad` off, so optimizers
  and gradient reduction skip it) and the model returns its other losses detached.
- `sparse`: the main attention attends to S_t; the indexer's inputs (x, cq) are detached so that it learns
  only from its KL loss, now over S_t: KL(P_t|S_t || softmax(I_{t, S_t})).
The KL loss (mean over tokens and layers) times `model.dsa_indexer_loss_coeff` is `ModelOutput.indexer_loss`.

Shared top-k (GLM-5, `model.indexer_types`): a "shared" layer has no indexer; it attends to the top-k of the last
"full" layer before it. The indices travel as an explicit tensor argument and result, never as module state: when
the model has shared layers (`shares_topk(cfg)`), every DSA layer's forward takes the previous layer's indices and
returns (output, the indices it used) — a full layer its own, a shared layer those it was given — and the decoder
loop (moecore/models/transformer.py) hands them to the next layer. Activation recomputation stays correct because
the indices are an input of the checkpointed layer: a recomputed shared layer sees the saved tensor, not whatever a
later (or recomputed) full layer selected. A full layer learns from the KL loss against its own attention only; a
shared layer has no indexer and no KL loss. Pipeline and context parallel refuse DSA (moecore/parallel/layout.py),
so the indices never cross a stage.

Tensor parallel: the main attention's heads split as MLA's do (moecore/models/mla.py); the indexer stays whole
on every rank (its nh heads and one key are small, and its scores sum over all its heads before the top-k), fed
the gathered sequence, so every rank selects the same tokens. The KL target, the main attention's probabilities
summed over heads, is summed over the TP ranks' heads (one all-reduce per query block, without gradient); the
indexer's gradients are then complete on every rank.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from moecore.config import ModelConfig
from moecore.models.mla import MLAttention
from moecore.models.rope import apply_rotary
from moecore.parallel import comm
from moecore.parallel.context import cp_size, gather_from_cp, gather_from_cp_plain
from moecore.parallel.tensor_parallel import tp_region_input, tp_size

# Query rows per block in the indexer's top-k and the KL losses: temporaries of at most about this many
# fp32 elements at once.
_BLOCK_ELEMENTS = 1 << 26


def shares_topk(cfg: ModelConfig) -> bool:
    """Whether some DSA layer reuses the top-k of an earlier one (`model.indexer_types` has a shared entry)."""
    return cfg.attention_type == "dsa" and cfg.indexer_types is not None and "shared" in cfg.indexer_types


def indexer_count(cfg: ModelConfig) -> int:
    """DSA layers with an indexer of their own in the whole model (their KL losses are averaged): every decoder
    layer that is not `shared` in `model.indexer_types`, and every MTP block (each runs its own indexer)."""
    if cfg.attention_type != "dsa":
        return 0
    main = cfg.num_layers if cfg.indexer_types is None else sum(t != "shared" for t in cfg.indexer_types)
    return main + cfg.mtp_num_layers


class LightningIndexer(nn.Module):
    """The indexer's parameters (transformers' names: wq_b, wk, k_norm, weights_proj) and its scores."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        if cfg.q_lora_rank is None:
            raise ValueError(
                "model.q_lora_rank=None is invalid with model.attention_type=dsa: the indexer reads the q latent"
            )
        if cfg.index_head_dim < cfg.qk_rope_head_dim:
            raise ValueError(
                f"model.index_head_dim={cfg.index_head_dim} is invalid: must be >= model.qk_rope_head_dim={cfg.qk_rope_head_dim}"
            )
        self.n_heads, self.head_dim, self.rope_dim = cfg.index_n_heads, cfg.index_head_dim, cfg.qk_rope_head_dim
        self.rope_interleave = cfg.indexer_rope_interleave
        self.wq_b = nn.Linear(cfg.q_lora_rank, self.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(cfg.hidden_size, self.head_dim, bias=False)
        self.k_norm = nn.LayerNorm(self.head_dim, eps=1e-6)
        self.weights_proj = nn.Linear(cfg.hidden_size, self.n_heads, bias=False)

    def forward(
        self, x: torch.Tensor, q_latent: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(q [B, nh, S, d], k [B, S, d], head weights [B, S, nh]) in fp32: the projections, the one use of the
        indexer's parameters (a module call, so that module hooks such as FSDP's gathers see it)."""
        b, s, _ = x.shape
        q = self.wq_b(q_latent).view(b, s, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.k_norm(self.wk(x)).unsqueeze(1)  # [B, 1, S, d]
        # the first rope_dim channels; interleaved pairs come out half-split, the same reordering for q and k
        q = apply_rotary(q, cos, sin, interleaved=self.rope_interleave)
        k = apply_rotary(k, cos, sin, interleaved=self.rope_interleave)
        w = self.weights_proj(x).float() * self.n_heads**-0.5
        return q.float(), k.squeeze(1).float(), w

    def scores(self, q: torch.Tensor, k: torch.Tensor, w: torch.Tensor, start: int, stop: int) -> torch.Tensor:
        """I[b, t, s] for queries start..stop-1 and every key s (masking is the caller's): [B, stop-start, S]."""
        logits = torch.einsum("bhtd,bsd->bths", q[:, :, start:stop], k) * self.head_dim**-0.5
        return torch.einsum("bth,bths->bts", w[:, start:stop], F.relu(logits))

    def scores_at(
        self, q: torch.Tensor, k: torch.Tensor, w: torch.Tensor, sel: torch.Tensor, start: int, stop: int
    ) -> torch.Tensor:
        """I[b, t, sel[b, t, j]] for queries start..stop-1: [B, stop-start, K] (sel: valid key indices)."""
        ks = k[torch.arange(k.shape[0], device=k.device)[:, None, None], sel]  # [B, T, K, d]
        logits = torch.einsum("bhtd,btjd->bthj", q[:, :, start:stop], ks) * self.head_dim**-0.5
        return torch.einsum("bth,bthj->btj", w[:, start:stop], F.relu(logits))


def query_blocks(batch: int, seq: int, per_query: int) -> list[tuple[int, int]]:
    """[start, stop) query ranges whose temporaries (`per_query` elements per query and sequence) hold at most
    _BLOCK_ELEMENTS elements."""
    block = max(1, _BLOCK_ELEMENTS // max(1, batch * per_query))
    return [(i, min(seq, i + block)) for i in range(0, seq, block)]


def causal_topk(
    indexer: LightningIndexer, q, k, w, topk: int, query_positions: torch.Tensor | None = None
) -> torch.Tensor:
    """int64 [B, S, min(topk, N)]: the top-k visible keys of every query by index score; -1 where a query has
    fewer visible keys than k. q holds S queries, k the N keys of the whole sequence; a query at position t sees
    keys 0..t. `query_positions` [S]: the queries' positions in the sequence (context parallel: this rank's
    share of it); default 0..S-1 (N = S). Computed in query blocks, without gradient."""
    b, _, s, _ = q.shape
    n = k.shape[1]
    kk = min(topk, n)
    out = torch.empty(b, s, kk, dtype=torch.long, device=q.device)
    rows = torch.arange(s, device=q.device) if query_positions is None else query_positions.to(q.device)
    with torch.no_grad():
        cols = torch.arange(n, device=q.device)
        for start, stop in query_blocks(b, s, indexer.n_heads * n):
            sc = indexer.scores(q, k, w, start, stop)
            visible = cols[None, :] <= rows[start:stop, None]
            sc = sc.masked_fill(~visible, float("-inf"))
            val, idx = sc.topk(kk, dim=-1)
            out[:, start:stop] = idx.masked_fill(val == float("-inf"), -1)
    return out


def sparse_mqa_attention_reference(
    q: torch.Tensor, kv: torch.Tensor, idx: torch.Tensor, scale: float, dv: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Multi-query attention of q [B, S, n, D] to the rows idx [B, S, K] (-1: none) of kv [B, S, D]; values are
    kv[..., :dv]. Returns (out [B, S, n, dv], lse [B, S, n] in fp32). Gathers [B, S, K, D] (reference)."""
    b = q.shape[0]
    valid = idx >= 0
    rows = kv[torch.arange(b, device=kv.device)[:, None, None], idx.clamp(min=0)]  # [B, S, K, D]
    logits = torch.einsum("btnd,btkd->btnk", q.float(), rows.float()) * scale
    logits = logits.masked_fill(~valid[:, :, None, :], float("-inf"))
    lse = torch.logsumexp(logits, dim=-1)
    p = torch.exp(logits - lse[..., None])
    out = torch.einsum("btnk,btkd->btnd", p, rows[..., :dv].float())
    return out.to(q.dtype), lse


def sparse_mqa_attention(
    q: torch.Tensor, kv: torch.Tensor, idx: torch.Tensor, scale: float, dv: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """`sparse_mqa_attention_reference`'s result: the Triton kernel on CUDA, the reference elsewhere."""
    if q.is_cuda:
        from moecore.kernels.sparse_mla import sparse_mla_attention

        return sparse_mla_attention(q, kv, idx, scale, dv)
    return sparse_mqa_attention_reference(q, kv, idx, scale, dv)


def sparse_mqa_attention_to_sequence(
    q: torch.Tensor, kv: torch.Tensor, idx: torch.Tensor, scale: float, dv: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """`sparse_mqa_attention` where kv [B, N, D] holds more rows than q [B, S, n, D] has queries (context
    parallel: this rank's queries against the gathered sequence): batches folded into one, so that every
    implementation indexes kv's rows as it would a sequence of its own."""
    b, s = idx.shape[:2]
    n = kv.shape[1]
    if n == s:
        return sparse_mqa_attention(q, kv, idx, scale, dv)
    offsets = (torch.arange(b, device=idx.device) * n)[:, None, None]
    flat = torch.where(idx >= 0, idx + offsets, idx).reshape(1, b * s, -1)
    out, lse = sparse_mqa_attention(q.reshape(1, b * s, *q.shape[2:]), kv.reshape(1, b * n, -1), flat, scale, dv)
    return out.reshape(b, s, *out.shape[2:]), lse.reshape(b, s, -1)


def kl_to_indexer(target: torch.Tensor, index_logits: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """sum over keys of KL(target || softmax(index_logits)) per query, keys outside `keep` excluded: [B, T]."""
    log_q = torch.log_softmax(index_logits.masked_fill(~keep, float("-inf")), dim=-1)
    t = target * keep
    return (torch.xlogy(t, t) - t * log_q.masked_fill(~keep, 0.0)).sum(-1)


def recomputed_kl(
    scores: Callable[..., torch.Tensor], target: torch.Tensor, keep: torch.Tensor, *inputs
) -> torch.Tensor:
    """sum of kl_to_indexer(target, scores(*inputs), keep), the index scores computed again in backward: a query
    block keeps its inputs, target and keep for the backward, not the fp32 keys gathered per query [B, T, K, d]
    and the ReLU of every indexer head [B, T, nh, K] (or [B, T, nh, S] in dense_warmup)."""

    def kl(t: torch.Tensor, k: torch.Tensor, *a: torch.Tensor) -> torch.Tensor:
        return kl_to_indexer(t, scores(*a), k).sum()

    return checkpoint(kl, target, keep, *inputs, use_reentrant=False)


class DSAttention(MLAttention):
    """MLA with the lightning indexer; `forward(x, position_ids) -> [B, S, H]` as MLAttention, or with shared
    layers in the model (`passes_topk`) `forward(x, position_ids, topk_idx) -> ([B, S, H], indices used)`. After a
    training forward, `indexer_loss` holds this layer's KL loss (mean over tokens) until `pop_indexer_loss()`."""

    def __init__(self, cfg: ModelConfig, layer_idx: int, dims: Any = None) -> None:
        super().__init__(cfg, layer_idx, dims)
        self.passes_topk = shares_topk(cfg)
        shared = self.passes_topk and cfg.indexer_types[layer_idx] == "shared"
        self.indexer = None if shared else LightningIndexer(cfg)  # a shared layer reuses an earlier top-k
        self.index_topk = cfg.index_topk
        self.stage = cfg.dsa_stage
        self.indexer_loss: torch.Tensor | None = None
        if not self.rope_interleave:
            raise ValueError("model.rope_interleave=false is invalid with model.attention_type=dsa (DeepSeek-V3.2)")

    def pop_indexer_loss(self) -> torch.Tensor | None:
        loss, self.indexer_loss = self.indexer_loss, None
        return loss

    def _keep_loss(self, loss: torch.Tensor) -> None:
        """Hold this forward's KL loss for the model to collect; a checkpointed layer's recomputation in backward
        computes it again (the recomputation must save what the forward saved) but it is not kept."""
        if torch._C._current_graph_task_id() == -1:
            self.indexer_loss = loss

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor, topk_idx: torch.Tensor | None = None):
        if self.stage == "dense_warmup":  # dense attention: no top-k to pass on
            out = super().forward(x, position_ids)
            if self.indexer is not None and self.training and torch.is_grad_enabled():
                # the indexer reads x detached: this second gather of the sequence shards has no backward
                self._keep_loss(self._dense_indexer_loss(tp_region_input(x.detach(), self.dims), position_ids))
            return (out, None) if self.passes_topk else out
        out, idx = self._sparse_forward(tp_region_input(x, self.dims), position_ids, topk_idx)
        return (out, idx) if self.passes_topk else out

    def _head_mean(self, p: torch.Tensor) -> torch.Tensor:
        """The mean over every head of the main attention's probabilities, from `p` summed over this rank's heads
        (tensor parallel: summed over the TP ranks; no gradient flows through the target)."""
        tp = tp_size(self.dims)
        if tp > 1:
            comm.all_reduce_(p, self.dims.tp_group, "sum")
        return p / (self.num_heads * tp)

    # ------------------------------------------------------------------ pieces
    def _latents(self, x: torch.Tensor, position_ids: torch.Tensor):
        cos, sin = self.rotary(position_ids, x.dtype)
        q_latent = self.q_a_layernorm(self.q_a_proj(x))
        latent, k_rope = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, self.rope_dim], dim=-1)
        return cos, sin, q_latent, latent, k_rope

    def _indexer_inputs(self, x: torch.Tensor, q_latent: torch.Tensor, cos, sin):
        """The indexer's q, k, w from detached inputs: the indexer never sends gradient into the model."""
        return self.indexer(x.detach(), q_latent.detach(), cos, sin)

    def _absorbed(self, q_latent, latent, k_rope, cos, sin) -> tuple[torch.Tensor, torch.Tensor]:
        """q~ [B, S, n, r + dr] and kv~ [B, S, r + dr] of the absorbed form (module docstring)."""
        b, s, _ = q_latent.shape
        n, dn, r = self.num_heads, self.nope_dim, self.kv_lora_rank
        q = self.q_b_proj(q_latent).view(b, s, n, self.qk_head_dim).transpose(1, 2)
        q_nope, q_rope = q.split([dn, self.rope_dim], dim=-1)
        w_uk = self.kv_b_proj.weight.view(n, dn + self.v_dim, r)[:, :dn]  # [n, dn, r]
        q_abs = torch.einsum("bnsd,ndr->bsnr", q_nope, w_uk)
        q_rope = apply_rotary(q_rope, cos, sin, interleaved=True).transpose(1, 2)  # [B, S, n, dr]
        k_rope = apply_rotary(k_rope.unsqueeze(1), cos, sin, interleaved=True).squeeze(1)
        c = self.kv_a_layernorm(latent)
        return torch.cat((q_abs, q_rope), dim=-1), torch.cat((c, k_rope), dim=-1)

    def _sparse_forward(
        self, x: torch.Tensor, position_ids: torch.Tensor, shared_idx: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(output [B, S, H], the top-k indices attended to: this layer's own, or `shared_idx` without an indexer)."""
        b, s, _ = x.shape
        cos, sin, q_latent, latent, k_rope = self._latents(x, position_ids)
        # Context parallel: this rank's queries select among, and attend to, the whole sequence's keys, gathered
        # in sequence order (their gradients summed back to the ranks holding them); `idx` counts in that order.
        cp = cp_size(self.dims)
        if self.indexer is None:
            if shared_idx is None:
                raise RuntimeError(f"DSA layer {self.layer_idx} is shared (model.indexer_types) but got no top-k")
            idx = shared_idx
        else:
            iq, ik, iw = self._indexer_inputs(x, q_latent, cos, sin)
            if cp > 1:
                ik = gather_from_cp(ik, self.dims, seq_dim=1)
            positions = position_ids.reshape(-1, s)[0] if cp > 1 else None
            idx = causal_topk(self.indexer, iq, ik, iw, self.index_topk, positions)
        q_t, kv_t = self._absorbed(q_latent, latent, k_rope, cos, sin)
        if cp > 1:
            kv_t = gather_from_cp(kv_t, self.dims, seq_dim=1)
        o_lat, lse = sparse_mqa_attention_to_sequence(q_t, kv_t, idx, self.softmax_scale, self.kv_lora_rank)
        n, dn, r = self.num_heads, self.nope_dim, self.kv_lora_rank
        w_uv = self.kv_b_proj.weight.view(n, dn + self.v_dim, r)[:, dn:]  # [n, dv, r]
        out = torch.einsum("bsnr,nvr->bsnv", o_lat, w_uv).reshape(b, s, n * self.v_dim)
        if self.indexer is not None and self.training and torch.is_grad_enabled():
            self._keep_loss(self._sparse_indexer_loss(q_t.detach(), kv_t.detach(), lse, idx, iq, ik, iw))
        return self.o_proj(out), idx

    def _sparse_indexer_loss(self, q_t, kv_t, lse, idx, iq, ik, iw) -> torch.Tensor:
        """KL over the selected keys, target = main attention probabilities summed over heads / n."""
        b, s = idx.shape[:2]
        valid = idx >= 0
        bidx = torch.arange(b, device=idx.device)[:, None, None]
        total = q_t.new_zeros((), dtype=torch.float32)
        ix = self.indexer
        per_query = idx.shape[-1] * (self.num_heads + ix.n_heads + q_t.shape[-1] + ix.head_dim)
        for start, stop in query_blocks(b, s, per_query):
            sel, keep = idx[:, start:stop], valid[:, start:stop]
            with torch.no_grad():
                rows = kv_t[bidx, sel.clamp(min=0)].float()  # [B, T, K, D]
                logits = torch.einsum("btnd,btkd->btnk", q_t[:, start:stop].float(), rows) * self.softmax_scale
                p = torch.exp(logits - lse[:, start:stop, :, None].float()) * keep[:, :, None, :]
                target = self._head_mean(p.sum(2))
            score = functools.partial(ix.scores_at, start=start, stop=stop)
            total = total + recomputed_kl(score, target, keep, iq, ik, iw, sel.clamp(min=0))
        # the mean over the whole sequence's queries; under context parallel this rank's share of it
        cp = cp_size(self.dims)
        return total / (b * s * cp)

    def _dense_indexer_loss(self, x: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        """KL over every visible key, target = dense MLA probabilities summed over heads / n."""
        b, s, _ = x.shape
        cos, sin, q_latent, latent, k_rope = self._latents(x, position_ids)
        iq, ik, iw = self._indexer_inputs(x, q_latent, cos, sin)
        with torch.no_grad():
            q, k, _ = self._up_project(x, latent, k_rope, cos, sin)
        # Context parallel: this rank's queries against the whole sequence's keys (the indexer's gathered with
        # their gradient summed back; the target's without gradient), visible up to each query's global position.
        cp = cp_size(self.dims)
        rows = torch.arange(s, device=x.device)
        if cp > 1:
            ik = gather_from_cp(ik, self.dims, seq_dim=1)
            k = gather_from_cp_plain(k, self.dims.cp_group, seq_dim=2)
            rows = position_ids.reshape(-1, s)[0]
        n = k.shape[2]
        cols = torch.arange(n, device=x.device)
        total = x.new_zeros((), dtype=torch.float32)
        for start, stop in query_blocks(b, s, n * (self.num_heads + self.indexer.n_heads)):
            keep = (cols[None, :] <= rows[start:stop, None]).expand(b, -1, -1)
            with torch.no_grad():
                logits = torch.einsum("bntd,bnsd->btns", q[:, :, start:stop].float(), k.float()) * self.softmax_scale
                p = torch.softmax(logits.masked_fill(~keep[:, :, None, :], float("-inf")), dim=-1)
                target = self._head_mean(p.sum(2))
            score = functools.partial(self.indexer.scores, start=start, stop=stop)
            total = total + recomputed_kl(score, target, keep, iq, ik, iw)
        return total / (b * s * cp)  # the mean over the whole sequence's queries: this rank's share of it


def collect_indexer_losses(model: nn.Module) -> torch.Tensor | None:
    """Mean over the DSA layers (main and MTP) of the indexer KL losses of the last forward; None without any."""
    losses = [m.pop_indexer_loss() for m in model.modules() if isinstance(m, DSAttention)]
    losses = [loss for loss in losses if loss is not None]
    return torch.stack(losses).mean() if losses else None


def freeze_all_but_indexers(model: nn.Module) -> None:
    """dense_warmup: only the lightning indexers' parameters train."""
    for name, p in model.named_parameters():
        if ".indexer." not in name:
            p.requires_grad_(False)
