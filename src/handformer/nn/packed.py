"""A float32 linear layer whose weight oneDNN holds in its own blocked layout, for inference on
the CPU.

torch multiplies a float32 ``nn.Linear`` on the CPU through its BLAS (MKL in the wheels).
BLAS libraries pick their kernels per CPU, and not every CPU gets their fastest ones: on some,
oneDNN's matrix product over a weight reordered once into the layout its kernels read
(``torch.ops.mkldnn._reorder_linear_weight`` — what torch's own compiler does for frozen CPU
models) multiplies the same numbers markedly faster, at one row and at many. Which is faster
is a property of the CPU, so nothing here decides it: ``handformer.models.packing`` measures
both on the machine it runs on.

A ``PackedLinear`` is for inference only: the reordered weight is an opaque oneDNN tensor, not
a parameter — nothing trains it, ``state_dict`` does not hold it, and it has no ``weight`` to
read. The results are float32 products of the same numbers, summed in another order: they
match ``nn.Linear``'s to float32 rounding, not bit for bit.

oneDNN compiles a kernel for every row count it is given and keeps it (a fraction of a
megabyte each, whatever the weight's size). A server's steps meet every row count from 1 to
far past its batch (prompts are prefilled beside running requests), so the row counts a
layer hands to oneDNN come from a fixed set: up to ``EXACT_ROWS`` as they are (the decoding
steps of a small batch, where a zero row would cost the most), above that rounded up to a
multiple of ``ROW_STEP`` with rows of zeros that are multiplied and dropped, and inputs
taller than ``ROWS_PER_CALL`` split into pieces of near-equal height. That keeps at most
``EXACT_ROWS + (ROWS_PER_CALL - EXACT_ROWS) // ROW_STEP`` kernels per layer shape. Each
piece reads the whole weight, so pieces are few and as tall as that bound allows: one call
of 45 rows costs less than 32 rows and then 13, and a few zero rows cost less than another
pass over the weight.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

__all__ = ["EXACT_ROWS", "ROWS_PER_CALL", "ROW_STEP", "PackedLinear", "call_rows",
           "onednn_packing_available"]

ROWS_PER_CALL = 64
EXACT_ROWS = 16
ROW_STEP = 4


def call_rows(rows: int) -> list[tuple[int, int]]:
    """How ``rows`` input rows are multiplied: a list of (rows taken, rows handed to oneDNN)
    per call — near-equal pieces of at most ``ROWS_PER_CALL``, each padded from above
    ``EXACT_ROWS`` up to a multiple of ``ROW_STEP``."""
    calls = -(-rows // ROWS_PER_CALL)  # ceil
    base, extra = divmod(rows, calls) if calls else (0, 0)
    pieces = [base + 1] * extra + [base] * (calls - extra)
    return [(p, p if p <= EXACT_ROWS else -(-p // ROW_STEP) * ROW_STEP) for p in pieces]


def _product(rows: Tensor, packed: Tensor, bias: Tensor | None) -> Tensor:
    """rows (M, K) @ the packed (N, K) weight, transposed, + bias → (M, N): one oneDNN call."""
    return torch.ops.mkldnn._linear_pointwise(rows, packed, bias, "none", [], "")


def onednn_packing_available() -> bool:
    """Whether this torch build has oneDNN's reordered-weight linear product."""
    return torch.backends.mkldnn.is_available() and hasattr(
        torch.ops.mkldnn, "_reorder_linear_weight")


class PackedLinear(nn.Module):
    """``nn.Linear``'s ``forward`` over a weight oneDNN reordered once: ``x (..., K) ->
    (..., N)``, float32 on the CPU. Build one with ``PackedLinear.from_linear(linear)``.

    ``ValueError`` for an input that is not float32 on the CPU or whose last dim is not K.
    """

    def __init__(self, packed_weight: Tensor, bias: Tensor | None, in_features: int,
                 out_features: int) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self._packed = packed_weight  # oneDNN's opaque layout of the (N, K) weight
        self.register_buffer("bias", bias)

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> PackedLinear:
        """Reorder ``linear``'s weight for oneDNN (the bias is kept as it is). ``ValueError``
        for a weight that is not float32 on the CPU, or a torch without oneDNN."""
        w = linear.weight
        if w.dtype != torch.float32 or w.device.type != "cpu":
            raise ValueError(f"oneDNN packing is for float32 weights on the CPU; got "
                             f"{w.dtype} on {w.device}")
        if not onednn_packing_available():
            raise ValueError("this torch build has no oneDNN (torch.backends.mkldnn is not "
                             "available): its float32 products stay on BLAS")
        with torch.no_grad():
            packed = torch.ops.mkldnn._reorder_linear_weight(w.detach(), None)
            bias = None if linear.bias is None else linear.bias.detach().clone()
        return cls(packed, bias, linear.in_features, linear.out_features)

    def forward(self, x: Tensor) -> Tensor:
        """x (..., K) → (..., N)."""
        k = self.in_features
        if x.dtype != torch.float32 or x.device.type != "cpu" or x.shape[-1:] != (k,):
            raise ValueError(f"a packed linear layer takes float32 CPU input (..., {k}); got "
                             f"{x.dtype} {tuple(x.shape)} on {x.device}")
        rows = x.reshape(-1, k).contiguous()  # (M, K)
        m, packed, bias = rows.shape[0], self._packed, self._buffers["bias"]
        if m == 0:
            return x.new_zeros(*x.shape[:-1], self.out_features)
        if m <= EXACT_ROWS:  # one call, as it is
            return _product(rows, packed, bias).view(*x.shape[:-1], self.out_features)
        pieces, start = [], 0
        for taken, height in call_rows(m):
            piece = rows[start : start + taken]  # (taken, K)
            if height > taken:  # zero rows up to a kernel oneDNN already has
                piece = torch.cat([piece, piece.new_zeros(height - taken, k)])  # (height, K)
            pieces.append(_product(piece, packed, bias)[:taken])  # (taken, N)
            start += taken
        y = pieces[0] if len(pieces) == 1 else torch.cat(pieces)  # (M, N)
        return y.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self._buffers['bias'] is not None}, oneDNN-packed")
