"""Bad input on the command line: one line naming the field or file, exit code 2, no traceback."""

from __future__ import annotations

import subprocess
import sys

import pytest

from moecore.cli import main

BAD = [
    # (argv after `moecore`, a word the one-line error must contain)
    (["train", "tiny-moe", "foo.bar=1"], "foo"),
    (["train", "tiny-moe", "model.nope=1"], "model.nope"),
    (["train", "tiny-moe", "train.steps=abc"], "train.steps"),
    (["train", "tiny-moe", "checkpoint.resume=maybe"], "checkpoint.resume"),
    (["train", "tiny-moe", "train.steps=0"], "train.steps"),
    (["train", "tiny-moe", "moe.router_topk=9"], "moe.router_topk"),
    (["train", "tiny-moe", "parallel.ep=3"], "parallel.ep"),
    (["train", "no-such-recipe"], "no-such-recipe"),
    (["train", "tiny-moe", "checkpoint.resume=true", "train.run_dir=/nonexistent/run"], "train.run_dir"),
    (["train", "tiny-moe", "checkpoint.resume=true"], "train.run_dir"),
    (["train", "tiny-moe", "moe.router_score_function=relu"], "moe.router_score_function"),
    (["train", "tiny-moe", "optim.schedule=foo"], "optim.schedule"),
    (["train", "tiny-moe", "train.global_batch_size=10", "train.micro_batch_size=4"], "train.global_batch_size"),
    (["train", "tiny-moe", "model.num_kv_heads=3"], "model.num_kv_heads"),
    (["train", "tiny-moe", "data.weights=[1]"], "data.weights"),
    (["train", "tiny-moe", "data.split=1,2"], "data.split"),
    (["train", "tiny-moe", "moe.token_drop_policy=random"], "moe.token_drop_policy"),
    (["train", "tiny-moe", "optim.lr=-1"], "optim.lr"),
    (["train", "tiny-moe", "train.steps"], "train.steps"),
    (["train", "tiny-moe", "checkpoint.load=/nonexistent/ckpt"], "checkpoint.load"),
    (["train", "tiny-moe", "moe.router_num_groups=3", "moe.router_group_topk=1"], "moe.router_num_groups"),
    (["train", "tiny-moe", "moe.aux_loss_coeff=[0.1,0.2]"], "moe.aux_loss_coeff"),
    (["train", "tiny-moe", "parallel.tp=3"], "parallel.tp"),
    (["train", "tiny-moe", "model.rope_scaling={type: ntk}"], "model.rope_scaling"),
    (["train", "tiny-moe", "train.exit_interval=500"], "train.exit_interval"),
    (["train", "tiny-moe", "parallel.pp=2"], "parallel"),
    (["train", "tiny-moe", "parallel.cp=2"], "parallel.cp"),
    (["train", "tiny-moe", "parallel.cp_comm=p2p"], "parallel.cp_comm"),
    (["train", "tiny-moe", "moe.layer_freq=[1,0]"], "moe.layer_freq"),
    (["train", "tiny-moe", "model.recompute_modules=[attention]"], "model.recompute_modules"),
]


@pytest.mark.parametrize("argv,word", BAD, ids=[" ".join(a[2:]) or a[1] for a, _ in BAD])
def test_bad_input_one_line_exit_2(argv, word, capsys):
    code = main(argv)
    err = capsys.readouterr().err.strip()
    assert code == 2
    lines = err.splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("moecore: error:")
    assert word in lines[0]
    assert "Traceback" not in err


def test_unreadable_yaml(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: [\n  hidden_size: 4\n")
    assert main(["train", str(bad)]) == 2
    err = capsys.readouterr().err.strip()
    assert "bad.yaml" in err and "YAML" in err and len(err.splitlines()) == 1


def test_unknown_section_in_recipe(tmp_path, capsys):
    bad = tmp_path / "r.yaml"
    bad.write_text("modle:\n  hidden_size: 4\n")
    assert main(["train", str(bad)]) == 2
    assert "'modle'" in capsys.readouterr().err


def test_subprocess_exit_code_and_no_traceback():
    """The real entry point, as a user runs it."""
    proc = subprocess.run(
        [sys.executable, "-m", "moecore", "train", "tiny-moe", "moe.router_topk=20"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [proc.stderr.strip()]
    assert "moe.router_topk=20" in proc.stderr and "Traceback" not in proc.stderr
