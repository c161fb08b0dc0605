"""Reading fields of a JSON request body, with messages a person can act on.

Every problem with what the page sent (a missing field, a wrong type, a layer that does
not exist) raises ``InputError``; the server turns it into a 400 answer whose message the
page shows. Nothing here touches the model.
"""

from __future__ import annotations

import math
from typing import Any

__all__ = ["InputError", "get_bool", "get_float", "get_int", "get_optional_int", "get_str",
           "get_str_list"]

_MISSING = object()


class InputError(ValueError):
    """Bad input from the page (or an API client): shown to the person, never a traceback."""


def _field(body: dict[str, Any], name: str, default: Any) -> Any:
    value = body.get(name, default)
    if value is _MISSING:
        raise InputError(f"missing field {name!r} in the request")
    return value


def get_str(body: dict[str, Any], name: str, default: Any = _MISSING) -> str:
    value = _field(body, name, default)
    if not isinstance(value, str):
        raise InputError(f"{name!r} must be text; got {type(value).__name__}")
    return value


def get_int(body: dict[str, Any], name: str, lo: int, hi: int, default: Any = _MISSING) -> int:
    """An integer in [lo, hi]; the message names the valid range."""
    value = _field(body, name, default)
    if isinstance(value, bool) or not isinstance(value, int):
        raise InputError(f"{name!r} must be an integer; got {value!r}")
    if not lo <= value <= hi:
        raise InputError(f"{name!r} must lie in [{lo}, {hi}]; got {value}")
    return value


def get_optional_int(body: dict[str, Any], name: str, lo: int, hi: int) -> int | None:
    return None if body.get(name) is None else get_int(body, name, lo, hi)


def get_float(body: dict[str, Any], name: str, lo: float, hi: float,
              default: Any = _MISSING) -> float:
    value = _field(body, name, default)
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise InputError(f"{name!r} must be a number; got {value!r}")
    if not lo <= value <= hi:
        raise InputError(f"{name!r} must lie in [{lo}, {hi}]; got {value}")
    return float(value)


def get_bool(body: dict[str, Any], name: str, default: Any = _MISSING) -> bool:
    value = _field(body, name, default)
    if not isinstance(value, bool):
        raise InputError(f"{name!r} must be true or false; got {value!r}")
    return value


def get_str_list(body: dict[str, Any], name: str, max_items: int) -> list[str]:
    value = _field(body, name, _MISSING)
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise InputError(f"{name!r} must be a list of texts")
    if not value:
        raise InputError(f"{name!r} is empty: give at least one")
    if len(value) > max_items:
        raise InputError(f"{name!r} has {len(value)} entries; at most {max_items} are allowed")
    return value
