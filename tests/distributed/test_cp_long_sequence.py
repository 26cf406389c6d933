"""A 32768-token sequence under cp 4 never materialises a [seq, seq] tensor.

A one-layer tiny model (one attention head) (embedding, attention, MLP, LM head and loss) runs one forward on 4 gloo
processes with the ring and with the all-gather exchange, under a TorchDispatchMode that records the
element count of every tensor any operator produces. The largest must be a score tile of the block
kernels (moecore/parallel/cp_attention.py: [q tile, seq / 2cp] per head), far below seq x seq.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from moecore.config import Config, ParallelConfig
from moecore.models.transformer import MoETransformer
from moecore.parallel import context
from moecore.parallel.cp_attention import Q_TILE
from moecore.parallel.dims import ParallelDims
from moecore.parallel.launch import run_local

pytestmark = pytest.mark.distributed

SEQ, CP = 32768, 4


class _Largest(TorchDispatchMode):
    """Records the largest element count among the outputs of every operator run under it."""

    def __init__(self) -> None:
        super().__init__()
        self.numel, self.shape, self.op = 0, None, None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.numel() > self.numel:
                self.numel, self.shape, self.op = t.numel(), tuple(t.shape), str(func)
        return out


def _worker(rank: int, world: int) -> dict:
    return {comm: _forward(rank, world, comm) for comm in ("ring", "allgather")}


def _forward(rank: int, world: int, comm: str) -> dict:
    cfg = Config()
    m = cfg.model
    m.vocab_size, m.hidden_size, m.num_layers, m.ffn_hidden_size = 64, 16, 1, 32
    m.num_attention_heads, m.num_kv_heads, m.head_dim = 1, 1, 8
    cfg.moe.num_experts = 0
    dims = ParallelDims(ParallelConfig(cp=CP, cp_comm=comm), world, rank, "cpu")
    torch.manual_seed(0)
    model = MoETransformer(cfg, dims)
    ids = torch.randint(0, 64, (1, SEQ), generator=torch.Generator().manual_seed(1))
    b = context.split_batch_for_cp({"input_ids": ids, "labels": ids, "loss_mask": torch.ones(1, SEQ)}, dims)
    rec = _Largest()
    with torch.no_grad(), rec:
        out = model(b["input_ids"], labels=b["labels"], loss_mask=b["loss_mask"], position_ids=b["position_ids"])
    assert torch.isfinite(out.lm_loss_sum)
    return {"numel": rec.numel, "shape": rec.shape, "op": rec.op}


@pytest.mark.slow  # ~20 s of CPU on each of 4 processes
def test_seq_32768_cp4_has_no_seq_by_seq_tensor() -> None:
    results = run_local(_worker, CP, timeout_s=900)
    chunk = SEQ // (2 * CP)
    tile = Q_TILE * chunk  # batch 1 x 1 head x tile rows x chunk keys
    for per_rank in results:
        for comm, r in per_rank.items():
            assert r["numel"] <= tile, (comm, r)  # nothing beyond a score tile
            assert r["numel"] * 100 < SEQ * SEQ, (comm, r)
