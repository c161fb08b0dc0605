"""Step 6: two roads to the same place must arrive together.

* attention kernels agree — every kernel (``sdpa``: torch's fused one; ``tiled``, where
  present) must give the readable ``manual`` kernel's logits, with and without padding. A
  mismatch localises a bug to one kernel's mask or scale handling.
* cached vs uncached — decoding with the KV cache (a prefix, then one token at a time, the
  queries end-aligned to the cached keys) must give the logits of recomputing the whole
  prefix, and greedy ``generate`` must pick the same tokens either way.

Shape legend: ``B`` batch, ``T`` sequence, ``V`` vocabulary.
"""

from __future__ import annotations

import torch

from handformer.capture import forced_attention_kind
from handformer.doctor.checks_masks import padded_inputs
from handformer.doctor.report import CheckResult, Status, guarded
from handformer.doctor.subject import Subject
from handformer.nn.attention import ATTENTION_KINDS

__all__ = ["check_cache", "check_kernels"]

SECTION = "paths"
KERNEL_HINT = ("all kernels must apply the same mask and scale: torch's SDPA boolean "
               "attn_mask means True = attend (nn.MultiheadAttention's means True = ignore), "
               "its is_causal is top-left aligned (handformer's causal mask is end-aligned), "
               "and a fully masked row is NaN in torch but zeros in handformer")
CACHE_HINT = ("cached decoding must equal recomputing the prefix: write the new keys/values at "
              "the cache's current length, build the causal mask end-aligned "
              "(causal_mask(T_q, T_k)), and give new tokens positions that continue the prefix")


@guarded(SECTION, "attention kernels agree", KERNEL_HINT)
def check_kernels(subject: Subject) -> CheckResult:
    """Every kernel in ``ATTENTION_KINDS`` against the readable ``manual`` reference."""
    name = "attention kernels agree"
    if not subject.attention:
        return CheckResult(SECTION, name, Status.SKIP,
                           "no handformer MultiHeadAttention in the model: one kernel only")
    inputs = [("no padding", subject.probe.ids, None)]
    if subject.accepts_padding_mask:
        _, padded = padded_inputs(subject)
        inputs.append(("left padding", *padded["left"]))
    diffs: dict[str, tuple[float, float]] = {}
    with torch.no_grad():
        for label, ids, mask in inputs:
            outs = {}
            for kind in ATTENTION_KINDS:
                with forced_attention_kind(subject.model, kind):
                    outs[kind] = subject.forward(ids, mask)  # (B, T, V)
            tol = subject.tolerance(outs["manual"])
            for kind in ATTENTION_KINDS[1:]:
                diff = (outs[kind] - outs["manual"]).abs()  # (B, T, V)
                if mask is not None:
                    diff = diff[mask]  # real positions only: (N_real, V)
                diffs[f"{kind} vs manual, {label}"] = (float(diff.max()), tol)
    details = {k: {"max_diff": d, "tolerance": t} for k, (d, t) in diffs.items()}
    bad = {k: v for k, v in diffs.items() if v[0] > v[1]}
    if bad:
        return CheckResult(SECTION, name, Status.FAIL, "; ".join(
            f"{k}: logits differ by {d:.3g} (tolerance {t:.1g})" for k, (d, t) in bad.items()),
            KERNEL_HINT, details)
    return CheckResult(SECTION, name, Status.PASS, "; ".join(
        f"{k}: max difference {d:.1g} ≤ {t:.1g}" for k, (d, t) in diffs.items())
        + f" ({len(subject.attention)} attention layers switched)", details=details)


@guarded(SECTION, "cached vs uncached decoding", CACHE_HINT)
def check_cache(subject: Subject) -> CheckResult:
    name = "cached vs uncached decoding"
    if not subject.has_cache:
        return CheckResult(SECTION, name, Status.SKIP,
                           "the model has no make_cache() / forward(cache=): no KV cache")
    from handformer.generate import generate

    model = subject.model
    ids = subject.probe.ids[:2, : min(int(subject.probe.ids.shape[1]), 24)]  # (B, n)
    b, n = ids.shape
    if n < 2:
        return CheckResult(SECTION, name, Status.SKIP, "T < 2: nothing to decode")
    prefix = n // 2
    with torch.no_grad():
        full = model(ids)  # (B, n, V)
        cache = model.make_cache(b)
        steps = [model(ids[:, :prefix], cache=cache)]
        steps += [model(ids[:, j: j + 1], cache=cache) for j in range(prefix, n)]
        cached = torch.cat(steps, dim=1)  # (B, n, V)
    diff = float((cached - full).abs().max())
    tol = subject.tolerance(full)
    details: dict[str, object] = {"max_diff": diff, "tolerance": tol, "prefix": prefix,
                                  "length": n}
    new = 8
    max_len = getattr(getattr(model, "config", None), "max_len", None)
    same_tokens = None
    if max_len is not None:
        new = max(1, min(new, max_len - prefix))
        prompt = ids[:1, :prefix]
        with_cache = generate(model, prompt, new, temperature=0, use_cache=True)
        without = generate(model, prompt, new, temperature=0, use_cache=False)
        same_tokens = torch.equal(with_cache, without)
        details["generate_equal"] = same_tokens
    if diff > tol or same_tokens is False:
        parts = []
        if diff > tol:
            parts.append(f"prefix of {prefix} then {n - prefix} single-token steps: logits differ "
                         f"from the full pass by {diff:.3g} (tolerance {tol:.1g})")
        if same_tokens is False:
            parts.append(f"greedy generate picks different tokens with and without the cache "
                         f"({new} new tokens)")
        return CheckResult(SECTION, name, Status.FAIL, "; ".join(parts), CACHE_HINT, details)
    gen = (f"; greedy generate gives the same {new} tokens either way"
           if same_tokens else "")
    return CheckResult(SECTION, name, Status.PASS,
                       f"a prefix of {prefix} then {n - prefix} single-token steps match the full "
                       f"pass (max difference {diff:.1g} ≤ {tol:.1g}){gen}", details=details)
