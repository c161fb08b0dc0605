"""Step 3 of the tutorial's order: the loss — its first value, the targets, the padding.

* first loss — a fresh model predicts a near-uniform distribution, so its cross-entropy is
  about ln V (logits with spread σ add about σ²/2). Far above: the initial logits are too
  large. Far below: the model can see its targets, or the loss is not cross-entropy.
* targets shifted — on the user's own batches, ``targets[:, t] == ids[:, t + 1]`` wherever
  both are real tokens. Unshifted targets teach the model to copy its input.
* padding ignored — positions whose target is ``IGNORE_INDEX`` must not change the loss:
  appending such positions (with arbitrary logits) leaves the user's loss unchanged, and
  padded positions in the data carry ``IGNORE_INDEX``, not the pad id.
* all-padding batch — a batch with nothing real in it must not put NaN into the logits; a
  NaN *loss* (mean over zero tokens) is reported as a warning, since the trainer can skip it.

Shape legend: ``B`` batch, ``T`` sequence, ``V`` vocabulary.
"""

from __future__ import annotations

import math

import torch

from handformer.doctor.report import CheckResult, Status, guarded
from handformer.doctor.subject import Subject
from handformer.loss import IGNORE_INDEX

__all__ = ["check_all_padding", "check_first_loss", "check_padding_ignored",
           "check_targets_shifted"]

SECTION = "loss"
SHIFT_HINT = ("targets must be the inputs shifted left by one, targets[:, t] = ids[:, t + 1]: "
              "cut windows of T + 1 tokens and take ids = chunk[:, :-1], targets = chunk[:, 1:] "
              "(handformer.data.LMWindows, collate_sequences)")
IGNORE_HINT = (f"give padded positions the target IGNORE_INDEX = {IGNORE_INDEX} and use a loss "
               "that skips it: F.cross_entropy(logits.flatten(0, 1), targets.flatten(), "
               "ignore_index=IGNORE_INDEX), i.e. handformer.loss.lm_loss. A loss that counts "
               "pad positions spends the model's capacity on predicting padding.")
FIRST_HINT_HIGH = ("the initial logits are too large: initialise the output layer small "
                   "(std 0.02), keep the final LayerNorm, and check the loss gets raw logits "
                   "(not probabilities or log-probabilities)")
FIRST_HINT_LOW = ("a fresh model cannot beat uniform guessing: the targets leak into the inputs "
                  "(unshifted targets with a broken causal mask) or the loss is not mean "
                  "cross-entropy. If the model is already trained, pass initial=False (the CLI "
                  "does for --run).")


@guarded(SECTION, "first loss", FIRST_HINT_HIGH)
def check_first_loss(subject: Subject) -> CheckResult:
    name = "first loss"
    batch = subject.probe
    with torch.no_grad():
        loss = float(subject.loss(subject.probe_logits(), batch.targets))
    v = subject.vocab
    ln_v = math.log(v)
    details = {"loss": loss, "ln_V": ln_v, "initial": subject.initial}
    if not math.isfinite(loss):
        return CheckResult(SECTION, name, Status.FAIL, f"the first loss is {loss}",
                           "a non-finite first loss: look for NaN logits (shapes section) or a "
                           "batch with no real targets", details)
    gap = loss - ln_v
    where = f"first loss {loss:.4f} vs ln V = ln {v} = {ln_v:.4f} (difference {gap:+.3f})"
    if not subject.initial:
        if gap < 0:
            return CheckResult(SECTION, name, Status.PASS,
                               f"{where}: {-gap:.3f} nats better than uniform guessing, as a "
                               "trained model should be", details=details)
        return CheckResult(SECTION, name, Status.WARN,
                           f"{where}: a trained model no better than uniform guessing",
                           "the weights may not have loaded, or this data differs from the "
                           "training data (another tokenizer?)", details)
    if abs(gap) <= 0.25:
        return CheckResult(SECTION, name, Status.PASS,
                           f"{where}: a fresh model guesses uniformly, as it should",
                           details=details)
    status = Status.WARN if abs(gap) <= 1.0 else Status.FAIL
    return CheckResult(SECTION, name, status, where,
                       FIRST_HINT_HIGH if gap > 0 else FIRST_HINT_LOW, details)


@guarded(SECTION, "targets shifted by one", SHIFT_HINT)
def check_targets_shifted(subject: Subject) -> CheckResult:
    name = "targets shifted by one"
    counts = {"next": 0, "same": 0, "previous": 0, "total": 0, "previous_total": 0}
    for b in subject.batches:
        ids, tgt = b.ids, b.targets  # (B, T) each
        real_ids = (torch.ones_like(ids, dtype=torch.bool) if b.padding_mask is None
                    else b.padding_mask)
        real_tgt = tgt != IGNORE_INDEX
        both = real_tgt[:, :-1] & real_ids[:, 1:]  # (B, T-1): target t vs id t+1
        counts["total"] += int(both.sum())
        counts["next"] += int(((tgt[:, :-1] == ids[:, 1:]) & both).sum())
        counts["same"] += int(((tgt[:, :-1] == ids[:, :-1]) & both).sum())
        back = real_tgt[:, 1:] & real_ids[:, :-1]  # (B, T-1): target t vs id t-1
        counts["previous_total"] += int(back.sum())
        counts["previous"] += int(((tgt[:, 1:] == ids[:, :-1]) & back).sum())
    total = counts["total"]
    if total == 0:
        return CheckResult(SECTION, name, Status.SKIP,
                           "no position has both a real target and a real next input",
                           details=counts)
    frac = {"next": counts["next"] / total, "same": counts["same"] / total,
            "previous": counts["previous"] / max(counts["previous_total"], 1)}
    details = {**counts, **{f"frac_{k}": v for k, v in frac.items()}}
    if frac["next"] >= 0.99:
        return CheckResult(SECTION, name, Status.PASS,
                           f"targets[:, t] == ids[:, t + 1] at {frac['next']:.1%} of {total} "
                           "positions", details=details)
    if frac["same"] >= 0.99:
        why = ("targets equal the inputs (not shifted): the model learns to copy its input, "
               "the loss falls to almost zero and generation repeats the prompt")
    elif frac["previous"] >= 0.99:
        why = "targets are shifted the wrong way (targets[:, t] == ids[:, t - 1])"
    else:
        why = "targets do not match the inputs shifted by one"
    return CheckResult(SECTION, name, Status.FAIL,
                       f"{why}: targets[:, t] == ids[:, t + 1] at only {frac['next']:.1%} of "
                       f"{total} positions (targets == ids at {frac['same']:.1%})",
                       SHIFT_HINT, details)


@guarded(SECTION, "padding ignored by the loss", IGNORE_HINT)
def check_padding_ignored(subject: Subject) -> CheckResult:
    name = "padding ignored by the loss"
    problems: list[str] = []
    pad_targets = 0
    for b in subject.batches:
        if b.padding_mask is not None:
            pad_targets += int(((~b.padding_mask) & (b.targets != IGNORE_INDEX)).sum())
    if pad_targets:
        problems.append(f"{pad_targets} padded position(s) in the data have a real target "
                        f"instead of IGNORE_INDEX = {IGNORE_INDEX}")
    batch = subject.probe
    logits = subject.probe_logits()  # (B, T, V)
    b, t, v = logits.shape
    k = max(1, t // 4)
    extra = torch.randn(b, k, v, generator=subject.generator).to(logits) * 3.0  # (B, k, V)
    longer = torch.cat([logits, extra], dim=1)  # (B, T+k, V)
    targets = torch.cat([batch.targets, torch.full((b, k), IGNORE_INDEX, dtype=batch.targets
                                                   .dtype, device=batch.targets.device)], 1)
    with torch.no_grad():
        before = float(subject.loss(logits, batch.targets))
        after = float(subject.loss(longer, targets))
    details = {"loss": before, "loss_with_pad": after, "pad_targets_in_data": pad_targets}
    if not math.isclose(before, after, rel_tol=1e-5, abs_tol=1e-6):
        problems.append(f"appending {k} positions with target IGNORE_INDEX changed the loss "
                        f"from {before:.5f} to {after:.5f}")
    if problems:
        return CheckResult(SECTION, name, Status.FAIL, "; ".join(problems), IGNORE_HINT,
                           details)
    return CheckResult(SECTION, name, Status.PASS,
                       f"appending {k} positions with target IGNORE_INDEX leaves the loss at "
                       f"{before:.5f}" + ("; padded positions in the data carry IGNORE_INDEX"
                                          if any(x.padding_mask is not None
                                                 for x in subject.batches) else ""),
                       details=details)


@guarded(SECTION, "all-padding batch", "a query with nothing to attend to must give zeros, "
         "not NaN: fill masked scores with a large negative finite number (not -inf) and zero "
         "the weights of empty rows")
def check_all_padding(subject: Subject) -> CheckResult:
    name = "all-padding batch"
    t = int(subject.probe.ids.shape[1])
    ids = torch.full((2, t), subject.pad_id, dtype=torch.long, device=subject.device)
    targets = torch.full_like(ids, IGNORE_INDEX)
    mask = torch.zeros_like(ids, dtype=torch.bool) if subject.accepts_padding_mask else None
    with torch.no_grad():
        logits = subject.forward(ids, mask)
        bad = int((~torch.isfinite(logits)).sum())
        loss = float(subject.loss(logits, targets))
    how = "with an all-False padding mask" if mask is not None else "(no padding mask taken)"
    details = {"nonfinite_logits": bad, "loss": loss}
    if bad:
        return CheckResult(SECTION, name, Status.FAIL,
                           f"a batch of only pad tokens {how} gives {bad} NaN/Inf logits",
                           "a query with nothing to attend to must give zeros, not NaN: fill "
                           "masked scores with a large negative finite number (not -inf) and "
                           "zero the weights of empty rows", details)
    if not math.isfinite(loss):
        return CheckResult(SECTION, name, Status.WARN,
                           f"the logits stay finite {how}, but the loss is {loss}: a mean over "
                           "zero real targets is 0/0",
                           "skip batches without real targets, or compute the loss as sum / "
                           "max(count, 1); with gradient accumulation one such micro-batch "
                           "turns the whole step's loss into NaN (NaN × 0 weight is NaN)",
                           details)
    return CheckResult(SECTION, name, Status.PASS,
                       f"a batch of only pad tokens {how} gives finite logits and a finite "
                       f"loss ({loss:.3g})", details=details)
