"""Attention masks as pure functions.

Convention (the one rule every module follows): a mask is boolean and ``True`` means
"this query may attend to this key". torch's ``nn.MultiheadAttention`` uses the opposite
polarity (``True`` = ignore) and its float masks are *additive* (0 = attend, ``-inf`` =
ignore); the converters at the bottom of this file are the only place in handformer where
those conventions are translated. ``check_padding_mask`` refuses any other mask at a model's
entry and says how to convert it: a float or int mask is never read as a boolean (``0.0``
would become False, ``-inf`` True — the padding turned inside out).

Shape legend: ``B`` batch, ``T`` query length, ``S`` key length, ``H`` heads.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = [
    "MASK_CONVERSIONS",
    "causal_mask",
    "check_padding_mask",
    "combine_masks",
    "from_additive_mask",
    "from_torch_key_padding_mask",
    "padding_mask",
    "to_torch_attn_mask",
    "to_torch_key_padding_mask",
]


def padding_mask(ids: Tensor, pad_id: int = 0) -> Tensor:
    """``True`` on real tokens, ``False`` on padding.

    ``ids`` (B, T) → (B, T) bool. Pad positions may still *receive* information (their
    own outputs are computed), but no query may attend *to* them.
    """
    if ids.dim() != 2:
        raise ValueError(f"padding_mask expects ids of shape (B, T); got {tuple(ids.shape)}")
    return ids != pad_id


# How to turn the masks other libraries use into handformer's; every refusal quotes it.
MASK_CONVERSIONS = (
    "To convert: a 0/1 mask with 1 on real tokens (Hugging Face's attention_mask) with "
    "mask.bool(); a torch additive float mask "
    "(0 = attend, -inf = ignore) with handformer.masks.from_additive_mask(mask); a torch "
    "bool key_padding_mask (True = ignore) with "
    "handformer.masks.from_torch_key_padding_mask(mask)"
)


def check_padding_mask(mask: object, shape: tuple[int, ...], who: str,
                       name: str = "padding_mask") -> None:
    """Raise ``ValueError`` unless ``mask`` is a bool tensor of ``shape`` (True = real token).

    A float or int mask is refused rather than cast: PyTorch's additive masks hold 0 where
    a token is kept and ``-inf`` where it is ignored, so ``.bool()`` would invert them, and a
    model that accepted one would return plausible but wrong logits. The message names the
    caller (``who``), the argument, handformer's polarity and the conversions.
    """
    if not isinstance(mask, Tensor):
        raise ValueError(f"{who}: {name} must be a torch bool tensor of shape {tuple(shape)}; "
                         f"got {type(mask).__name__}")
    if tuple(mask.shape) != tuple(shape) or mask.dtype != torch.bool:
        raise ValueError(
            f"{who}: {name} must be bool (B, T) = {tuple(shape)} with True on real tokens; "
            f"got {mask.dtype} {tuple(mask.shape)}"
            + ("" if mask.dtype == torch.bool else f". {MASK_CONVERSIONS}")
        )


def causal_mask(t_q: int, t_k: int | None = None, *, device: torch.device | str | None = None
                ) -> Tensor:
    """Lower-triangular (T_q, T_k) mask, aligned to the *end* of the keys.

    With ``t_q == t_k == 4``::

        1 0 0 0
        1 1 0 0
        1 1 1 0
        1 1 1 1

    With ``t_q = 2, t_k = 4`` (two new queries after two cached keys) the rows are the last
    two of the square mask, so query ``i`` sits at absolute position ``t_k - t_q + i``::

        1 1 1 0
        1 1 1 1
    """
    t_k = t_q if t_k is None else t_k
    if t_q < 0 or t_k < t_q:
        raise ValueError(
            f"causal_mask needs 0 <= t_q <= t_k; got t_q={t_q}, t_k={t_k} "
            "(queries must be the last t_q positions of the keys)"
        )
    offset = t_k - t_q
    rows = torch.arange(t_q, device=device).unsqueeze(1) + offset  # (T, 1) absolute positions
    cols = torch.arange(t_k, device=device).unsqueeze(0)  # (1, S)
    return cols <= rows  # (T, S)


def combine_masks(
    key_padding: Tensor | None = None,
    causal: Tensor | None = None,
    *,
    t_q: int | None = None,
) -> Tensor | None:
    """Combine a (B, S) padding mask and a (T, S) causal mask into (B, 1, T, S).

    Either may be ``None``; with both ``None`` the result is ``None`` (attend everywhere).
    The singleton head axis lets the mask broadcast over heads.
    """
    if key_padding is None and causal is None:
        return None
    if key_padding is not None:
        if key_padding.dim() != 2 or key_padding.dtype != torch.bool:
            raise ValueError(
                f"key padding mask must be bool (B, S), True on real tokens; got "
                f"{key_padding.dtype} {tuple(key_padding.shape)}. {MASK_CONVERSIONS}"
            )
        pad4 = key_padding[:, None, None, :]  # (B, 1, 1, S)
    if causal is not None:
        if causal.dim() != 2 or causal.dtype != torch.bool:
            raise ValueError(
                f"causal mask must be bool (T, S); got {causal.dtype} {tuple(causal.shape)}"
            )
        if key_padding is not None and causal.shape[1] != key_padding.shape[1]:
            raise ValueError(
                f"causal mask {tuple(causal.shape)} and padding mask {tuple(key_padding.shape)} "
                "disagree on the key length S"
            )
        causal4 = causal[None, None, :, :]  # (1, 1, T, S)
        return causal4 if key_padding is None else pad4 & causal4  # (B, 1, T, S)
    t = 1 if t_q is None else t_q
    return pad4.expand(-1, -1, t, -1)  # (B, 1, T, S)


def to_torch_key_padding_mask(key_padding: Tensor) -> Tensor:
    """handformer (B, S) ``True`` = real token → torch ``key_padding_mask`` ``True`` = ignore."""
    if key_padding.dtype != torch.bool:
        raise ValueError(f"padding mask must be boolean (True = real token); got "
                         f"{key_padding.dtype}")
    return ~key_padding


def from_torch_key_padding_mask(torch_mask: Tensor) -> Tensor:
    """torch ``key_padding_mask`` (``True`` = ignore) → handformer polarity (``True`` = attend)."""
    if torch_mask.dtype != torch.bool:
        raise ValueError(
            f"only boolean torch key_padding_mask can be converted; got {torch_mask.dtype}"
        )
    return ~torch_mask


def from_additive_mask(additive: Tensor) -> Tensor:
    """A torch-style additive float mask → handformer polarity: ``0`` (attend) → ``True``;
    a negative value (``-inf``, or a large negative such as ``finfo.min``) → ``False``.

    ``[[0., 0., -inf]]`` → ``[[True, True, False]]``. Positive or NaN entries mean the
    tensor is a bias, not a mask: ``ValueError``.
    """
    if not additive.is_floating_point():
        raise ValueError(f"from_additive_mask takes a float mask (0 = attend, -inf = ignore); "
                         f"got {additive.dtype}")
    if bool((additive > 0).any() | additive.isnan().any()):
        raise ValueError("from_additive_mask: an additive mask holds 0 (attend) and negative "
                         "values (ignore) only; this one has positive or NaN entries")
    return additive == 0


def to_torch_attn_mask(mask: Tensor) -> Tensor:
    """handformer (T, S) attend-mask → torch ``nn.MultiheadAttention`` ``attn_mask``."""
    return ~mask
