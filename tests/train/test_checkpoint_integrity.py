"""Checkpoint integrity: the manifest, `moecore checkpoint verify`, falling back past corrupt checkpoints on
resume, refusing a corrupt `checkpoint.load`, and the resume cases that get one line.

One uninterrupted 6-step run (checkpoint every step) is the reference; copies of its folder are damaged.
"""

from __future__ import annotations

import json
import shutil

import pytest
from reliability_common import TINY, flip_byte, truncate

from moecore.checkpoint.manifest import MANIFEST
from moecore.cli import main
from moecore.config import load_config
from moecore.train.loop import train


def _cfg(run_dir, *extra):
    return load_config("tiny-moe", [*TINY, f"train.run_dir={run_dir}", *extra])


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    run = tmp_path_factory.mktemp("ref") / "run"
    result = train(_cfg(run, "train.steps=6", "checkpoint.interval=1"))
    return run, dict(result.losses)


def _copy(reference, tmp_path, upto: int):
    """The reference run folder as it was after step `upto` (later checkpoints removed)."""
    run = tmp_path / "run"
    shutil.copytree(reference[0], run)
    for step in range(upto + 1, 7):
        shutil.rmtree(run / "checkpoints" / f"step-{step}")
    return run


def test_manifest_lists_every_file(reference):
    ckpt = reference[0] / "checkpoints" / "step-6"
    manifest = json.loads((ckpt / MANIFEST).read_text())
    on_disk = sorted(p.name for p in ckpt.iterdir() if p.name not in (MANIFEST, "complete"))
    assert sorted(manifest["files"]) == on_disk
    assert manifest["step"] == 6 and manifest["layout"]["world_size"] == 1
    assert {"moecore", "torch"} <= set(manifest)
    assert all(len(f["sha256"]) == 64 and f["size"] > 0 for f in manifest["files"].values())


@pytest.mark.parametrize("damage", ["flip", "truncate", "delete"])
def test_resume_skips_a_damaged_newest_checkpoint(reference, tmp_path, capsys, damage):
    run = _copy(reference, tmp_path, upto=4)
    data = run / "checkpoints" / "step-4" / "__0_0.distcp"
    {"flip": flip_byte, "truncate": truncate, "delete": lambda p: p.unlink()}[damage](data)
    assert main(["checkpoint", "verify", str(run / "checkpoints" / "step-4")]) == 1
    err = capsys.readouterr().err
    assert "__0_0.distcp" in err and len(err.strip().splitlines()) == 1

    resumed = train(_cfg(run, "train.steps=6", "checkpoint.resume=true"))
    err = capsys.readouterr().err
    assert "warning: checkpoint step-4 skipped" in err and "__0_0.distcp" in err
    assert "resuming from" in err and "step-3" in err
    want = reference[1]
    assert dict(resumed.losses) == {s: want[s] for s in (4, 5, 6)}  # bit-exact from step 3's checkpoint


def test_resume_skips_an_interrupted_save(reference, tmp_path, capsys):
    run = _copy(reference, tmp_path, upto=3)
    partial = run / "checkpoints" / "step-4.tmp"
    shutil.copytree(reference[0] / "checkpoints" / "step-4", partial)
    (partial / "complete").unlink()
    (partial / MANIFEST).unlink()
    resumed = train(_cfg(run, "train.steps=6", "train.exit_interval=5", "checkpoint.resume=true"))
    assert "checkpoint step-4.tmp skipped: an interrupted save" in capsys.readouterr().err
    assert dict(resumed.losses) == {s: reference[1][s] for s in (4, 5)}


def test_corrupt_checkpoint_load_is_refused(reference, tmp_path, capsys):
    run = _copy(reference, tmp_path, upto=2)
    flip_byte(run / "checkpoints" / "step-2" / "rank-0.pt")
    code = main(["train", "tiny-moe", *TINY, "train.steps=1", f"train.run_dir={tmp_path / 'new'}",
                 f"checkpoint.load={run / 'checkpoints' / 'step-2'}"])  # fmt: skip
    err = capsys.readouterr().err
    assert code == 2
    assert err.strip().splitlines()[-1].startswith("moecore: error: checkpoint.load=")
    assert "rank-0.pt does not match its sha256" in err and "Traceback" not in err


def test_checkpoint_without_manifest_still_loads_with_a_note(reference, tmp_path, capsys):
    run = _copy(reference, tmp_path, upto=5)
    (run / "checkpoints" / "step-5" / MANIFEST).unlink()  # as written before manifests existed
    assert main(["checkpoint", "verify", str(run)]) == 0
    assert "no manifest" in capsys.readouterr().out
    resumed = train(_cfg(run, "train.steps=6", "checkpoint.resume=true"))
    assert dict(resumed.losses) == {6: reference[1][6]}


def test_verify_cli(reference, capsys):
    assert main(["checkpoint", "verify", str(reference[0] / "checkpoints" / "step-6")]) == 0
    assert "ok (4 files verified, step 6)" in capsys.readouterr().out
    assert main(["checkpoint", "verify", str(reference[0] / "nope")]) == 2


def test_resume_edge_cases(reference, tmp_path, capsys):
    run = _copy(reference, tmp_path, upto=4)
    base = ["train", "tiny-moe", *TINY, f"train.run_dir={run}", "checkpoint.resume=true"]
    assert main([*base, "train.steps=6", "train.exit_interval=3"]) == 2
    err = capsys.readouterr().err
    assert "train.exit_interval=3 is invalid: the run resumes after step 4" in err and "Traceback" not in err
    assert main([*base, "train.steps=4"]) == 0
    assert "is complete (step-4, train.steps=4); nothing to train" in capsys.readouterr().err
    assert main([*base, "train.steps=6", "model.hidden_size=64"]) == 2
    err = capsys.readouterr().err
    assert "does not fit this model" in err and "model.hidden_size 32 -> 64" in err and "Traceback" not in err
