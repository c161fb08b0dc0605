"""Step 4 of the tutorial's order: the gradients after one backward pass, and one step.

* gradient flow — every trainable parameter must receive a gradient (``None`` means the
  graph was cut: ``.detach()``, ``.data``, ``torch.no_grad``, ``.item()`` or an unused
  module) and it must not be exactly zero (a dead layer).
* gradient values — no NaN/Inf; per-layer norms on one scale. A layer 1000× above the
  median, or a total norm above 100, is an explosion in the making; a layer a million times
  below the median is vanishing.
* update / weight ratio — ‖Δw‖ / ‖w‖ per tensor after one optimizer step. Adam's first step
  moves every weight by about lr, so for weights of size ~0.02 the ratio is ~50·lr. A ratio
  of 1 means one step replaces what the layer knew (the learning rate is far too high: FAIL);
  above 0.5 is a warning; below 1e-7 nothing moves.

The model is restored afterwards: parameters, buffers and gradients as they were.

Shape legend: ``V`` vocabulary.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Iterable

import torch
from torch import Tensor, nn

from handformer.doctor.report import CheckResult, Status
from handformer.doctor.subject import Subject, preserved_state

__all__ = ["OptimizerFactory", "default_optimizer", "gradient_checks"]

SECTION = "gradients"
OptimizerFactory = Callable[[Iterable[nn.Parameter], float], torch.optim.Optimizer]
LR_HINT = ("lower the learning rate (try lr / 10 until the ratio is ~1e-3 to 1e-2), warm it "
           "up over the first steps, and clip gradients (grad_clip = 1.0)")
FLOW_HINT = ("a parameter without a gradient is cut off from the loss: look for .detach(), "
             ".data, torch.no_grad(), .item() or a module whose output is never used on the "
             "way to the logits; a gradient of exactly zero means the layer is dead (e.g. "
             "all ReLU inputs negative, or multiplied by zero)")


def default_optimizer(params: Iterable[nn.Parameter], lr: float) -> torch.optim.Optimizer:
    """AdamW without weight decay: the update then shows the learning rate alone."""
    return torch.optim.AdamW(params, lr=lr, weight_decay=0.0)


def _layer(name: str) -> str:
    return name.rsplit(".", 1)[0] if "." in name else name


def _fail(name: str, err: Exception, hint: str) -> CheckResult:
    return CheckResult(SECTION, name, Status.FAIL, f"raised {type(err).__name__}: {err}", hint)


def gradient_checks(subject: Subject, optimizer: OptimizerFactory | None = None
                    ) -> list[CheckResult]:
    """One backward (flow and values) and one optimizer step (update ratio)."""
    names = ("gradient flow", "gradient values", "update/weight ratio")
    model = subject.model
    params = dict(model.named_parameters())  # tied weights appear once
    trainable = {n: p for n, p in params.items() if p.requires_grad}
    if not trainable:
        return [CheckResult(SECTION, n, Status.SKIP, "the model has no trainable parameters")
                for n in names]
    batch = subject.probe
    with preserved_state(model):
        model.eval()
        for p in trainable.values():
            p.grad = None
        try:
            loss = subject.loss(subject.forward(batch.ids, batch.padding_mask
                                                if subject.accepts_padding_mask else None),
                                batch.targets)
            if not torch.isfinite(loss):
                raise ValueError(f"the loss is {float(loss.detach())} before backward "
                                 "(see the loss section)")
            loss.backward()
        except Exception as err:  # the failure is the finding
            return [_fail(n, err, FLOW_HINT) for n in names]
        grads = {n: p.grad.detach().clone() if p.grad is not None else None
                 for n, p in trainable.items()}
        results = [_flow(grads, len(params) - len(trainable)), _values(grads)]
        try:
            results.append(_update_ratio(subject, trainable, optimizer or default_optimizer))
        except Exception as err:
            results.append(_fail(names[2], err, LR_HINT))
    return results


def _flow(grads: dict[str, Tensor | None], frozen: int) -> CheckResult:
    name = "gradient flow"
    missing = [n for n, g in grads.items() if g is None]
    dead = [n for n, g in grads.items() if g is not None and not bool(g.any())]
    details = {"no_grad": missing, "zero_grad": dead, "frozen": frozen}
    frozen_note = f" ({frozen} frozen parameter(s) skipped)" if frozen else ""
    if missing or dead:
        parts = []
        if missing:
            layers = sorted({_layer(n) for n in missing})
            parts.append(f"{len(missing)} parameter tensor(s) got no gradient at all, in "
                         f"{', '.join(layers[:6])}{' …' if len(layers) > 6 else ''}")
        if dead:
            parts.append(f"{len(dead)} got a gradient of exactly zero (dead): "
                         f"{', '.join(dead[:6])}{' …' if len(dead) > 6 else ''}")
        return CheckResult(SECTION, name, Status.FAIL, "; ".join(parts) + frozen_note,
                           FLOW_HINT, details)
    return CheckResult(SECTION, name, Status.PASS,
                       f"all {len(grads)} trainable tensors received a non-zero gradient"
                       + frozen_note, details=details)


def _values(grads: dict[str, Tensor | None]) -> CheckResult:
    name = "gradient values"
    present = {n: g for n, g in grads.items() if g is not None}
    if not present:
        return CheckResult(SECTION, name, Status.SKIP, "no parameter received a gradient")
    nonfinite = [n for n, g in present.items() if not bool(torch.isfinite(g).all())]
    if nonfinite:
        return CheckResult(SECTION, name, Status.FAIL,
                           f"NaN/Inf gradients in {len(nonfinite)} tensor(s): "
                           f"{', '.join(nonfinite[:6])}",
                           "find the first NaN: anomaly mode (torch.autograd.set_detect_anomaly"
                           "(True)) names the operation; usual suspects are -inf masking of a "
                           "fully masked row, log(0), and division by a zero norm",
                           {"nonfinite": nonfinite})
    sq: dict[str, float] = {}
    for n, g in present.items():
        sq[_layer(n)] = sq.get(_layer(n), 0.0) + float(g.double().pow(2).sum())
    norms = {layer: math.sqrt(v) for layer, v in sq.items()}
    total = math.sqrt(sum(sq.values()))
    nonzero = [v for v in norms.values() if v > 0]
    median = statistics.median(nonzero) if nonzero else 0.0
    big = {k: v for k, v in norms.items() if median and v > 1e3 * median}
    small = {k: v for k, v in norms.items() if median and 0 < v < 1e-6 * median}
    top = max(norms, key=lambda k: norms[k])
    low = min(norms, key=lambda k: norms[k])
    summary = (f"total norm {total:.3g} over {len(norms)} layers; median layer {median:.3g}, "
               f"largest {top} {norms[top]:.3g}, smallest {low} {norms[low]:.3g}")
    details = {"total_norm": total, "median_layer_norm": median, "layer_norms": norms}
    if total > 100 or big:
        where = ", ".join(f"{k} {v:.3g}" for k, v in list(big.items())[:4])
        return CheckResult(SECTION, name, Status.WARN,
                           f"exploding: {summary}" + (f"; {where} above 1000× the median"
                                                      if big else ""),
                           "clip gradients (torch.nn.utils.clip_grad_norm_, 1.0), lower the "
                           "learning rate, and check the initialisation (std 0.02, residual "
                           "projections scaled by 1/√(2·layers)) and the 1/√D attention scale",
                           details)
    if small:
        where = ", ".join(f"{k} {v:.3g}" for k, v in list(small.items())[:4])
        return CheckResult(SECTION, name, Status.WARN,
                           f"vanishing: {where} below 1e-6× the median; {summary}",
                           "a layer that barely gets gradient barely learns: check its "
                           "initialisation, normalisation placement and residual path", details)
    return CheckResult(SECTION, name, Status.PASS, f"all finite; {summary}", details=details)


def _update_ratio(subject: Subject, trainable: dict[str, nn.Parameter],
                  optimizer: OptimizerFactory) -> CheckResult:
    name = "update/weight ratio"
    before = {n: p.detach().clone() for n, p in trainable.items()}
    opt = optimizer(trainable.values(), subject.lr)
    opt.step()
    ratios: dict[str, float] = {}
    for n, p in trainable.items():
        w = float(before[n].double().norm())
        if w > 0:
            ratios[n] = float((p.detach() - before[n]).double().norm()) / w
    if not ratios:
        return CheckResult(SECTION, name, Status.SKIP, "every weight is zero")
    nonfinite = [n for n, r in ratios.items() if not math.isfinite(r)]
    finite = {n: r for n, r in ratios.items() if math.isfinite(r)}
    kind = type(opt).__name__
    details = {"optimizer": kind, "lr": subject.lr, "ratios": ratios}
    if nonfinite:
        return CheckResult(SECTION, name, Status.FAIL,
                           f"one {kind} step at lr={subject.lr:g} made {len(nonfinite)} "
                           f"tensor(s) non-finite: {', '.join(nonfinite[:4])}", LR_HINT, details)
    top = max(finite, key=lambda k: finite[k])
    median = statistics.median(finite.values())
    summary = (f"after one {kind} step at lr={subject.lr:g}: ‖Δw‖/‖w‖ median {median:.2g}, "
               f"largest {finite[top]:.2g} ({top})")
    details["median"] = median
    if finite[top] >= 1.0:
        return CheckResult(SECTION, name, Status.FAIL,
                           f"{summary}: one step is as large as the weights themselves",
                           LR_HINT, details)
    if finite[top] >= 0.5:
        return CheckResult(SECTION, name, Status.WARN, f"{summary}: very large first steps",
                           LR_HINT, details)
    if finite[top] < 1e-7:
        return CheckResult(SECTION, name, Status.WARN, f"{summary}: the weights barely move",
                           "raise the learning rate, or check that the optimizer was given "
                           "the model's parameters", details)
    return CheckResult(SECTION, name, Status.PASS, summary, details=details)
