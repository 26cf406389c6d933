"""GPT samples, splits, index caches and blends, checked against plain numpy reconstructions."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from moecore.data.gpt_dataset import BLEND_CHUNK, BlendedSamples, SplitSamples, split_document_ranges
from moecore.data.indexed import DataError, IndexedDataset

from .conftest import write_dataset


def test_samples_are_windows_of_the_shuffled_epoch_stream(small_dataset) -> None:
    prefix, docs = small_dataset
    s = 16
    sp = SplitSamples(IndexedDataset(prefix), (0, len(docs)), s, seed=7)
    for epoch in (0, 1):
        order, _, _ = sp.epoch(epoch)
        assert sorted(order.tolist()) == list(range(len(docs)))
        stream = np.concatenate([docs[d] for d in order])  # the reference: documents concatenated in order
        starts = set()
        for j in range(sp.samples_per_epoch):
            got = sp.sample(epoch * sp.samples_per_epoch + j)
            assert got.shape == (s + 1,)
            pos = int(np.flatnonzero(stream == got[0])[0])  # ids are unique within an epoch's stream
            np.testing.assert_array_equal(got, stream[pos : pos + s + 1])
            starts.add(pos)
        # One epoch visits every sample start 0, S, 2S, ... exactly once.
        assert starts == set(range(0, sp.samples_per_epoch * s, s))
    assert sp.samples_per_epoch == (sum(len(d) for d in docs) - 1) // s


def test_seed_changes_the_order_and_is_reproducible(small_dataset) -> None:
    prefix, docs = small_dataset
    ds = IndexedDataset(prefix)
    a = [SplitSamples(ds, (0, len(docs)), 8, seed=1).sample(k) for k in range(20)]
    b = [SplitSamples(ds, (0, len(docs)), 8, seed=1).sample(k) for k in range(20)]
    c = [SplitSamples(ds, (0, len(docs)), 8, seed=2).sample(k) for k in range(20)]
    assert all(np.array_equal(x, y) for x, y in zip(a, b))
    assert not all(np.array_equal(x, y) for x, y in zip(a, c))


def test_split_ranges_and_disjoint_documents(small_dataset) -> None:
    prefix, docs = small_dataset
    assert split_document_ranges(50, "98,2,0") == [(0, 49), (49, 50), (50, 50)]
    assert split_document_ranges(10, "1,1,2") == [(0, 2), (2, 5), (5, 10)]
    ranges = split_document_ranges(len(docs), "80,20,0")
    ds = IndexedDataset(prefix)
    train = SplitSamples(ds, ranges[0], 8, 0, "train")
    valid = SplitSamples(ds, ranges[1], 8, 0, "valid")
    doc_of = lambda tokens: set((tokens // 1000).tolist())  # noqa: E731 - ids encode their document
    seen_train = set().union(*(doc_of(train.sample(k)) for k in range(train.samples_per_epoch)))
    seen_valid = set().union(*(doc_of(valid.sample(k)) for k in range(valid.samples_per_epoch)))
    assert seen_train <= set(range(*ranges[0])) and seen_valid <= set(range(*ranges[1]))
    with pytest.raises(DataError, match="test split holds 0 tokens"):
        SplitSamples(ds, ranges[2], 8, 0, "test")


def test_index_cache_is_written_and_reused(small_dataset, tmp_path: Path) -> None:
    prefix, docs = small_dataset
    ds = IndexedDataset(prefix)
    cache = tmp_path / "cache"
    a = SplitSamples(ds, (0, len(docs)), 8, 3, cache_dir=cache, cache_min_docs=0)
    first = [a.sample(k) for k in range(a.samples_per_epoch + 5)]  # epochs 0 and 1
    files = sorted(p.name for p in cache.iterdir())
    assert len(files) == 2 and files[0].endswith("epoch0.npz")
    b = SplitSamples(ds, (0, len(docs)), 8, 3, cache_dir=cache, cache_min_docs=0)
    with np.load(a.cache_path(0)) as z:
        np.testing.assert_array_equal(z["order"], b.epoch(0)[0])
    assert all(np.array_equal(x, b.sample(k)) for k, x in enumerate(first))
    # The key covers what the indices depend on: another seed or seq_length gets other files.
    c = SplitSamples(ds, (0, len(docs)), 8, 4, cache_dir=cache, cache_min_docs=0)
    d = SplitSamples(ds, (0, len(docs)), 9, 3, cache_dir=cache, cache_min_docs=0)
    assert len({a.cache_path(0), c.cache_path(0), d.cache_path(0)}) == 3


def _blend(tmp_path: Path, weights: list[float]) -> BlendedSamples:
    sources = []
    for i in range(len(weights)):
        prefix = tmp_path / f"d{i}"
        docs = write_dataset(prefix, [40] * 5, base=i * 100_000)
        sources.append(SplitSamples(IndexedDataset(prefix), (0, len(docs)), 8, 0))
    return BlendedSamples(sources, weights)


def test_blend_ratios_within_one_percent(tmp_path: Path) -> None:
    weights = [2.0, 3.0, 5.0]
    blend = _blend(tmp_path, weights)
    n = 20_000
    picks = np.array([blend.locate(k)[0] for k in range(n)])
    for d, w in enumerate(weights):
        expected = w / sum(weights) * n
        assert abs((picks == d).sum() - expected) <= 0.01 * expected
        # Every prefix is balanced too (the blend never drifts by more than a couple of samples).
        assert np.all(np.abs(np.cumsum(picks == d) - w / sum(weights) * np.arange(1, n + 1)) < 2.0)
    # Each dataset's draws are 0, 1, 2, ... in blend order (no draw skipped or repeated).
    for d in range(len(weights)):
        idx = [blend.locate(k)[1] for k in np.flatnonzero(picks == d)]
        assert idx == list(range(len(idx)))


def test_blend_random_access_matches_sequential(tmp_path: Path) -> None:
    blend = _blend(tmp_path, [0.3, 0.7])
    seq = [blend.locate(k) for k in range(3 * BLEND_CHUNK)]
    fresh = _blend(tmp_path / "again", [0.3, 0.7])
    for k in (0, 1, BLEND_CHUNK - 1, BLEND_CHUNK, 2 * BLEND_CHUNK + 17, 3 * BLEND_CHUNK - 1):
        assert fresh.locate(k) == seq[k]
    d, tokens = blend.sample(5)
    assert tokens.min() >= d * 100_000 and tokens.max() < (d + 1) * 100_000


def test_blend_zero_weight_excluded(tmp_path: Path) -> None:
    blend = _blend(tmp_path, [0.0, 1.0])
    assert len(blend.sources) == 1
    with pytest.raises(ValueError, match="not all zero"):
        _blend(tmp_path / "z", [0.0, 0.0])
