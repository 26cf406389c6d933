"""User input found wrong while checking the docs against the code.

Numbers written the way users write them (`optim.lr=1e-5`) are numbers, in overrides and recipe files:
PyYAML implements YAML 1.1, where `1e-5` (no dot) is a string; the docs show `optim.lr=1e-5`, and
YAML 1.2 and Python's `float()` read it as a number, which is the reference here.

A router option the model refuses is refused by the config preflight too (one line, exit code 2),
not by a traceback while the model is built.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from moecore.cli import main
from moecore.config import ConfigError, load_config


@pytest.mark.parametrize("text", ["1e-5", "1E-6", "+2.5e-4", "3e2", ".5e-3", "4.e-1"])
def test_override_exponent_without_dot_is_a_float(text: str) -> None:
    cfg = load_config(None, [f"optim.lr={text}"])
    assert isinstance(cfg.optim.lr, float) and cfg.optim.lr == float(text)


def test_recipe_file_and_lists_read_exponents(tmp_path: Path) -> None:
    recipe = tmp_path / "r.yaml"
    recipe.write_text("optim:\n  lr: 1e-4\n  min_lr: 1e-5\nmoe:\n  z_loss_coeff: 1e-3\n")
    cfg = load_config(str(recipe), ["moe.aux_loss_coeff=[1e-2]"])
    assert (cfg.optim.lr, cfg.optim.min_lr, cfg.moe.z_loss_coeff) == (1e-4, 1e-5, 1e-3)
    assert cfg.moe.aux_loss_coeff == [0.01]
    cfg.validate()


def test_non_numbers_stay_strings_and_integers_stay_strict() -> None:
    assert load_config(None, ["train.run_dir=e5"]).train.run_dir == "e5"
    assert load_config(None, ["data.split=98,2,0"]).data.split == "98,2,0"
    with pytest.raises(ConfigError, match="train.steps"):
        load_config(None, ["train.steps=1e3"])  # an integer field does not take a float


def test_unnormalised_softmax_after_topk_is_refused_before_any_work(capsys: pytest.CaptureFixture) -> None:
    # The reason for the refusal: a softmax taken over the k picked logits already sums to one.
    top = torch.randn(5, 8).topk(2, dim=-1).values.softmax(dim=-1)
    torch.testing.assert_close(top.sum(-1), torch.ones(5))
    assert main(["train", "tiny-moe", "moe.norm_topk_prob=false"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("moecore: error: moe.norm_topk_prob=False")
    load_config(None, ["moe.norm_topk_prob=false", "moe.router_pre_softmax=true"]).validate()  # Qwen2-MoE's way


def test_a_folder_named_like_a_recipe_does_not_hide_it(tmp_path: Path, monkeypatch) -> None:
    """A run folder called after its recipe in the working directory: the shipped recipe is still found."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "tiny-moe").mkdir()
    assert load_config("tiny-moe").recipe == "tiny-moe"
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(str(tmp_path / "no-such.yaml"))
