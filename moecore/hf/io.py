"""Streaming safetensors I/O for Hugging Face checkpoint folders, one tensor at a time.

A Hugging Face folder holds `config.json`, the weights as `model.safetensors` or as shards listed in
`model.safetensors.index.json` (`{"metadata": {"total_size": N}, "weight_map": {name: file}}`), and
tokenizer files. `SafetensorsReader` parses the shard headers and reads one tensor per call with plain
file reads, straight into the destination tensor where it can (no memory map, no second copy).
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
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import torch

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


class _Shard:
    """One safetensors file: its parsed header, and plain file reads (no memory map) for the data."""

    def __init__(self, path: Path) -> None:
        self.path = path
        size = path.stat().st_size
        with open(path, "rb") as f:
            raw = f.read(8)
            n = struct.unpack("<Q", raw)[0] if len(raw) == 8 else -1
            if n < 2 or 8 + n > size:
                raise ValueError(f"{path} is not a safetensors file (bad header length)")
            try:
                header = json.loads(f.read(n))
            except (json.JSONDecodeError, UnicodeDecodeError):
                raise ValueError(f"{path} is not a safetensors file (header is not JSON)") from None
        header.pop("__metadata__", None)
        self.data_start = 8 + n
        self.entries: dict[str, tuple[torch.dtype, tuple[int, ...], int, int]] = {}
        for name, e in header.items():
            if e.get("dtype") not in _ST_TO_DTYPE:
                raise ValueError(f"tensor {name!r} in {path.name} has dtype {e.get('dtype')}, which is not supported")
            begin, end = e["data_offsets"]
            dtype, shape = _ST_TO_DTYPE[e["dtype"]], tuple(e["shape"])
            if end - begin != _numel(shape) * _itemsize(dtype) or self.data_start + end > size:
                raise ValueError(f"tensor {name!r} in {path.name} has data offsets that do not match its shape")
            self.entries[name] = (dtype, shape, begin, end)
        self._file = None

    def read_into(self, name: str, out: torch.Tensor) -> None:
        """Read tensor `name` straight into `out` (contiguous, same dtype and shape)."""
        if self._file is None:
            self._file = open(self.path, "rb")
        _, _, begin, end = self.entries[name]
        self._file.seek(self.data_start + begin)
        if end > begin:
            buf = out.reshape(-1).view(torch.uint8).numpy()
            done = 0
            while done < buf.size:
                got = self._file.readinto(buf[done:].data)
                if not got:
                    raise ValueError(f"{self.path} ends inside tensor {name!r}")
                done += got

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _shards(folder: Path) -> list[_Shard]:
    """The safetensors files of a folder: those of the sharded index, or the single model.safetensors."""
    index = folder / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            files = sorted(set(weight_map.values()))
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError):
            raise ValueError(f"{index} is not a valid safetensors index (needs a 'weight_map' object)") from None
        for file in files:
            if not (folder / file).is_file():
                raise ValueError(f"{index} lists {file}, which does not exist")
        shards = [_Shard(folder / file) for file in files]
        listed = {name for sh in shards for name in sh.entries}
        for name in weight_map:
            if name not in listed:
                raise ValueError(f"{index} lists tensor {name!r}, which its file {weight_map[name]} does not hold")
        return shards
    single = folder / SINGLE_FILE
    if single.is_file():
        return [_Shard(single)]
    found = sorted(p.name for p in folder.glob("*.bin")) + sorted(p.name for p in folder.glob("*.pt"))
    hint = f" (found {', '.join(found)}: convert them to safetensors first)" if found else ""
    raise ValueError(f"{folder} holds no {SINGLE_FILE} or {INDEX_FILE}{hint}")


class SafetensorsReader:
    """Read tensors one at a time from a Hugging Face folder (single file or sharded index).

    Tensors are read with plain file reads into memory we own, optionally straight into a destination
    tensor (`read_into`), so reading never holds more than the tensor being read, and nothing of the
    files stays mapped into the process.
    """

    def __init__(self, folder: str | Path) -> None:
        self.folder = Path(folder)
        self._shards = _shards(self.folder)
        self._where: dict[str, _Shard] = {}
        for sh in self._shards:
            for name in sh.entries:
                if name in self._where:
                    raise ValueError(f"tensor {name!r} is stored twice ({self._where[name].path.name}, {sh.path.name})")
                self._where[name] = sh

    def __enter__(self) -> SafetensorsReader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        for sh in self._shards:
            sh.close()

    def names(self) -> list[str]:
        return list(self._where)

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def shape(self, name: str) -> tuple[int, ...]:
        return self._where[name].entries[name][1]

    def dtype(self, name: str) -> torch.dtype:
        return self._where[name].entries[name][0]

    def get(self, name: str) -> torch.Tensor:
        """A new tensor holding `name`."""
        out = torch.empty(self.shape(name), dtype=self.dtype(name))
        self._where[name].read_into(name, out)
        return out

    def read_into(self, name: str, out: torch.Tensor) -> None:
        """Fill `out` (same shape) with `name`, converting the dtype if it differs."""
        if tuple(out.shape) != self.shape(name):
            raise ValueError(f"tensor {name!r} has shape {list(self.shape(name))}, not {list(out.shape)}")
        if out.dtype == self.dtype(name) and out.is_contiguous():
            self._where[name].read_into(name, out)
        else:
            out.copy_(self.get(name))


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
