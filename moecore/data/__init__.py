"""Data: the embedded corpus and tokenizer, Megatron indexed datasets, GPT samples, blends and batches.

`build_data(cfg, dp_rank, dp_size)` is what the training loop calls; `moecore.data.preprocess.main` is the
`moecore preprocess` command. See docs/data.md.
"""

from moecore.data.indexed import DataError, IndexedDataset, IndexedDatasetWriter
from moecore.data.loader import BatchIterator, DataBundle, build_data
from moecore.data.tokenizer import Tokenizer, load_tokenizer

__all__ = [
    "BatchIterator",
    "DataBundle",
    "DataError",
    "IndexedDataset",
    "IndexedDatasetWriter",
    "Tokenizer",
    "build_data",
    "load_tokenizer",
]
