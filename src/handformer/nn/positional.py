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

import torch
from torch import Tensor, nn

__all__ = [
    "ADDITIVE_KINDS",
    "POSITIONAL_KINDS",
    "LearnedPositions",
    "RotaryEmbedding",
    "SinusoidalPositions",
    "alibi_bias",
    "alibi_slopes",
    "build_positional",
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


class RotaryEmbedding(nn.Module):
    """Rotary position embedding (Su et al., 2021), applied to q and k inside attention.

    Each channel pair (2i, 2i+1) of a head is read as a complex number and multiplied by
    e^{i·p·θ_i}, θ_i = base^(-2i/D). Rotations preserve norms, and
    ⟨R(m)q, R(n)k⟩ = Re Σ q_i·conj(k_i)·e^{i(m−n)θ_i} depends on m − n only.
    """

    def __init__(self, head_dim: int, base: float = 10000.0) -> None:
        super().__init__()
        if head_dim % 2 != 0:
            raise ValueError(f"rotary embedding needs an even head dim; got {head_dim}")
        self.head_dim = head_dim
        self.base = base
        inv_freq = base ** (-torch.arange(0, head_dim, 2).float() / head_dim)  # (D/2,)
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
