"""The options ``handformer train --from`` and ``handformer classify train --from`` share:
where the pretrained model comes from and, with ``--lora R``, the LoRA recipe
(``handformer.nn.lora``)."""

from __future__ import annotations

import argparse
from typing import Any

from handformer.cli.common import DROPOUT, POSITIVE, UsageError

__all__ = ["add_lora_options", "lora_config"]


def lora_rank(text: str) -> int:
    """argparse type: a LoRA rank, an integer ≥ 1 (0 or less would train nothing)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a LoRA rank (an integer >= 1); got "
                                         f"{text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"a LoRA rank is an integer >= 1; got {value}")
    return value


def add_lora_options(parser: Any, default_targets: str) -> None:
    """``--lora R``, ``--lora-alpha``, ``--lora-dropout`` and ``--lora-targets``."""
    parser.add_argument("--lora", type=lora_rank, default=None, metavar="R",
                        help="with --from: train only rank-R LoRA adapters beside the frozen "
                             "weights (the run folder then stores only the adapters)")
    parser.add_argument("--lora-alpha", type=POSITIVE, default=None, metavar="ALPHA",
                        help="LoRA scale alpha / R (default alpha = 2·R)")
    parser.add_argument("--lora-dropout", type=DROPOUT, default=None,
                        help="dropout on the LoRA path, in [0, 1) (default 0)")
    parser.add_argument("--lora-targets", default=None, metavar="NAMES",
                        help="comma-separated: q, k, v, qkv, o, gate, up, down, or the groups "
                             f"attn, mlp, all-linear (default {default_targets})")


def lora_config(args: argparse.Namespace, default_targets: str) -> Any:
    """The ``LoRAConfig`` the options ask for, or None without ``--lora``; LoRA options
    without ``--lora`` (or ``--lora`` without ``--from``) are usage errors."""
    from handformer.nn.lora import LoRAConfig

    extra = [f"--lora-{k}" for k in ("alpha", "dropout", "targets")
             if getattr(args, f"lora_{k}") is not None]
    if args.lora is None:
        if extra:
            raise UsageError(f"{', '.join(extra)} need(s) --lora R")
        return None
    if getattr(args, "from_", None) is None:
        raise UsageError("--lora fine-tunes a pretrained model: give it with --from")
    targets = tuple(t.strip() for t in (args.lora_targets or default_targets).split(",")
                    if t.strip())
    if not targets:
        raise UsageError("--lora-targets names no target")
    alpha = 2.0 * args.lora if args.lora_alpha is None else args.lora_alpha
    return LoRAConfig(r=args.lora, alpha=alpha, dropout=args.lora_dropout or 0.0,
                      targets=targets)
