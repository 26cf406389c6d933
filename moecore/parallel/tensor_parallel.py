"""Tensor parallel (TP) layers and sequence parallel (SP) region helpers.

A TP block (attention, dense MLP) reads:

    x  --tp_region_input-->  column-parallel linears (local heads / FFN columns)
       --> local compute --> row-parallel linear (partial sums) --reduce--> out

- `tp_region_input(x, dims)`: with SP, x is sharded along the sequence (dim 1) and is all-gathered
  (backward: reduce-scatter); without SP, x is replicated and passes through (backward: all-reduce).
- `ColumnParallelLinear`: weight [out/tp, in], bias [out/tp]; a local matmul, no communication
  (optionally all-gathers its output along the last dim).
- `RowParallelLinear`: weight [out, in/tp]; local matmul, then reduce-scatter along the sequence
  (SP) or all-reduce (no SP), then the bias (replicated).
- `VocabParallelEmbedding`: rows [V/tp, H]; ids outside this rank's range look up zeros, and the
  partial embeddings are summed (SP: reduce-scattered along the sequence).
- `vocab_parallel_cross_entropy`: cross-entropy of logits sharded along the vocabulary, with three
  small all-reduces (max, target logit, sum of exponentials); no rank ever holds all logits.
- `sharded_rms_norm`: RMSNorm over a feature dim split over the TP ranks (MiniMax-M2's q/k norm over all
  heads, `model.qk_norm_scope=projection`): one all-reduce of each row's sum of squares, forward and backward.

With dims None or tp == 1 every layer is the plain single-device one (the classes subclass
`nn.Linear` / `nn.Embedding` so initialisation code treats them alike) and nothing communicates.
Each parameter records its ShardSpec (`moecore.parallel.sharding`) for checkpoints and grad sync.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from moecore.parallel import comm
from moecore.parallel.dims import ParallelDims
from moecore.parallel.sharding import mark_tp_partial, set_shard


def tp_size(dims: ParallelDims | None) -> int:
    return 1 if dims is None else dims.tp


def _split(n: int, dims: ParallelDims | None, what: str) -> int:
    tp = tp_size(dims)
    if n % tp:
        raise ValueError(f"parallel.tp={tp} does not divide {what}={n}")
    return n // tp


def tp_region_input(x: torch.Tensor, dims: ParallelDims | None) -> torch.Tensor:
    """Enter a TP block: all-gather the sequence shards (SP) or mark the replicated input (no SP)."""
    if tp_size(dims) == 1:
        return x
    if dims.sequence_parallel:
        return comm.gather_from_sequence_parallel(x, dims.tp_group, dim=1)
    return comm.copy_to_region(x, dims.tp_group)


def tp_region_output(x: torch.Tensor, dims: ParallelDims | None) -> torch.Tensor:
    """Leave a TP block with partial sums: reduce-scatter along the sequence (SP) or all-reduce."""
    if tp_size(dims) == 1:
        return x
    if dims.sequence_parallel:
        return comm.reduce_scatter_to_sequence_parallel(x, dims.tp_group, dim=1)
    return comm.reduce_from_region(x, dims.tp_group)


def sequence_shard(t: torch.Tensor, dims: ParallelDims | None, dim: int = 1) -> torch.Tensor:
    """This rank's sequence chunk of a replicated tensor under SP (e.g. the loss mask); t otherwise."""
    if tp_size(dims) == 1 or not dims.sequence_parallel:
        return t
    return comm.split_dim(t, dims.tp_group, dim)


def mark_sequence_parallel(module: nn.Module, dims: ParallelDims | None) -> None:
    """Norms (and other replicated weights) applied to sequence shards get partial gradients over TP."""
    if tp_size(dims) > 1 and dims.sequence_parallel:
        mark_tp_partial(module)


class ColumnParallelLinear(nn.Linear):
    """y = x W^T + b with W's output rows split over TP ranks: weight [out/tp, in].

    The input must already be in the TP region (`tp_region_input`). `gather_output` all-gathers the
    output columns (backward keeps this rank's slice).
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = False,
        dims: ParallelDims | None = None,
        gather_output: bool = False,
        name: str = "out_features",
    ) -> None:
        local = _split(out_features, dims, name)
        super().__init__(in_features, local, bias=bias)
        self.dims = dims
        self.gather_output = gather_output
        self.global_out_features = out_features
        if tp_size(dims) > 1:
            r = dims.tp_group.rank
            set_shard(self.weight, "tensor_parallel", (out_features, in_features), (r * local, 0))
            if self.bias is not None:
                set_shard(self.bias, "tensor_parallel", (out_features,), (r * local,))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight, self.bias)
        if self.gather_output and tp_size(self.dims) > 1:
            y = comm.gather_from_region(y, self.dims.tp_group, dim=-1)
        return y


class RowParallelLinear(nn.Linear):
    """y = x W^T + b with W's input columns split over TP ranks: weight [out, in/tp].

    The input is this rank's slice of the features; the partial products are summed over TP
    (reduce-scattered along the sequence under SP) and the bias is added once after the sum.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = False,
        dims: ParallelDims | None = None,
        name: str = "in_features",
    ) -> None:
        local = _split(in_features, dims, name)
        super().__init__(local, out_features, bias=bias)
        self.dims = dims
        self.global_in_features = in_features
        if tp_size(dims) > 1:
            r = dims.tp_group.rank
            set_shard(self.weight, "tensor_parallel", (out_features, in_features), (0, r * local))
            if self.bias is not None and dims.sequence_parallel:
                mark_tp_partial(self.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = tp_region_output(F.linear(x, self.weight), self.dims)
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Embedding):
    """Embedding whose rows are split over TP ranks: weight [V/tp, H]; output summed (or reduce-scattered) over TP."""

    def __init__(self, num_embeddings: int, embedding_dim: int, dims: ParallelDims | None = None) -> None:
        local = _split(num_embeddings, dims, "model.vocab_size")
        super().__init__(local, embedding_dim)
        self.dims = dims
        self.global_num_embeddings = num_embeddings
        self.vocab_start = 0 if tp_size(dims) == 1 else dims.tp_group.rank * local
        if tp_size(dims) > 1:
            set_shard(self.weight, "tensor_parallel", (num_embeddings, embedding_dim), (self.vocab_start, 0))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if tp_size(self.dims) == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.vocab_start
        outside = (local < 0) | (local >= self.num_embeddings)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        return tp_region_output(out, self.dims)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Per-token -log softmax(logits)[label] with logits [N, V/tp] split along the vocabulary."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, labels: torch.Tensor, group, vocab_start: int) -> torch.Tensor:
        n_local = logits.shape[-1]
        # 1. Global max for a stable softmax.
        m = logits.max(dim=-1).values
        comm.all_reduce_(m, group, "max")
        z = logits - m.unsqueeze(-1)
        # 2. The target's logit lives on one rank: the others contribute 0.
        local = labels - vocab_start
        inside = (local >= 0) & (local < n_local)
        local = local.clamp(0, n_local - 1)
        target = z.gather(-1, local.unsqueeze(-1)).squeeze(-1) * inside
        comm.all_reduce_(target, group, "sum")
        # 3. Partition function: sum of exponentials over every shard.
        e = z.exp()
        denom = e.sum(dim=-1)
        comm.all_reduce_(denom, group, "sum")
        loss = denom.log() - target
        e.div_(denom.unsqueeze(-1))  # softmax, kept for backward
        ctx.save_for_backward(e, local, inside)
        return loss

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        softmax, local, inside = ctx.saved_tensors
        # d loss / d logits = softmax - onehot(label), the one-hot only on the rank holding the label.
        grad = softmax.clone()
        grad.scatter_add_(-1, local.unsqueeze(-1), -inside.to(grad.dtype).unsqueeze(-1))
        return grad * g.unsqueeze(-1), None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, labels: torch.Tensor, dims: ParallelDims | None) -> torch.Tensor:
    """Per-token cross-entropy (reduction none), in fp32 or wider; logits [..., V/tp] sharded along the vocabulary."""
    shape = labels.shape
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32)).reshape(-1, logits.shape[-1])
    labels = labels.reshape(-1)
    if tp_size(dims) == 1:
        return F.cross_entropy(logits, labels, reduction="none").view(shape)
    vocab_start = dims.tp_group.rank * logits.shape[-1]
    return _VocabParallelCrossEntropy.apply(logits, labels, dims.tp_group, vocab_start).view(shape)


def gather_vocab(logits: torch.Tensor, dims: ParallelDims | None) -> torch.Tensor:
    """Full-vocabulary logits from vocabulary shards (for generation and evaluation)."""
    if tp_size(dims) == 1:
        return logits
    return comm.gather_from_region(logits, dims.tp_group, dim=-1)


def gather_sequence(x: torch.Tensor, dims: ParallelDims | None) -> torch.Tensor:
    """Full sequence from SP shards, with a replicated gradient (backward keeps this rank's chunk)."""
    if tp_size(dims) == 1 or not dims.sequence_parallel:
        return x
    return comm.gather_from_region(x, dims.tp_group, dim=1)


def sharded_rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, zero_centered: bool, dims: ParallelDims | None
) -> torch.Tensor:
    """RMSNorm over the last dim of x when that dim is this rank's 1/tp share of the row (weight: the same share).

    Statistics in fp32, the result in x's dtype, as `moecore.models.norms.rms_norm`; with tp == 1 it is that norm.
    1. Each rank sums the squares of its part of every row.
    2. The sums are all-reduced over TP, so every rank divides by the mean of squares of the whole row. The
       backward all-reduces too: the whole-row sum scales every rank's part, so its gradient is the sum of the
       ranks' partial gradients (`copy_to_region` then `reduce_from_region`: all-reduce both ways).
    3. Each rank scales its part by 1/rms and by its shard of the weight.
    """
    h = x.float()
    sq = h.pow(2).sum(-1, keepdim=True)
    n = x.shape[-1]
    if tp_size(dims) > 1:
        sq = comm.reduce_from_region(comm.copy_to_region(sq, dims.tp_group), dims.tp_group)
        n *= dims.tp
    h = h * torch.rsqrt(sq / n + eps)
    w = weight.float() + 1.0 if zero_centered else weight.float()
    return (h * w).to(x.dtype)
