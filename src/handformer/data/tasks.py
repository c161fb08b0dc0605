"""Built-in synthetic tasks: data generated on the spot, so every command runs offline.

Classification — ``brackets``: is a string of ``(`` and ``)`` balanced (every prefix opens
at least as many brackets as it closes, and the whole string closes them all)?

* Both classes have exactly the same character counts (``k`` of each) and the same length
  distribution, and every string starts with ``(`` and ends with ``)``. So a model that
  ignores order — bag of characters, length, first/last character — scores exactly the
  chance level, 50 %: the classes are balanced 1:1. It has to learn the running depth.
* Balanced strings are uniform over all balanced strings of their length (cycle lemma);
  unbalanced ones are uniform over the rest.
* Difficulty grows with length: the running depth must be read over more positions.

Seq2seq — over the digits (and ``+``):

* ``copy`` 1234 → 1234, ``reverse`` 1234 → 4321, ``sort`` 3141 → 1134: lengths in
  [min_len, max_len] (default 3..10: from 3 digits on, a held-out set of a few hundred
  strings is a small part of each length's space, so training can avoid it);
* ``add`` 57+968 → 1025: two numbers drawn uniformly below 10^max_len (default 3 digits);
  the harder one (carries must be resolved before the first output digit is written). The
  small default recipe does *not* solve it in a few CPU minutes: it learns the leading
  digits first and stalls on the units, whose source digits its cross-attention has not
  yet learned to find — a task to watch a model struggle with, not a proof of learning.

Shape legend: none (strings and lists).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

__all__ = [
    "BRACKETS_CHANCE",
    "BRACKETS_LABELS",
    "SEQ2SEQ_ALPHABET",
    "SEQ2SEQ_TASKS",
    "Seq2SeqTask",
    "balanced_brackets",
    "brackets_examples",
    "is_balanced",
    "seq2seq_pairs",
    "unbalanced_brackets",
]

BRACKETS_LABELS: tuple[str, str] = ("balanced", "unbalanced")
BRACKETS_CHANCE = 0.5
BRACKETS_MIN_LEN = 6  # the shortest unbalanced string that starts "(" and ends ")": ())(()


def is_balanced(text: str) -> bool:
    """True when no prefix closes more brackets than it opened and the totals match."""
    depth = 0
    for ch in text:
        depth += 1 if ch == "(" else -1
        if depth < 0:
            return False
    return depth == 0


def balanced_brackets(pairs: int, rng: random.Random) -> str:
    """A uniformly random balanced string of ``pairs`` pairs.

    Cycle lemma: of the rotations of any arrangement of ``pairs`` ``+1`` and ``pairs + 1``
    ``-1``, exactly one keeps every proper prefix sum ≥ 0 — the one starting just after the
    first minimum of the prefix sums. Dropping its final ``-1`` leaves a balanced string,
    and each balanced string arises from the same number of arrangements.
    """
    steps = [1] * pairs + [-1] * (pairs + 1)
    rng.shuffle(steps)
    depth, lowest, cut = 0, 0, 0
    for i, step in enumerate(steps):
        depth += step
        if depth < lowest:
            lowest, cut = depth, i + 1
    rotated = steps[cut:] + steps[:cut]
    return "".join("(" if s == 1 else ")" for s in rotated[:-1])


def unbalanced_brackets(pairs: int, rng: random.Random) -> str:
    """A random *unbalanced* string with ``pairs`` of each bracket that still starts with
    ``(`` and ends with ``)`` (so first/last-character shortcuts tell the classes apart no
    better than chance). Needs ``pairs >= 3``."""
    if pairs < 3:
        raise ValueError(f"an unbalanced string starting '(' and ending ')' needs pairs >= 3; "
                         f"got {pairs}")
    middle = list("(" * (pairs - 1) + ")" * (pairs - 1))
    while True:
        rng.shuffle(middle)
        text = "(" + "".join(middle) + ")"
        if not is_balanced(text):
            return text


def brackets_examples(
    n: int, *, min_len: int = 8, max_len: int = 32, seed: int = 0,
    exclude: frozenset[str] | set[str] = frozenset(),
) -> tuple[list[str], list[str]]:
    """``n`` strings with even lengths in [min_len, max_len] and their labels, half
    ``balanced`` and half ``unbalanced``, in random order. Strings in ``exclude`` are
    redrawn (so a training set can avoid the held-out set)."""
    if n <= 0:
        raise ValueError(f"n must be positive; got {n}")
    if min_len < BRACKETS_MIN_LEN or max_len < min_len:
        raise ValueError(f"need {BRACKETS_MIN_LEN} <= min_len <= max_len; got min_len={min_len}, "
                         f"max_len={max_len}")
    rng = random.Random(seed)
    lo, hi = (min_len + 1) // 2, max_len // 2  # pairs
    if hi < lo:
        raise ValueError(f"no even length lies in [{min_len}, {max_len}]")
    examples: list[tuple[str, str]] = []
    attempts = 0
    while len(examples) < n:
        attempts += 1
        if attempts > 100 * n + 1000:
            raise ValueError(f"could not draw {n} strings outside the excluded set of "
                             f"{len(exclude)}; widen the lengths or hold out fewer")
        pairs = rng.randint(lo, hi)
        balanced = len(examples) % 2 == 0
        text = (balanced_brackets if balanced else unbalanced_brackets)(pairs, rng)
        if text not in exclude:
            examples.append((text, BRACKETS_LABELS[0 if balanced else 1]))
    rng.shuffle(examples)
    return [t for t, _ in examples], [y for _, y in examples]


# -- seq2seq ----------------------------------------------------------------------------
SEQ2SEQ_ALPHABET = "0123456789+"


def _digits(rng: random.Random, lo: int, hi: int) -> str:
    return "".join(rng.choice("0123456789") for _ in range(rng.randint(lo, hi)))




def _copy(rng: random.Random, lo: int, hi: int) -> tuple[str, str]:
    src = _digits(rng, lo, hi)
    return src, src


def _reverse(rng: random.Random, lo: int, hi: int) -> tuple[str, str]:
    src = _digits(rng, lo, hi)
    return src, src[::-1]


def _sort(rng: random.Random, lo: int, hi: int) -> tuple[str, str]:
    src = _digits(rng, lo, hi)
    return src, "".join(sorted(src))


def _add(rng: random.Random, lo: int, hi: int) -> tuple[str, str]:
    a, b = rng.randint(0, 10**hi - 1), rng.randint(0, 10**hi - 1)
    return f"{a}+{b}", str(a + b)


@dataclass(frozen=True)
class Seq2SeqTask:
    """A named generator of (source, target) strings over ``SEQ2SEQ_ALPHABET``."""

    name: str
    description: str
    make: Callable[[random.Random, int, int], tuple[str, str]]
    default_min_len: int
    default_max_len: int

    def max_lengths(self, max_len: int) -> tuple[int, int]:
        """Longest source and target (characters) for a given ``max_len``."""
        if self.name == "add":
            return 2 * max_len + 1, max_len + 1
        return max_len, max_len


SEQ2SEQ_TASKS: dict[str, Seq2SeqTask] = {
    "copy": Seq2SeqTask("copy", "repeat the digits: 3141 → 3141", _copy, 3, 10),
    "reverse": Seq2SeqTask("reverse", "reverse the digits: 3141 → 1413", _reverse, 3, 10),
    "sort": Seq2SeqTask("sort", "sort the digits: 3141 → 1134", _sort, 3, 10),
    "add": Seq2SeqTask("add", "add two numbers below 10^max_len: 57+968 → 1025", _add, 1, 3),
}


def seq2seq_pairs(
    task: str,
    n: int,
    *,
    min_len: int | None = None,
    max_len: int | None = None,
    seed: int = 0,
    exclude: frozenset[str] | set[str] = frozenset(),
) -> list[tuple[str, str]]:
    """``n`` (source, target) pairs of ``task`` (lengths default to the task's); sources in
    ``exclude`` are never returned (so a training stream can avoid the held-out set).
    ``add`` reads only ``max_len``, its operands' digit count."""
    if task not in SEQ2SEQ_TASKS:
        raise ValueError(f"unknown seq2seq task {task!r}; expected one of {sorted(SEQ2SEQ_TASKS)}")
    spec = SEQ2SEQ_TASKS[task]
    lo = spec.default_min_len if min_len is None else min_len
    hi = spec.default_max_len if max_len is None else max_len
    if not 1 <= lo <= hi:
        raise ValueError(f"need 1 <= min_len <= max_len; got min_len={lo}, max_len={hi}")
    rng = random.Random(seed)
    pairs: list[tuple[str, str]] = []
    attempts = 0
    while len(pairs) < n:
        attempts += 1
        if attempts > 100 * n + 1000:
            raise ValueError(f"{task}: could not draw {n} sources outside the excluded set of "
                             f"{len(exclude)}; widen the lengths or hold out fewer")
        src, tgt = spec.make(rng, lo, hi)
        if src not in exclude:
            pairs.append((src, tgt))
    return pairs
