"""The start of `moecore train`: a short summary (model, parameters, layout, batch, precision, run folder);
the full resolved config goes to the run folder only."""

from __future__ import annotations

import yaml
from reliability_common import TINY

from moecore.cli import main
from moecore.config import load_config
from moecore.models.transformer import MoETransformer
from moecore.train.summary import global_param_counts


def test_summary_lines_and_full_config_in_run_folder(tmp_path, capsys):
    run = tmp_path / "run"
    assert main(["train", "tiny-moe", *TINY, "train.steps=1", f"train.run_dir={run}"]) == 0
    err = capsys.readouterr().err
    cfg = load_config("tiny-moe", [*TINY, "model.vocab_size=4096"])
    total, active = global_param_counts(MoETransformer(cfg), cfg)
    assert total == sum(p.numel() for p in MoETransformer(cfg).parameters()) and active < total
    lines = [
        line for line in err.splitlines() if line.split(" ", 1)[0] in ("model", "layout", "batch", "precision", "run")
    ]
    assert len(lines) == 5, err
    assert f"{total / 1e3:.2f}K parameters" in lines[0] and "4 experts top-2" in lines[0]
    assert "tp1 pp1 cp1 ep1 etp1 dp1" in lines[1] and "4 sequences x 16 tokens" in lines[2]
    assert lines[3].startswith("precision fp32; seed 1234") and str(run) in lines[4]
    assert "family: moecore" not in err  # the YAML is not printed ...
    assert yaml.safe_load((run / "config.yaml").read_text())["model"]["family"] == "moecore"  # ... it is saved
