"""The planner's parameter counts equal the real model's, one process: every shipped recipe on the meta device.

The recipes cover GQA with q/k norm and biases, MLA with and without q LoRA, dense first layers, shared
experts (gated or not), linear-attention layers and multi-token prediction, at their real sizes (meta
tensors allocate nothing). The per-rank counts under tp / ep / etp and the optimizer bytes are checked
on gloo ranks in test_state_bytes_gloo.py.
"""

from __future__ import annotations

import pytest
import torch

from moecore.config import list_recipes, load_config
from moecore.models.transformer import MoETransformer
from moecore.optim.groups import param_groups
from moecore.plan.layout import Layout
from moecore.plan.params import param_entries, stage_layers, total_params


@pytest.mark.parametrize("recipe", list_recipes())
def test_total_and_active_params_match_the_model(recipe: str) -> None:
    cfg = load_config(recipe)
    if cfg.model.vocab_size <= 0:
        cfg.model.vocab_size = 1000
    with torch.device("meta"):
        model = MoETransformer(cfg)
    assert total_params(cfg) == model.num_params()
    decayed = param_groups(model, 0.1)[0]["params"]  # what the optimizer decays (moecore.optim.groups)
    n_decay = sum(p.numel() for p in decayed)
    assert sum(e.numel for e in param_entries(cfg, Layout()) if e.decay and e.trained) == n_decay


def test_stage_layers_split_contiguously_with_the_extra_layers_first() -> None:
    assert [list(r) for r in stage_layers(7, 3)] == [[0, 1, 2], [3, 4], [5, 6]]
    assert [len(r) for r in stage_layers(61, 16)] == [4] * 13 + [3] * 3


def test_pipeline_stages_partition_the_parameters() -> None:
    cfg = load_config("deepseek-v3")
    whole = sum(e.numel for e in param_entries(cfg, Layout()))
    lay = Layout(pp=4, dp=1)
    parts = sum(e.numel for s in range(4) for e in param_entries(cfg, lay, s))
    assert parts == whole
    first = {e.name for e in param_entries(cfg, lay, 0)}
    last = {e.name for e in param_entries(cfg, lay, 3)}
    assert "embed.weight" in first and "lm_head.weight" not in first
    assert "lm_head.weight" in last and any(n.startswith("mtp.") for n in last)
