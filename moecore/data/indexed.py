"""Megatron-LM's indexed dataset format (`PREFIX.bin` + `PREFIX.idx`): a memory-mapped reader and a writer.

The `.bin` file is the token ids of every sequence back to back, in one numpy dtype. The `.idx` file is,
all little-endian, byte for byte what Megatron-LM's `IndexedDataset` reads and writes:

    offset  size          field
    0       9             magic b"MMIDIDX\\x00\\x00"
    9       8   uint64    version, always 1
    17      1   uint8     dtype code: 1 uint8, 2 int8, 3 int16, 4 int32, 5 int64, 6 float64, 7 float32, 8 uint16
    18      8   uint64    sequence count S
    26      8   uint64    document-index count D (= number of documents + 1)
    34      4*S int32     tokens per sequence
    ..      8*S int64     byte offset of each sequence in .bin
    ..      8*D int64     document indices: document d is sequences [doc[d], doc[d+1]); doc[0] = 0, doc[-1] = S
    ..      1*S int8      (multimodal datasets only) a mode per sequence; read past, never written

A document is usually one sequence (one line of the input); Megatron's sentence-split data has several.
Every inconsistency (missing file, wrong magic or version, unknown dtype, truncated files) raises
`DataError` with one line naming the file.
"""

from __future__ import annotations

import struct
from array import array
from pathlib import Path

import numpy as np

from moecore.config import ConfigError

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
HEADER_BYTES = 34  # magic 9 + version 8 + dtype code 1 + sequence count 8 + document count 8
DTYPE_CODES: dict[int, type[np.number]] = {
    1: np.uint8,
    2: np.int8,
    3: np.int16,
    4: np.int32,
    5: np.int64,
    6: np.float64,
    7: np.float32,
    8: np.uint16,
}
CODE_OF_DTYPE = {np.dtype(t): c for c, t in DTYPE_CODES.items()}


class DataError(ConfigError):
    """A data file that cannot be used; the message is one line naming the file."""


def optimal_dtype(vocab_size: int) -> type[np.number]:
    """Megatron's choice: uint16 when every id fits below 65500, int32 otherwise."""
    return np.uint16 if vocab_size < 65500 else np.int32


def normalize_prefix(path: str | Path) -> str:
    """`a/b`, `a/b.bin` and `a/b.idx` all name the dataset `a/b`."""
    s = str(path)
    for suffix in (".bin", ".idx"):
        if s.endswith(suffix):
            return s[: -len(suffix)]
    return s


class IndexedDatasetWriter:
    """Writes `PREFIX.bin` while sequences arrive and `PREFIX.idx` on `close()` (or leaving a `with`)."""

    def __init__(self, prefix: str | Path, dtype: type[np.number] | np.dtype = np.uint16) -> None:
        self.prefix = normalize_prefix(prefix)
        self.dtype = np.dtype(dtype)
        if self.dtype not in CODE_OF_DTYPE:
            raise ValueError(
                f"dtype={self.dtype} is invalid: allowed {sorted(str(np.dtype(t)) for t in DTYPE_CODES.values())}"
            )
        Path(self.prefix).parent.mkdir(parents=True, exist_ok=True)
        self._bin = open(f"{self.prefix}.bin", "wb")
        self._lengths = array("q")
        self._doc_indices = array("q", [0])
        self._closed = False

    def add_sequence(self, tokens: np.ndarray | list[int]) -> None:
        """Append one sequence to the current document."""
        arr = np.asarray(tokens)
        if arr.size and self.dtype.kind in "iu":
            info = np.iinfo(self.dtype)
            lo, hi = int(arr.min()), int(arr.max())
            if lo < info.min or hi > info.max:
                raise ValueError(f"token ids in [{lo}, {hi}] do not fit {self.dtype}; use a wider dtype")
        self._bin.write(np.ascontiguousarray(arr, dtype=self.dtype).tobytes(order="C"))
        self._lengths.append(int(arr.size))

    def end_document(self) -> None:
        """Close the current document (its sequences are those added since the previous call)."""
        self._doc_indices.append(len(self._lengths))

    def add_document(self, tokens: np.ndarray | list[int] | list[np.ndarray]) -> None:
        """One document: a 1-D array of ids (one sequence), or a list of such arrays (several sequences)."""
        if isinstance(tokens, list) and tokens and not np.isscalar(tokens[0]):
            for seq in tokens:
                self.add_sequence(seq)
        else:
            self.add_sequence(tokens)
        self.end_document()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._bin.close()
        lengths = np.frombuffer(self._lengths, dtype=np.int64) if len(self._lengths) else np.zeros(0, np.int64)
        pointers = np.zeros(len(lengths), dtype=np.int64)
        if len(lengths) > 1:
            pointers[1:] = np.cumsum(lengths[:-1]) * self.dtype.itemsize
        with open(f"{self.prefix}.idx", "wb") as f:
            f.write(MAGIC)
            f.write(struct.pack("<Q", VERSION))
            f.write(struct.pack("<B", CODE_OF_DTYPE[self.dtype]))
            f.write(struct.pack("<Q", len(lengths)))
            f.write(struct.pack("<Q", len(self._doc_indices)))
            f.write(lengths.astype("<i4").tobytes(order="C"))
            f.write(pointers.astype("<i8").tobytes(order="C"))
            f.write(np.frombuffer(self._doc_indices, dtype=np.int64).astype("<i8").tobytes(order="C"))

    def __enter__(self) -> IndexedDatasetWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class IndexedDataset:
    """A memory-mapped Megatron indexed dataset. `ds[i]` is sequence i; `document(d)` is document d."""

    def __init__(self, prefix: str | Path) -> None:
        self.prefix = normalize_prefix(prefix)
        idx_path, bin_path = f"{self.prefix}.idx", f"{self.prefix}.bin"
        for p in (idx_path, bin_path):
            if not Path(p).is_file():
                raise DataError(f"{p}: no such file (an indexed dataset needs {self.prefix}.bin and {self.prefix}.idx)")
        idx_size = Path(idx_path).stat().st_size
        with open(idx_path, "rb") as f:
            head = f.read(HEADER_BYTES)
        if len(head) < 9 or head[:9] != MAGIC:
            raise DataError(
                f"{idx_path}: not a Megatron indexed dataset index (magic {head[:9]!r}, expected {MAGIC!r})"
            )
        if len(head) < HEADER_BYTES:
            raise DataError(f"{idx_path}: truncated index header ({len(head)} of {HEADER_BYTES} bytes)")
        (version,) = struct.unpack("<Q", head[9:17])
        if version != VERSION:
            raise DataError(f"{idx_path}: unsupported index version {version} (supported: {VERSION})")
        code = head[17]
        if code not in DTYPE_CODES:
            raise DataError(f"{idx_path}: unknown dtype code {code} (known: {sorted(DTYPE_CODES)})")
        self.dtype = np.dtype(DTYPE_CODES[code])
        n_seq, n_doc_idx = struct.unpack("<QQ", head[18:34])
        need = HEADER_BYTES + 12 * n_seq + 8 * n_doc_idx
        if idx_size < need:
            raise DataError(f"{idx_path}: truncated index ({idx_size} bytes, the header announces {need})")
        self.idx_path, self.bin_path = idx_path, bin_path
        mm = np.memmap(idx_path, dtype=np.uint8, mode="r")
        off = HEADER_BYTES
        self.sequence_lengths = np.frombuffer(mm, dtype="<i4", count=n_seq, offset=off)
        off += 4 * n_seq
        self.sequence_pointers = np.frombuffer(mm, dtype="<i8", count=n_seq, offset=off)
        off += 8 * n_seq
        self.document_indices = np.frombuffer(mm, dtype="<i8", count=n_doc_idx, offset=off)
        self._check_index(n_seq)
        bin_size = Path(bin_path).stat().st_size
        end = int(self.sequence_pointers[-1]) + int(self.sequence_lengths[-1]) * self.dtype.itemsize if n_seq else 0
        if bin_size < end:
            raise DataError(f"{bin_path}: truncated data file ({bin_size} bytes, the index needs {end})")
        self._bin = np.memmap(bin_path, dtype=self.dtype, mode="r") if bin_size else np.zeros(0, self.dtype)
        self._doc_offsets, self._doc_lengths = self._document_spans()

    def _check_index(self, n_seq: int) -> None:
        doc = self.document_indices
        if len(doc) == 0 or doc[0] != 0 or doc[-1] != n_seq or (len(doc) > 1 and np.any(np.diff(doc) < 0)):
            raise DataError(f"{self.idx_path}: inconsistent document indices (must rise from 0 to {n_seq})")
        if n_seq and (np.any(self.sequence_lengths < 0) or np.any(self.sequence_pointers < 0)):
            raise DataError(f"{self.idx_path}: negative sequence lengths or pointers")

    def _document_spans(self) -> tuple[np.ndarray, np.ndarray]:
        """Token offset in .bin and token count of every document (its sequences must be contiguous)."""
        lengths = self.sequence_lengths.astype(np.int64)
        starts = self.sequence_pointers // self.dtype.itemsize
        csum = np.concatenate([[0], np.cumsum(lengths)])
        doc = self.document_indices
        doc_lengths = csum[doc[1:]] - csum[doc[:-1]]
        first = np.minimum(doc[:-1], max(len(lengths) - 1, 0))
        doc_offsets = starts[first] if len(lengths) else np.zeros(len(doc) - 1, np.int64)
        # Within a document, sequence j+1 must start where sequence j ends.
        if len(lengths) > 1:
            follows = starts[1:] == starts[:-1] + lengths[:-1]
            doc_start = np.zeros(len(lengths), dtype=bool)
            doc_start[doc[:-1][doc[:-1] < len(lengths)]] = True
            if not np.all(follows | doc_start[1:]):
                raise DataError(f"{self.idx_path}: sequences of one document are not contiguous in the .bin file")
        return doc_offsets.astype(np.int64), doc_lengths.astype(np.int64)

    @property
    def num_sequences(self) -> int:
        return len(self.sequence_lengths)

    @property
    def num_documents(self) -> int:
        return len(self.document_indices) - 1

    @property
    def document_lengths(self) -> np.ndarray:
        """Tokens per document, [num_documents] int64."""
        return self._doc_lengths

    @property
    def num_tokens(self) -> int:
        return int(self._doc_lengths.sum())

    def __len__(self) -> int:
        return self.num_sequences

    def __getitem__(self, i: int) -> np.ndarray:
        start = int(self.sequence_pointers[i]) // self.dtype.itemsize
        return self._bin[start : start + int(self.sequence_lengths[i])]

    def document(self, d: int) -> np.ndarray:
        """All tokens of document d (its sequences concatenated)."""
        return self.read(d, 0, int(self._doc_lengths[d]))

    def read(self, d: int, offset: int, length: int) -> np.ndarray:
        """`length` tokens of document d starting at token `offset` (a view into the memory map)."""
        start = int(self._doc_offsets[d]) + offset
        return self._bin[start : start + length]
