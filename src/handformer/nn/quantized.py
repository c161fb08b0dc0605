"""Weight-only int8: a linear layer that stores its weight in a quarter of fp32's bytes.

Why: at batch 1 a decoding step multiplies one vector by every weight matrix, so its time is
the time to *read* the weights from memory, not to multiply them. Storing each weight in
one byte instead of four cuts that read by 4×; the activations stay floating point.

The scheme, per output channel (row ``n`` of the (N, K) weight), symmetric::

    scale[n] = max_k |W[n, k]| / 127            (fp32; a zero row keeps a tiny scale)
    Q[n, k]  = round(W[n, k] / scale[n])        (int8 in [-127, 127])
    W[n, k] ≈ Q[n, k] · scale[n]                (error ≤ scale[n] / 2 per entry)

and since ``scale`` is per output, it factors out of the product:
``y[m, n] = scale[n] · Σ_k x[m, k] · Q[n, k] + bias[n]``.

Three kernels compute that sum, chosen by measurement (``bench.generation_speed``):

* ``native``: the hand-written C loop of ``int8_native`` (the default for a few float32
  rows). It rounds each input row to an int16 grid of its own (``xq = round(x / sx)``,
  ``sx = max|x| / 32767``) and multiplies integers, 32 pairs an instruction where the CPU
  has AVX-512 (16 with AVX2), so it spends less per weight byte than the float loop below.
  The one new rounding is x's, at most ``sx / 2`` per entry, so per output
  ``|error| ≤ scale[n] · Σ_k |Q[n, k]| · sx / 2`` beyond the weight's own; the integer sum is
  exact, so the result is the same on every CPU and whatever the rows around it. It runs on
  one thread whatever torch's thread count (a row's result never depends on it).
* ``fused``: ``torch.compile`` of the sum written as "convert each int8 on load, multiply,
  reduce" — inductor emits one loop that streams the int8 weight once and never builds a
  float copy. It is ~5× faster than fp32 on a weight too large for the caches, where the
  stock ``torch._weight_int8pack_mm`` is ~4× *slower* than fp32 on this CPU. It serves a few
  rows at a time (decoding: B rows of one token; speculation: the K + 1 positions a step
  verifies), each converted weight multiplied into every row, outside autograd. Each row
  count is compiled once per process, on first use — about a second each, a few seconds
  per model; ``compile_seconds`` says how many. It serves what ``native`` does not: bfloat16
  rows, and every row where the C loop cannot be built. Without a working compiler it falls
  back, once, with a warning.
* ``dequantized``: ``F.linear(x, Q.to(x.dtype)) · scale`` — a float copy of ``Q`` per call,
  then the ordinary matmul. For many rows (a long prompt, a validation batch) the copy is
  paid once for all of them; it is also the path that autograd (gradients to ``x``) goes
  through.

Shape legend: ``M`` rows (every leading dim of ``x`` flattened), ``K`` in features, ``N`` out
features.
"""

from __future__ import annotations

import math
import threading
import time
import warnings
from collections.abc import Callable
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from handformer.nn.int8_native import NativeProduct, native_build_seconds, native_status

__all__ = ["FUSED_MAX_ELEMENTS", "FUSED_MAX_ROWS", "INT8_MAX", "Int8Kernel", "Int8Linear",
           "compile_seconds", "dequantize_weight", "fused_kernel_status", "quantize_weight"]

INT8_MAX = 127  # symmetric: -128 is never used, so Q and -Q are both representable
# The fused kernel serves up to this many rows (B rows of one new token, or the K + 1
# positions a speculative step verifies), compiled for each row count it meets; more rows (a
# long prompt, a validation batch) dequantize once for all of them. Measured (one thread,
# 768 × 3072 weight): 8 rows fused 0.27 ms, dequantized 1.27, fp32 0.77; 12 rows 0.88 / 1.50 /
# 0.91; 16 rows 1.61 / 1.54 / 1.28 — each input row's running sums outgrow the core's fast
# caches, hence the second bound, on rows × K (12 rows at K = 3072; 16 at K ≤ 2304).
FUSED_MAX_ROWS = 16
FUSED_MAX_ELEMENTS = 12 * 3072
# A row whose largest |w| / 127 underflows float32 gets the smallest positive float32 as its
# scale, so Q = round(w / scale) stays finite (and within ±127: see quantize_weight).
_TINY_SCALE = torch.finfo(torch.float32).smallest_normal * 2.0**-23  # 1.4e-45, subnormal

Int8Kernel = Literal["auto", "native", "fused", "dequantized"]
KERNELS: tuple[str, ...] = ("auto", "native", "fused", "dequantized")


def quantize_weight(weight: Tensor, name: str = "weight") -> tuple[Tensor, Tensor]:
    """A float weight (N, K) → (int8 Q (N, K), fp32 scale (N,)), symmetric per output row.

    Every entry satisfies ``|W - Q·scale| ≤ scale / 2`` (up to float32 rounding), with
    ``scale = max|W[n]| / 127``. A zero row gives Q = 0 exactly. ``ValueError`` (naming
    ``name``) for a weight that is not 2-D floating point or holds NaN or ±inf — int8 has no
    such values, and a silent 0 or ±127 in their place would hide a damaged model.
    """
    if weight.dim() != 2 or not weight.is_floating_point():
        raise ValueError(f"{name}: expected a 2-D floating-point weight (N, K); got "
                         f"{tuple(weight.shape)} {weight.dtype}")
    w = weight.detach().float()  # (N, K)
    amax = w.abs().amax(dim=1)  # (N,): NaN where a row holds one, inf where it holds ±inf
    finite = torch.isfinite(amax)  # (N,)
    if not bool(finite.all()):
        bad_rows = (~finite).nonzero().flatten().tolist()
        raise ValueError(f"{name}: cannot quantize a weight holding {int(w.isnan().sum())} NaN "
                         f"and {int(w.isinf().sum())} infinite value(s) (rows "
                         f"{bad_rows[:5]}{'…' if len(bad_rows) > 5 else ''}); the model is "
                         "damaged — `handformer doctor --run DIR` checks a run")
    scale = (amax / INT8_MAX).clamp_min(_TINY_SCALE)  # (N,)
    # Never below max|w| / 127: a scale rounded down (subnormal ones lose digits) would push
    # the largest entry past 127, and clamping it would break the half-step bound.
    low = scale.double() * INT8_MAX < amax.double()  # (N,)
    scale = torch.where(low, torch.nextafter(scale, torch.full_like(scale, math.inf)), scale)
    q = w / scale[:, None]  # (N, K), a new tensor: rounded and clamped in place
    q.round_().clamp_(-INT8_MAX, INT8_MAX)
    return q.to(torch.int8), scale


def dequantize_weight(q: Tensor, scale: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """int8 Q (N, K) and scale (N,) → the float weight (N, K) they stand for."""
    return q.to(dtype) * scale.to(dtype)[:, None]  # (N, K)


# -- the kernels ------------------------------------------------------------------------------
# The fused loop splits the output features into this many interleaved streams (when N
# allows): each step of the reduction then carries that many independent accumulators, so
# the CPU overlaps their additions instead of waiting on one chain (two beat one and four
# on a 12L-768d step's weights).
_STREAMS = 2


def _fused_sum(x: Tensor, q: Tensor, scale: Tensor) -> Tensor:
    """x (M, K) float, q (N, K) int8, scale (N,) → (M, N). Written so that inductor emits
    one loop over the weight's rows that converts each int8 once, as it is loaded, and
    multiplies it into every input row — one reduction per input row and weight stream
    (``_STREAMS``), fused into the same loop, each with its own accumulator. Eager would
    build (N, K) float copies: only ever run compiled."""
    n, k = q.shape
    streams = _STREAMS if n % _STREAMS == 0 and n >= 16 * _STREAMS else 1
    q_streams = q.view(streams, n // streams, k)  # (S, N/S, K)
    columns = []
    for s in range(streams):
        qf = q_streams[s].to(x.dtype)  # (N/S, K): converted on load, never stored
        columns.append(torch.stack([(x[m] * qf).sum(dim=-1) for m in range(x.shape[0])]))
    out = torch.stack(columns, dim=1).view(x.shape[0], n)  # (M, S, N/S) → (M, N)
    return out * scale.to(x.dtype)  # (M, N)


def _fused_sum_bias(x: Tensor, q: Tensor, scale: Tensor, bias: Tensor) -> Tensor:
    """``_fused_sum`` plus the bias (N,), in the same loop."""
    return _fused_sum(x, q, scale) + bias.to(x.dtype)  # (M, N)


def _dequantized(x: Tensor, q: Tensor, scale: Tensor) -> Tensor:
    """x (..., K) → (..., N): one float copy of q, the ordinary matmul, the scale after."""
    return F.linear(x, q.to(x.dtype)) * scale.to(x.dtype)  # (..., N)


_Key = tuple[object, ...]


def _inductor_compile(graph: torch.fx.GraphModule,
                      examples: list[Tensor]) -> Callable[..., Tensor]:
    """``graph`` compiled by inductor, called as ``f(*inputs) -> Tensor``.

    ``torch._inductor.compile`` wraps the generated code in autograd's runtime wrappers
    (grad-mode and alias bookkeeping, ~10 µs a call here, as long as the product itself at
    decoding sizes). Nothing of that applies to this graph: inputs never require grad on this
    path and nothing aliases. So the inner compiler's output is kept and its generated
    ``call`` used directly — it still checks every input's size and stride. Where that
    output is not what this torch version returns, the public wrapper is used instead.
    """
    from torch._inductor import compile_fx

    inner: list[Any] = []

    def keep_inner(*args: Any, **kwargs: Any) -> Any:
        out = compile_fx.compile_fx_inner(*args, **kwargs)
        inner.append(out)
        return out

    public = compile_fx.compile_fx(graph, examples, inner_compile=keep_inner)
    runner = getattr(inner[0], "current_callable", None) if len(inner) == 1 else None
    if runner is None or not getattr(inner[0], "_boxed_call", False):
        return public  # type: ignore[return-value]

    def call(*inputs: Tensor) -> Tensor:
        return runner(list(inputs))[0]  # boxed: a fresh list, which the callee may empty

    with torch.no_grad():  # the shortcut must give what the wrapper gives, or not be used
        if not torch.equal(call(*examples), public(*examples)):
            return public  # type: ignore[return-value]
    return call


class _FusedKernel:
    """The fused product compiled by inductor, once per input shape, kept for the process.

    Why not ``torch.compile``: its guards and wrappers cost ~35 µs per call here, more than
    the product itself at these sizes (a step makes 4 such calls per layer). Tracing the
    function to a graph (``make_fx``) and compiling that with inductor (``_inductor_compile``)
    gives the same generated loop behind a few µs of call overhead — but no guards, so each
    compiled graph is only ever called with the exact shapes, dtypes and layout it was
    compiled for (the key below), which is why each shape compiles once. Inductor's on-disk
    cache makes later processes compile in a fraction of the time.
    """

    def __init__(self) -> None:
        self._compiled: dict[_Key, Callable[..., Tensor]] = {}
        self.broken: str | None = None
        self.seconds = 0.0  # spent compiling, all shapes together
        self._lock = threading.Lock()

    def _compile(self, key: _Key, args: tuple[Tensor, ...]) -> Callable[..., Tensor] | None:
        from torch.fx.experimental.proxy_tensor import make_fx

        t0 = time.perf_counter()
        try:
            fn = _fused_sum if len(args) == 3 else _fused_sum_bias
            examples = [a.detach().clone() for a in args]  # plain tensors, outside any mode
            with torch.inference_mode(False), torch.no_grad():
                compiled = _inductor_compile(make_fx(fn)(*examples), examples)
        except Exception as err:  # no C++ compiler, unsupported platform, …: many types
            text = str(err).strip()
            self.broken = f"{type(err).__name__}: {text.splitlines()[0] if text else ''}"
            warnings.warn(f"int8: the fused kernel cannot be compiled here ({self.broken}); "
                          "using the dequantize-then-matmul kernel instead (correct, but "
                          "slower than float32 at batch 1: int8 then saves memory, not time)",
                          RuntimeWarning, stacklevel=5)
            return None
        self.seconds += time.perf_counter() - t0
        self._compiled[key] = compiled
        return compiled

    def kernel_for(self, *args: Tensor) -> Callable[..., Tensor] | None:
        """The compiled product for exactly these inputs' shapes, dtypes, strides and device
        — (x (M, K), q (N, K), scale (N,)[, bias (N,)]) — compiling it on first request; None
        when compiling is impossible here (the caller falls back to the dequantized kernel)."""
        if self.broken is not None:
            return None
        key = tuple((a.shape, a.stride(), a.dtype, a.device) for a in args)
        compiled = self._compiled.get(key)
        if compiled is None:
            with self._lock:
                compiled = self._compiled.get(key) or self._compile(key, args)
        return compiled

    def shapes(self) -> int:
        """How many input shapes have been compiled so far."""
        return len(self._compiled)


_FUSED = _FusedKernel()


def compile_seconds() -> float:
    """Seconds this process has spent building int8 kernels: the C loop (0 when its library
    came from the disk cache) and the fused one, all shapes together (0 before first use;
    inductor's on-disk cache makes later processes faster)."""
    return _FUSED.seconds + native_build_seconds()


def fused_kernel_status() -> str | None:
    """Why the fused kernel is unavailable in this process, or None (not yet tried, or works)."""
    return _FUSED.broken


class Int8Linear(nn.Module):
    """``nn.Linear`` with an int8 weight and a float scale per output feature.

    ``forward(x (..., K)) -> (..., N)``, like ``nn.Linear``; ``x`` may be float32 or
    bfloat16 (the scale and bias follow ``.to(dtype)``; the int8 weight never changes).
    Stored tensors: ``qweight`` int8 (N, K) and ``scale`` (N,) as buffers (they are not
    trained), ``bias`` (N,) as a parameter. ``weight`` gives the dequantized float weight,
    so code that reads a linear layer's weight (the doctor's attention checks, cross-
    attention's slices) still works. Build one with ``Int8Linear.from_linear(linear)``.

    ``kernel``: ``"auto"`` (for up to ``FUSED_MAX_ROWS`` rows of input — a decoding step of B
    rows, the K + 1 positions a speculative step verifies, a short prompt: the native loop
    for float32 rows on the CPU, the fused one otherwise, the latter and the plain-C native
    loop only while rows × K stays within ``FUSED_MAX_ELEMENTS``; dequantized for more),
    ``"native"``, ``"fused"`` or ``"dequantized"`` (always that one where it can run; for
    tests and benchmarks). The fused kernel is compiled once per row count a layer shape
    meets; the native one once per machine (cached on disk).
    Whatever autograd must differentiate (training, ``x.requires_grad``) is dequantized.
    ``ValueError`` for an input whose last dim is not K.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *,
                 device: torch.device | str | None = None,
                 dtype: torch.dtype = torch.float32, kernel: Int8Kernel = "auto") -> None:
        super().__init__()
        if kernel not in KERNELS:
            raise ValueError(f"unknown int8 kernel {kernel!r}; expected one of {KERNELS}")
        self.in_features, self.out_features, self.kernel = in_features, out_features, kernel
        self._kernels: dict[tuple[object, ...], Callable[..., Tensor]] = {}
        self._native: NativeProduct | None = None  # the C loop bound to the stored tensors
        self.register_buffer("qweight", torch.zeros(out_features, in_features,
                                                    dtype=torch.int8, device=device))
        self.register_buffer("scale", torch.ones(out_features, dtype=dtype, device=device))
        self.bias = (nn.Parameter(torch.zeros(out_features, dtype=dtype, device=device))
                     if bias else None)

    @classmethod
    def from_linear(cls, linear: nn.Linear, name: str = "weight",
                    kernel: Int8Kernel = "auto") -> Int8Linear:
        """Quantize ``linear``'s weight (see ``quantize_weight``; ``name`` goes in its errors);
        the bias is copied as it is."""
        q, scale = quantize_weight(linear.weight, name)
        layer = cls(linear.in_features, linear.out_features, linear.bias is not None,
                    device=linear.weight.device, kernel=kernel)
        layer.qweight = q  # (N, K), fresh and contiguous: taken as it is, not copied
        with torch.no_grad():
            layer.scale.copy_(scale)
            if linear.bias is not None:
                layer.bias.copy_(linear.bias.float())  # type: ignore[union-attr]
        dtype = linear.weight.dtype
        return layer.to(dtype) if dtype != torch.float32 else layer

    @property
    def weight(self) -> Tensor:
        """The dequantized weight (N, K), in the scale's dtype (a new tensor each time)."""
        return dequantize_weight(self.qweight, self.scale, self.scale.dtype)

    def _stored(self) -> tuple[Tensor, ...]:
        """(qweight, scale[, bias]): what the kernels take after x. Read from the module's
        own dicts — at batch 1 a call is a few µs, and attribute lookup through
        ``nn.Module.__getattr__`` costs a visible share of it."""
        buffers, bias = self._buffers, self._parameters.get("bias")
        q, scale = buffers["qweight"], buffers["scale"]
        return (q, scale) if bias is None else (q, scale, bias)  # type: ignore[return-value]

    def _takes_row_loop(self, x: Tensor, rows: int) -> bool:
        """Whether ``x`` ((rows, K) once flattened) goes to a loop over the int8 rows — the C
        loop, else the fused one — rather than dequantize-then-matmul: a few rows under
        "auto" (see the class docstring), any rows for a pinned "native" or "fused", never
        when autograd needs a backward."""
        if torch.is_grad_enabled():
            bias = self._parameters.get("bias")
            if x.requires_grad or (bias is not None and bias.requires_grad):
                return False  # the compiled graph has no backward: autograd goes the other way
        if self.kernel != "auto":
            return self.kernel in ("native", "fused") and rows > 0
        return 0 < rows <= FUSED_MAX_ROWS

    def forward(self, x: Tensor) -> Tensor:
        """x (..., K) → (..., N)."""
        k = self.in_features
        if x.dim() == 0 or x.shape[-1] != k:
            raise ValueError(f"Int8Linear expects x of shape (..., {k}); got {tuple(x.shape)}")
        rows = x.numel() // k if k else 0
        if self._takes_row_loop(x, rows):
            # Rows × K past FUSED_MAX_ELEMENTS outgrow the fast caches of the fused and the
            # plain C loops; the vector C loops' tiles keep no running sums there and serve.
            wide = self.kernel == "auto" and rows * k > FUSED_MAX_ELEMENTS
            product = self._native_product(x)
            if product is not None and not (wide and not product.vectorized):
                # the C loop, bound to this layer: all rows in one call
                return product(x if x.is_contiguous() else x.contiguous())  # (..., N)
            out = None if wide else self._fused_forward(x, rows)
            if out is not None:  # None: it cannot compile here (warned once)
                return out
        out = _dequantized(x, self.qweight, self.scale)  # (..., N)
        return out if self.bias is None else out + self.bias.to(out.dtype)

    def _native_product(self, x: Tensor) -> NativeProduct | None:
        """The C loop bound to this layer's stored tensors, or None where it does not serve
        ``x`` (already bound for a few-row kernel): rows not float32 on the CPU, the layer
        pinned to ``"fused"``, no loop built here, or stored tensors it cannot read (the
        checks ``NativeProduct`` makes). Bound once; bound again when they were replaced."""
        if self.kernel == "fused" or x.dtype != torch.float32 or not x.is_cpu:
            return None
        stored = self._stored()
        q, scale = stored[0], stored[1]
        bias = stored[2] if len(stored) == 3 else None
        product = self.__dict__.get("_native")  # absent in a layer pickled before it
        if product is not None and product.matches(q, scale, bias):
            return product
        if native_status() is not None:
            return None
        try:
            product = NativeProduct(q, scale, bias)
        except ValueError:  # e.g. a bfloat16 scale: the fused kernel serves it instead
            product = None
        self._native = product
        return product

    def _fused_forward(self, x: Tensor, rows: int) -> Tensor | None:
        """x (..., K) → (..., N) through the fused kernel compiled for its row count (rows
        beyond ``FUSED_MAX_ROWS`` — only with ``kernel="fused"`` — in blocks of that many)."""
        flat = x.reshape(rows, self.in_features)  # (M, K)
        if not flat.is_contiguous():
            flat = flat.contiguous()
        stored = self._stored()
        blocks = []
        for start in range(0, rows, FUSED_MAX_ROWS):
            block = flat if rows <= FUSED_MAX_ROWS else flat[start : start + FUSED_MAX_ROWS]
            kernel = self._kernels.get((block.shape[0], block.dtype)) or \
                self._add_kernel(block, stored)
            if kernel is None:
                return None
            blocks.append(kernel(block, *stored))  # (rows of the block, N)
        out = blocks[0] if len(blocks) == 1 else torch.cat(blocks)  # (M, N)
        return out.view((*x.shape[:-1], self.out_features))  # (..., N)

    def _add_kernel(self, block: Tensor, stored: tuple[Tensor, ...]
                    ) -> Callable[..., Tensor] | None:
        """Find the shared compiled product for ``block``'s row count and dtype (compiling it
        on first request) and add it to this layer's own index, which a step reads with one
        small key instead of describing every input (µs a call at batch 1). Its tensors'
        dtypes and device are fixed between two ``_apply``s (``.to()``), which empty the
        index. None where nothing can compile here."""
        kernel = _FUSED.kernel_for(block, *stored)
        if kernel is not None:
            self._kernels[(block.shape[0], block.dtype)] = kernel
        return kernel

    def __getstate__(self) -> dict[str, Any]:
        """Pickled (``torch.save(model)``) without the compiled kernels: they are found again
        on first use."""
        state = super().__getstate__()  # type: ignore[misc]
        return {**state, "_kernels": {}, "_native": None}

    def _apply(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Int8Linear:
        """``.to()``, ``.cuda()``, …: the tensors change, so forget the kernels found for them."""
        self._kernels, self._native = {}, None
        return super()._apply(fn, *args, **kwargs)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, weight=int8 per-output-channel, "
                f"kernel={self.kernel}")
