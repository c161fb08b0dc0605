"""Two attention-level checks that belong with the masks: the 1/√D scale and positions.

**Scale.** Softmax weights satisfy log w_ij = s·(q_i·k_j) + b_ij − log Z_i, where s is the
score scale, b the ALiBi bias (if any) and Z_i the row's normaliser. So with the layer's
weights (read through ``need_weights``) and its raw dot products (recomputed from the layer's
input and its ``in_proj`` weights), a least-squares fit of the row-centred log-weights on the
row-centred dot products measures the scale the kernel *actually* used — whatever code path
produced it. It must be 1/√D: without it the scores' spread grows like √D and the softmax
saturates (vanishing gradients); at initialisation the damage is invisible in the loss, which
is why the doctor measures the scale directly instead of waiting for training to go wrong.

**Positions.** Feed one token repeated T times. Without any position information every
position sees the same bag of identical tokens, so all positions give identical logits and
identical (uniform) attention. Added positions (sinusoidal / learned) make the logits differ;
positions applied inside attention (RoPE / ALiBi) leave the logits equal — the values are
identical — but make the first layer's weights non-uniform. (Permuting a prefix is *not* a
usable probe for causal models: the causal mask itself leaks order from layer 2 on.)

Shape legend: ``B`` batch, ``H`` heads, ``Hkv`` key/value heads, ``T`` queries, ``S`` keys,
``D`` head dim, ``C`` model dim, ``V`` vocabulary.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from handformer.capture import AttentionRecord
from handformer.doctor.checks_masks import probe_records
from handformer.doctor.report import CheckResult, Status, guarded
from handformer.doctor.subject import Subject
from handformer.nn.positional import alibi_bias

__all__ = ["check_attention_scale", "check_positions", "fitted_scale"]

SECTION = "masks"
SCALE_HINT = ("divide the scores by √D (D = head dim) before the softmax: scores = q @ k.T / "
              "math.sqrt(D). Without it their spread grows like √D, the softmax saturates "
              "and gradients vanish.")
POSITION_HINT = ("add the positional encoding to the token embeddings, x = embed(ids) + "
                 "pos(positions), or apply RoPE / ALiBi inside attention: without position "
                 "information self-attention sees a bag of tokens, and 'dog bites man' reads "
                 "like 'man bites dog'.")


@torch.no_grad()
def _raw_scores(r: AttentionRecord) -> tuple[Tensor, Tensor | None]:
    """q·kᵀ (B, H, T, S) before any scaling, and the ALiBi bias, from the layer's input."""
    m = r.module
    b, t, _ = r.x.shape
    qkv = F.linear(r.x, m.in_proj.weight, m.in_proj.bias)  # (B, T, H·D + 2·Hkv·D)
    q, k, _ = qkv.split([m.n_heads * m.head_dim, m.kv_dim, m.kv_dim], -1)
    q = q.view(b, t, m.n_heads, m.head_dim).transpose(1, 2)  # (B, H, T, D)
    k = k.view(b, t, m.n_kv_heads, m.head_dim).transpose(1, 2)  # (B, Hkv, T, D)
    if getattr(m, "q_norm", None) is not None:  # QK-norm: normalised before RoPE, as in forward
        q, k = m.q_norm(q), m.k_norm(k)
    positions = r.kwargs.get("positions")
    if m.positional != "none" and positions is None:
        positions = torch.arange(t, device=r.x.device)
    if m.rotary is not None:
        q, k = m.rotary(q, positions), m.rotary(k, positions)
    k = k.repeat_interleave(m.n_heads // m.n_kv_heads, dim=1)  # (B, H, S, D)
    raw = q.double() @ k.double().transpose(-2, -1)  # (B, H, T, S)
    bias = None
    if m.positional == "alibi":
        q_pos = positions if positions.dim() == 2 else positions[None]  # (B|1, T)
        k_pos = r.kwargs.get("key_positions")
        k_pos = q_pos if k_pos is None else (k_pos if k_pos.dim() == 2 else k_pos[None])
        bias = alibi_bias(m.alibi_slopes, q_pos, k_pos).double()  # (B|1, H, T, S)
    return raw, bias


def fitted_scale(r: AttentionRecord) -> tuple[float, float]:
    """(scale, r²): the least-squares s in log w = s·q·kᵀ + bias − log Z, over visible keys."""
    raw, bias = _raw_scores(r)
    w = r.weights.double()  # (B, H, T, S)
    visible = w > 0
    y = torch.where(visible, w.clamp_min(1e-300).log(), torch.zeros_like(w))
    if bias is not None:
        y = y - bias
    n = visible.sum(-1, keepdim=True)  # (B, H, T, 1)
    rows = n > 1
    n = n.clamp_min(1)
    yc = torch.where(visible & rows, y - (y * visible).sum(-1, keepdim=True) / n, 0.0)
    xc = torch.where(visible & rows, raw - (raw * visible).sum(-1, keepdim=True) / n, 0.0)
    sxx = float((xc * xc).sum())
    if sxx == 0.0:
        raise ValueError(f"{r.name}: the dot products do not vary; the scale cannot be fitted")
    scale = float((xc * yc).sum()) / sxx
    syy = float((yc * yc).sum())
    resid = float(((yc - scale * xc) ** 2).sum())
    return scale, (1.0 - resid / syy) if syy > 0 else 1.0


@guarded(SECTION, "attention scale", SCALE_HINT)
def check_attention_scale(subject: Subject) -> CheckResult:
    name = "attention scale"
    records = [r for r in probe_records(subject)
               if r.self_attention and hasattr(r.module, "in_proj")]
    if not records:
        return CheckResult(SECTION, name, Status.SKIP,
                           "needs handformer MultiHeadAttention layers that return weights")
    fits = {}
    for r in records:
        if r.name not in fits:
            fits[r.name] = (*fitted_scale(r), 1.0 / math.sqrt(r.module.head_dim),
                            r.module.head_dim)
    details = {n: {"scale": s, "r2": r2, "expected": e} for n, (s, r2, e, _) in fits.items()}
    poor = {n: f for n, f in fits.items() if f[1] < 0.99}
    off = {n: f for n, f in fits.items() if abs(f[0] / f[2] - 1.0) > 0.05}
    if off:
        n, (s, _, e, d) = next(iter(off.items()))
        ratio = s / e
        why = (f"the scores are not divided by √D (ratio ≈ √D = {math.sqrt(d):.3g})"
               if abs(ratio / math.sqrt(d) - 1) < 0.05 else
               "the scores are divided by √D twice (ratio ≈ 1/√D)"
               if abs(ratio * math.sqrt(d) - 1) < 0.05 else
               f"the scores are scaled by {ratio:.3g}× the expected 1/√D")
        return CheckResult(SECTION, name, Status.FAIL,
                           f"{len(off)} of {len(fits)} layers use the wrong scale; {n}: softmax "
                           f"weights follow q·kᵀ × {s:.4g}, expected 1/√D = 1/√{d} = {e:.4g}: "
                           f"{why}", SCALE_HINT, details)
    if poor:
        n, (s, r2, e, d) = next(iter(poor.items()))
        return CheckResult(SECTION, name, Status.WARN,
                           f"{n}: the weights are not softmax(q·kᵀ·s) of the layer's own "
                           f"projections (fit r² = {r2:.3f}), so the scale cannot be read "
                           f"(fitted {s:.4g}, expected {e:.4g})",
                           "a custom attention that changes q or k outside in_proj (or adds "
                           "its own bias) cannot be checked here", details)
    s, r2, e, d = next(iter(fits.values()))
    return CheckResult(SECTION, name, Status.PASS,
                       f"in all {len(fits)} layers the softmax weights follow q·kᵀ × s with s "
                       f"within 5% of 1/√D = 1/√{d} = {e:.4g} (first layer: s = {s:.4g}, "
                       f"fit r² = {r2:.4f})", details=details)


def _repeated_token(subject: Subject) -> int:
    ids = subject.probe.ids
    real = ids[ids != subject.pad_id]
    return int(real.mode().values) if real.numel() else (subject.pad_id + 1) % subject.vocab


@guarded(SECTION, "position probe", POSITION_HINT)
def check_positions(subject: Subject) -> CheckResult:
    name = "position probe"
    t_len = int(subject.probe.ids.shape[1])
    if t_len < 2:
        return CheckResult(SECTION, name, Status.SKIP, "T < 2: one position only")
    token = _repeated_token(subject)
    const = torch.full((1, t_len), token, dtype=torch.long, device=subject.device)  # (1, T)
    with torch.no_grad():
        logits = subject.forward(const)[0]  # (T, V)
    spread = float((logits - logits[:1]).abs().max())
    tol = subject.tolerance(logits)
    details = {"token": token, "logit_spread": spread, "tolerance": tol}
    if spread > tol:
        return CheckResult(SECTION, name, Status.PASS,
                           f"token {token} repeated {t_len} times gets logits that differ by up "
                           f"to {spread:.3g} across positions: position information reaches the "
                           "output", details=details)
    if subject.attention:
        _, records = subject.captured_forward(const)
        first = next((r for r in records if r.self_attention), None)
        if first is not None:
            w = first.weights[0]  # (H, T, S)
            visible = w > 0
            uniform = visible / visible.sum(-1, keepdim=True).clamp_min(1)
            wobble = float((w - uniform).abs().max())
            details["first_layer_nonuniformity"] = wobble
            if wobble > 1e-6:
                return CheckResult(SECTION, name, Status.PASS,
                                   f"a repeated token gets equal logits at every position, but "
                                   f"{first.name}'s weights on it vary by up to {wobble:.2g} "
                                   "from uniform: positions enter inside attention (RoPE / "
                                   "ALiBi)", details=details)
            return CheckResult(SECTION, name, Status.FAIL,
                               f"token {token} repeated {t_len} times gets identical logits at "
                               f"every position (max difference {spread:.1g}) and uniform "
                               f"attention in {first.name}: the model cannot tell positions "
                               "apart", POSITION_HINT, details)
    return CheckResult(SECTION, name, Status.WARN,
                       f"token {token} repeated {t_len} times gets identical logits at every "
                       f"position (max difference {spread:.1g}): no absolute position signal "
                       "reaches the output. That is expected only if positions are applied "
                       "inside attention (RoPE / ALiBi), which cannot be seen from outside.",
                       POSITION_HINT, details)
