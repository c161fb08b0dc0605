"""``handformer generate``: sample from a run folder, streaming text as it is produced."""

from __future__ import annotations

import argparse
import sys
import threading
import warnings
from pathlib import Path
from typing import Any

from handformer.cli.common import (
    NON_NEGATIVE,
    POSITIVE,
    PROBABILITY,
    UsageError,
    device_name,
    folder_arg,
    non_negative_int,
    positive_int,
    reporting,
    seed_int,
)

__all__ = ["register", "run_generate"]

# The same bound as handformer.generate.MAX_SPECULATE (kept here: the parser is built
# without importing torch); tests hold the two equal.
MAX_SPECULATE = 32
DEFAULT_SPECULATE = 4
# How long the int8 kernel's preparation runs before the CLI says it is preparing one.
PREPARING_AFTER_S = 0.5


def register(sub: Any) -> None:
    gen = sub.add_parser("generate", help="sample text from a trained run folder")
    gen.add_argument("--run", type=Path, required=True, help="run folder written by train")
    source = gen.add_mutually_exclusive_group()
    source.add_argument("--prompt", default=None, help="text to continue (default: a newline)")
    source.add_argument("--prompt-file", type=Path, default=None,
                        help="one prompt per line, generated together as a batch")
    source.add_argument("--interactive", action="store_true",
                        help="read prompts from the terminal, one per line, until EOF")
    gen.add_argument("--max-new-tokens", type=non_negative_int, default=200)
    gen.add_argument("--temperature", type=NON_NEGATIVE, default=0.8,
                     help="0 = greedy; a positive value below 1e-30 also decodes greedily "
                     "(the limit as it goes to 0)")
    gen.add_argument("--top-k", type=positive_int, default=None)
    gen.add_argument("--top-p", type=PROBABILITY, default=None, help="in (0, 1]")
    gen.add_argument("--repetition-penalty", type=POSITIVE, default=1.0,
                     help="> 0; 1 = off, 1.1-1.3 discourages repeats")
    gen.add_argument("--stop", action="append", default=[],
                     help="stop before this string (repeatable)")
    gen.add_argument("--seed", type=seed_int, default=None)
    gen.add_argument("--no-cache", action="store_true", help="recompute the whole context "
                     "every step (slow; for comparison)")
    gen.add_argument("--device", type=device_name, default="cpu")
    gen.add_argument("--draft", type=folder_arg, default=None, metavar="RUN_DIR",
                     help="speculative decoding: a small run with the same tokenizer proposes "
                     "tokens that the model checks several at a time (train one with "
                     "`handformer train --draft-for RUN`); greedy output is unchanged, "
                     "sampled tokens keep the model's distribution; prints the acceptance "
                     "rate on stderr")
    gen.add_argument("--speculate", type=_speculate_int, default=None, metavar="K",
                     help=f"draft tokens proposed per step with --draft (1-{MAX_SPECULATE}, "
                     f"default {DEFAULT_SPECULATE})")
    gen.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                     help="cast the model for inference (bfloat16: half the weight traffic; "
                     "logits differ from float32 in the 2nd–3rd digit)")
    gen.add_argument("--quantize", choices=["int8"], default=None,
                     help="int8 weights (one float scale per output channel; activations "
                     "stay float): a quarter of float32's bytes to read per token. The "
                     "first run compiles the int8 kernel (seconds, said on stderr)")
    # warnings (unknown characters, a prompt cropped to the window) as plain lines
    gen.set_defaults(handler=reporting("generate", run_generate))


def _speculate_int(text: str) -> int:
    """argparse type: an int in [1, MAX_SPECULATE]."""
    value = positive_int(text)
    if value > MAX_SPECULATE:
        raise argparse.ArgumentTypeError(f"expected at most {MAX_SPECULATE} draft tokens per "
                                         f"step; got {value}")
    return value


def _warn_unknown(tokenizer: Any, prompts: list[str]) -> None:
    vocabulary = getattr(tokenizer, "stoi", None)
    if vocabulary is None:  # subword tokenizers: byte-level BPE never meets an unknown
        return
    unknown = sorted({ch for p in prompts for ch in p if ch not in vocabulary})
    if unknown:
        from handformer.data.classification import DataWarning

        warnings.warn(f"{len(unknown)} character(s) not in the model's vocabulary are read "
                      f"as <unk>: {''.join(unknown[:20])!r}", DataWarning, stacklevel=2)


def _quantized(model: Any, speculate: int | None, *, use_cache: bool = True) -> Any:
    """The model with int8 weights (as it is if its run folder holds them already), its
    kernel compiled before the first token — for one new position and, with a draft, for the
    ``speculate`` + 1 a step verifies — saying on stderr what that cost. Without the cache
    every step feeds the whole prefix, a new row count each time, so the dequantizing kernel
    serves it (the fused one would compile again at every new length)."""
    from handformer.models.quantize import (
        is_quantized,
        quantize_int8,
        set_int8_kernel,
        warm_up_int8,
    )

    if not is_quantized(model):
        model = quantize_int8(model, inplace=True)
    if not use_cache:
        print("int8: without the KV cache every step runs the whole prefix: using the "
              "dequantizing kernel (no compiling)", file=sys.stderr, flush=True)
        return set_int8_kernel(model, "dequantized")
    # Said only when the wait is felt: a kernel cached on disk is ready at once.
    waiting = threading.Timer(PREPARING_AFTER_S, lambda: print(
        "int8: preparing the int8 kernel for this model's layer shapes (built once per "
        "machine, then cached on disk)...", file=sys.stderr, flush=True))
    waiting.start()
    try:
        seconds, note = warm_up_int8(model, positions=(1,) if speculate is None else
                                     (1, speculate + 1))
    finally:
        waiting.cancel()
        waiting.join()
    print(f"int8: {note or f'ready in {seconds:.1f} s'}", file=sys.stderr, flush=True)
    return model


def _check_options(args: argparse.Namespace) -> None:
    """Texts that cannot work are usage errors, found before the model is loaded (the
    numbers' ranges are checked by their argparse types)."""
    if args.prompt == "":
        raise UsageError("--prompt is empty; give at least one character")
    if any(stop == "" for stop in args.stop):
        raise UsageError("--stop strings must be non-empty")
    if args.draft is None:
        if args.speculate is not None:
            raise UsageError("--speculate needs --draft RUN_DIR (the model that proposes)")
        return
    if args.no_cache:
        raise UsageError("--draft verifies proposals with the KV cache; drop --no-cache")
    if args.repetition_penalty != 1.0:
        raise UsageError("--draft does not take --repetition-penalty (a position's penalty "
                         "depends on the proposals before it)")


def run_generate(args: argparse.Namespace) -> int:
    from handformer.generate import SpeculationStats, check_same_tokenizer, generate_text
    from handformer.runs import load_run

    _check_options(args)
    run = load_run(args.run, device=args.device, kind="lm")
    model, tokenizer = run.model, run.tokenizer
    draft = None
    if args.draft is not None:
        draft_run = load_run(args.draft, device=args.device, kind="lm")
        check_same_tokenizer(tokenizer, draft_run.tokenizer)
        draft = draft_run.model
    if args.dtype != "float32":
        import torch

        model = model.to(getattr(torch, args.dtype))
        draft = None if draft is None else draft.to(getattr(torch, args.dtype))
    if args.quantize is not None:
        if "lora" in run.config:  # int8 goes on the merged weights, adapters folded in
            from handformer.nn.lora import merge_lora

            model = merge_lora(model)
        model = _quantized(model, None if draft is None else
                           args.speculate or DEFAULT_SPECULATE, use_cache=not args.no_cache)
    sampling: dict[str, Any] = dict(temperature=args.temperature, top_k=args.top_k,
                                    top_p=args.top_p, seed=args.seed)
    stats = SpeculationStats()
    if draft is None:
        sampling.update(repetition_penalty=args.repetition_penalty,
                        use_cache=not args.no_cache)
    else:
        sampling.update(draft=draft, speculate=args.speculate or DEFAULT_SPECULATE,
                        stats=stats)
    try:
        return _generate_all(args, model, tokenizer, sampling, generate_text)
    finally:
        if draft is not None and stats.target_calls:
            print(f"handformer generate: {stats.summary()}", file=sys.stderr, flush=True)


def _generate_all(args: argparse.Namespace, model: Any, tokenizer: Any,
                  sampling: dict[str, Any], generate_text: Any) -> int:
    def one(prompt: str) -> None:
        if not prompt:
            raise ValueError("the prompt is empty; give at least one character")
        _warn_unknown(tokenizer, [prompt])
        sys.stdout.write(prompt)
        sys.stdout.flush()
        generate_text(model, tokenizer, prompt, args.max_new_tokens, stop=args.stop,
                      stream=lambda _row, piece: (sys.stdout.write(piece), sys.stdout.flush()),
                      stream_keeps_model=True, **sampling)
        sys.stdout.write("\n")
        sys.stdout.flush()

    if args.prompt_file is not None:
        from handformer.data.corpora import read_text_file

        prompts = [line for line in read_text_file(args.prompt_file).splitlines() if line]
        if not prompts:
            raise ValueError(f"{args.prompt_file} holds no prompts (one per line)")
        _warn_unknown(tokenizer, prompts)
        outputs = generate_text(model, tokenizer, prompts, args.max_new_tokens,
                                stop=args.stop, **sampling)
        for prompt, text in zip(prompts, outputs, strict=True):
            print(f"=== {prompt}\n{prompt}{text}")
        return 0
    if args.interactive:
        print("handformer generate: type a prompt and press Enter (Ctrl-D to quit)",
              file=sys.stderr)
        for line in sys.stdin:
            line = line.rstrip("\n")
            if not line:
                print("(empty prompt: type some text)", file=sys.stderr)
                continue
            one(line)
        return 0
    one("\n" if args.prompt is None else args.prompt)
    return 0
