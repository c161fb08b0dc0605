"""Position information, four ways.

Self-attention is blind to order: permute the tokens and the outputs permute with them.

* Added to the token embeddings: ``sinusoidal`` (fixed) and ``learned`` (a table). Both map
  integer positions (…, T) to vectors (…, T, C).
* Applied inside attention: ``rope`` rotates queries and keys by an angle proportional to
  their position, so q·k depends only on the *offset* between them; ``alibi`` adds a
  per-head linear penalty on the distance to the attention scores. Neither has parameters
  or a table, which is why they can be run past the training length.

Shape legend: ``B`` batch, ``H`` heads, ``T`` positions, ``D`` head dim, ``C`` model dim.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor, nn

__all__ = [
    "ADDITIVE_KINDS",
    "POSITIONAL_KINDS",
    "ROPE_SCALING_KINDS",
    "LearnedPositions",
    "RopeScaling",
    "RotaryEmbedding",
    "SinusoidalPositions",
    "alibi_bias",
    "alibi_slopes",
    "build_positional",
    "rope_frequencies",
]

POSITIONAL_KINDS: tuple[str, ...] = ("sinusoidal", "learned", "rope", "alibi")
ADDITIVE_KINDS: tuple[str, ...] = ("sinusoidal", "learned")  # added to the embeddings


class SinusoidalPositions(nn.Module):
    """sin/cos of geometrically spaced frequencies (Vaswani et al., 2017). No parameters.

    Channel pairs (2i, 2i+1) hold sin(p·ω_i) and cos(p·ω_i) with ω_i = base^(-2i/C), so a
    shift by k is a fixed rotation of each pair — relative offsets are linear functions of
    the encoding. Computed from the positions on the fly, so any position is valid.
    """

    def __init__(self, d_model: int, base: float = 10000.0) -> None:
        super().__init__()
        if d_model % 2 != 0:
            raise ValueError(f"sinusoidal positions need an even d_model; got {d_model}")
        self.d_model = d_model
        inv_freq = torch.exp(torch.arange(0, d_model, 2).float() * (-math.log(base) / d_model))
        self.register_buffer("inv_freq", inv_freq, persistent=False)  # (C/2,)

    def forward(self, positions: Tensor) -> Tensor:
        angles = positions.unsqueeze(-1).float() * self.inv_freq  # (…, T, C/2)
        enc = torch.stack((angles.sin(), angles.cos()), dim=-1)  # (…, T, C/2, 2)
        return enc.flatten(-2)  # (…, T, C), channels interleaved sin, cos, sin, cos …


class LearnedPositions(nn.Module):
    """One trained vector per position, up to ``max_len`` — and not one position further."""

    def __init__(self, max_len: int, d_model: int) -> None:
        super().__init__()
        self.max_len = max_len
        self.table = nn.Embedding(max_len, d_model)

    def forward(self, positions: Tensor) -> Tensor:
        # The range check reads a value back to the host, which a traced graph (torch.export,
        # the ONNX exporter, torch.compile) cannot express: it runs in eager calls only.
        if (not torch.compiler.is_compiling() and positions.numel()
                and int(positions.max()) >= self.max_len):
            length = int(positions.max()) + 1
            raise ValueError(
                f"learned positions cover 0..{self.max_len - 1} (max_len={self.max_len}) but "
                f"position {length - 1} was asked for (sequence length {length}). Crop the "
                f"input to max_len, train with a larger max_len, or use positional="
                f"'sinusoidal', 'rope' or 'alibi' (defined for any position)."
            )
        return self.table(positions)  # (…, T, C)


ROPE_SCALING_KINDS: tuple[str, ...] = ("none", "linear", "llama3")


@dataclass(frozen=True)
class RopeScaling:
    """How a long-context checkpoint stretches RoPE's frequencies (``kind`` in
    ``ROPE_SCALING_KINDS``).

    * ``linear`` — every frequency divided by ``factor`` (position interpolation).
    * ``llama3`` — Llama 3.1's rule, by wavelength λ = 2π/θ against the pre-training window
      L = ``original_max_len``: λ < L / ``high_freq_factor`` keeps θ (fast rotations already
      repeat inside the window), λ > L / ``low_freq_factor`` becomes θ / ``factor`` (slow
      ones are interpolated), and in between θ blends linearly in L/λ between the two.
    """

    kind: str
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_len: int = 8192

    def __post_init__(self) -> None:
        if self.kind not in ROPE_SCALING_KINDS[1:]:
            raise ValueError(f"unknown RoPE scaling {self.kind!r}; implemented: "
                             f"{ROPE_SCALING_KINDS[1:]}")
        if not self.factor >= 1.0:
            raise ValueError(f"RoPE scaling factor must be >= 1; got {self.factor}")
        if self.kind == "llama3" and not (0 < self.low_freq_factor < self.high_freq_factor
                                          and self.original_max_len > 0):
            raise ValueError("llama3 RoPE scaling needs 0 < low_freq_factor < high_freq_factor "
                             f"and original_max_len > 0; got {self}")


def rope_frequencies(head_dim: int, base: float, scaling: RopeScaling | None = None) -> Tensor:
    """θ_i = base^(-2i/D) for each of the D/2 channel pairs, then ``scaling`` applied: (D/2,)."""
    # In fp32, written 1 / base^(2i/D): the rounding published checkpoints were trained with.
    inv_freq = 1.0 / base ** (torch.arange(0, head_dim, 2).float() / head_dim)
    if scaling is not None and scaling.kind == "linear":
        inv_freq = inv_freq / scaling.factor
    elif scaling is not None:  # llama3
        s = scaling
        ratio = s.original_max_len * inv_freq / (2 * math.pi)  # L / λ for each pair
        # 0 at λ = L / low_freq_factor (fully interpolated) … 1 at L / high_freq_factor (kept).
        keep = ((ratio - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor))
        keep = keep.clamp(0.0, 1.0)
        inv_freq = keep * inv_freq + (1 - keep) * inv_freq / s.factor
    return inv_freq  # (D/2,)


class RotaryEmbedding(nn.Module):
    """Rotary position embedding (Su et al., 2021), applied to q and k inside attention.

    Each channel pair (2i, 2i+1) of a head is read as a complex number and multiplied by
    e^{i·p·θ_i}, θ_i = base^(-2i/D) (``rope_frequencies``, optionally ``scaling``).
    Rotations preserve norms, and ⟨R(m)q, R(n)k⟩ = Re Σ q_i·conj(k_i)·e^{i(m−n)θ_i} depends
    on m − n only. Hugging Face Llama-family checkpoints pair channel i with i + D/2 instead
    ("rotate half"); ``handformer.interop.llama`` permutes their q/k rows into these pairs on
    the way in (and back on the way out), so one rotation serves both.
    """

    def __init__(self, head_dim: int, base: float = 10000.0,
                 scaling: RopeScaling | None = None) -> None:
        super().__init__()
        if head_dim % 2 != 0:
            raise ValueError(f"rotary embedding needs an even head dim; got {head_dim}")
        self.head_dim = head_dim
        self.base = base
        self.scaling = scaling
        inv_freq = rope_frequencies(head_dim, base, scaling)  # (D/2,)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, x: Tensor, positions: Tensor) -> Tensor:
        """x (B, H, T, D); positions (T,) or (B, T) → rotated x, same shape and dtype."""
        if positions.dim() == 1:
            positions = positions[None, :]  # (1, T)
        angles = positions[:, None, :, None].float() * self.inv_freq  # (B|1, 1, T, D/2)
        cos, sin = angles.cos(), angles.sin()
        xf = x.float()
        even, odd = xf[..., 0::2], xf[..., 1::2]  # (B, H, T, D/2) each
        rotated = torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1)
        return rotated.flatten(-2).to(x.dtype)  # (B, H, T, D), pairs interleaved again


def alibi_slopes(n_heads: int) -> Tensor:
    """Per-head slopes of Press et al. (2022): a geometric sequence 2^(-8/n), 2^(-16/n), …

    For a head count that is not a power of two, take the slopes of the nearest lower power
    of two and fill up with every other slope of the next power (the paper's recipe).
    """

    def power_of_two(n: int) -> list[float]:
        start = 2.0 ** (-8.0 / n)
        return [start ** (i + 1) for i in range(n)]

    if n_heads <= 0:
        raise ValueError(f"n_heads must be positive; got {n_heads}")
    lower = 2 ** math.floor(math.log2(n_heads))
    slopes = power_of_two(lower)
    if lower != n_heads:
        slopes += power_of_two(2 * lower)[0::2][: n_heads - lower]
    return torch.tensor(slopes)  # (H,)


def alibi_bias(slopes: Tensor, q_positions: Tensor, k_positions: Tensor) -> Tensor:
    """Additive score bias −slope_h · |i − j|: (H,), (B|1, T), (B|1, S) → (B|1, H, T, S).

    The absolute distance makes the same function serve causal decoders (where only
    j ≤ i is ever attended) and bidirectional encoders.
    """
    distance = (q_positions[:, :, None] - k_positions[:, None, :]).abs()  # (B|1, T, S)
    return -slopes[None, :, None, None] * distance[:, None].float()  # (B|1, H, T, S)


def build_positional(kind: str, d_model: int, max_len: int) -> nn.Module | None:
    """The module added to the embeddings; ``None`` for kinds applied inside attention."""
    if kind == "sinusoidal":
        return SinusoidalPositions(d_model)
    if kind == "learned":
        return LearnedPositions(max_len, d_model)
    if kind in ("rope", "alibi"):
        return None
    raise ValueError(f"unknown positional kind {kind!r}; expected one of {POSITIONAL_KINDS}")
