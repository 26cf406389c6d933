"""The embedded default corpus: the Python standard library's own `.py` sources on this machine.

Every Python installation carries a few megabytes of real, varied text in its standard library, so
`moecore train` has data without a download. The selection is deterministic: files under
`sysconfig.get_paths()["stdlib"]` (no `site-packages`, no test suites, no huge generated files),
ordered by a hash of their relative path (a spread over the whole library rather than its first
packages alphabetically) and taken until `max_bytes` of text.

The tokenized corpus is cached as a Megatron-format indexed dataset under the cache folder, keyed by a
hash of the selected file list (paths and sizes), the tokenizer file and the format version, so only the
first run pays for tokenization. Concurrent builders (several ranks on one machine) serialise on a file
lock and write atomically.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import sysconfig
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from moecore.data.indexed import IndexedDatasetWriter, optimal_dtype
from moecore.data.tokenizer import Tokenizer

CORPUS_FORMAT_VERSION = 1
DEFAULT_MAX_BYTES = 4 * 1024 * 1024
MAX_FILE_BYTES = 256 * 1024  # skip generated giants such as pydoc_data/topics.py
_EXCLUDED_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}


@dataclass(frozen=True)
class CorpusFile:
    """One selected source file: its path relative to the stdlib root and its size in bytes."""

    relpath: str
    size: int


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def select_files(root: Path | None = None, max_bytes: int = DEFAULT_MAX_BYTES) -> list[CorpusFile]:
    """The deterministic file selection: filtered, ordered by sha1(relpath), capped at max_bytes in total."""
    root = root or stdlib_root()
    candidates: list[CorpusFile] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _EXCLUDED_DIRS)
        for name in sorted(filenames):
            if not name.endswith(".py"):
                continue
            path = Path(dirpath) / name
            try:
                size = path.stat().st_size
            except OSError:
                continue
            if 0 < size <= MAX_FILE_BYTES:
                candidates.append(CorpusFile(path.relative_to(root).as_posix(), size))
    candidates.sort(key=lambda f: (hashlib.sha1(f.relpath.encode()).hexdigest(), f.relpath))
    chosen, total = [], 0
    for f in candidates:
        if total + f.size > max_bytes:
            continue
        chosen.append(f)
        total += f.size
    return chosen


def iter_texts(files: list[CorpusFile], root: Path | None = None) -> Iterator[str]:
    """The text of each selected file (undecodable bytes replaced, so every machine yields text)."""
    root = root or stdlib_root()
    for f in files:
        yield (root / f.relpath).read_text(encoding="utf-8", errors="replace")


def corpus_key(files: list[CorpusFile], tokenizer: Tokenizer) -> str:
    """Hash of what the cached tokens depend on: the file list with sizes, the tokenizer, the format."""
    h = hashlib.sha256()
    h.update(f"v{CORPUS_FORMAT_VERSION}\n".encode())
    h.update(tokenizer.fingerprint.encode())
    for f in files:
        h.update(f"{f.relpath}\t{f.size}\n".encode())
    return h.hexdigest()[:16]


def default_cache_dir() -> Path:
    return Path.home() / ".cache" / "moecore"


@contextlib.contextmanager
def file_lock(path: Path) -> Iterator[None]:
    """An exclusive advisory lock on `path` (POSIX); a no-op where fcntl is unavailable."""
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        import fcntl
    except ImportError:  # pragma: no cover - Windows
        yield
        return
    with open(path, "a+") as fh:
        fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh.fileno(), fcntl.LOCK_UN)


def build_embedded_corpus(
    tokenizer: Tokenizer,
    cache_dir: str | Path | None = None,
    max_bytes: int = DEFAULT_MAX_BYTES,
    root: Path | None = None,
) -> str:
    """Tokenize the embedded corpus once (EOD after each file) and return the indexed-dataset prefix."""
    cache = Path(cache_dir) if cache_dir else default_cache_dir()
    files = select_files(root, max_bytes)
    if not files:
        raise ValueError(f"the embedded corpus found no .py files under {root or stdlib_root()}")
    prefix = cache / "corpus" / f"stdlib-{corpus_key(files, tokenizer)}"
    if _complete(prefix):
        return str(prefix)
    with file_lock(prefix.with_suffix(".lock")):
        if _complete(prefix):  # another process built it while we waited
            return str(prefix)
        eod = tokenizer.eod_id
        docs = tokenizer.encode_batch(list(iter_texts(files, root)))
        dtype = optimal_dtype(tokenizer.vocab_size)
        # Write under a temporary name, then rename both files: readers never see a partial dataset.
        tmp = Path(tempfile.mkdtemp(dir=prefix.parent, prefix=".tmp-"))
        try:
            tmp_prefix = tmp / prefix.name
            with IndexedDatasetWriter(tmp_prefix, dtype) as w:
                for ids in docs:
                    if eod is not None:
                        ids = ids + [eod]
                    w.add_document(np.asarray(ids, dtype=dtype))
            os.replace(f"{tmp_prefix}.bin", f"{prefix}.bin")
            os.replace(f"{tmp_prefix}.idx", f"{prefix}.idx")
        finally:
            for p in tmp.iterdir():
                p.unlink()
            tmp.rmdir()
    return str(prefix)


def _complete(prefix: Path) -> bool:
    return Path(f"{prefix}.bin").is_file() and Path(f"{prefix}.idx").is_file()
