"""`moecore preprocess`: tokenize jsonl / jsonl.gz / parquet documents into a Megatron indexed dataset.

    moecore preprocess --input FILE.jsonl[.gz] | FILES.parquet --output-prefix PREFIX [--tokenizer DIR]
                       [--json-key text] [--workers N] [--append-eod] [--on-bad-line skip|error]

One document per input line (jsonl: a JSON object whose `--json-key` holds the text; parquet: one row of
that column). Documents are tokenized in parallel by `--workers` processes, in chunks, and written in input
order to `PREFIX.bin` / `PREFIX.idx`, which `data.paths=[PREFIX]` trains on and Megatron-LM reads (Megatron's
own tool names its output `PREFIX_text_document`; here the prefix is used as given). `--append-eod` ends
every document with the tokenizer's end-of-document token, which is what separates documents inside
packed training samples.

A line that is not JSON, is not an object, lacks the key or holds a non-string is an error naming the file
and line (exit code 2, partial output removed); with `--on-bad-line skip` such lines are skipped and counted.
"""

from __future__ import annotations

import argparse
import glob
import gzip
import json
import multiprocessing as mp
import os
import sys
import time
from collections import deque
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np

from moecore.config import ConfigError
from moecore.data.indexed import IndexedDatasetWriter, normalize_prefix, optimal_dtype
from moecore.data.tokenizer import load_tokenizer

CHUNK_LINES = 256
# Per-process state of pool workers only (set by _init_worker in each child, never in the parent).
_WORKER: dict = {}


class _ArgError(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line instead of usage + error
        raise _ArgError(message)


def _parser() -> argparse.ArgumentParser:
    p = _Parser(prog="moecore preprocess", description="Tokenize jsonl/parquet documents into .bin/.idx files.")
    p.add_argument("--input", nargs="+", required=True, help="jsonl, jsonl.gz or parquet files (globs allowed)")
    p.add_argument("--output-prefix", required=True, help="writes PREFIX.bin and PREFIX.idx")
    p.add_argument("--tokenizer", default=None, help="tokenizer.json or a folder holding one (default: embedded)")
    p.add_argument("--json-key", default="text", help="the key (jsonl) or column (parquet) holding the text")
    p.add_argument("--workers", type=int, default=min(8, os.cpu_count() or 1), help="tokenizer processes")
    p.add_argument("--append-eod", action="store_true", help="end each document with the EOD token")
    p.add_argument("--on-bad-line", choices=("skip", "error"), default="error")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def _expand_inputs(patterns: list[str]) -> list[Path]:
    files: list[Path] = []
    for pat in patterns:
        if any(c in pat for c in "*?["):
            hits = sorted(glob.glob(pat))
            if not hits:
                raise ConfigError(f"--input {pat!r}: no file matches")
            files.extend(Path(h) for h in hits)
        else:
            p = Path(pat)
            if not p.is_file():
                raise ConfigError(f"--input {pat!r}: no such file")
            files.append(p)
    return files


def _is_parquet(path: Path) -> bool:
    return path.suffix == ".parquet"


def _read_records(
    files: list[Path], key: str, progress_cb: Callable[[int, float], None]
) -> Iterator[list[tuple[int, int, object]]]:
    """Chunks of (file index, line or row number, raw bytes line | text | None) in input order."""
    for fi, path in enumerate(files):
        chunk: list[tuple[int, int, object]] = []
        if _is_parquet(path):
            try:
                import pyarrow.parquet as pq
            except ImportError:
                raise ConfigError(f"{path}: reading parquet needs pyarrow (pip install pyarrow)") from None
            pf = pq.ParquetFile(path)
            if key not in pf.schema_arrow.names:
                raise ConfigError(f"{path}: no column {key!r} (columns: {', '.join(pf.schema_arrow.names)})")
            row, num_rows = 0, max(pf.metadata.num_rows, 1)
            for batch in pf.iter_batches(columns=[key], batch_size=CHUNK_LINES):
                values = batch.column(0).to_pylist()
                yield [(fi, row + i + 1, v) for i, v in enumerate(values)]
                row += len(values)
                progress_cb(fi, row / num_rows)
            continue
        raw = open(path, "rb")
        size = max(path.stat().st_size, 1)
        stream = gzip.open(raw, "rb") if path.suffix == ".gz" else raw
        try:
            for lineno, line in enumerate(stream, start=1):
                chunk.append((fi, lineno, line))
                if len(chunk) == CHUNK_LINES:
                    yield chunk
                    chunk = []
                    progress_cb(fi, raw.tell() / size)
            if chunk:
                yield chunk
            progress_cb(fi, 1.0)
        except (OSError, EOFError) as e:  # a damaged gzip stream
            raise ConfigError(f"{path}: cannot be read ({e})") from None
        finally:
            stream.close()
            raw.close()


def _text_of(record: object, key: str) -> str:
    """The document text of one record, or ValueError with the reason it is bad."""
    if isinstance(record, bytes):
        if not record.strip():
            raise ValueError("empty line")
        try:
            obj = json.loads(record)
        except ValueError as e:
            raise ValueError(f"not valid JSON ({str(e).splitlines()[0]})") from None
        if not isinstance(obj, dict):
            raise ValueError(f"expected a JSON object, found {type(obj).__name__}")
        if key not in obj:
            raise ValueError(f"no key {key!r} in the JSON object")
        record = obj[key]
    if not isinstance(record, str):
        raise ValueError(f"{key!r} holds {type(record).__name__}, expected a string")
    return record


def _encode_chunk(chunk, tokenizer, key: str, eod: int | None, dtype) -> list[tuple[int, int, object]]:
    """[(file index, line, token array | error message str)] for one chunk."""
    texts, where, out = [], [], []
    for fi, line, rec in chunk:
        try:
            texts.append(_text_of(rec, key))
            where.append(len(out))
            out.append((fi, line, None))
        except ValueError as e:
            out.append((fi, line, str(e)))
    for pos, ids in zip(where, tokenizer.encode_batch(texts)):
        if eod is not None:
            ids.append(eod)
        out[pos] = (out[pos][0], out[pos][1], np.asarray(ids, dtype=dtype))
    return out


def _init_worker(tokenizer_path: str | None, key: str, eod: int | None, dtype: str) -> None:
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one thread per worker process; the pool is the parallelism
    _WORKER.update(tok=load_tokenizer(tokenizer_path), key=key, eod=eod, dtype=np.dtype(dtype))


def _worker_encode(chunk):
    w = _WORKER
    return _encode_chunk(chunk, w["tok"], w["key"], w["eod"], w["dtype"])


def _bounded_map(pool, chunks: Iterator, max_pending: int) -> Iterator:
    """pool.imap in input order, but reading at most `max_pending` chunks ahead of the writer."""
    pending: deque = deque()
    for chunk in chunks:
        pending.append(pool.apply_async(_worker_encode, (chunk,)))
        if len(pending) >= max_pending:
            yield pending.popleft().get()
    while pending:
        yield pending.popleft().get()


def main(argv: list[str] | None = None) -> int:
    """Run `moecore preprocess`; returns the exit code (2 for bad input, with one line on stderr)."""
    try:
        args = _parser().parse_args(argv)
    except _ArgError as e:
        print(f"moecore preprocess: error: {e}", file=sys.stderr)
        return 2
    except SystemExit as e:  # --help
        return int(e.code or 0)
    try:
        return _run(args)
    except ConfigError as e:
        print(f"moecore preprocess: error: {e}", file=sys.stderr)
        return 2


def _run(args: argparse.Namespace) -> int:
    if args.workers < 1:
        raise ConfigError(f"--workers={args.workers} is invalid: must be >= 1")
    files = _expand_inputs(args.input)
    tokenizer = load_tokenizer(args.tokenizer, field="--tokenizer")
    eod = None
    if args.append_eod:
        if tokenizer.eod_id is None:
            raise ConfigError(f"--append-eod: tokenizer {tokenizer.source} has no end-of-document token")
        eod = tokenizer.eod_id
    dtype = np.dtype(optimal_dtype(tokenizer.vocab_size))
    prefix = normalize_prefix(args.output_prefix)

    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    sizes = [f.stat().st_size for f in files]
    starts = np.concatenate([[0], np.cumsum(sizes)])
    progress = Progress(
        TextColumn("[bold]tokenizing[/]"),
        BarColumn(),
        TextColumn("{task.percentage:>5.1f}%"),
        TextColumn("{task.fields[docs]:,} docs"),
        TextColumn("{task.fields[tps]:,.0f} tokens/s"),
        TimeElapsedColumn(),
        console=Console(stderr=True),
        disable=args.no_progress,
        transient=False,
    )
    task = progress.add_task("tokenize", total=max(int(starts[-1]), 1), docs=0, tps=0.0)

    def on_progress(fi: int, fraction: float) -> None:  # progress in input bytes (parquet: by rows)
        progress.update(task, completed=int(starts[fi] + fraction * sizes[fi]))

    docs = tokens = skipped = 0
    first_skip = ""
    t0 = time.perf_counter()
    writer = IndexedDatasetWriter(prefix, dtype)
    pool = None
    ok = False
    try:
        chunks = _read_records(files, args.json_key, on_progress)
        if args.workers > 1:
            ctx = mp.get_context("fork" if "fork" in mp.get_all_start_methods() else "spawn")
            init = (args.tokenizer, args.json_key, eod, dtype.str)
            pool = ctx.Pool(args.workers, initializer=_init_worker, initargs=init)
            results = _bounded_map(pool, chunks, 4 * args.workers)
        else:
            results = (_encode_chunk(c, tokenizer, args.json_key, eod, dtype) for c in chunks)
        with progress:
            for out in results:
                for fi, line, item in out:
                    if isinstance(item, str):
                        where = f"{files[fi]}:{line}"
                        if args.on_bad_line == "error":
                            raise ConfigError(f"{where}: {item} (use --on-bad-line skip to skip such lines)")
                        skipped += 1
                        first_skip = first_skip or f"{where}: {item}"
                        continue
                    writer.add_document(item)
                    docs += 1
                    tokens += int(item.size)
                progress.update(task, docs=docs, tps=tokens / max(time.perf_counter() - t0, 1e-9))
        writer.close()
        ok = True
    finally:
        if pool is not None:
            pool.terminate()
            pool.join()
        if not ok:
            writer.close()
            for suffix in (".bin", ".idx"):
                Path(prefix + suffix).unlink(missing_ok=True)
    dt = time.perf_counter() - t0
    print(
        f"wrote {prefix}.bin/.idx: {docs:,} documents, {tokens:,} tokens ({dtype.name}) in {dt:.1f} s "
        f"({tokens / max(dt, 1e-9):,.0f} tokens/s)"
    )
    if skipped:
        print(f"skipped {skipped:,} bad line(s); first: {first_skip}")
    return 0
