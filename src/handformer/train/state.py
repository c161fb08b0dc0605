"""Trainer state as tensors + JSON: what a checkpoint needs beyond the weights.

Everything is split into a flat ``{name: Tensor}`` dict (saved with safetensors) and plain
JSON data (saved with ``json``), so loading never unpickles anything. The optimizer's own
``state_dict`` is flattened here: its per-parameter tensors become ``optimizer.<id>.<key>``
and its hyper-parameters (param groups) become JSON.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

__all__ = ["TrainerState", "TrainerStateError", "flatten_optimizer", "restore_optimizer"]

_TENSOR_REF = "__tensor__"


class TrainerStateError(ValueError):
    """Saved trainer state that does not fit (a foreign or damaged file)."""


@dataclass
class TrainerState:
    """Tensors for safetensors, ``meta`` for JSON. Both round-trip without pickle."""

    tensors: dict[str, Tensor] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)


def _json_value(value: Any, where: str) -> Any:
    """Optimizer hyper-parameters as JSON: tuples become lists; anything odd is refused."""
    if value is None or isinstance(value, bool | int | str):
        return value
    if isinstance(value, float):
        if not math.isfinite(value):
            raise TypeError(f"{where}: non-finite value {value} cannot be saved as JSON")
        return value
    if isinstance(value, list | tuple):
        return [_json_value(v, where) for v in value]
    raise TypeError(f"{where}: cannot save a {type(value).__name__} as JSON")


def flatten_optimizer(optimizer: torch.optim.Optimizer) -> TrainerState:
    """``optimizer.state_dict()`` → tensors named ``optimizer.<param id>.<key>`` + JSON."""
    sd = optimizer.state_dict()
    tensors: dict[str, Tensor] = {}
    state_meta: dict[str, dict[str, Any]] = {}
    for pid, pstate in sd["state"].items():
        entry: dict[str, Any] = {}
        for key, value in pstate.items():
            if isinstance(value, Tensor):
                name = f"optimizer.{pid}.{key}"
                tensors[name] = value.detach().cpu().contiguous()
                entry[key] = {_TENSOR_REF: name}
            else:
                entry[key] = _json_value(value, f"optimizer state {pid}.{key}")
        state_meta[str(pid)] = entry
    groups = [{k: _json_value(v, f"param group {k}") for k, v in g.items()}
              for g in sd["param_groups"]]
    return TrainerState(tensors, {"state": state_meta, "param_groups": groups})


def restore_optimizer(optimizer: torch.optim.Optimizer, saved: TrainerState) -> None:
    """Inverse of ``flatten_optimizer``; raises ``TrainerStateError`` on anything that does
    not fit this optimizer (wrong parameter count, missing tensors, wrong shapes)."""
    try:
        state: dict[int, dict[str, Any]] = {}
        for pid, entry in saved.meta["state"].items():
            state[int(pid)] = {
                key: saved.tensors[value[_TENSOR_REF]]
                if isinstance(value, dict) else value
                for key, value in entry.items()
            }
        current = optimizer.param_groups
        groups = saved.meta["param_groups"]
        if not isinstance(groups, list) or len(groups) != len(current):
            raise ValueError(f"expected {len(current)} parameter groups; got "
                             f"{len(groups) if isinstance(groups, list) else type(groups)}")
        # JSON turned tuples (AdamW's betas) into lists: give back the optimizer's own types.
        groups = [{k: tuple(v) if isinstance(cur.get(k), tuple) else v for k, v in g.items()}
                  for g, cur in zip(groups, current, strict=True)]
        _check_recipe(groups, current)
        _check_shapes(optimizer, groups, state)
        optimizer.load_state_dict({"state": state, "param_groups": groups})
    except TrainerStateError:
        raise
    except (KeyError, TypeError, ValueError, AttributeError, RuntimeError) as err:
        raise TrainerStateError(f"optimizer state does not fit this model's optimizer: "
                                f"{type(err).__name__}: {err}") from None


# The hyper-parameters a run's recipe (its TrainConfig) sets on each optimizer group. The
# saved ones replace the optimizer's on load, so where they differ the run would train with a
# recipe other than the one it records. (``lr`` itself is set again at every step from
# ``base_lr`` and the schedule.)
RECIPE_KEYS = ("base_lr", "weight_decay", "betas", "eps", "momentum", "nesterov", "ns_steps")


def _check_recipe(saved: list[dict[str, Any]], current: list[dict[str, Any]]) -> None:
    """``TrainerStateError`` naming the first group hyper-parameter whose saved value differs
    from the one the optimizer was built with (from the recorded recipe)."""
    for i, (old, new) in enumerate(zip(saved, current, strict=True)):
        for key in RECIPE_KEYS:
            if key in old and key in new and old[key] != new[key]:
                raise TrainerStateError(
                    f"parameter group {i} was saved with {key}={old[key]!r} but the recorded "
                    f"recipe (config.json) gives {key}={new[key]!r}: the checkpoint's files do "
                    "not belong together, and resuming would train with a recipe other than "
                    "the one it records")


def _check_shapes(optimizer: torch.optim.Optimizer, groups: list[dict[str, Any]],
                  state: dict[int, dict[str, Any]]) -> None:
    """torch would silently load moments of the wrong shape; name the first mismatch."""
    params = [p for g in optimizer.param_groups for p in g["params"]]
    ids = [i for g in groups for i in g["params"]]
    if len(ids) != len(params):
        raise TrainerStateError(f"optimizer state holds {len(ids)} parameters; this model has "
                                f"{len(params)}")
    for pid, param in zip(ids, params, strict=True):
        for key, value in state.get(pid, {}).items():
            if isinstance(value, Tensor) and value.dim() > 0 and value.shape != param.shape:
                raise TrainerStateError(
                    f"optimizer state {pid}.{key} has shape {tuple(value.shape)}; the "
                    f"parameter has shape {tuple(param.shape)}")
