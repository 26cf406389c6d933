"""Streaming safetensors I/O for Hugging Face checkpoint folders, one tensor at a time.

A Hugging Face folder holds `config.json`, the weights as `model.safetensors` or as shards listed in
`model.safetensors.index.json` (`{"metadata": {"total_size": N}, "weight_map": {name: file}}`), and
tokenizer files. `SafetensorsReader` memory-maps the shards and hands out one tensor per call.
`write_safetensors` writes shards without ever holding more than one tensor: it first lays out every
shard from the tensors' shapes and dtypes, writes each shard's header, then asks for the tensors one
by one and streams their bytes.

The safetensors layout (https://github.com/huggingface/safetensors, "Format"): 8 bytes little-endian
header length N, N bytes of JSON `{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__":
{...}}` (padded with spaces to a multiple of 8), then the raw little-endian, C-ordered tensor bytes, with
offsets counted from the end of the header.
"""

from __future__ import annotations

import json
import shutil
import struct
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
DEFAULT_MAX_SHARD_BYTES = 5 * 1024**3

# Files of a Hugging Face folder that describe the tokenizer or generation defaults; carried across a conversion.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
    "generation_config.json",
)

_DTYPE_TO_ST = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
}
_ST_TO_DTYPE = {v: k for k, v in _DTYPE_TO_ST.items()}


def read_config_json(folder: str | Path) -> dict:
    """The parsed `config.json` of a Hugging Face folder, with a clear error when it is absent or broken."""
    path = Path(folder) / "config.json"
    if not Path(folder).is_dir():
        raise ValueError(f"{folder} is not a folder; expected a Hugging Face checkpoint folder with config.json")
    if not path.is_file():
        raise ValueError(f"{path} does not exist; a Hugging Face checkpoint folder needs config.json")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON (line {e.lineno})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold a JSON object")
    return data


def weight_files(folder: str | Path) -> dict[str, Path]:
    """Map every tensor name to the safetensors file that holds it (single file or sharded index)."""
    folder = Path(folder)
    index = folder / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError):
            raise ValueError(f"{index} is not a valid safetensors index (needs a 'weight_map' object)") from None
        out = {}
        for name, file in weight_map.items():
            path = folder / file
            if not path.is_file():
                raise ValueError(f"{index} lists tensor {name!r} in {file}, which does not exist")
            out[name] = path
        return out
    single = folder / SINGLE_FILE
    if single.is_file():
        with safe_open(single, framework="pt") as f:
            return {name: single for name in f.keys()}
    found = sorted(p.name for p in folder.glob("*.bin")) + sorted(p.name for p in folder.glob("*.pt"))
    hint = f" (found {', '.join(found)}: convert them to safetensors first)" if found else ""
    raise ValueError(f"{folder} holds no {SINGLE_FILE} or {INDEX_FILE}{hint}")


class SafetensorsReader:
    """Read tensors one at a time from a Hugging Face folder (memory-mapped; nothing is loaded up front)."""

    def __init__(self, folder: str | Path) -> None:
        self.folder = Path(folder)
        self._where = weight_files(self.folder)
        self._handles: dict[Path, object] = {}

    def __enter__(self) -> SafetensorsReader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        for h in self._handles.values():
            h.__exit__(None, None, None)
        self._handles.clear()

    def _handle(self, name: str):
        if name not in self._where:
            raise KeyError(name)
        path = self._where[name]
        if path not in self._handles:
            h = safe_open(path, framework="pt")
            self._handles[path] = h.__enter__()
        return self._handles[path]

    def names(self) -> list[str]:
        return list(self._where)

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._handle(name).get_slice(name).get_shape())

    def dtype(self, name: str) -> torch.dtype:
        st = self._handle(name).get_slice(name).get_dtype()
        if st not in _ST_TO_DTYPE:
            raise ValueError(f"tensor {name!r} in {self._where[name].name} has dtype {st}, which is not supported")
        return _ST_TO_DTYPE[st]

    def get(self, name: str) -> torch.Tensor:
        return self._handle(name).get_tensor(name)


@dataclass
class PlannedTensor:
    """A tensor to write: its name, shape and dtype now, its values from `produce()` when its turn comes."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    produce: Callable[[], torch.Tensor]

    @property
    def nbytes(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n * torch.empty((), dtype=self.dtype).element_size()


def _shard_plan(tensors: list[PlannedTensor], max_shard_bytes: int) -> list[list[PlannedTensor]]:
    """Greedy shards in the given order; a tensor larger than the limit gets a shard of its own."""
    shards: list[list[PlannedTensor]] = [[]]
    size = 0
    for t in tensors:
        if shards[-1] and size + t.nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(t)
        size += t.nbytes
    return shards


def _header(tensors: list[PlannedTensor], metadata: dict[str, str]) -> bytes:
    entries: dict[str, object] = {"__metadata__": metadata}
    offset = 0
    for t in tensors:
        if t.dtype not in _DTYPE_TO_ST:
            raise ValueError(f"tensor {t.name!r} has dtype {t.dtype}, which safetensors cannot store")
        entries[t.name] = {
            "dtype": _DTYPE_TO_ST[t.dtype],
            "shape": list(t.shape),
            "data_offsets": [offset, offset + t.nbytes],
        }
        offset += t.nbytes
    raw = json.dumps(entries, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data section starts 8-byte aligned
    return struct.pack("<Q", len(raw)) + raw


def _write_tensor(f, t: PlannedTensor) -> None:
    value = t.produce()
    if tuple(value.shape) != tuple(t.shape) or value.dtype != t.dtype:
        raise ValueError(
            f"tensor {t.name!r} was planned as {list(t.shape)} {t.dtype} but produced {list(value.shape)} {value.dtype}"
        )
    flat = value.detach().to("cpu").contiguous().reshape(-1)
    if flat.numel():
        f.write(flat.view(torch.uint8).numpy().data)


def write_safetensors(
    folder: str | Path,
    tensors: Iterable[PlannedTensor],
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    metadata: dict[str, str] | None = None,
    on_tensor: Callable[[str], None] | None = None,
) -> list[Path]:
    """Write `tensors` as `model.safetensors`, or as `model-0000i-of-0000n.safetensors` shards plus an index.

    Each tensor's `produce()` is called once, right before its bytes are written, so at most one
    produced tensor is alive at a time. `on_tensor(name)` is called after each tensor is written.
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tensors = list(tensors)
    seen: set[str] = set()
    for t in tensors:
        if t.name in seen:
            raise ValueError(f"tensor {t.name!r} is planned twice")
        seen.add(t.name)
    metadata = {"format": "pt", **(metadata or {})}
    shards = _shard_plan(tensors, max_shard_bytes)
    n = len(shards)
    names = [SINGLE_FILE] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    for stale in [folder / SINGLE_FILE, folder / INDEX_FILE, *folder.glob("model-*-of-*.safetensors")]:
        if stale.exists() and stale.name not in names:
            stale.unlink()
    paths = []
    for shard, fname in zip(shards, names):
        path = folder / fname
        with open(path, "wb") as f:
            f.write(_header(shard, metadata))
            for t in shard:
                _write_tensor(f, t)
                if on_tensor is not None:
                    on_tensor(t.name)
        paths.append(path)
    if n > 1:
        index = {
            "metadata": {"total_size": sum(t.nbytes for t in tensors)},
            "weight_map": {t.name: fname for shard, fname in zip(shards, names) for t in shard},
        }
        (folder / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    return paths


def copy_tokenizer_files(src: str | Path, dst: str | Path) -> list[str]:
    """Copy the tokenizer and generation files found in `src` into `dst`; returns the names copied."""
    src, dst = Path(src), Path(dst)
    copied = []
    for name in TOKENIZER_FILES:
        if (src / name).is_file():
            dst.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(src / name, dst / name)
            copied.append(name)
    return copied


def iter_shapes(reader: SafetensorsReader) -> Iterator[tuple[str, tuple[int, ...]]]:
    """(name, shape) of every tensor in the folder, without reading any data."""
    for name in reader.names():
        yield name, reader.shape(name)
