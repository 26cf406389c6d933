"""Typed, nested run configuration: one small dataclass per section, YAML recipes, dotted overrides.

A run is described by `Config`, whose sections are `model`, `moe`, `parallel`, `optim`, `data`,
`train`, `checkpoint`, `log` and `fp8`. A recipe is a YAML file holding any subset of these sections;
overrides on the command line look like `section.field=value` (lists as `data.paths=[a,b]`).

Every section has a `validate()` that raises `ConfigError` (a `ValueError`) with one line naming the
field, the bad value and what is allowed; `Config.validate()` adds the checks that span sections
(for example `moe.router_topk` <= `moe.num_experts`). Nothing here touches torch or the filesystem
beyond reading YAML, so validation runs before any work starts.

The package's files, lowest first (a file imports only those above it):

- `errors.py`: `ConfigError` and the field checks that raise it
- `model.py`: `ModelConfig` (the `model` section) and `MODEL_FAMILIES`
- `moe.py`: `MoEConfig` (the `moe` section)
- `parallel.py`: `ParallelConfig` (the `parallel` section)
- `train.py`: `OptimConfig`, `DataConfig`, `TrainConfig`, `CheckpointConfig`, `LogConfig`
- `fp8.py`: `FP8Config` (the `fp8` section) and `FP8_MODULES`
- `root.py`: `Config` and the validation rules that span sections (`check_fp8_dims`, ...)
- `loader.py`: recipes (`RECIPE_DIR`, `list_recipes`, `recipe_path`), `load_config`, overrides
  (`parse_override`, `apply_dict`) and `config_from_dict`

Import every name from `moecore.config` itself; the file layout is not part of the interface.
"""

from moecore.config.errors import ConfigError
from moecore.config.fp8 import FP8_MODULES, FP8Config
from moecore.config.loader import (
    DEFAULT_RECIPE,
    RECIPE_DIR,
    apply_dict,
    config_from_dict,
    list_recipes,
    load_config,
    parse_override,
    recipe_path,
)
from moecore.config.model import MODEL_FAMILIES, ModelConfig
from moecore.config.moe import MoEConfig
from moecore.config.parallel import ParallelConfig
from moecore.config.root import Config, check_fp8_dims
from moecore.config.train import CheckpointConfig, DataConfig, LogConfig, OptimConfig, TrainConfig

__all__ = [
    "DEFAULT_RECIPE",
    "FP8_MODULES",
    "MODEL_FAMILIES",
    "RECIPE_DIR",
    "CheckpointConfig",
    "Config",
    "ConfigError",
    "DataConfig",
    "FP8Config",
    "LogConfig",
    "ModelConfig",
    "MoEConfig",
    "OptimConfig",
    "ParallelConfig",
    "TrainConfig",
    "apply_dict",
    "check_fp8_dims",
    "config_from_dict",
    "list_recipes",
    "load_config",
    "parse_override",
    "recipe_path",
]
