"""GPT-style samples over indexed datasets: train/valid/test splits, per-epoch shuffles, weighted blends.

A split is a contiguous range of documents of one indexed dataset (Megatron's rule: `data.split` =
"98,2,0" gives the first 98% of documents to training). Within a split the token stream of epoch `e` is
its documents concatenated in an order shuffled by (seed, split, epoch); the stream is cut into samples of
`seq_length + 1` tokens that overlap by one token (the last label of sample i is the first input of
sample i+1), so samples span document boundaries and the EOD tokens written at the end of each document
(by `moecore preprocess --append-eod` and the embedded corpus) separate them. The samples of an epoch are
visited in an order shuffled by the same key. Global sample k is sample `k % n` of epoch `k // n`, so the
sample order is infinite and does not depend on how many steps a run will take, and resuming from any
sample count gives exactly the samples an uninterrupted run would have read. The tail of fewer than
`seq_length` tokens at the end of each epoch's stream is not used.

Per-epoch index arrays (document order, cumulative lengths, sample order) are cheap for small corpora and
cached on disk for large ones, keyed by a hash of everything they depend on (the files' sizes and
modification times, the document range, seq_length, seed, split and epoch).

A blend draws from several splits with weights. Dataset d's j-th draw is given the virtual time
(j + 0.5) / w_d (weights normalised to sum to one) and the blend visits draws in time order (ties by
dataset index), so after n samples every dataset has been drawn round(w_d * n) times up to +-1. Times are
processed in chunks of `BLEND_CHUNK`, each chunk computed on demand: the number of draws of dataset d
before time T is max(0, ceil(w_d * T - 0.5)), a closed form, so any sample's source is found without
replaying the blend from the start.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from collections import OrderedDict
from pathlib import Path

import numpy as np

from moecore.data.indexed import DataError, IndexedDataset

BLEND_CHUNK = 4096
INDEX_FORMAT_VERSION = 1
SPLIT_NAMES = ("train", "valid", "test")


def split_document_ranges(num_documents: int, split: str) -> list[tuple[int, int]]:
    """[start, end) document ranges for train, valid and test from proportions such as "98,2,0"."""
    parts = [float(x) for x in str(split).split(",")]
    total = sum(parts)
    bounds, acc = [0], 0.0
    for p in parts:
        acc += p
        bounds.append(int(round(acc / total * num_documents)))
    bounds[-1] = num_documents
    return [(bounds[i], bounds[i + 1]) for i in range(len(parts))]


def _cache_key(ds: IndexedDataset, doc_range: tuple[int, int], seq_length: int, seed: int, split: str) -> str:
    idx, bin_ = Path(ds.idx_path).stat(), Path(ds.bin_path).stat()
    desc = {
        "v": INDEX_FORMAT_VERSION,
        "prefix": os.path.abspath(ds.prefix),
        "idx": [idx.st_size, idx.st_mtime_ns],
        "bin": [bin_.st_size, bin_.st_mtime_ns],
        "docs": list(doc_range),
        "seq_length": seq_length,
        "seed": seed,
        "split": split,
    }
    return hashlib.sha256(json.dumps(desc, sort_keys=True).encode()).hexdigest()[:16]


class SplitSamples:
    """The infinite, shuffled sample sequence of one split (a document range) of one indexed dataset."""

    def __init__(
        self,
        ds: IndexedDataset,
        doc_range: tuple[int, int],
        seq_length: int,
        seed: int,
        split: str = "train",
        cache_dir: Path | None = None,
        cache_min_docs: int = 4096,
    ) -> None:
        self.ds, self.doc_range, self.seq_length, self.seed, self.split = ds, doc_range, seq_length, seed, split
        lo, hi = doc_range
        self.doc_ids = np.arange(lo, hi, dtype=np.int64)
        self.doc_lengths = ds.document_lengths[lo:hi]
        self.num_tokens = int(self.doc_lengths.sum())
        if self.num_tokens < seq_length + 1:
            raise DataError(
                f"{ds.prefix}: the {split} split holds {self.num_tokens} tokens in {hi - lo} documents, "
                f"fewer than train.seq_length+1={seq_length + 1}"
            )
        self.samples_per_epoch = (self.num_tokens - 1) // seq_length
        self._split_code = SPLIT_NAMES.index(split) if split in SPLIT_NAMES else 3
        self._cache_dir = cache_dir if (cache_dir is not None and hi - lo >= cache_min_docs) else None
        self._key = _cache_key(ds, doc_range, seq_length, seed, split) if self._cache_dir else ""
        self._epochs: OrderedDict[int, tuple[np.ndarray, np.ndarray, np.ndarray]] = OrderedDict()

    def _build_epoch(self, epoch: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        rng = np.random.default_rng(np.random.SeedSequence([self.seed, self._split_code, epoch]))
        order = rng.permutation(len(self.doc_ids))
        cum = np.zeros(len(order) + 1, dtype=np.int64)
        np.cumsum(self.doc_lengths[order], out=cum[1:])
        sample_order = rng.permutation(self.samples_per_epoch)
        return order.astype(np.int64), cum, sample_order.astype(np.int64)

    def cache_path(self, epoch: int) -> Path | None:
        if self._cache_dir is None:
            return None
        return self._cache_dir / f"{Path(self.ds.prefix).name}.{self.split}.{self._key}.epoch{epoch}.npz"

    def epoch(self, epoch: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(document order, cumulative token counts in that order, sample order) of one epoch."""
        if epoch in self._epochs:
            self._epochs.move_to_end(epoch)
            return self._epochs[epoch]
        path = self.cache_path(epoch)
        arrays = None
        if path is not None and path.is_file():
            try:
                with np.load(path) as z:
                    arrays = (z["order"], z["cum"], z["samples"])
            except (OSError, ValueError, KeyError):
                arrays = None  # a damaged cache file is rebuilt below
        if arrays is None:
            arrays = self._build_epoch(epoch)
            if path is not None:
                _save_atomic(path, order=arrays[0], cum=arrays[1], samples=arrays[2])
        self._epochs[epoch] = arrays
        while len(self._epochs) > 2:
            self._epochs.popitem(last=False)
        return arrays

    def sample(self, k: int) -> np.ndarray:
        """Global sample k: seq_length + 1 token ids (int64), possibly spanning several documents."""
        epoch, j = divmod(int(k), self.samples_per_epoch)
        order, cum, sample_order = self.epoch(epoch)
        start = int(sample_order[j]) * self.seq_length
        need = self.seq_length + 1
        out = np.empty(need, dtype=np.int64)
        pos = int(np.searchsorted(cum, start, side="right")) - 1  # position (in `order`) of the first document
        offset, filled = start - int(cum[pos]), 0
        while filled < need:
            d = int(order[pos])
            take = min(int(self.doc_lengths[d]) - offset, need - filled)
            if take > 0:
                out[filled : filled + take] = self.ds.read(int(self.doc_ids[d]), offset, take)
                filled += take
            pos, offset = pos + 1, 0
        return out


def _save_atomic(path: Path, **arrays: np.ndarray) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.tmp{os.getpid()}.npz")
        np.savez(tmp, **arrays)
        os.replace(tmp, path)
    except OSError:
        pass  # an unwritable cache only costs recomputation


class BlendedSamples:
    """Samples drawn from several `SplitSamples` in proportion to weights (see the module docstring)."""

    def __init__(self, sources: list[SplitSamples], weights: list[float] | None = None) -> None:
        if not sources:
            raise ValueError("a blend needs at least one dataset")
        w = np.asarray(weights if weights is not None else [1.0] * len(sources), dtype=np.float64)
        if len(w) != len(sources) or np.any(w < 0) or w.sum() <= 0:
            raise ValueError(f"blend weights {list(w)} must be non-negative, one per dataset, not all zero")
        keep = w > 0
        self.sources = [s for s, k in zip(sources, keep) if k]
        self.weights = w[keep] / w[keep].sum()
        self._chunks: OrderedDict[int, tuple[np.ndarray, np.ndarray]] = OrderedDict()
        self._offsets: dict[int, int] = {}

    def _counts_before(self, chunk: int) -> np.ndarray:
        """Draws of each dataset with virtual time < chunk * BLEND_CHUNK."""
        t = chunk * BLEND_CHUNK
        return np.array([max(0, math.ceil(w * t - 0.5)) for w in self.weights], dtype=np.int64)

    def _offset(self, chunk: int) -> int:
        """Blended samples before chunk `chunk` (memoised: locate() asks for neighbouring chunks often)."""
        if chunk not in self._offsets:
            if len(self._offsets) > 64:
                self._offsets.clear()
            self._offsets[chunk] = int(self._counts_before(chunk).sum())
        return self._offsets[chunk]

    def _chunk(self, chunk: int) -> tuple[np.ndarray, np.ndarray]:
        if chunk in self._chunks:
            return self._chunks[chunk]
        lo, hi = self._counts_before(chunk), self._counts_before(chunk + 1)
        src = np.concatenate([np.full(h - low, d, dtype=np.int64) for d, (low, h) in enumerate(zip(lo, hi))])
        idx = np.concatenate([np.arange(low, h, dtype=np.int64) for low, h in zip(lo, hi)])
        times = (idx + 0.5) / self.weights[src]
        order = np.lexsort((src, times))  # by time, then dataset index
        self._chunks[chunk] = (src[order], idx[order])
        while len(self._chunks) > 4:
            self._chunks.popitem(last=False)
        return self._chunks[chunk]

    def locate(self, k: int) -> tuple[int, int]:
        """(dataset index, draw index within that dataset) of blended sample k."""
        if len(self.sources) == 1:
            return 0, int(k)
        c = k // BLEND_CHUNK  # chunk offsets stay within a few samples of chunk * BLEND_CHUNK
        while c > 0 and self._offset(c) > k:
            c -= 1
        while self._offset(c + 1) <= k:
            c += 1
        src, idx = self._chunk(c)
        p = k - self._offset(c)
        return int(src[p]), int(idx[p])

    def sample(self, k: int) -> tuple[int, np.ndarray]:
        d, j = self.locate(k)
        return d, self.sources[d].sample(j)
