"""`moecore preprocess` and the tokenizers: tokens equal Hugging Face tokenizers' output, bad input handled."""

from __future__ import annotations

import functools
import gzip
import json
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import models, pre_tokenizers

from moecore.config import ConfigError
from moecore.data.indexed import IndexedDataset
from moecore.data.preprocess import main
from moecore.data.tokenizer import EMBEDDED_TOKENIZER, load_tokenizer

TEXTS = [
    "def f(x):\n    return x + 1\n",
    "Ünïcödé text — with «quotes» and 日本語.",
    "",
    "class A:\n\tpass\n\n\n" * 3,
    "x" * 500,
]


@functools.lru_cache(maxsize=1)
def _reference() -> HFTokenizer:
    return HFTokenizer.from_file(str(EMBEDDED_TOKENIZER))


def _reference_ids(text: str) -> list[int]:
    return _reference().encode(text, add_special_tokens=False).ids


def test_embedded_tokenizer() -> None:
    tok = load_tokenizer(None)
    assert tok.vocab_size == 4096 and tok.eod_id == tok.token_to_id("<|endoftext|>")
    for text in TEXTS:
        assert tok.encode(text) == _reference_ids(text)
        assert tok.decode(tok.encode(text)) == text  # byte-level: lossless
    assert tok.encode_batch(TEXTS) == [_reference_ids(t) for t in TEXTS]


def test_tokenizer_from_folder(tmp_path: Path) -> None:
    vocab = {"[UNK]": 0, "hello": 1, "world": 2, "</s>": 3, "<eos_alt>": 4}
    hf = HFTokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    hf.pre_tokenizer = pre_tokenizers.Whitespace()
    hf.save(str(tmp_path / "tokenizer.json"))
    tok = load_tokenizer(tmp_path)
    assert tok.encode("hello world") == [1, 2] and tok.vocab_size == 5 and tok.eod_id == 3
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<eos_alt>"}))
    assert load_tokenizer(tmp_path).eod_id == 4
    with pytest.raises(ConfigError, match="data.tokenizer=.*tokenizer.json"):
        load_tokenizer(tmp_path / "missing")
    (tmp_path / "broken.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not a readable tokenizer.json"):
        load_tokenizer(tmp_path / "broken.json")


def _write_jsonl(path: Path, lines: list[str]) -> None:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "wt", encoding="utf-8") as f:
        f.write("".join(line + "\n" for line in lines))


@pytest.mark.parametrize("suffix,workers", [(".jsonl", 1), (".jsonl.gz", 2)])
def test_preprocessed_tokens_equal_tokenizer_output(tmp_path: Path, suffix: str, workers: int) -> None:
    texts = TEXTS * 120  # several chunks, so workers return out of order and are put back in order
    src = tmp_path / f"in{suffix}"
    _write_jsonl(src, [json.dumps({"content": t, "id": i}) for i, t in enumerate(texts)])
    prefix = tmp_path / "out"
    argv = ["--input", str(src), "--output-prefix", str(prefix), "--json-key", "content"]
    assert main(argv + ["--append-eod", "--workers", str(workers), "--no-progress"]) == 0
    ds = IndexedDataset(prefix)
    eod = _reference().token_to_id("<|endoftext|>")
    assert ds.num_documents == len(texts) and ds.dtype == np.uint16
    for d, text in enumerate(texts):
        assert ds.document(d).tolist() == _reference_ids(text) + [eod]
    assert main(argv + ["--output-prefix", str(tmp_path / "noeod"), "--no-progress"]) == 0
    assert IndexedDataset(tmp_path / "noeod").document(0).tolist() == _reference_ids(texts[0])


def test_parquet_input(tmp_path: Path) -> None:
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": TEXTS}), tmp_path / "a.parquet")
    pq.write_table(pa.table({"text": TEXTS[::-1]}), tmp_path / "b.parquet")
    prefix = tmp_path / "pq"
    assert main(["--input", str(tmp_path / "*.parquet"), "--output-prefix", str(prefix), "--no-progress"]) == 0
    ds = IndexedDataset(prefix)
    assert [ds.document(d).tolist() for d in range(ds.num_documents)] == [
        _reference_ids(t) for t in TEXTS + TEXTS[::-1]
    ]
    assert main(["--input", str(tmp_path / "a.parquet"), "--output-prefix", str(prefix), "--json-key", "body"]) == 2


BAD = [
    ("{not json", "not valid JSON"),
    ('["a", "list"]', "expected a JSON object"),
    ('{"other": "no text key"}', "no key 'text'"),
    ('{"text": 5}', "'text' holds int"),
    ("", "empty line"),
]


@pytest.mark.parametrize("bad,reason", BAD)
def test_bad_line_is_one_error_naming_file_and_line(tmp_path: Path, capsys, bad: str, reason: str) -> None:
    src = tmp_path / "in.jsonl"
    _write_jsonl(src, [json.dumps({"text": "ok"}), json.dumps({"text": "fine"}), bad, json.dumps({"text": "after"})])
    prefix = tmp_path / "out"
    assert main(["--input", str(src), "--output-prefix", str(prefix), "--no-progress", "--workers", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and f"{src}:3:" in err and reason in err and "Traceback" not in err
    assert not Path(f"{prefix}.bin").exists() and not Path(f"{prefix}.idx").exists()  # no partial output


def test_skip_bad_lines_reports_count(tmp_path: Path, capsys) -> None:
    src = tmp_path / "in.jsonl"
    good = [json.dumps({"text": t}) for t in ("a b", "c d", "e f")]
    _write_jsonl(src, [good[0], BAD[0][0], BAD[2][0], good[1], BAD[3][0], good[2]])
    prefix = tmp_path / "out"
    argv = ["--input", str(src), "--output-prefix", str(prefix), "--on-bad-line", "skip", "--no-progress"]
    assert main(argv + ["--workers", "2"]) == 0
    out = capsys.readouterr().out
    assert "skipped 3 bad line(s)" in out and f"{src}:2:" in out
    assert [IndexedDataset(prefix).document(d).tolist() for d in range(3)] == [
        _reference_ids(t) for t in ("a b", "c d", "e f")
    ]


def test_bad_arguments(tmp_path: Path, capsys) -> None:
    assert main(["--input", str(tmp_path / "missing.jsonl"), "--output-prefix", str(tmp_path / "o")]) == 2
    assert "missing.jsonl" in capsys.readouterr().err
    assert main(["--output-prefix", str(tmp_path / "o")]) == 2
    assert "--input" in capsys.readouterr().err
    (tmp_path / "x.jsonl").write_text('{"text": "a"}\n')
    assert main(["--input", str(tmp_path / "x.jsonl"), "--output-prefix", str(tmp_path / "o"), "--workers", "0"]) == 2
    (tmp_path / "broken.jsonl.gz").write_bytes(b"\x1f\x8b\x08\x00garbage")
    assert main(["--input", str(tmp_path / "broken.jsonl.gz"), "--output-prefix", str(tmp_path / "o")]) == 2
    assert "broken.jsonl.gz" in capsys.readouterr().err
