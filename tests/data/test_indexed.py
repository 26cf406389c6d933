"""Megatron indexed dataset format: byte-compatibility with Megatron-LM's files, round trips, bad files.

The files in fixtures/ were written by megatron-core 0.16.1's own `IndexedDatasetBuilder` (add_item per
sequence, end_document per document, finalize), so they are the reference we did not write:
  megatron_uint16: documents [[1,2,3,0]], [[5,6],[7,8,9,0]] (two sequences), [] (no sequence), [[65000,11,0]]
  megatron_int32:  documents [[70000,3]], [[4]], [[1,2,3,4,5,6,7]]
"""

from __future__ import annotations

import shutil
import struct
from pathlib import Path

import numpy as np
import pytest

from moecore.data.indexed import DataError, IndexedDataset, IndexedDatasetWriter

FIXTURES = Path(__file__).parent / "fixtures"
MEGATRON_DOCS = {
    "megatron_uint16": (np.uint16, [[[1, 2, 3, 0]], [[5, 6], [7, 8, 9, 0]], [], [[65000, 11, 0]]]),
    "megatron_int32": (np.int32, [[[70000, 3]], [[4]], [[1, 2, 3, 4, 5, 6, 7]]]),
}


@pytest.mark.parametrize("name", sorted(MEGATRON_DOCS))
def test_writer_is_byte_identical_to_megatron(tmp_path: Path, name: str) -> None:
    dtype, docs = MEGATRON_DOCS[name]
    with IndexedDatasetWriter(tmp_path / name, dtype) as w:
        for doc in docs:
            for seq in doc:
                w.add_sequence(seq)
            w.end_document()
    for suffix in (".bin", ".idx"):
        assert (tmp_path / f"{name}{suffix}").read_bytes() == (FIXTURES / f"{name}{suffix}").read_bytes(), suffix


@pytest.mark.parametrize("name", sorted(MEGATRON_DOCS))
def test_reader_reads_megatron_files(name: str) -> None:
    dtype, docs = MEGATRON_DOCS[name]
    ds = IndexedDataset(FIXTURES / name)
    assert ds.dtype == np.dtype(dtype)
    seqs = [s for doc in docs for s in doc]
    assert ds.num_sequences == len(seqs) and ds.num_documents == len(docs)
    assert [ds[i].tolist() for i in range(len(ds))] == seqs
    assert [ds.document(d).tolist() for d in range(ds.num_documents)] == [sum(doc, []) for doc in docs]
    assert ds.document_lengths.tolist() == [sum(len(s) for s in doc) for doc in docs]
    longest = max(range(len(docs)), key=lambda d: sum(len(s) for s in docs[d]))
    assert ds.read(longest, 1, 3).tolist() == sum(docs[longest], [])[1:4]


def test_round_trip_random(tmp_path: Path) -> None:
    rng = np.random.default_rng(1)
    docs = [
        [rng.integers(0, 2**31 - 1, size=int(n)) for n in rng.integers(0, 40, size=rng.integers(1, 4))]
        for _ in range(200)
    ]
    with IndexedDatasetWriter(tmp_path / "r.bin", np.int32) as w:  # a .bin suffix names the same prefix
        for doc in docs:
            w.add_document(doc)
    ds = IndexedDataset(tmp_path / "r")
    assert ds.num_documents == 200
    for d, doc in enumerate(docs):
        np.testing.assert_array_equal(ds.document(d), np.concatenate(doc))
    # The header fields, read with struct straight from the file.
    raw = (tmp_path / "r.idx").read_bytes()
    assert raw[:9] == b"MMIDIDX\x00\x00" and struct.unpack("<Q", raw[9:17]) == (1,) and raw[17] == 4
    assert struct.unpack("<QQ", raw[18:34]) == (sum(len(d) for d in docs), 201)


def test_writer_refuses_ids_that_do_not_fit(tmp_path: Path) -> None:
    with IndexedDatasetWriter(tmp_path / "x", np.uint16) as w:
        with pytest.raises(ValueError, match="do not fit uint16"):
            w.add_document([1, 70000])


def _copy(tmp_path: Path, name: str = "megatron_uint16") -> Path:
    for suffix in (".bin", ".idx"):
        shutil.copy(FIXTURES / f"{name}{suffix}", tmp_path / f"{name}{suffix}")
    return tmp_path / name


def _one_line_error(prefix: Path, fragment: str, file: str) -> None:
    with pytest.raises(DataError) as e:
        IndexedDataset(prefix)
    msg = str(e.value)
    assert "\n" not in msg and file in msg and fragment in msg, msg


def test_truncated_bin(tmp_path: Path) -> None:
    p = _copy(tmp_path)
    data = Path(f"{p}.bin").read_bytes()
    Path(f"{p}.bin").write_bytes(data[:-4])
    _one_line_error(p, "truncated data file", f"{p}.bin")


def test_wrong_magic(tmp_path: Path) -> None:
    p = _copy(tmp_path)
    raw = bytearray(Path(f"{p}.idx").read_bytes())
    raw[:9] = b"TNTIDX\x00\x00\x00"  # the old non-mmap index magic
    Path(f"{p}.idx").write_bytes(bytes(raw))
    _one_line_error(p, "magic", f"{p}.idx")


def test_wrong_version(tmp_path: Path) -> None:
    p = _copy(tmp_path)
    raw = bytearray(Path(f"{p}.idx").read_bytes())
    raw[9:17] = struct.pack("<Q", 2)
    Path(f"{p}.idx").write_bytes(bytes(raw))
    _one_line_error(p, "version 2", f"{p}.idx")


def test_unknown_dtype_and_truncated_index(tmp_path: Path) -> None:
    p = _copy(tmp_path)
    raw = bytearray(Path(f"{p}.idx").read_bytes())
    Path(f"{p}.idx").write_bytes(bytes(raw[:-8]))
    _one_line_error(p, "truncated index", f"{p}.idx")
    raw[17] = 9
    Path(f"{p}.idx").write_bytes(bytes(raw))
    _one_line_error(p, "dtype code 9", f"{p}.idx")


def test_missing_file(tmp_path: Path) -> None:
    p = _copy(tmp_path)
    Path(f"{p}.bin").unlink()
    _one_line_error(p, "no such file", f"{p}.bin")
