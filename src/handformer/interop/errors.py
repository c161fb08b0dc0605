"""What every converter raises, and the weight check every converter runs."""

from __future__ import annotations

from collections.abc import Iterable

from torch import Tensor

__all__ = ["ConversionError", "check_float_tensors"]


class ConversionError(ValueError):
    """A checkpoint or configuration that does not map onto the other architecture."""


def check_float_tensors(state: dict[str, Tensor], keys: Iterable[str], source: str) -> None:
    """``ConversionError`` for an integer or boolean tensor where a weight belongs: loading
    would cast it into float values silently (a model that prints garbage)."""
    for key in keys:
        if not state[key].is_floating_point():
            raise ConversionError(f"{source}: tensor {key!r} holds "
                                  f"{str(state[key].dtype).removeprefix('torch.')} values "
                                  "where a floating-point weight belongs")
