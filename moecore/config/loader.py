"""Building a `Config` from a YAML recipe and `section.field=value` overrides.

A recipe is a shipped name (`moecore/recipes/<name>.yaml`) or a path to a YAML file holding any
subset of the sections; overrides are parsed as YAML scalars or lists (`data.paths=[a,b]`) and
checked against each field's declared type before `Config.validate()` runs.
"""

from __future__ import annotations

import dataclasses
import re
import types
import typing
from pathlib import Path
from typing import Any

import yaml

from moecore.config.errors import ConfigError, _fail
from moecore.config.root import Config

RECIPE_DIR = Path(__file__).parent.parent / "recipes"  # moecore/recipes, beside this package
DEFAULT_RECIPE = "tiny-moe"


class _YamlLoader(yaml.SafeLoader):
    """PyYAML's safe loader that also reads `1e-5` as a number: YAML 1.1 (PyYAML) wants `1.0e-5`, YAML 1.2 not."""


_YamlLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float", re.compile(r"^[-+]?(?:[0-9]+\.?[0-9]*|\.[0-9]+)[eE][-+]?[0-9]+$"), list("-+.0123456789")
)


def _yaml_load(text: str) -> Any:
    return yaml.load(text, Loader=_YamlLoader)


def list_recipes() -> list[str]:
    return sorted(p.stem for p in RECIPE_DIR.glob("*.yaml"))


def recipe_path(name_or_path: str) -> Path:
    """A recipe name (shipped with the package) or a path to a YAML file."""
    p = Path(name_or_path)
    shipped = RECIPE_DIR / f"{name_or_path}.yaml"
    if p.is_dir() and shipped.is_file():  # e.g. a run folder named after its recipe: the name wins
        return shipped
    if p.suffix in (".yaml", ".yml") or p.exists():
        if not p.is_file():
            raise ConfigError(f"recipe file {name_or_path!r} does not exist")
        return p
    if not shipped.is_file():
        raise ConfigError(
            f"recipe {name_or_path!r} is not a shipped recipe or a YAML file; shipped: {', '.join(list_recipes())}"
        )
    return shipped


def _field_types(cls: type) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def _coerce(name: str, value: Any, typ: Any) -> Any:
    """Convert a YAML/CLI value to the field's declared type, or raise ConfigError."""
    if typ is Any:
        return value
    origin = typing.get_origin(typ)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(typ)
        if value is None and type(None) in args:
            return None
        errors = []
        for a in args:
            if a is type(None):
                continue
            try:
                return _coerce(name, value, a)
            except ConfigError as e:
                errors.append(e)
        allowed = " or ".join(getattr(a, "__name__", str(a)) for a in args)
        _fail(name, value, f"expected {allowed}")
    if typ is bool:
        if isinstance(value, bool):
            return value
        _fail(name, value, "expected true or false")
    if typ is int:
        if isinstance(value, bool) or not isinstance(value, int):
            _fail(name, value, "expected an integer")
        return value
    if typ is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            _fail(name, value, "expected a number")
        return float(value)
    if typ is str:
        if not isinstance(value, str):
            _fail(name, value, "expected a string")
        return value
    if typ is list or origin is list:
        if not isinstance(value, list):
            _fail(name, value, "expected a list, e.g. [a,b]")
        return value
    if typ is dict or origin is dict:
        if not isinstance(value, dict):
            _fail(name, value, "expected a mapping, e.g. {type: yarn, factor: 4}")
        return value
    return value


def _apply_section(section_obj: Any, section: str, values: dict) -> None:
    if not isinstance(values, dict):
        raise ConfigError(f"{section}={values!r} is invalid: expected a mapping of fields")
    types_ = _field_types(type(section_obj))
    for key, val in values.items():
        if key not in types_:
            close = ", ".join(sorted(types_))
            raise ConfigError(f"{section}.{key} is not a known field; fields of {section}: {close}")
        setattr(section_obj, key, _coerce(f"{section}.{key}", val, types_[key]))


def apply_dict(cfg: Config, data: dict, source: str = "recipe") -> Config:
    """Merge a nested mapping (a parsed recipe) into cfg."""
    if data is None:
        return cfg
    if not isinstance(data, dict):
        raise ConfigError(f"{source} must be a mapping of sections ({', '.join(Config.SECTIONS)})")
    for section, values in data.items():
        if section == "recipe":
            cfg.recipe = str(values)
            continue
        if section == "description":  # a recipe's one-line summary, shown by `moecore recipes`
            continue
        if section not in Config.SECTIONS:
            raise ConfigError(
                f"{section!r} in {source} is not a config section; sections: {', '.join(Config.SECTIONS)}"
            )
        _apply_section(getattr(cfg, section), section, values or {})
    return cfg


def parse_override(text: str) -> tuple[str, str, Any]:
    """`section.field=value` -> (section, field, parsed value). Values are parsed as YAML scalars/lists."""
    if "=" not in text:
        raise ConfigError(f"override {text!r} is invalid: expected section.field=value")
    key, raw = text.split("=", 1)
    parts = key.strip().split(".")
    if len(parts) != 2 or not all(parts):
        raise ConfigError(f"override {text!r} is invalid: expected section.field=value, e.g. train.steps=100")
    section, name = parts
    if section not in Config.SECTIONS:
        raise ConfigError(
            f"{section!r} in override {text!r} is not a config section; sections: {', '.join(Config.SECTIONS)}"
        )
    try:
        value = _yaml_load(raw) if raw.strip() != "" else None
    except yaml.YAMLError:
        value = raw  # fall back to the raw string; the field's type check decides
    if isinstance(value, list):
        # `[a,b]` parses as strings already; keep numbers as numbers.
        value = [v for v in value]
    return section, name, value


def load_config(recipe: str | None = None, overrides: list[str] | tuple = ()) -> Config:
    """Build a Config from a recipe (name or path; None: the default tiny recipe) and overrides."""
    name = recipe or DEFAULT_RECIPE
    path = recipe_path(name)
    try:
        data = _yaml_load(path.read_text())
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" (line {mark.line + 1})" if mark is not None else ""
        raise ConfigError(f"recipe file {str(path)!r} is not valid YAML{where}") from None
    except OSError as e:
        raise ConfigError(f"recipe file {str(path)!r} cannot be read: {e.strerror}") from None
    cfg = Config(recipe=path.stem)
    apply_dict(cfg, data or {}, source=str(path))
    for ov in overrides:
        section, fname, value = parse_override(ov)
        _apply_section(getattr(cfg, section), section, {fname: value})
    return cfg


def config_from_dict(data: dict) -> Config:
    """Rebuild a Config from `Config.to_dict()` output (e.g. a run folder's config.yaml)."""
    cfg = Config()
    apply_dict(cfg, data)
    return cfg
