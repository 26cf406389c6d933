"""Checkpoint integrity: a manifest of every file of a checkpoint folder, written last, and its check.

`manifest.json` lists each file of the folder (relative name, size in bytes, sha256), the training
step, the parallel layout that wrote it and the moecore / torch versions. It is written after every
data file is on disk (fsynced) and just before the `complete` marker, so a folder with a manifest
is a folder whose data was fully written; any later change to a file (a flipped byte, a truncated
or deleted file) is found by `verify_checkpoint`, which names the first bad file in one line.

Hashing is spread over the ranks (`hash_files(..., rank, world)`: rank r hashes every world-th
file), so the time to check a checkpoint does not grow with the number of ranks that wrote it.

Folders written before manifests existed (only `complete`) still load: `verify_checkpoint` reports
them as unverified with a note instead of failing.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

MANIFEST = "manifest.json"
COMPLETE = "complete"
FORMAT = 1
_CHUNK = 8 << 20  # bytes read at a time while hashing


@dataclass
class Verification:
    """The outcome of `verify_checkpoint`: ok, or the one-line reason it is not; `note` for unverified folders."""

    path: Path
    ok: bool
    reason: str = ""
    note: str = ""
    manifest: dict | None = None

    def message(self) -> str:
        if not self.ok:
            return f"checkpoint {str(self.path)!r} is unusable: {self.reason}"
        return f"checkpoint {str(self.path)!r}: " + (self.note or "ok")


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def data_files(folder: Path) -> list[str]:
    """Every file of a checkpoint folder that the manifest covers (all but the manifest and the marker), sorted."""
    folder = Path(folder)
    names = [p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()]
    return sorted(n for n in names if n not in (MANIFEST, COMPLETE))


def hash_files(folder: Path, names: list[str], rank: int = 0, world: int = 1) -> dict[str, dict]:
    """{name: {size, sha256}} for this rank's share of `names` (every world-th, starting at rank)."""
    out = {}
    for name in names[rank::world]:
        p = Path(folder) / name
        out[name] = {"size": p.stat().st_size, "sha256": sha256_file(p)}
    return out


def fsync(path: Path) -> None:
    """Flush a file (or folder) to stable storage."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _versions() -> dict:
    import torch

    import moecore

    return {"moecore": moecore.__version__, "torch": torch.__version__}


def write_manifest(folder: Path, files: dict[str, dict], step: int | None, layout: dict | None = None) -> Path:
    """Write `manifest.json` then `complete` into `folder` (one process), each fsynced; returns the manifest path.

    `files` is the merged output of `hash_files` over all ranks; the data files are fsynced here too,
    so that the manifest never describes bytes that are still only in the page cache.
    """
    folder = Path(folder)
    for name in files:
        fsync(folder / name)
    body = {
        "format": FORMAT,
        "step": step,
        "layout": layout or {},
        **_versions(),
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "files": dict(sorted(files.items())),
    }
    path = folder / MANIFEST
    path.write_text(json.dumps(body, indent=1) + "\n")
    fsync(path)
    (folder / COMPLETE).write_text("ok\n")
    fsync(folder / COMPLETE)
    fsync(folder)
    return path


def read_manifest(folder: Path) -> dict | None:
    path = Path(folder) / MANIFEST
    if not path.is_file():
        return None
    return json.loads(path.read_text())


def verify_checkpoint(folder: Path, rank: int = 0, world: int = 1, hashes: bool = True) -> Verification:
    """Check `folder` against its manifest: every file present with its size and (`hashes`) its sha256.

    With world > 1 this rank hashes only its share of the files; combine the ranks' results with
    `merge_verifications`. Never raises for a bad checkpoint: the Verification says what is wrong.
    """
    folder = Path(folder)
    if not folder.is_dir():
        return Verification(folder, False, "no such folder")
    try:
        manifest = read_manifest(folder)
    except (OSError, ValueError) as e:
        return Verification(folder, False, f"{MANIFEST} cannot be read ({e.__class__.__name__}: {e})")
    if manifest is None:
        if not (folder / COMPLETE).exists() and not (folder / ".metadata").exists():
            return Verification(
                folder, False, f"not a moecore checkpoint folder (no {MANIFEST}, .metadata or {COMPLETE})"
            )
        if not (folder / COMPLETE).exists():
            return Verification(folder, False, "incomplete (no manifest and no 'complete' marker: an interrupted save)")
        if not (folder / ".metadata").exists():
            return Verification(folder, False, "not a moecore checkpoint folder (no .metadata)")
        return Verification(folder, True, note="no manifest (written by an older moecore): files not verified")
    if not isinstance(manifest, dict) or not isinstance(manifest.get("files"), dict):
        return Verification(folder, False, f"{MANIFEST} is malformed (no 'files' table)")
    names = sorted(manifest["files"])
    for name in names:  # sizes first, on every rank: cheap, and catches missing and truncated files
        p = folder / name
        want = manifest["files"][name]
        if not p.is_file():
            return Verification(folder, False, f"file {name} is missing")
        size = p.stat().st_size
        if size != want.get("size"):
            return Verification(folder, False, f"file {name} has {size} bytes, the manifest says {want.get('size')}")
    if hashes:
        for name in names[rank::world]:
            if sha256_file(folder / name) != manifest["files"][name].get("sha256"):
                return Verification(folder, False, f"file {name} does not match its sha256 in {MANIFEST} (corrupt)")
    if not (folder / COMPLETE).exists():
        return Verification(folder, False, "incomplete (manifest without the 'complete' marker)")
    step = manifest.get("step")
    note = f"ok ({len(names)} files verified" + (f", step {step}" if step is not None else "") + ")"
    return Verification(folder, True, note=note, manifest=manifest)


def merge_verifications(results: list[Verification]) -> Verification:
    """One verdict from every rank's share: the first failure, else the first result."""
    for r in results:
        if not r.ok:
            return r
    return results[0]
