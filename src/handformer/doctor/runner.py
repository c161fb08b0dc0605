"""``run``: the whole checklist, in the tutorial's order, on one model and its data.

Order matters: a forward pass that does not run makes every later check meaningless, so if
step 1 fails the rest are reported as SKIP, pointing back at it. Everything else runs even
after a failure — one broken mask usually shows up in several places, and seeing them
together tells where it is.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import Tensor, nn

from handformer.doctor.checks_attention import check_attention_scale, check_positions
from handformer.doctor.checks_grads import OptimizerFactory, gradient_checks
from handformer.doctor.checks_learning import check_overfit
from handformer.doctor.checks_loss import (
    check_all_padding,
    check_first_loss,
    check_padding_ignored,
    check_targets_shifted,
)
from handformer.doctor.checks_masks import (
    check_causality,
    check_data_padding_mask,
    check_mask_builders,
    check_pad_keys,
    check_padding_probe,
)
from handformer.doctor.checks_paths import check_cache, check_kernels
from handformer.doctor.checks_shapes import check_batch, check_forward
from handformer.doctor.report import CheckResult, Report, Status
from handformer.doctor.subject import DataLike, LossFn, Subject, as_batches, preserved_state
from handformer.loss import lm_loss

__all__ = ["CHECK_NAMES", "run"]

# Every check, in report order (section, name): what a caller can look up in a Report.
CHECK_NAMES: tuple[tuple[str, str], ...] = (
    ("shapes", "batch"), ("shapes", "forward pass"),
    ("masks", "mask builders"), ("masks", "padding mask in the data"),
    ("masks", "causality probe"), ("masks", "padding probe"),
    ("masks", "pad keys get zero attention"), ("masks", "attention scale"),
    ("masks", "position probe"),
    ("loss", "first loss"), ("loss", "targets shifted by one"),
    ("loss", "padding ignored by the loss"), ("loss", "all-padding batch"),
    ("gradients", "gradient flow"), ("gradients", "gradient values"),
    ("gradients", "update/weight ratio"),
    ("learning", "overfit one batch"),
    ("paths", "attention kernels agree"), ("paths", "cached vs uncached decoding"),
)


def run(
    model: nn.Module,
    data: DataLike,
    *,
    loss_fn: LossFn = lm_loss,
    vocab_size: int | None = None,
    pad_id: int = 0,
    lr: float = 1e-3,
    initial: bool = True,
    optimizer: OptimizerFactory | None = None,
    learning_steps: int = 60,
    learning_factor: float = 2.0,
    batch_size: int = 4,
    seed: int = 0,
    causal_mask_fn: Callable[..., Tensor] | None = None,
    pictures: str | Path | None = None,
    decode: Callable[[int], str] | None = None,
    overwrite: bool = False,
) -> Report:
    """Run the debugging checklist on ``model`` and return a ``Report``.

    ``model`` maps ids (B, T) to logits (B, T, V); it may also take ``padding_mask=`` (True on
    real tokens). ``data`` is a ``Batch``, a list of them, an ``LMWindows``, a function
    returning a ``Batch`` or a (B, T+1) token tensor; the doctor uses at most
    ``batch_size`` rows. ``loss_fn(logits, targets)`` is the user's loss. ``initial`` says the
    model is freshly initialised (its first loss should be ≈ ln V); pass False for a trained
    one. ``lr`` and ``optimizer(params, lr)`` (default AdamW, no weight decay) drive the
    update-ratio and overfitting checks. ``causal_mask_fn(T)`` / ``(T_q, T_k)`` is checked
    instead of handformer's builder if given. ``pictures`` is a folder for PNGs: new, empty or
    one the doctor drew into before, unless ``overwrite`` (``RunFolderError`` otherwise).

    The model is left exactly as it was: parameters, buffers, gradients, train/eval flag.
    """
    started = time.perf_counter()
    generator = torch.Generator().manual_seed(seed)
    batches = as_batches(data, batch_size=batch_size, generator=generator)
    subject = Subject(model, batches, loss_fn, pad_id=pad_id, vocab_size=vocab_size, lr=lr,
                      initial=initial, seed=seed, decode=decode, probe_rows=batch_size)
    checks: list[CheckResult] = []
    modules = []
    written: list[str] = []
    with preserved_state(model):
        model.eval()
        checks.append(check_batch(subject))
        forward, modules = check_forward(subject)
        checks.append(forward)
        if forward.status is Status.FAIL:
            checks += [CheckResult(section, name, Status.SKIP,
                                   "the forward pass does not run: fix step 1 first")
                       for section, name in CHECK_NAMES[2:]]
        else:
            checks += [
                check_mask_builders(subject, causal_mask_fn),
                check_data_padding_mask(subject),
                check_causality(subject),
                check_padding_probe(subject),
                check_pad_keys(subject),
                check_attention_scale(subject),
                check_positions(subject),
                check_first_loss(subject),
                check_targets_shifted(subject),
                check_padding_ignored(subject),
                check_all_padding(subject),
                *gradient_checks(subject, optimizer),
                check_overfit(subject, steps=learning_steps, factor=learning_factor,
                              optimizer=optimizer),
                check_kernels(subject),
                check_cache(subject),
            ]
            if pictures is not None:
                written = write_pictures_safely(subject, pictures, checks,
                                                overwrite=overwrite)
    return Report(checks, modules, subject.describe(), time.perf_counter() - started, written)


def write_pictures_safely(subject: Subject, out_dir: str | Path,
                          checks: list[CheckResult], *, overwrite: bool = False) -> list[str]:
    """Pictures are a view, not a check: a drawing error becomes a WARN, never a crash. A
    folder that may not be written (``RunFolderError``) is an error, not a drawing one."""
    from handformer.doctor.pictures import write_pictures
    from handformer.runs import RunFolderError

    try:
        return write_pictures(subject, out_dir, overwrite=overwrite)
    except RunFolderError:
        raise
    except Exception as err:  # reported in the report
        checks.append(CheckResult("output", "pictures", Status.WARN,
                                  f"could not draw the pictures: {type(err).__name__}: {err}",
                                  "is matplotlib installed (pip install matplotlib)?"))
        return []
