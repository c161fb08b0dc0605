"""Step 5: can the model learn at all? Overfit one batch within a step budget.

A healthy model memorises a handful of sequences quickly, so the loss on that one batch must
fall by ``factor`` within ``steps`` optimizer steps at the user's learning rate (PASS). If it
does not even fall by 10% the model is stuck, and the bug is somewhere between the loss and
the weights, whatever the data (FAIL); in between it is learning, only slowly (WARN). A loss
that blows up on integer-id data points at the learning rate, not at the input (FAIL). Blowing
up means turning NaN/Inf *or* climbing past ``BLOW_UP`` times the first loss (or past
``BLOW_UP`` itself when the first loss is under 1, so a near-zero start is no hair trigger).
Whether a diverging run overflows, and at which step, depends on the CPU's kernels, so the
check must not wait for the overflow to name the cause.

"Stuck" needs a budget that can tell: a healthy model at a sensible learning rate may take
tens of steps to lose its first 10% (a trained run's batch, a warm-up-free optimizer), so
below ``MIN_STEPS_TO_JUDGE`` steps a loss that did move is a WARN ("too few steps to
judge"), never a FAIL. A loss that did not move at all is a FAIL at any budget: the weights
never changed.

Runs in eval mode (no dropout: memorising is the point) and restores the model afterwards.

Shape legend: ``B`` batch, ``T`` sequence.
"""

from __future__ import annotations

import math

from handformer.doctor.checks_grads import OptimizerFactory, default_optimizer
from handformer.doctor.report import CheckResult, Status, guarded
from handformer.doctor.subject import Subject, preserved_state

__all__ = ["MIN_STEPS_TO_JUDGE", "check_overfit"]

SECTION = "learning"
STUCK_HINT = ("a model that cannot memorise one batch has a bug between the loss and the "
              "weights: gradients must reach every layer (section 4), zero_grad() and "
              "optimizer.step() must run every step, the optimizer must hold the model's "
              "parameters, and the learning rate must be neither tiny nor huge")
STUCK = 0.9  # a loss that has not fallen by 10% within the budget is not learning
MIN_STEPS_TO_JUDGE = 30  # half the default budget (60): fewer steps cannot call it stuck
BLOW_UP = 10.0  # a loss ten times its first value is diverging, finite or not
BLOW_UP_HINT = ("lower the learning rate (try lr / 10), warm it up over the first steps and "
                "clip gradients (grad_clip = 1.0); the inputs are integer ids and the first "
                "loss was finite, so the optimisation, not the data, made it blow up")


def _blew_up(first: float, value: float) -> bool:
    return value > BLOW_UP * max(first, 1.0)


@guarded(SECTION, "overfit one batch", STUCK_HINT)
def check_overfit(subject: Subject, *, steps: int = 60, factor: float = 2.0,
                  optimizer: OptimizerFactory | None = None) -> CheckResult:
    name = "overfit one batch"
    if steps < 1 or factor <= 1.0:
        raise ValueError(f"need steps >= 1 and factor > 1; got steps={steps}, factor={factor}")
    model = subject.model
    batch = subject.probe
    mask = batch.padding_mask if subject.accepts_padding_mask else None
    trainable = [p for p in model.parameters() if p.requires_grad]
    history: list[float] = []
    with preserved_state(model):
        model.eval()
        opt = (optimizer or default_optimizer)(trainable, subject.lr)
        for step in range(steps + 1):
            opt.zero_grad(set_to_none=True)
            loss = subject.loss(subject.forward(batch.ids, mask), batch.targets)
            value = float(loss.detach())
            history.append(value)
            if not math.isfinite(value) or _blew_up(history[0], value):
                break
            if value <= history[0] / factor or step == steps:
                break
            loss.backward()
            opt.step()
    first, last = history[0], history[-1]
    shown = [round(h, 4) for h in history[:: max(1, len(history) // 8)]]
    details = {"history": history, "steps": len(history) - 1, "budget": steps,
               "factor": factor, "lr": subject.lr, "tokens": int(batch.targets.numel())}
    where = f"({tuple(batch.ids.shape)} batch, lr={subject.lr:g})"
    if not math.isfinite(first):
        return CheckResult(SECTION, name, Status.FAIL, f"the first loss is {first} {where}",
                           "fix the loss section first", details)
    if not math.isfinite(last) or _blew_up(first, last):
        how = ("went non-finite" if not math.isfinite(last)
               else f"rose to {last:.4g} from a first loss of {first:.4f}")
        return CheckResult(SECTION, name, Status.FAIL,
                           f"the loss blew up at step {len(history) - 1} ({how}): {shown} "
                           f"{where}", BLOW_UP_HINT, details)
    target = first / factor
    if last <= target:
        return CheckResult(SECTION, name, Status.PASS,
                           f"the loss fell from {first:.4f} to {last:.4f} (÷{first / last:.2f}, "
                           f"needed ÷{factor:g}) in {len(history) - 1} of {steps} steps {where}",
                           details=details)
    progress = f"after {steps} steps the loss is {last:.4f}, not ≤ {target:.4f} (÷{factor:g} " \
               f"from {first:.4f}): {shown} {where}"
    if steps < MIN_STEPS_TO_JUDGE and last != first:
        return CheckResult(SECTION, name, Status.WARN,
                           f"too few steps to judge: {steps} < {MIN_STEPS_TO_JUDGE}; {progress}",
                           f"give --learning-steps {MIN_STEPS_TO_JUDGE} or more (default 60) to "
                           "tell a slow model from a stuck one", details)
    if last > STUCK * first:
        return CheckResult(SECTION, name, Status.FAIL, f"stuck: {progress}", STUCK_HINT, details)
    return CheckResult(SECTION, name, Status.WARN, f"learning, but slowly: {progress}",
                       "if nothing else is wrong the learning rate is low or the model small "
                       "for this batch: raise lr or the step budget (--learning-steps)", details)
