"""build_data: micro-batch layout, exact resume, independence from the data-parallel size, blends, vocab."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from moecore.config import Config, ConfigError
from moecore.data import DataError, build_data

from .conftest import write_dataset


def _cfg(paths: list[str], tmp_path: Path, **train) -> Config:
    cfg = Config()
    cfg.data.paths = paths
    cfg.data.cache_dir = str(tmp_path / "cache")
    cfg.data.split = "90,10,0"
    cfg.model.vocab_size = 300_000
    cfg.train.seq_length = 16
    cfg.train.global_batch_size = 8
    cfg.train.micro_batch_size = 2
    for k, v in train.items():
        setattr(cfg.train, k, v)
    return cfg


@pytest.fixture
def two_datasets(tmp_path: Path) -> list[str]:
    rng = np.random.default_rng(3)
    out = []
    for i in range(2):
        prefix = tmp_path / f"ds{i}"
        write_dataset(prefix, [int(x) for x in rng.integers(5, 80, size=60)], base=i * 100_000)
        out.append(str(prefix))
    return out


def test_micro_batch_layout(two_datasets, tmp_path: Path) -> None:
    b = build_data(_cfg(two_datasets[:1], tmp_path), 0, 1)
    mbs = b.train.next_global_batch()
    assert len(mbs) == 4 == b.micro_batches_per_step
    for mb in mbs:
        assert mb["input_ids"].shape == (2, 16) and mb["input_ids"].dtype == torch.int64
        assert mb["labels"].dtype == torch.int64 and mb["loss_mask"].dtype == torch.float32
        assert torch.equal(mb["labels"][:, :-1], mb["input_ids"][:, 1:])  # labels are the inputs shifted by one
        assert torch.all(mb["loss_mask"] == 1)


def _global_batches(cfg: Config, dp: int, steps: int) -> list[list[torch.Tensor]]:
    """Per step, the rows of the global batch in rank-then-micro-batch order, gathered over dp ranks."""
    its = [build_data(cfg, r, dp).train for r in range(dp)]
    out = []
    for _ in range(steps):
        rows = []
        for it in its:
            for mb in it.next_global_batch():
                rows.extend(torch.cat([mb["input_ids"], mb["labels"][:, -1:]], dim=1))
        out.append(rows)
    return out


def test_global_batches_do_not_depend_on_dp_size(two_datasets, tmp_path: Path) -> None:
    cfg = _cfg(two_datasets, tmp_path)
    ref = _global_batches(cfg, 1, 5)
    for dp in (2, 4):
        got = _global_batches(cfg, dp, 5)
        for a, b in zip(ref, got):
            assert all(torch.equal(x, y) for x, y in zip(a, b))
    # Validation micro-batches: the same sample set for any dp size, and the same at every call.
    v1 = torch.cat([m["input_ids"] for m in build_data(cfg, 0, 1).valid_batches()])
    b2 = [build_data(cfg, r, 2) for r in range(2)]
    v2 = torch.cat([m["input_ids"] for b in b2 for m in b.valid_batches()])
    assert v1.shape[0] == cfg.train.eval_iters * cfg.train.global_batch_size
    assert sorted(map(tuple, v1.tolist())) == sorted(map(tuple, v2.tolist()))
    vb = b2[0].valid_batches()  # a lazy sequence: every pass yields the same batches
    assert all(torch.equal(x["input_ids"], y["input_ids"]) for x, y in zip(vb, vb))
    assert torch.equal(vb[len(vb) - 1]["input_ids"], list(vb)[-1]["input_ids"])


def test_exact_resume(two_datasets, tmp_path: Path) -> None:
    cfg = _cfg(two_datasets, tmp_path)
    full = build_data(cfg, 0, 1).train
    batches = [full.next_global_batch() for _ in range(40)]  # crosses epoch boundaries of both datasets
    first = build_data(cfg, 0, 1).train
    for _ in range(17):
        first.next_global_batch()
    state = first.state_dict()
    resumed = build_data(cfg, 0, 1).train
    resumed.load_state_dict(state)
    for step in range(17, 40):
        for a, b in zip(batches[step], resumed.next_global_batch()):
            assert torch.equal(a["input_ids"], b["input_ids"]) and torch.equal(a["labels"], b["labels"])
    # Mid-step resume through next_micro_batch, and resume under another dp size at a step boundary.
    it = build_data(cfg, 0, 1).train
    for _ in range(6):
        it.next_micro_batch()
    again = build_data(cfg, 0, 1).train
    again.load_state_dict(it.state_dict())
    assert torch.equal(again.next_micro_batch()["input_ids"], batches[1][2]["input_ids"])
    rank1 = build_data(cfg, 1, 2).train
    rank1.load_state_dict(state)
    assert torch.equal(rank1.next_global_batch()[0]["input_ids"], batches[17][2]["input_ids"])


def test_blend_weights_through_build_data(two_datasets, tmp_path: Path) -> None:
    cfg = _cfg(two_datasets, tmp_path, global_batch_size=64, micro_batch_size=8)
    cfg.data.weights = [1, 3]
    it = build_data(cfg, 0, 1).train
    first_ids = torch.cat([mb["input_ids"][:, 0] for _ in range(60) for mb in it.next_global_batch()])
    share = (first_ids >= 100_000).double().mean().item()  # ids of the second dataset start at 100000
    assert abs(share - 0.75) <= 0.0075


def test_vocab_checks(two_datasets, tmp_path: Path) -> None:
    cfg = _cfg(two_datasets[1:], tmp_path)
    cfg.model.vocab_size = 1000  # smaller than the ids in the data
    with pytest.raises(DataError, match="ds1: token id .* >= model vocabulary 1000"):
        build_data(cfg, 0, 1).train.next_micro_batch()
    cfg = _cfg([], tmp_path)
    cfg.model.vocab_size = 100
    with pytest.raises(ConfigError, match="model.vocab_size=100"):
        build_data(cfg)


def test_too_small_dataset_and_bad_batch_layout(tmp_path: Path) -> None:
    write_dataset(tmp_path / "tiny", [3, 4])
    with pytest.raises(DataError, match="train split holds .* fewer than train.seq_length"):
        build_data(_cfg([str(tmp_path / "tiny")], tmp_path))
    write_dataset(tmp_path / "ok", [100] * 10)
    with pytest.raises(ConfigError, match="train.global_batch_size=8"):
        build_data(_cfg([str(tmp_path / "ok")], tmp_path), 0, 3)


def test_embedded_corpus_default() -> None:
    """No data.paths: the standard-library corpus with the embedded tokenizer (cached after the first build)."""
    cfg = Config()
    cfg.train.seq_length, cfg.train.global_batch_size, cfg.train.micro_batch_size = 64, 4, 2
    b = build_data(cfg)
    assert b.vocab_size == b.tokenizer.vocab_size == 4096
    mb = b.train.next_micro_batch()
    text = b.tokenizer.decode(mb["input_ids"][0].tolist())
    assert len(text) > 64 and int(mb["input_ids"].max()) < 4096
    assert b.valid is not None and len(b.valid_batches()) == cfg.train.eval_iters * 2
