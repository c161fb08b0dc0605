"""Reading fields of a JSON request body, with messages a person can act on.

Every problem with what the page sent (a missing field, a wrong type, a layer that does
not exist) raises ``InputError``; the server turns it into a 400 answer whose message the
page shows. Nothing here touches the model.
"""

from __future__ import annotations

import math
import reprlib
from typing import Any

__all__ = ["InputError", "get_bool", "get_float", "get_int", "get_optional_int", "get_str",
           "get_str_list", "shown"]

_MISSING = object()

_repr = reprlib.Repr()
_repr.maxstring = _repr.maxother = 80
_repr.maxlevel = 3  # a value nested hundreds deep is shown as [[[...]]], never recursed into
_repr.maxlist = _repr.maxdict = 6


def shown(value: Any, limit: int = 80) -> str:
    """``repr(value)`` cut to a readable length (a 60 KB list in a message helps no one, and
    repr of a deeply nested one could itself overflow the stack)."""
    if isinstance(value, str):
        return repr(value) if len(value) <= limit else repr(value[:limit]) + f"… ({len(value)} " \
            "characters)"
    return _repr.repr(value)


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
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as err:  # JSON "\ud800": a lone surrogate is no character
        raise InputError(f"{name!r} holds a lone surrogate ({err.object[err.start]!r} at "
                         f"position {err.start}), which is not a character") from None
    return value


def get_int(body: dict[str, Any], name: str, lo: int, hi: int, default: Any = _MISSING) -> int:
    """An integer in [lo, hi]; the message names the valid range."""
    value = _field(body, name, default)
    if isinstance(value, bool) or not isinstance(value, int):
        raise InputError(f"{name!r} must be an integer; got {shown(value)}")
    if not lo <= value <= hi:
        raise InputError(f"{name!r} must lie in [{lo}, {hi}]; got {shown(value)}")
    return value


def get_optional_int(body: dict[str, Any], name: str, lo: int, hi: int) -> int | None:
    return None if body.get(name) is None else get_int(body, name, lo, hi)


def get_float(body: dict[str, Any], name: str, lo: float, hi: float,
              default: Any = _MISSING) -> float:
    """A finite number in [lo, hi]. JSON's integers count (``1`` for ``1.0``); a huge one is
    refused by the range check, never overflowed into a float."""
    value = _field(body, name, default)
    if isinstance(value, bool) or not isinstance(value, int | float) or (
            isinstance(value, float) and not math.isfinite(value)):
        raise InputError(f"{name!r} must be a finite number; got {shown(value)}")
    if not lo <= value <= hi:  # int vs float compares exactly, whatever the int's size
        raise InputError(f"{name!r} must lie in [{lo}, {hi}]; got {shown(value)}")
    return float(value)


def get_bool(body: dict[str, Any], name: str, default: Any = _MISSING) -> bool:
    value = _field(body, name, default)
    if not isinstance(value, bool):
        raise InputError(f"{name!r} must be true or false; got {shown(value)}")
    return value


def get_str_list(body: dict[str, Any], name: str, max_items: int) -> list[str]:
    value = _field(body, name, _MISSING)
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise InputError(f"{name!r} must be a list of texts; got {shown(value)}")
    if not value:
        raise InputError(f"{name!r} is empty: give at least one")
    if len(value) > max_items:
        raise InputError(f"{name!r} has {len(value)} entries; at most {max_items} are allowed")
    return value
