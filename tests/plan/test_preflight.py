"""train.preflight_memory: warn (default) returns one line, error raises it, off skips; fitting runs pass."""

from __future__ import annotations

import pytest

from moecore.config import ConfigError, load_config
from moecore.plan.preflight import check_memory

GiB = 2**30


def _cfg(mode: str | None = None):
    cfg = load_config("qwen3-30b-a3b", ["model.num_layers=4", "parallel.ep=1"])
    if mode is not None:
        cfg.train.preflight_memory = mode
    return cfg


def test_warn_is_the_default_and_names_the_kinds_and_a_layout() -> None:
    cfg = _cfg()
    assert cfg.train.preflight_memory == "warn"
    msg = check_memory(cfg, 8, 40 * GiB)
    assert msg is not None and "\n" not in msg
    for word in ("params", "grads", "optimizer", "activations", "40.0 GiB", "would pick", "parallel.ep="):
        assert word in msg, msg
    assert check_memory(cfg, 8, 400 * GiB) is None


def test_error_raises_and_off_skips() -> None:
    with pytest.raises(ConfigError, match="memory preflight"):
        check_memory(_cfg("error"), 1, 10 * GiB)
    assert check_memory(_cfg("off"), 1, 10 * GiB) is None
    assert check_memory(_cfg(), 1, None) is None  # no memory size known (CPU)


def test_off_from_the_command_line() -> None:
    cfg = load_config("qwen3-30b-a3b", ["train.preflight_memory=off"]).validate()  # YAML: off -> false
    assert cfg.train.preflight_memory == "off" and check_memory(cfg, 1, 1 * GiB) is None


def test_bad_value_is_refused() -> None:
    with pytest.raises(ConfigError, match="train.preflight_memory"):
        load_config("tiny-moe", ["train.preflight_memory=maybe"]).validate()


@pytest.mark.gpu
@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs CUDA")
def test_trainer_refuses_a_layout_that_cannot_fit_before_building_the_model() -> None:
    import torch

    from moecore.train.loop import Trainer

    cfg = load_config("qwen3-30b-a3b", ["parallel.ep=1", "train.preflight_memory=error", "log.progress=false"])
    torch.cuda.reset_peak_memory_stats()
    with pytest.raises(ConfigError, match="memory preflight"):
        Trainer(cfg)
    assert torch.cuda.max_memory_allocated() < 2**30  # refused before the 30B model was built
