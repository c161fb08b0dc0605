"""Step 2 of the tutorial's order: are the masks right?

Static checks read the mask builders and the data's padding masks. Behavioural probes run
the model, so they catch a wrong mask wherever it is built:

* causality probe — change the tokens after position t: the logits at ≤ t must not move,
  for every cut t when T ≤ 17, else at 16 cuts spread over the window (first, middle and
  last included). A second probe tells *how* it is wrong: if changing every earlier token leaves
  the last position unmoved, each query sees only itself and the future (a transposed
  mask); if not, it sees everything (a missing mask). With handformer attention the weights
  themselves show the mask each layer used, and any weight on a future key fails the check:
  that sees a single (query, key) pair of leak, wherever it is, which cuts between the
  sampled positions could miss.
* padding probe — pad a sequence on the right and on the left: its real positions must
  give the same logits as the sequence alone.
* pad keys — the attention weights of real queries on pad keys must be exactly zero, and
  each real query's weights must sum to one.

Shape legend: ``B`` batch, ``H`` heads, ``T`` queries, ``S`` keys, ``V`` vocabulary.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from handformer.capture import AttentionRecord
from handformer.doctor.maskmath import allowed, classify, describe, show
from handformer.doctor.report import CheckResult, Status, guarded
from handformer.doctor.subject import Subject
from handformer.masks import causal_mask, combine_masks, padding_mask

__all__ = [
    "check_causality",
    "check_data_padding_mask",
    "check_mask_builders",
    "check_pad_keys",
    "check_padding_probe",
    "probe_records",
]

SECTION = "masks"
CAUSAL_HINT = (
    "build the causal mask as torch.tril(torch.ones(T, T)).bool() (handformer.masks."
    "causal_mask): mask[i, j] = True iff key j ≤ query i, rows = queries, columns = keys, "
    "applied to scores (B, H, T, S) — not its transpose, and not left out. A model that sees "
    "the future gets a great training loss and collapses at generation.")
POLARITY_HINT = (
    "padding masks are True on real tokens (handformer.masks.padding_mask: ids != pad_id); "
    "torch's key_padding_mask has the opposite polarity (True = ignore) — convert only with "
    "handformer.masks.to_torch_key_padding_mask / from_torch_key_padding_mask. Masked scores "
    "get a large negative value before the softmax, so no real query attends to a pad key.")


# -- static: the builders and the data --------------------------------------------------------
@guarded(SECTION, "mask builders", CAUSAL_HINT)
def check_mask_builders(subject: Subject,
                        causal_fn: Callable[..., Tensor] | None = None) -> CheckResult:
    """causal(T) lower-triangular, causal(2, 4) end-aligned, padding True on real tokens."""
    fn = causal_fn or causal_mask
    t = max(2, min(int(subject.probe.ids.shape[1]), 8))
    square = allowed(torch.as_tensor(fn(t)).cpu())
    if square.shape != (t, t):
        raise ValueError(f"causal({t}) has shape {tuple(square.shape)}, expected ({t}, {t})")
    kind = classify(square)
    problems, notes = [], [f"causal({t}) is {describe(kind)}"]
    if kind != "causal":
        problems.append(f"causal({t}) = {show(square)} is {describe(kind)}, expected lower-"
                        f"triangular {show(causal_mask(t))}")
    try:
        rect = allowed(torch.as_tensor(fn(2, 4)).cpu())
        end = allowed(torch.as_tensor(fn(4)).cpu())[2:]
        if torch.equal(rect, end):
            notes.append("causal(2, 4) = last two rows of causal(4): end-aligned")
        else:
            problems.append(f"causal(2, 4) = {show(rect)} is not the last two rows of causal(4) "
                            f"= {show(end)}: new queries after cached keys must be end-aligned")
    except TypeError:
        notes.append("end alignment not checked (the builder takes one length)")
    a, b = subject.pad_id + 1, subject.pad_id + 2  # any two ids that are not padding
    ids = torch.tensor([[a, b, subject.pad_id, subject.pad_id]])
    pad = padding_mask(ids, subject.pad_id)  # (1, 4)
    if pad.tolist() != [[True, True, False, False]]:
        problems.append(f"padding_mask([a, b, pad, pad]) = {pad.int().tolist()}, expected "
                        "[1, 1, 0, 0] (True on real tokens)")
    combined = combine_masks(pad, causal_mask(4))  # (1, 1, 4, 4)
    if combined is None or combined.shape != (1, 1, 4, 4):
        problems.append("combine_masks(padding (1, 4), causal (4, 4)) is not (B, 1, T, S)")
    else:
        notes.append("padding_mask is True on real tokens; combine_masks gives (B, 1, T, S)")
    details = {"causal": show(square), "kind": kind}
    if problems:
        return CheckResult(SECTION, "mask builders", Status.FAIL, "; ".join(problems),
                           CAUSAL_HINT, details)
    return CheckResult(SECTION, "mask builders", Status.PASS, "; ".join(notes),
                       details=details)


@guarded(SECTION, "padding mask in the data", POLARITY_HINT)
def check_data_padding_mask(subject: Subject) -> CheckResult:
    """The data's masks: False exactly on pad ids (True = real token)."""
    masked = [b for b in subject.batches if b.padding_mask is not None]
    if not masked:
        return CheckResult(SECTION, "padding mask in the data", Status.SKIP,
                           "the batches carry no padding mask (fixed-length windows, no "
                           "padding); the padding probes below still test the model")
    hides = shows = pads = total = 0
    for b in masked:
        is_pad = b.ids == subject.pad_id  # (B, T)
        hides += int((~b.padding_mask & ~is_pad).sum())  # real tokens marked as padding
        shows += int((b.padding_mask & is_pad).sum())  # pad tokens marked as real
        pads += int(is_pad.sum())
        total += b.ids.numel()
    details = {"real_marked_pad": hides, "pad_marked_real": shows, "pad_tokens": pads}
    if hides or shows:
        inverted = hides + shows == total
        what = ("inverted: True on padding, False on real tokens" if inverted else
                f"{hides} real token(s) marked as padding, {shows} pad token(s) marked as real")
        return CheckResult(SECTION, "padding mask in the data", Status.FAIL,
                           f"padding mask is {what} (pad id {subject.pad_id})", POLARITY_HINT,
                           details)
    return CheckResult(SECTION, "padding mask in the data", Status.PASS,
                       f"True on all real tokens, False on all {pads} pad tokens "
                       f"(pad id {subject.pad_id}) in {len(masked)} batch(es)", details=details)


# -- behavioural: causality -----------------------------------------------------------------
def probe_records(subject: Subject) -> list[AttentionRecord]:
    """Attention records of the unpadded probe batch (computed once, manual kernel)."""
    if "probe_records" not in subject.memo:
        if not subject.attention:
            subject.memo["probe_records"] = []
        else:
            _, records = subject.captured_forward(subject.probe.ids)
            subject.memo["probe_records"] = list(records)
    return subject.memo["probe_records"]


def effective_masks(records: list[AttentionRecord]) -> dict[str, Tensor]:
    """Per self-attention layer, the (T, S) mask it used: where any weight is non-zero."""
    out = {}
    for r in records:
        if r.self_attention and r.name not in out:
            out[r.name] = (r.weights > 0).any(dim=0).any(dim=0).cpu()  # (T, S)
    return out


CAUSAL_CUTS = 16  # perturbation probes at most (each one forward pass)


def future_pairs(mask: Tensor) -> list[tuple[int, int]]:
    """(query, key) pairs of an allowed-mask (T, S) that lie after the end-aligned diagonal."""
    t, s = mask.shape
    future = mask & ~causal_mask(t, s, device=mask.device)  # (T, S)
    return [(int(i), int(j)) for i, j in future.nonzero().tolist()]


def _cuts(t_len: int) -> list[int]:
    """Cut positions t in [0, T − 2]: all of them, or ``CAUSAL_CUTS`` spread evenly (with the
    middle one, T // 2)."""
    last = t_len - 2
    if last + 1 <= CAUSAL_CUTS:
        return list(range(last + 1))
    spread = {round(k * last / (CAUSAL_CUTS - 1)) for k in range(CAUSAL_CUTS)}
    return sorted(spread | {t_len // 2})


@guarded(SECTION, "causality probe", CAUSAL_HINT)
def check_causality(subject: Subject) -> CheckResult:
    ids = subject.probe.ids  # (B, T)
    t_len = ids.shape[1]
    if t_len < 2:
        return CheckResult(SECTION, "causality probe", Status.SKIP,
                           "the probe batch has T < 2: nothing to probe")
    with torch.no_grad():
        base = subject.forward(ids)  # (B, T, V)
        tol = subject.tolerance(base)
        leaks: dict[int, float] = {}
        later = 0.0
        # The first, middle and last cut draw from the subject's generator and the others
        # from their own, so the checks after this one see the random draws they always saw.
        own = torch.Generator().manual_seed(subject.seed + 1)
        main = {0, t_len // 2, t_len - 2}
        for t in _cuts(t_len):
            changed = ids.clone()
            changed[:, t + 1:] = subject.random_tokens(
                tuple(ids[:, t + 1:].shape), avoid=ids[:, t + 1:],
                generator=None if t in main else own)
            out = subject.forward(changed)
            leaks[t] = float((out[:, : t + 1] - base[:, : t + 1]).abs().max())
            later = max(later, float((out[:, t + 1:] - base[:, t + 1:]).abs().max()))
        changed = ids.clone()
        changed[:, :-1] = subject.random_tokens(tuple(ids[:, :-1].shape), avoid=ids[:, :-1])
        past = float((subject.forward(changed)[:, -1] - base[:, -1]).abs().max())
    details = {"leak_by_position": {str(k): v for k, v in leaks.items()}, "tolerance": tol,
               "later_moved": later, "past_moved_last": past}
    used = effective_masks(probe_records(subject))
    layers = {n: classify(m) for n, m in used.items()}
    details["layer_masks"] = layers
    future = {n: pairs for n, m in used.items() if (pairs := future_pairs(m))}
    details["future_pairs"] = {n: len(pairs) for n, pairs in future.items()}
    worst_t = max(leaks, key=lambda k: leaks[k])
    first_future = ""
    if future:
        name, pairs = next(iter(future.items()))
        shown = ", ".join(f"query {i} → key {j}" for i, j in pairs[:4])
        first_future = (f"{name} gives weight to {len(pairs)} (query, key) pair(s) after the "
                        f"diagonal ({shown}{' …' if len(pairs) > 4 else ''})")
    if leaks[worst_t] <= tol and future:
        return CheckResult(
            SECTION, "causality probe", Status.FAIL,
            f"attention weights on future keys: {first_future}; {len(future)} layer(s) see "
            f"the future, though changing the tokens after positions {sorted(leaks)} moved no "
            "earlier logit", CAUSAL_HINT, details)
    if leaks[worst_t] > tol:
        leaky = [t for t in sorted(leaks) if leaks[t] > tol]
        if past <= tol:
            verdict = ("changing every earlier token did not move the last position: each "
                       "query sees only itself and later keys — the causal mask is transposed")
        elif "full" in layers.values() or (not layers and len(leaky) == len(leaks)):
            verdict = ("the last position still sees the past, so the future is visible on "
                       "top of it — the causal mask is missing (or not applied)")
        else:
            verdict = (f"only part of the future is visible (cuts {leaky[:8]} leak): the mask "
                       "is wrong at some positions, e.g. off by one (query i seeing key i + 1)"
                       + (f"; {first_future}" if first_future else ""))
        wrong = {n: k for n, k in layers.items() if k != "causal"}
        inside = ("; attention weights: " + ", ".join(f"{n} {describe(k)}"
                                                       for n, k in wrong.items())) if wrong else ""
        return CheckResult(
            SECTION, "causality probe", Status.FAIL,
            f"changing the tokens after position {worst_t} moved the logits at positions ≤ "
            f"{worst_t} by up to {leaks[worst_t]:.3g} (tolerance {tol:.1g}): the model sees the "
            f"future. {verdict}{inside}", CAUSAL_HINT, details)
    if later <= tol and past <= tol:
        return CheckResult(SECTION, "causality probe", Status.WARN,
                           "changing tokens moved no logits at all: the output does not "
                           "depend on the input", "check that forward uses its ids (a constant "
                           "or detached input path)", details)
    inside = (" Attention weights: every layer lower-triangular." if layers
              and all(k == "causal" for k in layers.values()) else "")
    return CheckResult(
        SECTION, "causality probe", Status.PASS,
        f"changing tokens after positions {sorted(leaks)} left earlier logits unchanged (max "
        f"{max(leaks.values()):.1g} ≤ {tol:.1g}) while later ones moved by up to {later:.3g}; "
        f"the last position sees the past (moved {past:.3g}).{inside}", details=details)


# -- behavioural: padding ---------------------------------------------------------------------
def padded_inputs(subject: Subject) -> tuple[Tensor, dict[str, tuple[Tensor, Tensor]]]:
    """One real sequence (1, n) and its right- and left-padded versions (1, n + k) + masks.

    n + k never exceeds the probe length, so the model's window is respected.
    """
    if "padded" not in subject.memo:
        ids = subject.probe.ids  # (B, T)
        real = ids != subject.pad_id  # the probe pads by itself: the data's mask is not trusted
        row = ids[int(real.sum(1).argmax())]
        row = row[row != subject.pad_id]
        t_len = int(subject.probe.ids.shape[1])
        k = max(1, min(4, t_len // 4))
        n = min(len(row), t_len - k)
        if n < 1:
            raise ValueError(f"the probe sequence is too short to pad (T={t_len})")
        seq = row[:n].unsqueeze(0)  # (1, n)
        pads = torch.full((1, k), subject.pad_id, dtype=seq.dtype, device=seq.device)
        real = torch.ones(1, n, dtype=torch.bool, device=seq.device)
        none = torch.zeros(1, k, dtype=torch.bool, device=seq.device)
        subject.memo["padded"] = (seq, {
            "right": (torch.cat([seq, pads], 1), torch.cat([real, none], 1)),
            "left": (torch.cat([pads, seq], 1), torch.cat([none, real], 1)),
        })
    return subject.memo["padded"]


def _needs_padding(subject: Subject, name: str) -> CheckResult | None:
    if subject.accepts_padding_mask:
        return None
    return CheckResult(SECTION, name, Status.SKIP,
                       "the model's forward takes no padding_mask argument (True on real "
                       "tokens), so padding cannot be probed")


@guarded(SECTION, "padding probe", POLARITY_HINT)
def check_padding_probe(subject: Subject) -> CheckResult:
    skip = _needs_padding(subject, "padding probe")
    if skip:
        return skip
    seq, padded = padded_inputs(subject)
    with torch.no_grad():
        alone = subject.forward(seq)[0]  # (n, V)
        moved = {}
        for side, (ids, mask) in padded.items():
            out = subject.forward(ids, mask)[0]  # (n + k, V)
            moved[side] = float((out[mask[0]] - alone).abs().max())
    tol = subject.tolerance(alone)
    k = int((~padded["right"][1]).sum())
    details = {"moved": moved, "tolerance": tol, "pads": k, "length": int(seq.shape[1])}
    bad = {s: v for s, v in moved.items() if v > tol}
    if bad:
        sides = ", ".join(f"{s} padding moved them by {v:.3g}" for s, v in bad.items())
        extra = ""
        if set(bad) == {"left"}:
            extra = (" Only left padding fails: position ids must count real tokens only "
                     "(handformer.models.embedding.positions_from_padding).")
        return CheckResult(SECTION, "padding probe", Status.FAIL,
                           f"adding {k} pad tokens changed the logits of the {seq.shape[1]} real "
                           f"positions: {sides} (tolerance {tol:.1g}).{extra}",
                           POLARITY_HINT, details)
    return CheckResult(SECTION, "padding probe", Status.PASS,
                       f"{k} pad tokens on the right or on the left leave the logits of the "
                       f"{seq.shape[1]} real positions unchanged (max "
                       f"{max(moved.values()):.1g} ≤ {tol:.1g})", details=details)


@guarded(SECTION, "pad keys get zero attention", POLARITY_HINT)
def check_pad_keys(subject: Subject) -> CheckResult:
    name = "pad keys get zero attention"
    skip = _needs_padding(subject, name)
    if skip:
        return skip
    if not subject.attention:
        return CheckResult(SECTION, name, Status.SKIP,
                           "no handformer MultiHeadAttention in the model: its attention "
                           "weights cannot be read")
    _, padded = padded_inputs(subject)
    worst_pad, worst_sum, seen = 0.0, 0.0, 0
    where_pad = where_sum = ""
    for side, (ids, mask) in padded.items():
        _, records = subject.captured_forward(ids, mask)
        real = mask[0]  # (T,)
        for r in records:
            if not r.self_attention:
                continue
            seen += 1
            w = r.weights[0][:, real]  # (H, n_real, S)
            pad_mass = float(w[:, :, ~real].sum(-1).max())
            sum_err = float((w.sum(-1) - 1).abs().max())
            if pad_mass > worst_pad:
                worst_pad, where_pad = pad_mass, f"{r.name} ({side} padding)"
            if sum_err > worst_sum:
                worst_sum, where_sum = sum_err, f"{r.name} ({side} padding)"
    if not seen:
        return CheckResult(SECTION, name, Status.SKIP,
                           "the attention layers returned no weights (need_weights ignored)")
    details = {"max_pad_weight": worst_pad, "max_row_sum_error": worst_sum, "layers": seen}
    if worst_pad > 1e-6 or worst_sum > 1e-4:
        parts = []
        if worst_pad > 1e-6:
            parts.append(f"real queries put up to {worst_pad:.3g} of their attention on pad keys "
                         f"in {where_pad}")
        if worst_sum > 1e-4:
            parts.append(f"real queries' weights sum to 1 ± {worst_sum:.3g} in {where_sum} "
                         "(a real query with nothing visible means the real keys are hidden)")
        return CheckResult(SECTION, name, Status.FAIL, "; ".join(parts), POLARITY_HINT, details)
    return CheckResult(SECTION, name, Status.PASS,
                       f"in {seen} attention calls (left and right padding) real queries give "
                       f"pad keys weight {worst_pad:.1g} and their weights sum to 1",
                       details=details)
