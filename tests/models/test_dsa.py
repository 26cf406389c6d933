"""DeepSeek sparse attention pieces (moecore/models/dsa.py): the indexer's block-wise top-k equals the top-k of
its whole score matrix, the KL losses a few queries at a time equal the one-block losses, dense_warmup trains
only the indexers (a DSA layer through the Triton kernel: tests/kernels/test_sparse_mla.py)."""

from __future__ import annotations

import pytest
import torch

from moecore.models import dsa
from tests.kernels.test_sparse_mla import _cfg, _layer


def test_blockwise_topk_equals_whole_matrix(monkeypatch):
    layer = _layer(_cfg())
    x = torch.randn(2, 23, 48)
    cos, sin = layer.rotary(torch.arange(23), x.dtype)
    q_lat = layer.q_a_layernorm(layer.q_a_proj(x))
    iq, ik, iw = layer.indexer(x, q_lat, cos, sin)
    whole = dsa.causal_topk(layer.indexer, iq, ik, iw, 6)
    monkeypatch.setattr(dsa, "_BLOCK_ELEMENTS", 2 * 4 * 23 * 3)  # blocks of 3 queries
    assert dsa.query_blocks(2, 23, 4 * 23)[:2] == [(0, 3), (3, 6)]
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


@pytest.mark.parametrize("stage", ["sparse", "dense_warmup"])
def test_indexer_loss_in_query_blocks_equals_one_block(monkeypatch, stage):
    """The KL losses computed a few queries at a time give the one-block loss and gradients."""
    layer = _layer(_cfg(dsa_stage=stage)).train()
    x = torch.randn(2, 17, 48)

    def run():
        layer.zero_grad()
        layer(x, torch.arange(17))
        loss = layer.pop_indexer_loss()
        loss.backward()
        return [loss.detach()] + [p.grad.clone() for p in layer.indexer.parameters()]

    whole = run()
    monkeypatch.setattr(dsa, "_BLOCK_ELEMENTS", 1)  # one query per block
    for a, b in zip(whole, run()):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-7)


def test_full_recompute_gives_the_same_losses_and_gradients():
    """model.recompute_granularity=full: the DSA layers' recomputation in backward changes nothing (and leaves
    no KL loss behind)."""
    from moecore.config import load_config
    from moecore.models.transformer import MoETransformer

    results = []
    for gran in ("none", "full"):
        cfg = load_config(
            "tiny-deepseek-v32",
            [
                "model.vocab_size=64",
                "model.num_layers=2",
                "model.mtp_num_layers=0",
                f"model.recompute_granularity={gran}",
            ],
        ).validate()
        torch.manual_seed(0)
        model = MoETransformer(cfg).train()
        ids = torch.randint(0, 64, (2, 33), generator=torch.Generator().manual_seed(1))
        out = model(ids[:, :-1], labels=ids[:, 1:])
        out.loss.backward()
        assert all(m.indexer_loss is None for m in model.modules() if isinstance(m, dsa.DSAttention))
        results.append([out.loss.detach()] + [p.grad for p in model.parameters()])
    for a, b in zip(*results):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-7)


def test_dense_warmup_refuses_fp8_primary_weights() -> None:
    """dense_warmup freezes all but the indexers: FP8 primary weights (quantised from master weights frozen ones
    lack) are refused in one line naming the field. (FSDP runs: tests/distributed/test_fsdp_dense_warmup.py.)"""
    from moecore.config import ConfigError, load_config

    over = ["train.precision=fp8", "fp8.primary_weights=true"]
    with pytest.raises(ConfigError, match=r"fp8\.primary_weights=True is invalid: model.dsa_stage=dense_warmup"):
        load_config("tiny-deepseek-v32", ["model.dsa_stage=dense_warmup", *over]).validate()
    load_config("tiny-deepseek-v32", ["model.dsa_stage=sparse", *over]).validate()  # the sparse stage trains all
    load_config("tiny-deepseek-v32", ["model.dsa_stage=dense_warmup", "parallel.fsdp=true"]).validate()


def test_indexer_flops_match_torch_flop_counter():
    """The model-FLOPs count of a lightning indexer (moecore.train.logger, used for tflops_per_device, MFU and the
    planner's time) equals what torch's FLOP counter counts for its projections and its scores of every key."""
    from torch.utils.flop_counter import FlopCounterMode

    from moecore.config import Config
    from moecore.train.logger import _indexer_flops

    layer = _layer(_cfg())
    b, s = 2, 13
    x = torch.randn(b, s, 48)
    cos, sin = layer.rotary(torch.arange(s), x.dtype)
    q_lat = layer.q_a_layernorm(layer.q_a_proj(x))
    with FlopCounterMode(display=False) as counter:
        iq, ik, iw = layer.indexer(x, q_lat, cos, sin)
        layer.indexer.scores(iq, ik, iw, 0, s)  # every query against every key: ctx = s
    cfg = Config()
    cfg.model = _cfg()
    assert counter.get_total_flops() == _indexer_flops(cfg, float(s)) * b * s


@pytest.mark.parametrize("seq,topk", [(5, 2), (4, 8), (9, 9), (40, 7)])
def test_selected_keys_is_the_mean_over_queries(seq: int, topk: int) -> None:
    from moecore.train.logger import selected_keys

    assert selected_keys(seq, topk) == pytest.approx(sum(min(topk, t + 1) for t in range(seq)) / seq)
    assert selected_keys(seq, topk, causal=False) == min(topk, seq)


def test_dsa_flops_per_token_follow_the_stage():
    """The sparse stage's attention reads the selected keys, dense_warmup's every visible key; both add the
    indexer; DeepSeek-V3.2's sparse model at 32K tokens costs ~2/3 of its dense-attention FLOPs."""
    from moecore.config import load_config
    from moecore.train.logger import flops_per_token

    sparse = load_config("deepseek-v3.2", ["model.dsa_stage=sparse", "model.vocab_size=129280"])
    dense = load_config("deepseek-v3.2", ["model.dsa_stage=dense_warmup", "model.vocab_size=129280"])
    assert flops_per_token(sparse, 2048) == pytest.approx(flops_per_token(dense, 2048))  # topk = 2048: all keys
    ratio = flops_per_token(sparse, 32768) / flops_per_token(dense, 32768)
    assert 0.55 < ratio < 0.65
