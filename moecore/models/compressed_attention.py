"""DeepSeek-V4 attention: a sliding window over the layer's own tokens plus compressed entries of the past.

Shapes: x [B, S, H], n query heads of size D (`head_dim`), r = `qk_rope_head_dim` rotary channels at the END of
every head (layout [nope | rope], rotated in interleaved pairs (0,1), (2,3), ...), window W = `sliding_window`.

Queries and the single key/value head (multi-query attention; the key IS the value):

    cq  = RMSNorm(q_a_proj(x))                          [B, S, q_lora_rank]
    q   = RoPE(RMSNorm_unweighted(q_b_proj(cq)))        [B, S, n, D]    (per-head norm without a weight)
    kv  = RoPE(RMSNorm(kv_proj(x)))                     [B, S, D]

Compressed entries (layers of kind CSA / HCA; none on `sliding_attention` layers). A compressor pools windows of
m tokens with a softmax gate per channel and slot:  with c_j = kv_proj(x_j), z_j = gate_proj(x_j) + bias[slot(j)],

    C_w = RoPE_{w*m}( RMSNorm( sum_j softmax_j(z_j) * c_j ) )        (softmax over the window's slots, per channel)

- HCA (`heavily_compressed_attention`, m' = `hca_compress_rate`): window w = tokens w*m'..(w+1)*m'-1.
- CSA (`compressed_sparse_attention`, m = `csa_compress_rate`): the projections give 2D channels, a series Ca
  (first D) and a series Cb (last D). Entry w pools 2m slots: Ca of window w-1 and Cb of window w, i.e.
  overlapping windows of width 2m and stride m. For w = 0 the Ca half does not exist (gate -inf, weight 0).
Only complete windows are compressed: T = S // m entries; the tail S - T*m tokens make none. Entry w is rotated
at position w*m, and a query at position t may see it only once its window is complete:

    entry w is visible to query t  iff  (w+1) * m <= t + 1.

HCA layers see every such entry. CSA layers see only the entries a lightning indexer picks: it has its own
CSA-style compressor at `index_head_dim` = d (keys K^I_w), queries qI = RoPE(q_b_proj(cq)) with `index_n_heads` = h
heads and per-head weights w_{t,h} = weights_proj(x_t)_h / sqrt(h):

    I[t, w] = sum_h w_{t,h} * ReLU(qI_{t,h} . K^I_w) / sqrt(d)

and keeps, per query, the top `index_topk` visible entries (all of them when fewer are visible). The selection
is an integer choice made without gradient: nothing trains the indexer, whose parameters are frozen.

Attention over the S local keys and T compressed entries, scores [B, n, S, S + T] in fp32, with per-head sinks:

    s_{t,j} = q_t . k_j / sqrt(D)   for visible j:  local j with t-W < j <= t, and the visible entries above
    p_{t,j} = exp(s_{t,j}) / (exp(sink_h) + sum_{j'} exp(s_{t,j'}))          o_t = sum_j p_{t,j} k_j

A query that sees nothing gets o = 0. Since the values carry the keys' rotation, o's rope channels are rotated
back by the query's own angle (RoPE with -sin at position t), so each value contributes according to its
distance to the query only. Output projection, grouped: the n heads split into g = `o_groups` contiguous groups
of n*D/g channels, each mapped by its own block to `o_lora_rank` channels (`o_a_proj`, block-diagonal), and
the g * o_lora_rank channels mapped to H by `o_b_proj`.

RoPE: `sliding_attention` layers use (`rope_theta`, `rope_scaling`); CSA / HCA layers, their compressors and
indexer use (`compress_rope_theta`, `compress_rope_scaling`), where YaRN leaves cos / sin unscaled (attention
factor 1) unless the dict says otherwise. Angles, norms' statistics and softmaxes are computed in fp32.

Three implementations of the attention itself: `sink_attention`, eager (the [B, n, S, S + T] scores; CPU, and the
reference); `sink_attention_sparse` (`model.compressed_attention_kernel=sparse`), moecore's sparse MLA kernel over
each query's window and picked entries (at most window + index_topk rows of the one key/value head), its sinks from
the kernel's differentiable log-sum-exp (its PyTorch reference off CUDA; not yet timed on a GPU); and on CUDA by
default `sink_attention_flex`, torch's flex_attention (compiled) with a block mask built from the
same visibility rule (window blocks and the picked entries only; no [S, S] tensor) and the sinks applied from its
log-sum-exp: out * sigmoid(lse - sink) (moecore/models/sinks.py gives the derivation).

Tensor parallel: the query heads split over the ranks with their sinks and output-projection groups (q_b_proj by
columns, o_a_proj by its groups' rows, o_b_proj by its input columns, summed over the ranks); the q LoRA, the key /
value head, the compressor and the indexer stay whole on every rank (`tp_partial`: each rank's heads give their
share of the gradient; the indexer has none), so every rank selects the same entries.

Context parallel: a rank holds some of the sequence's tokens (`position_ids`: their positions). It all-gathers the
key/value head and the compressors' projections of the whole sequence in order (small next to the queries; the
backward sums the ranks' gradients), pools every entry, and attends with its own queries by their positions.

Parameter names follow transformers' DeepseekV4Attention (there the indexer's `weights_proj` sits under
`indexer.scorer`). Training only: whole sequences, no KV cache.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from moecore.config import ModelConfig
from moecore.models.norms import RMSNorm
from moecore.models.rope import RotaryEmbedding
from moecore.models.sinks import compiled_flex_attention
from moecore.parallel.context import cp_size, gather_from_cp
from moecore.parallel.sharding import mark_tp_partial, set_shard
from moecore.parallel.tensor_parallel import ColumnParallelLinear, RowParallelLinear, tp_region_input, tp_size

LAYER_KINDS = ("sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention")


def apply_interleaved_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the trailing 2 * cos.shape[-1] channels of x in interleaved pairs; cos / sin broadcast to
    x[..., pairs]. The rotation runs in fp32, the result has x's dtype."""
    r = 2 * cos.shape[-1]
    even, odd = x[..., -r:].float().unflatten(-1, (-1, 2)).unbind(-1)
    rotated = torch.stack((even * cos - odd * sin, odd * cos + even * sin), dim=-1).flatten(-2)
    return torch.cat((x[..., :-r], rotated.to(x.dtype)), dim=-1)


def sink_attention(
    q: torch.Tensor, kv: torch.Tensor, visible: torch.Tensor, sinks: torch.Tensor, scale: float
) -> torch.Tensor:
    """Multi-query attention with sinks, eager: q [B, S, n, D], kv [B, K, D] (keys and values), visible
    [B or 1, S, K] bool, sinks [n] -> [B, S, n, D]. Rows that see no key give zeros."""
    scores = torch.einsum("bshd,bkd->bhsk", q, kv).float() * scale
    scores = scores.masked_fill(~visible.unsqueeze(1), float("-inf"))
    sink = sinks.float().view(1, -1, 1, 1).expand(scores.shape[0], -1, scores.shape[2], 1)
    # The sink is a finite logit in every row, so the (internally max-subtracted) softmax never sees a row of
    # -inf only; it takes its share of the mass and is dropped.
    probs = torch.softmax(torch.cat((scores, sink), dim=-1), dim=-1)[..., :-1]
    return torch.einsum("bhsk,bkd->bshd", probs.to(kv.dtype), kv)


def sink_attention_flex(
    q: torch.Tensor,
    kv: torch.Tensor,
    q_pos: torch.Tensor,
    window: int,
    picked: torch.Tensor | None,
    sinks: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """`sink_attention` through flex_attention (CUDA): q [B, S, n, D] at positions `q_pos` [S], kv [B, L + T, D] (the
    L tokens of the sequence, then T compressed entries), `picked` [B or 1, S, T] bool (None: no entries) ->
    [B, S, n, D]."""
    from torch.nn.attention.flex_attention import AuxRequest, create_block_mask

    b, s, _, _ = q.shape
    local = kv.shape[1] - (picked.shape[-1] if picked is not None else 0)

    def visible(bi, hi, qi, ki):
        t = q_pos[qi]
        near = (ki < local) & (ki <= t) & (ki > t - window)
        if picked is None:
            return near
        entry = torch.where(ki >= local, ki - local, 0)
        return near | ((ki >= local) & picked[bi, qi, entry])

    rows = 1 if picked is None else picked.shape[0]
    mask = create_block_mask(visible, rows, None, s, kv.shape[1], device=q.device)
    qh, kvh = q.transpose(1, 2), kv.unsqueeze(1)
    out, aux = compiled_flex_attention()(
        qh, kvh, kvh, block_mask=mask, scale=scale, enable_gqa=True, return_aux=AuxRequest(lse=True)
    )
    gate = torch.sigmoid(aux.lse.float() - sinks.float().view(1, -1, 1))  # [B, n, S]; a row seeing nothing: 0
    return (out.float() * gate.unsqueeze(-1)).to(q.dtype).transpose(1, 2)


def attended_indices(
    q_pos: torch.Tensor, window: int, local: int, picked: torch.Tensor | None, most: int
) -> torch.Tensor:
    """int [B or 1, S, window + k]: the rows of kv [.., L + T, D] each query attends to (-1: none), the window's
    positions t - window < j <= t, then the picked compressed entries (L + entry), at most `most` of them."""
    win = q_pos[:, None] - torch.arange(window, device=q_pos.device)[None, :]  # [S, W]
    win = torch.where(win >= 0, win, -1).unsqueeze(0)
    if picked is None:
        return win
    k = min(most, picked.shape[-1])
    flags, order = picked.to(torch.uint8).sort(dim=-1, descending=True, stable=True)  # picked entries first
    entries = torch.where(flags[..., :k] > 0, order[..., :k] + local, -1)
    return torch.cat((win.expand(entries.shape[0], -1, -1), entries), dim=-1)


def sink_attention_sparse(
    q: torch.Tensor,
    kv: torch.Tensor,
    q_pos: torch.Tensor,
    window: int,
    picked: torch.Tensor | None,
    sinks: torch.Tensor,
    scale: float,
    most: int,
) -> torch.Tensor:
    """`sink_attention_flex`'s result through the sparse MLA kernel (moecore/kernels/sparse_mla.py; its reference
    off CUDA): each query attends to its `attended_indices` rows of the one key/value head, and the sinks gate the
    output by the kernel's log-sum-exp (differentiable). `most`: the entries a query can have picked."""
    from moecore.models.dsa import sparse_mqa_attention_to_sequence

    b, s, _, d = q.shape
    local = kv.shape[1] - (picked.shape[-1] if picked is not None else 0)
    idx = attended_indices(q_pos, window, local, picked, most).expand(b, -1, -1)
    out, lse = sparse_mqa_attention_to_sequence(q, kv, idx, scale, d)
    gate = torch.sigmoid(lse - sinks.float().view(1, 1, -1))  # [B, S, n]
    return (out.float() * gate.unsqueeze(-1)).to(q.dtype)


class GroupedLinear(ColumnParallelLinear):
    """Block-diagonal linear: x [..., g, in_per_group] -> [..., g, out_per_group], group i by rows
    i*out_per_group..(i+1)*out_per_group-1 of weight [g * out_per_group, in_per_group]. Under tensor parallel each
    rank holds the contiguous rows of its g / tp groups (those of its heads)."""

    def __init__(self, in_per_group: int, out_features: int, groups: int, dims: Any = None) -> None:
        super().__init__(in_per_group, out_features, False, dims, name="model.o_groups * o_lora_rank")
        self.groups = groups // tp_size(dims)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight.view(self.groups, -1, self.in_features)
        return torch.einsum("...gi,goi->...go", x, w)


class KVCompressor(nn.Module):
    """Gated pooling of windows of `rate` tokens into entries [B, S // rate, dim] (see the module doc); with
    `overlap` (CSA) the windows span 2 * rate tokens at stride rate."""

    def __init__(self, hidden: int, dim: int, rate: int, overlap: bool, eps: float) -> None:
        super().__init__()
        self.dim, self.rate, self.overlap = dim, rate, overlap
        width = 2 * dim if overlap else dim
        self.kv_proj = nn.Linear(hidden, width, bias=False)
        self.gate_proj = nn.Linear(hidden, width, bias=False)
        self.position_bias = nn.Parameter(torch.zeros(rate, width, dtype=torch.float32))
        self.kv_norm = RMSNorm(dim, eps)

    def reset_parameters(self) -> None:
        nn.init.zeros_(self.position_bias)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, dims: Any = None) -> torch.Tensor:
        """x [B, S, H] (under context parallel this rank's tokens); cos / sin [T, r/2] at the entries' positions 0,
        m, 2m, ... of the whole sequence -> [B, T, dim], the entries of the whole sequence on every rank."""
        kv, gate = self.kv_proj(x), self.gate_proj(x)
        if cp_size(dims) > 1:  # every rank pools the whole sequence; each one's use of the entries sums in backward
            kv, gate = gather_from_cp(kv, dims, 1), gather_from_cp(gate, dims, 1)
        return self.pool(kv, gate, cos, sin)

    def pool(self, kv: torch.Tensor, gate: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """The projections kv / gate [B, S, width] of the whole sequence in order -> the entries [B, T, dim]."""
        b, s, _ = kv.shape
        m, d, n = self.rate, self.dim, s // self.rate
        kv = kv[:, : n * m].view(b, n, m, -1)  # the incomplete last window makes no entry
        gate = gate[:, : n * m].float().view(b, n, m, -1) + self.position_bias.float()
        if self.overlap:
            # Slots 0..m-1: series Ca of the previous window (zeros with gate -inf before window 0);
            # slots m..2m-1: series Cb of this window.
            prev_kv = F.pad(kv[:, :-1, :, :d], (0, 0, 0, 0, 1, 0))
            prev_gate = F.pad(gate[:, :-1, :, :d], (0, 0, 0, 0, 1, 0), value=float("-inf"))
            kv = torch.cat((prev_kv, kv[..., d:]), dim=2)
            gate = torch.cat((prev_gate, gate[..., d:]), dim=2)
        pooled = (kv * gate.softmax(dim=2).to(kv.dtype)).sum(dim=2)
        return apply_interleaved_rope(self.kv_norm(pooled), cos, sin)


class CompressedIndexer(KVCompressor):
    """CSA's lightning indexer: a CSA compressor at `index_head_dim` for its keys, plus query heads and
    per-head weights; `select` returns which compressed entries each query attends to."""

    def __init__(self, cfg: ModelConfig, rate: int) -> None:
        super().__init__(cfg.hidden_size, cfg.index_head_dim, rate, True, cfg.norm_eps)
        self.n_heads, self.topk = cfg.index_n_heads, cfg.index_topk
        self.q_b_proj = nn.Linear(cfg.q_lora_rank, self.n_heads * self.dim, bias=False)
        self.weights_proj = nn.Linear(cfg.hidden_size, self.n_heads, bias=False)
        # Only its top-k choice leaves the indexer, and no gradient flows through a choice: nothing trains it. Frozen
        # (requires_grad off), so optimizers, gradient reductions and checkpoints of optimizer state skip it.
        self.requires_grad_(False)

    @torch.no_grad()
    def select(
        self,
        x: torch.Tensor,
        q_latent: torch.Tensor,
        ready: torch.Tensor,
        cos_q: torch.Tensor,
        sin_q: torch.Tensor,
        cos_e: torch.Tensor,
        sin_e: torch.Tensor,
        dims: Any = None,
    ) -> torch.Tensor:
        """Bool [B, S, T]: the top-k entries by index score among those `ready` [S, T] for each query (this rank's
        queries; the keys of the whole sequence)."""
        b, s, _ = x.shape
        keys = self(x, cos_e, sin_e, dims).float()  # [B, T, d]
        q = self.q_b_proj(q_latent).view(b, s, self.n_heads, self.dim)
        q = apply_interleaved_rope(q, cos_q.unsqueeze(1), sin_q.unsqueeze(1)).float()
        logits = torch.matmul(q, keys.unsqueeze(1).transpose(-1, -2))  # [B, S, h, T]
        weights = self.weights_proj(x).float() * self.n_heads**-0.5
        scores = (F.relu(logits) * self.dim**-0.5 * weights.unsqueeze(-1)).sum(dim=2)
        scores = scores.masked_fill(~ready, float("-inf"))
        picks = scores.topk(min(self.topk, scores.shape[-1]), dim=-1).indices
        # A query with fewer than k ready entries also picks some that are not ready: drop those.
        return torch.zeros_like(scores, dtype=torch.bool).scatter_(-1, picks, True) & ready


class CompressedAttention(nn.Module):
    """DeepSeek-V4 attention for one layer; `forward(x [B, S, H], position_ids [S]) -> [B, S, H]`."""

    def __init__(self, cfg: ModelConfig, layer_idx: int, dims: Any = None) -> None:
        super().__init__()
        self.kind = cfg.layer_types[layer_idx]
        if self.kind not in LAYER_KINDS:
            raise ValueError(f"model.layer_types[{layer_idx}]={self.kind!r}: expected one of {LAYER_KINDS}")
        tp = tp_size(dims)
        h, n = cfg.hidden_size, cfg.num_attention_heads
        if n % tp or cfg.o_groups % tp:
            raise ValueError(f"parallel.tp={tp} must divide model.num_attention_heads={n} and model.o_groups")
        self.dims = dims
        self.num_heads = n // tp  # this rank's heads, with their output-projection groups
        self.head_dim = d = cfg.head_dim or h // n
        self.window = cfg.sliding_window
        self.eps = cfg.norm_eps
        self.groups = cfg.o_groups // tp
        self.scale = d**-0.5

        heads = "model.num_attention_heads * head_dim"
        self.q_a_proj = nn.Linear(h, cfg.q_lora_rank, bias=False)
        self.q_a_norm = RMSNorm(cfg.q_lora_rank, cfg.norm_eps)
        self.q_b_proj = ColumnParallelLinear(cfg.q_lora_rank, n * d, False, dims, name=heads)
        self.kv_proj = nn.Linear(h, d, bias=False)
        self.kv_norm = RMSNorm(d, cfg.norm_eps)
        self.o_a_proj = GroupedLinear(n * d // cfg.o_groups, cfg.o_groups * cfg.o_lora_rank, cfg.o_groups, dims)
        self.o_b_proj = RowParallelLinear(cfg.o_groups * cfg.o_lora_rank, h, False, dims, name="model.o_groups")
        self.sinks = nn.Parameter(torch.zeros(self.num_heads, dtype=torch.float32))
        if tp > 1:  # sinks split with the heads
            set_shard(self.sinks, "tensor_parallel", (n,), (dims.tp_group.rank * self.num_heads,))

        self.rate = 0
        if self.kind == "sliding_attention":
            theta, scaling = cfg.rope_theta, cfg.rope_scaling
        else:
            theta, scaling = cfg.compress_rope_theta, dict(cfg.compress_rope_scaling or {})
            if scaling.get("type", scaling.get("rope_type")) == "yarn":
                scaling.setdefault("attention_factor", 1.0)  # V4 does not scale cos / sin under YaRN
            csa = self.kind == "compressed_sparse_attention"
            self.rate = cfg.csa_compress_rate if csa else cfg.hca_compress_rate
            self.compressor = KVCompressor(h, d, self.rate, csa, cfg.norm_eps)
            if csa:
                self.compressor.indexer = CompressedIndexer(cfg, self.rate)
        if tp > 1:  # whole on every rank, read by this rank's heads only: partial gradients over TP (the indexer
            # trains not at all)
            for name in ("q_a_proj", "q_a_norm", "kv_proj", "kv_norm"):
                mark_tp_partial(getattr(self, name))
            if self.rate:
                for name in ("kv_proj", "gate_proj", "position_bias", "kv_norm"):
                    mark_tp_partial(getattr(self.compressor, name))
        self.recompute_core = "core_attn" in cfg.recompute_modules  # keep q and the keys, not the probabilities
        self.use_flex = True  # on CUDA; False: the eager reference (tests)
        self.kernel = cfg.compressed_attention_kernel  # flex | sparse (module docstring)
        self.most_picked = cfg.index_topk if self.kind == "compressed_sparse_attention" else None
        self.rope_pairs = cfg.qk_rope_head_dim // 2
        self.rotary = RotaryEmbedding(cfg.qk_rope_head_dim, theta, scaling or None, cfg.max_position_embeddings)

    def reset_parameters(self) -> None:
        nn.init.zeros_(self.sinks)

    def _cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """fp32 cos / sin [len, r/2], one angle per interleaved pair (RotaryEmbedding repeats them)."""
        cos, sin = self.rotary(positions, torch.float32)
        return cos[:, : self.rope_pairs], sin[:, : self.rope_pairs]

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        x = tp_region_input(x, self.dims)  # sequence-parallel shards -> the whole sequence
        b, s, _ = x.shape  # s: this rank's tokens (all of them without context parallel)
        pos = position_ids.to(x.device)  # their positions in the sequence
        full = s * cp_size(self.dims)  # the sequence's length
        cos, sin = self._cos_sin(pos)
        q_latent = self.q_a_norm(self.q_a_proj(x))
        q = self.q_b_proj(q_latent).view(b, s, self.num_heads, self.head_dim)
        q = (q.float() * torch.rsqrt(q.float().square().mean(-1, keepdim=True) + self.eps)).to(q.dtype)
        q = apply_interleaved_rope(q, cos.unsqueeze(1), sin.unsqueeze(1))
        kv = apply_interleaved_rope(self.kv_norm(self.kv_proj(x)), cos, sin)
        # Context parallel: every rank's queries read keys of the whole sequence (one head: a small all-gather);
        # the backward sums the ranks' gradients of each key.
        kv = gather_from_cp(kv, self.dims, 1)  # [B, full, D] in sequence order

        picked = None  # [B or 1, S, T]: which compressed entries each query sees
        n_entries = full // self.rate if self.rate else 0
        if n_entries:
            cos_e, sin_e = self._cos_sin(torch.arange(n_entries, device=x.device) * self.rate)
            entries = self.compressor(x, cos_e, sin_e, self.dims)  # [B, T, D]
            ready = (torch.arange(n_entries, device=x.device)[None, :] + 1) * self.rate <= pos[:, None] + 1
            if self.kind == "compressed_sparse_attention":
                picked = self.compressor.indexer.select(x, q_latent, ready, cos, sin, cos_e, sin_e, self.dims)
            else:
                picked = ready.unsqueeze(0)
            kv = torch.cat((kv, entries), dim=1)

        if self.kernel == "sparse" and self.use_flex:  # the sparse MLA kernel over each query's rows
            most = self.most_picked or n_entries
            args, attend = (q, kv, pos, self.window, picked, self.sinks, self.scale, most), sink_attention_sparse
        elif x.is_cuda and self.use_flex:  # flex_attention: no [S, S + T] tensors
            args, attend = (q, kv, pos, self.window, picked, self.sinks, self.scale), sink_attention_flex
        else:
            gap = pos[:, None] - torch.arange(full, device=x.device)[None, :]
            visible = ((gap >= 0) & (gap < self.window)).unsqueeze(0)  # keys t - W < j <= t: [1, S, full]
            if picked is not None:
                visible = torch.cat((visible.expand(picked.shape[0], -1, -1), picked), dim=-1)
            args, attend = (q, kv, visible, self.sinks, self.scale), sink_attention
        if self.recompute_core and self.training and torch.is_grad_enabled():
            out = checkpoint(attend, *args, use_reentrant=False)
        else:
            out = attend(*args)  # [B, S, n, D]
        out = apply_interleaved_rope(out, cos.unsqueeze(1), -sin.unsqueeze(1))  # undo the values' rotation
        out = self.o_a_proj(out.reshape(b, s, self.groups, -1))  # [B, S, g, o_lora_rank]
        return self.o_b_proj(out.flatten(2))
