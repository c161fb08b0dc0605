"""Step 1 of the tutorial's order: does the forward pass run, and are the logits (B, T, V)?

Forward hooks on every module record input and output shapes and parameter counts, so when
the pass fails the report names the innermost module that was running — the place to start
printing shapes.

Shape legend: ``B`` batch, ``T`` sequence, ``V`` vocabulary.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from handformer.doctor.report import CheckResult, ModuleRow, Status, guarded
from handformer.doctor.subject import Subject
from handformer.loss import IGNORE_INDEX

__all__ = ["check_batch", "check_forward"]

SECTION = "shapes"


def _first_tensor(value: Any) -> Tensor | None:
    if isinstance(value, Tensor):
        return value
    if isinstance(value, (tuple, list)):
        for item in value:
            found = _first_tensor(item)
            if found is not None:
                return found
    if isinstance(value, dict):
        return _first_tensor(list(value.values()))
    return None


def _shape_of(value: Any) -> list[int] | None:
    t = _first_tensor(value)
    return None if t is None else list(t.shape)


@guarded(SECTION, "batch", "a batch is ids (B, T) long, targets (B, T) long with "
         "IGNORE_INDEX=-100 where nothing is predicted, padding_mask (B, T) bool or None")
def check_batch(subject: Subject) -> CheckResult:
    """The batches themselves: dtypes, shapes and id ranges, before any model runs."""
    problems: list[str] = []
    v = subject.vocab_size
    for i, b in enumerate(subject.batches):
        if b.ids.dim() != 2:
            problems.append(f"batch {i}: ids {tuple(b.ids.shape)} is not (B, T)")
            continue
        if b.ids.dtype not in (torch.long, torch.int32):
            problems.append(f"batch {i}: ids dtype {b.ids.dtype}, expected torch.long")
        if b.targets.shape != b.ids.shape:
            problems.append(f"batch {i}: targets {tuple(b.targets.shape)} != ids "
                            f"{tuple(b.ids.shape)}")
        if b.padding_mask is not None and (b.padding_mask.dtype != torch.bool
                                           or b.padding_mask.shape != b.ids.shape):
            problems.append(f"batch {i}: padding_mask {b.padding_mask.dtype} "
                            f"{tuple(b.padding_mask.shape)}, expected bool {tuple(b.ids.shape)}")
        if v is not None and b.ids.numel():
            lo, hi = int(b.ids.min()), int(b.ids.max())
            if lo < 0 or hi >= v:
                problems.append(f"batch {i}: ids span [{lo}, {hi}], outside [0, {v})")
            real = b.targets[b.targets != IGNORE_INDEX]
            if real.numel() and (int(real.min()) < 0 or int(real.max()) >= v):
                problems.append(f"batch {i}: targets span [{int(real.min())}, "
                                f"{int(real.max())}], outside [0, {v}) ∪ {{{IGNORE_INDEX}}}")
    shapes = ", ".join(str(tuple(b.ids.shape)) for b in subject.batches)
    if problems:
        return CheckResult(SECTION, "batch", Status.FAIL, "; ".join(problems),
                           "build batches with handformer.data (LMWindows, collate_sequences); "
                           "an id ≥ V means the tokenizer and the model disagree on the "
                           "vocabulary", {"problems": problems})
    return CheckResult(SECTION, "batch", Status.PASS,
                       f"{len(subject.batches)} batch(es) {shapes}; ids and targets in range",
                       details={"shapes": [list(b.ids.shape) for b in subject.batches]})


def _params(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def _in_model_order(model: nn.Module, rows: dict[str, ModuleRow]) -> list[ModuleRow]:
    order = {name: i for i, (name, _) in enumerate(model.named_modules())}
    return sorted(rows.values(), key=lambda r: order[r.name])


def check_forward(subject: Subject) -> tuple[CheckResult, list[ModuleRow]]:
    """One forward pass on the probe batch with shape-recording hooks on every module."""
    rows: dict[str, ModuleRow] = {}
    running: list[str] = []
    handles = []
    names = {id(m): n for n, m in subject.model.named_modules()}

    def pre_hook(module: nn.Module, args: tuple[Any, ...]) -> None:
        running.append(names[id(module)])

    def hook(module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        name = names[id(module)]
        if running and running[-1] == name:
            running.pop()
        if name in rows:
            rows[name].calls += 1
            return
        rows[name] = ModuleRow(name, type(module).__name__, _shape_of(args), _shape_of(output),
                               _params(module))

    for module in subject.model.modules():
        handles.append(module.register_forward_pre_hook(pre_hook))
        handles.append(module.register_forward_hook(hook))
    hint = ("print each module's input and output shapes (the table shows them for every "
            "module that finished); the logits must be (B, T, V)")
    b, t = subject.probe.ids.shape
    try:
        with torch.no_grad():
            logits = subject.forward(subject.probe.ids, subject.probe.padding_mask
                                     if subject.accepts_padding_mask else None)
    except Exception as err:  # the failure is the finding
        where = (running[-1] if running else "") or "(model)"
        return CheckResult(
            SECTION, "forward pass", Status.FAIL,
            f"model(ids {(b, t)}) raised {type(err).__name__} inside module '{where}': {err}",
            hint, {"module": where}), _in_model_order(subject.model, rows)
    finally:
        for h in handles:
            h.remove()
    table = _in_model_order(subject.model, rows)
    subject.memo["probe_logits"] = logits
    v = subject.vocab
    shape = tuple(logits.shape) if isinstance(logits, Tensor) else None
    details = {"logits_shape": list(shape) if shape else None, "expected": [b, t, v]}
    if shape != (b, t, v):
        got = type(logits).__name__ if shape is None else str(shape)
        return CheckResult(SECTION, "forward pass", Status.FAIL,
                           f"logits {got}, expected (B, T, V) = {(b, t, v)}",
                           "return logits of shape (B, T, V) from forward: no softmax, no "
                           "flattening (flatten only inside the loss), and V = the "
                           "vocabulary size of the tokenizer", details), table
    bad = int((~torch.isfinite(logits)).sum())
    if bad:
        return CheckResult(SECTION, "forward pass", Status.FAIL,
                           f"logits {shape} = (B, T, V) but {bad} values are NaN/Inf",
                           "non-finite logits at initialisation: look for -inf masking of a "
                           "row with nothing to attend to, division by zero in a norm, or "
                           "NaN in the data", details), table
    return CheckResult(SECTION, "forward pass", Status.PASS,
                       f"logits {shape} = (B, T, V), all finite; {len(table)} modules ran",
                       details=details), table
