"""A safetensors file checked against a module from its header, before any tensor is read.

``safetensors.torch.load_model`` copies each stored tensor into the module's with
``copy_``, which casts silently: an ``int64`` tensor becomes float "weights" (the model then
prints garbage), and a shape mismatch is only found tensor by tensor, after the module —
however large its config says it is — has been allocated. ``check_tensor_file`` reads just
the header (names, dtypes, shapes; ``safetensors.safe_open``) and compares it with a module,
which may live on the ``meta`` device (built from a config without allocating a byte):

* every tensor the module needs is stored (tied weights — ``tie_weights`` — are stored once,
  under any one of their names) and nothing else is;
* every stored tensor has the module's shape, and a floating dtype where the module holds
  floats (fp16/bf16 files load into fp32 modules; integers and booleans never do), and
  exactly the integer dtype where it holds integers (int8 quantized weights: I64 would wrap).

Errors name the file, the tensor, what was expected and what was found, and — given the
config's integer fields — which field the differing size is (``vocab_size=37?``).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors import safe_open
from torch import Tensor, nn

__all__ = ["TensorFileError", "check_tensor_file", "read_header"]

# safetensors' dtype names that hold floating-point values
_FLOAT_DTYPES = {"F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2", "F8_E4M3FNUZ",
                 "F8_E5M2FNUZ", "F8_E8M0", "F6_E2M3", "F6_E3M2", "F4"}
# safetensors' names of the integer dtypes a module may hold (int8 quantized weights):
# those must match exactly, since copying I64 into I8 wraps values silently.
_INT_DTYPES = {torch.int8: "I8", torch.uint8: "U8", torch.int16: "I16", torch.int32: "I32",
               torch.int64: "I64", torch.bool: "BOOL"}
_LAYER = re.compile(r"(?:^|\.)blocks\.(\d+)\.")


class TensorFileError(ValueError):
    """A weights file that does not fit the module it is meant for. ``str()`` is
    ``"PATH: does not fit the model: DETAIL"``; ``path`` and ``detail`` are kept apart for
    callers that phrase it their own way."""

    def __init__(self, path: str | Path, detail: str) -> None:
        super().__init__(f"{path}: does not fit the model: {detail}")
        self.path, self.detail = Path(path), detail


def read_header(path: str | Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    """name → (safetensors dtype name such as ``"F32"``, shape), reading the header only."""
    try:
        with safe_open(str(path), framework="pt") as f:
            return {name: (f.get_slice(name).get_dtype(), tuple(f.get_slice(name).get_shape()))
                    for name in f.keys()}  # noqa: SIM118 (safe_open is not a dict)
    except FileNotFoundError:
        raise TensorFileError(path, "the file is missing") from None
    except Exception as err:  # safetensors raises several types on foreign or torn bytes
        raise TensorFileError(path, f"not a readable safetensors file "
                                    f"({type(err).__name__}: {err})") from None


def _tied_groups(module: nn.Module) -> list[list[str]]:
    """Names of the module's tensors, grouped where several names share one tensor."""
    groups: dict[int, list[str]] = {}
    for name, tensor in module.state_dict(keep_vars=True).items():
        groups.setdefault(id(tensor), []).append(name)
    return list(groups.values())


def _field_hint(expected: tuple[int, ...], found: tuple[int, ...],
                fields: Mapping[str, int]) -> str:
    """`` — vocab_size=37?`` for the config fields equal to a size that differs."""
    if len(expected) != len(found):
        return ""
    names = sorted({name for e, f in zip(expected, found, strict=True) if e != f
                    for name, value in fields.items() if value == e})
    return f" (config: {', '.join(f'{n}={fields[n]}' for n in names)}?)" if names else ""


def _layers(names: object) -> str:
    found = sorted({int(m.group(1)) for n in names if (m := _LAYER.search(str(n)))})
    return f"{len(found)} layer(s)" if found else "no layers"


def _names_hint(names: list[str], header: Mapping[str, object],
                expected: Mapping[str, object]) -> str:
    """Which config field the missing/unexpected names point at."""
    hints = []
    if any(_LAYER.search(n) for n in names):
        hints.append(f"n_layers: the file holds {_layers(header)}, the config "
                     f"{_layers(expected)}")
    if any("lm_head" in n for n in names):
        hints.append("tie_weights: a tied head is stored once, under the embedding's name")
    return f" ({'; '.join(hints)})" if hints else ""


def check_tensor_file(module: nn.Module, path: str | Path, *,
                      fields: Mapping[str, int] | None = None) -> None:
    """``TensorFileError`` unless the file at ``path`` holds exactly the tensors ``module``
    needs, with its shapes and a compatible dtype. ``fields`` (a config's integer fields,
    e.g. ``{"vocab_size": 37, "d_model": 32}``) only sharpen the messages."""
    header = read_header(path)
    fields = dict(fields or {})
    expected: dict[str, Tensor] = dict(module.state_dict(keep_vars=True))
    missing, doubled = [], []
    for group in _tied_groups(module):
        stored = [name for name in group if name in header]
        if not stored:
            missing.append(group[0])
        elif len(stored) > 1:
            doubled.append(stored)
    unexpected = sorted(set(header) - set(expected))
    if missing or unexpected:
        parts = [f"{what} {sorted(names)[:6]}{'…' if len(names) > 6 else ''}"
                 for what, names in (("missing", missing), ("unexpected", unexpected)) if names]
        raise TensorFileError(
            path, f"it does not hold the tensors the config describes: {', '.join(parts)}"
                  f"{_names_hint(missing + unexpected, header, expected)}")
    if doubled:
        raise TensorFileError(
            path, f"it stores {doubled[0]} separately, but the config ties them into one "
            "tensor (tie_weights=true); loading would keep one and silently drop the other")
    for name, (dtype, shape) in header.items():
        want = expected[name]
        if tuple(want.shape) != shape:
            raise TensorFileError(
                path, f"tensor {name!r} has shape {shape} but the config needs "
                f"{tuple(want.shape)}{_field_hint(tuple(want.shape), shape, fields)}")
        if want.is_floating_point() and dtype not in _FLOAT_DTYPES:
            raise TensorFileError(
                path, f"tensor {name!r} holds {dtype} values where a floating-point "
                f"weight ({str(want.dtype).removeprefix('torch.')}) belongs; casting them "
                "would load garbage weights")
        if not want.is_floating_point() and dtype != _INT_DTYPES.get(want.dtype, dtype):
            raise TensorFileError(path, f"tensor {name!r} holds {dtype} values where "
                                        f"{want.dtype} belongs")
