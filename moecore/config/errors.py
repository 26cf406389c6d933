"""`ConfigError` and the small checks every section's `validate()` uses to raise it.

Each check raises one line naming the field, the bad value and what is allowed, e.g.
`moe.router_topk=9 is invalid: must be in [1, 8]`.
"""

from __future__ import annotations

from typing import Any


class ConfigError(ValueError):
    """Invalid user input. The message is one line meant to be shown as is (CLI exit code 2)."""


def _fail(name: str, value: Any, allowed: str) -> None:
    raise ConfigError(f"{name}={value!r} is invalid: {allowed}")


def _check_choice(name: str, value: Any, choices: tuple) -> None:
    if value not in choices:
        _fail(name, value, "allowed: " + " | ".join(str(c) for c in choices))


def _check_range(name: str, value: float | int | None, lo: float | None = None, hi: float | None = None) -> None:
    if value is None:
        return
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        lo_s = "-inf" if lo is None else str(lo)
        hi_s = "inf" if hi is None else str(hi)
        _fail(name, value, f"must be in [{lo_s}, {hi_s}]")
