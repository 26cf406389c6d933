"""The layering of the `moecore.config` package: bottom of moecore, torch-free, sections below the root."""

import ast
import json
import subprocess
import sys
from pathlib import Path

import moecore.config

PKG = Path(moecore.config.__file__).parent
SECTIONS = ("errors", "model", "moe", "parallel", "train", "fp8")


def _imports(path: Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
    return out


def test_sections_never_import_root_or_loader():
    for name in SECTIONS:
        mods = _imports(PKG / f"{name}.py")
        moecore_mods = {m for m in mods if m.startswith("moecore")}
        assert moecore_mods <= {"moecore.config.errors"}, (name, moecore_mods)
    assert "moecore.config.loader" not in _imports(PKG / "root.py")


def test_import_pulls_in_no_torch_and_no_other_moecore_module():
    code = "import json, sys, moecore.config; print(json.dumps(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    loaded = [m for m in json.loads(out) if m == "torch" or m.startswith("moecore")]
    assert "torch" not in loaded
    assert all(m == "moecore" or m.startswith("moecore.config") for m in loaded), loaded


def test_every_exported_name_resolves_and_config_error_is_one_class():
    for name in moecore.config.__all__:
        assert getattr(moecore.config, name) is not None, name
    from moecore.config import errors, loader, model

    assert loader.ConfigError is errors.ConfigError is moecore.config.ConfigError
    assert issubclass(moecore.config.ConfigError, ValueError)
    assert model.ModelConfig is moecore.config.ModelConfig
    assert moecore.config.RECIPE_DIR == PKG.parent / "recipes" and moecore.config.RECIPE_DIR.is_dir()
