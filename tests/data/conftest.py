"""Fixtures for the data tests: small indexed datasets whose token ids say where they came from."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from moecore.data.indexed import IndexedDatasetWriter


def write_dataset(prefix: Path, doc_lengths: list[int], base: int = 0, dtype=np.int32) -> list[np.ndarray]:
    """Document d holds ids base + 1000*d + [0, 1, ...]: each token names its dataset, document and position."""
    docs = [base + 1000 * d + np.arange(n, dtype=np.int64) for d, n in enumerate(doc_lengths)]
    with IndexedDatasetWriter(prefix, dtype) as w:
        for doc in docs:
            w.add_document(doc)
    return docs


@pytest.fixture
def small_dataset(tmp_path: Path) -> tuple[str, list[np.ndarray]]:
    rng = np.random.default_rng(0)
    lengths = [int(x) for x in rng.integers(1, 60, size=50)]
    prefix = tmp_path / "small"
    return str(prefix), write_dataset(prefix, lengths)
