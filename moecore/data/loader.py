"""What the training loop calls: `build_data(cfg, dp_rank, dp_size) -> DataBundle`.

Global batch s is samples [s*G, (s+1)*G) of the blended, shuffled sample order (G =
`train.global_batch_size`); data-parallel rank r takes the contiguous slice [r*G/dp, (r+1)*G/dp) and cuts
it into micro-batches of `train.micro_batch_size`. The set and order of samples in a global batch
therefore do not depend on the number of data-parallel ranks, and the position in the data is one number,
the samples consumed, saved in `state_dict()` so a resumed run reads exactly the batches the uninterrupted
run would have read (also under a different data-parallel size).

A micro-batch is a dict of `input_ids` [mb, S] int64, `labels` [mb, S] int64 (input shifted by one) and
`loss_mask` [mb, S] float32 (all ones: packed samples have no padding).
"""

from __future__ import annotations

import hashlib
import json
import os
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from moecore.config import Config, ConfigError
from moecore.data.corpus import build_embedded_corpus, default_cache_dir
from moecore.data.gpt_dataset import BlendedSamples, SplitSamples, split_document_ranges
from moecore.data.indexed import DataError, IndexedDataset, normalize_prefix
from moecore.data.tokenizer import Tokenizer, load_tokenizer


class BatchIterator:
    """Micro-batches of one split for one data-parallel rank; its position is the global sample count."""

    def __init__(
        self,
        samples: BlendedSamples,
        global_batch_size: int,
        micro_batch_size: int,
        dp_rank: int = 0,
        dp_size: int = 1,
        vocab_size: int | None = None,
        fingerprint: str = "",
    ) -> None:
        if dp_size < 1 or not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank={dp_rank} is invalid: must be in [0, dp_size={dp_size})")
        if global_batch_size % (micro_batch_size * dp_size):
            raise ConfigError(
                f"train.global_batch_size={global_batch_size} is invalid: must be a multiple of "
                f"train.micro_batch_size * data-parallel size = {micro_batch_size * dp_size}"
            )
        self.samples = samples
        self.global_batch_size, self.micro_batch_size = global_batch_size, micro_batch_size
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.samples_per_rank = global_batch_size // dp_size
        self.micro_batches_per_step = self.samples_per_rank // micro_batch_size
        self.vocab_size = vocab_size
        self.fingerprint = fingerprint
        self.consumed_samples = 0  # global samples before the current global batch
        self.micro_batch = 0  # next micro-batch of the current global batch (on this rank)

    def sample_ids(self, batch_start: int, micro: int) -> np.ndarray:
        """Global sample ids of micro-batch `micro` of this rank in the global batch starting at batch_start."""
        first = batch_start + self.dp_rank * self.samples_per_rank + micro * self.micro_batch_size
        return np.arange(first, first + self.micro_batch_size, dtype=np.int64)

    def make_batch(self, ids: np.ndarray) -> dict:
        """Collate samples into the micro-batch dict (torch tensors)."""
        import torch

        rows, sources = [], []
        for k in ids:
            d, tokens = self.samples.sample(int(k))
            rows.append(tokens)
            sources.append(d)
        x = np.stack(rows)
        if self.vocab_size is not None and x.size and int(x.max()) >= self.vocab_size:
            bad = int(np.argmax(x.max(axis=1) >= self.vocab_size))
            prefix = self.samples.sources[sources[bad]].ds.prefix
            raise DataError(
                f"{prefix}: token id {int(x[bad].max())} >= model vocabulary {self.vocab_size}; "
                "set model.vocab_size to the vocabulary the data was tokenized with"
            )
        t = torch.from_numpy(x)
        return {
            "input_ids": t[:, :-1].contiguous(),
            "labels": t[:, 1:].contiguous(),
            "loss_mask": torch.ones(t.shape[0], t.shape[1] - 1, dtype=torch.float32),
        }

    def next_micro_batch(self) -> dict:
        batch = self.make_batch(self.sample_ids(self.consumed_samples, self.micro_batch))
        self.micro_batch += 1
        if self.micro_batch == self.micro_batches_per_step:
            self.consumed_samples += self.global_batch_size
            self.micro_batch = 0
        return batch

    def next_global_batch(self) -> list[dict]:
        """All micro-batches of this rank for the next global batch (one optimizer step)."""
        if self.micro_batch:
            raise RuntimeError("next_global_batch() called in the middle of a global batch")
        return [self.next_micro_batch() for _ in range(self.micro_batches_per_step)]

    def __iter__(self) -> BatchIterator:
        return self

    def __next__(self) -> dict:
        return self.next_micro_batch()

    def state_dict(self) -> dict:
        return {
            "consumed_samples": self.consumed_samples,
            "micro_batch": self.micro_batch,
            "dp_size": self.dp_size,
            "fingerprint": self.fingerprint,
        }

    def load_state_dict(self, state: dict) -> None:
        micro = int(state.get("micro_batch", 0))
        if micro and int(state.get("dp_size", self.dp_size)) != self.dp_size:
            raise ValueError("cannot resume mid-way through a global batch under a different data-parallel size")
        if state.get("fingerprint") and self.fingerprint and state["fingerprint"] != self.fingerprint:
            warnings.warn(
                "resuming with different data settings (data.*, train.seq_length or train.seed changed): "
                "the sample order differs from the original run's",
                stacklevel=2,
            )
        self.consumed_samples = int(state["consumed_samples"])
        self.micro_batch = micro

    def eval_batches(self, num_micro_batches: int) -> EvalBatches:
        """Fixed micro-batches from the start of the order: iteration i, micro m = global batch i's slice m."""
        return EvalBatches(self, num_micro_batches)


class EvalBatches:
    """A lazy, re-iterable sequence of evaluation micro-batches (built on access, never all held at once)."""

    def __init__(self, it: BatchIterator, num_micro_batches: int) -> None:
        self.it, self.n = it, num_micro_batches

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, n: int) -> dict:
        if not 0 <= n < self.n:
            raise IndexError(n)
        i, m = divmod(n, self.it.micro_batches_per_step)
        return self.it.make_batch(self.it.sample_ids(i * self.it.global_batch_size, m))

    def __iter__(self) -> Iterator[dict]:
        return (self[n] for n in range(self.n))


@dataclass
class DataBundle:
    """Tokenizer, vocabulary size and the per-split batch iterators of one data-parallel rank."""

    tokenizer: Tokenizer
    vocab_size: int
    train: BatchIterator
    valid: BatchIterator | None
    test: BatchIterator | None
    eval_iters: int = 1
    description: str = ""

    @property
    def micro_batches_per_step(self) -> int:
        return self.train.micro_batches_per_step

    def valid_batches(self, num_micro_batches: int | None = None) -> EvalBatches | list:
        """Deterministic validation micro-batches of this rank ([] without a validation split).

        The default, train.eval_iters global batches cut like training batches, is the same sample set
        whatever the data-parallel size. The result is a lazy sequence: iterate it (again) or index it."""
        return self._eval(self.valid, num_micro_batches)

    def test_batches(self, num_micro_batches: int | None = None) -> EvalBatches | list:
        return self._eval(self.test, num_micro_batches)

    def _eval(self, it: BatchIterator | None, n: int | None) -> EvalBatches | list:
        if it is None:
            return []
        return it.eval_batches(self.eval_iters * it.micro_batches_per_step if n is None else n)


def _index_cache_dir(cfg_cache: str | None, prefix: str) -> Path:
    if cfg_cache:
        return Path(cfg_cache) / "index"
    here = Path(prefix).parent / "moecore_index_cache"
    try:
        here.mkdir(parents=True, exist_ok=True)
        if os.access(here, os.W_OK):
            return here
    except OSError:
        pass
    return default_cache_dir() / "index"


def _fingerprint(cfg: Config, tokenizer: Tokenizer, prefixes: list[str]) -> str:
    d = cfg.data
    paths = [os.path.abspath(p) for p in prefixes]
    desc = [paths, d.weights, d.split, cfg.train.seq_length, cfg.train.seed, tokenizer.fingerprint]
    return hashlib.sha256(json.dumps(desc, default=str).encode()).hexdigest()[:16]


def build_data(
    cfg: Config,
    dp_rank: int = 0,
    dp_size: int = 1,
    log: Callable[[str], None] | None = None,
) -> DataBundle:
    """Tokenizer, splits and batch iterators for `cfg` (empty data.paths: the embedded corpus)."""
    d, t = cfg.data, cfg.train
    tokenizer = load_tokenizer(d.tokenizer)
    embedded = not d.paths
    if cfg.model.vocab_size:
        vocab_size = cfg.model.vocab_size
        if embedded and vocab_size < tokenizer.vocab_size:
            raise ConfigError(
                f"model.vocab_size={vocab_size} is invalid: must be >= the tokenizer's vocabulary ({tokenizer.vocab_size})"
            )
    else:
        tp = cfg.parallel.tp
        vocab_size = -(-tokenizer.vocab_size // tp) * tp  # rounded up to a multiple of parallel.tp

    if embedded:
        cache = Path(d.cache_dir) if d.cache_dir else default_cache_dir()
        if log is not None:
            log(f"data: embedded corpus (Python standard library sources), tokenized once into {cache}")
        prefixes = [build_embedded_corpus(tokenizer, cache)]
    else:
        prefixes = [normalize_prefix(p) for p in d.paths]
    weights = [float(w) for w in d.weights] if d.weights is not None else [1.0] * len(prefixes)

    datasets = [IndexedDataset(p) for p in prefixes]
    per_split: dict[str, list[SplitSamples | None]] = {"train": [], "valid": [], "test": []}
    for ds in datasets:
        ranges = split_document_ranges(ds.num_documents, d.split)
        cache_dir = _index_cache_dir(d.cache_dir, ds.prefix)
        for name, rng in zip(("train", "valid", "test"), ranges):
            try:
                per_split[name].append(SplitSamples(ds, rng, t.seq_length, t.seed, name, cache_dir))
            except DataError:
                if name == "train":
                    raise
                per_split[name].append(None)  # too small a held-out split: this dataset adds none

    fp = _fingerprint(cfg, tokenizer, prefixes)

    def make(name: str) -> BatchIterator | None:
        pairs = [(s, w) for s, w in zip(per_split[name], weights) if s is not None and w > 0]
        if not pairs:
            return None
        blend = BlendedSamples([s for s, _ in pairs], [w for _, w in pairs])
        return BatchIterator(blend, t.global_batch_size, t.micro_batch_size, dp_rank, dp_size, vocab_size, fp)

    train = make("train")
    if train is None:
        raise ConfigError(f"data.weights={d.weights} is invalid: every dataset with a training split has weight 0")
    valid, test = make("valid"), make("test")
    docs = sum(ds.num_documents for ds in datasets)
    toks = sum(ds.num_tokens for ds in datasets)
    what = "embedded stdlib corpus" if embedded else f"{len(datasets)} dataset(s)"
    desc = (
        f"{what}: {docs} documents, {toks / 1e6:.2f}M tokens, split {d.split}; "
        f"tokenizer vocab {tokenizer.vocab_size}, model vocab {vocab_size}"
    )
    return DataBundle(tokenizer, vocab_size, train, valid, test, t.eval_iters, desc)
