"""DeepSeek sparse attention pieces (moecore/models/dsa.py): the indexer's block-wise top-k equals the top-k of
its whole score matrix (a DSA layer through the Triton kernel: tests/kernels/test_sparse_mla.py)."""

from __future__ import annotations

import torch

from moecore.models import dsa
from tests.kernels.test_sparse_mla import _cfg, _layer


def test_blockwise_topk_equals_whole_matrix(monkeypatch):
    layer = _layer(_cfg())
    x = torch.randn(2, 23, 48)
    cos, sin = layer.rotary(torch.arange(23), x.dtype)
    q_lat = layer.q_a_layernorm(layer.q_a_proj(x))
    iq, ik, iw = layer.indexer.project(x, q_lat, cos, sin)
    whole = dsa.causal_topk(layer.indexer, iq, ik, iw, 6)
    monkeypatch.setattr(dsa, "_BLOCK_ELEMENTS", 2 * 4 * 23 * 3)  # blocks of 3 queries
    assert dsa.query_blocks(2, 23, 4)[:2] == [(0, 3), (3, 6)]
    assert torch.equal(dsa.causal_topk(layer.indexer, iq, ik, iw, 6), whole)
    # every query keeps min(6, t + 1) distinct visible tokens, -1 for the rest
    for t in range(23):
        row = whole[0, t]
        kept = row[row >= 0]
        assert len(kept) == min(6, t + 1) and len(set(kept.tolist())) == len(kept) and kept.max() <= t


def test_dense_warmup_trains_only_the_indexers():
    """dense_warmup freezes every parameter but the indexers' (optimizers and gradient reduction skip them),
    and one step's objective (the KL loss) reaches exactly the indexers."""
    from moecore.config import load_config
    from moecore.models.transformer import MoETransformer

    cfg = load_config(
        "tiny-deepseek-v32", ["model.vocab_size=64", "model.num_layers=2", "model.dsa_stage=dense_warmup"]
    )
    model = MoETransformer(cfg.validate()).train()
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(".indexer." in n for n in trainable)
    assert len(trainable) == 5 * 3  # 2 layers + the MTP layer, 5 tensors each
    ids = torch.randint(0, 64, (2, 33))
    out = model(ids[:, :-1], labels=ids[:, 1:])
    out.loss.backward()
    assert out.loss is out.indexer_loss and out.lm_loss.grad_fn is None
    for n, p in model.named_parameters():
        assert (p.grad is not None) == (n in trainable), n
