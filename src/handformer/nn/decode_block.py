"""A whole block's decoding step as one kernel (``decode_block.c``), for int8 models at batch 1.

Why: a cached decoding step of one token reads each block's int8 weights and its cached keys
and values once, and the two C loops that read them (``int8_native``, ``decode_attention``) go
near memory's rate. Run one module at a time, the step also pays Python for every module and
ctypes call and a dozen small torch ops per block (norms, GELU, adds, the cache write), each
running cold after the weights streamed through the caches; together that cost about as much
as the loops. The C step runs the block's modules' own arithmetic in one call: the same
products and attention (same bits), and the norms and activation in plain C.

It is a kernel, chosen per call like attention's: ``TransformerBlock.forward`` asks ``step``
first, and ``step`` declines (returns None) for anything but the case it was written for —
one token of one request (x (1, 1, C) float32 on the CPU) with a contiguous float32
``KVCache`` (stored column by column; not serving's paged one), no mask, no gradient, not
under ``torch.compile`` or a tracer (the C call would not be recorded), a pre-norm block
without cross-attention, RoPE, ALiBi or QK-norm, LayerNorm or RMSNorm, every projection an
``Int8Linear`` the C loop serves, attention not set to ``manual`` (read at every call:
``forced_attention_kind`` switches it) — and whenever something watches the block's
modules (a forward hook, ``capture_attention``'s wrapper), so that hooks and captures still
see every step.
``stack_step`` runs a whole stack of such blocks as one C call (``Trunk.run_blocks`` asks it
first), so that no Python runs between blocks while their weights stream through the caches;
it declines unless every block is served, in eval mode, and unhooked itself (the blocks are
then called one by one, each asking ``step``). ``token_step`` runs a whole token of a
``DecoderLM`` as one C call — the embedding's rows, the stack, the final norm and the head —
so that the Python around the stack, which ran cold after the weights' stream too, is not
run at all (``DecoderLM.forward`` asks it first for one real token of one request; it
declines to the stack where the model's ends are not ones it knows or are watched).
``greedy_token`` is that call for greedy decoding (``generate`` asks it first for one
request): it also writes the logits' argmax into the caller's token buffer and reads the
next call's id from there, so that between tokens no tensor op and no module call runs —
each would run cold, as the ends' Python did. Every call checks all of that again, which
touches every module and tensor of every block — cold, since the weights' stream has just
pushed them out of the caches — unless the caller's loop holds the checks
(``checks_held``: ``generate`` does, and lets go after each ``on_token``). ``disabled()``
turns both off for a block of code (tests hold the paths equal; benchmarks time both). The
path (AVX-512 VNNI, AVX-512, AVX2, plain C) is the int8 loop's, capped by ATen's level;
every path gives the same bits.
"""

from __future__ import annotations

import ctypes
import math
import threading
import weakref
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch
from torch import Tensor, nn

from handformer.nn.attention import MultiHeadAttention
from handformer.nn.feedforward import ACTIVATIONS, FeedForward
from handformer.nn.kv_cache import DecoderCache, KVCache
from handformer.nn.native_build import NativeLibrary
from handformer.nn.norm import RMSNorm
from handformer.nn.quantized import Int8Linear

__all__ = ["StackHold", "block_step_status", "checks_held", "disabled", "greedy_token",
           "stack_step", "step", "token_step"]

_ATEN_CAP = {"DEFAULT": 0, "AVX2": 1, "AVX512": 3}  # int8_kernel.c's ISA_* values
_P, _I64 = ctypes.c_void_p, ctypes.c_int64


class _Linear(ctypes.Structure):
    _fields_ = [("q", _P), ("scale", _P), ("bias", _P), ("n", _I64), ("k", _I64)]


class _Block(ctypes.Structure):
    _fields_ = [("d_model", _I64), ("n_heads", _I64), ("n_kv_heads", _I64), ("head_dim", _I64),
                ("norm_type", ctypes.c_int32), ("activation", ctypes.c_int32),
                ("eps", ctypes.c_float), ("attn_scale", ctypes.c_float),
                ("norm1_w", _P), ("norm1_b", _P), ("norm2_w", _P), ("norm2_b", _P),
                ("in_proj", _Linear), ("out_proj", _Linear), ("fc_in", _Linear),
                ("fc_out", _Linear)]


class _Ends(ctypes.Structure):
    _fields_ = [("token", _P), ("n_tokens", _I64), ("positions", _P), ("n_positions", _I64),
                ("norm_type", ctypes.c_int32), ("eps", ctypes.c_float), ("norm_w", _P),
                ("norm_b", _P), ("head", _Linear)]


def _bind(lib: ctypes.CDLL) -> None:
    lib.hf_decode_block.restype = ctypes.c_int
    lib.hf_decode_block.argtypes = [ctypes.c_int, ctypes.POINTER(_Block), _P, _P, _I64, _I64,
                                    _P]
    lib.hf_decode_stack.restype = ctypes.c_int
    lib.hf_decode_stack.argtypes = [ctypes.c_int, _I64, ctypes.POINTER(ctypes.POINTER(_Block)),
                                    ctypes.POINTER(_P), ctypes.POINTER(_I64), _I64, _P, _P, _P]
    lib.hf_decode_token.restype = ctypes.c_int
    lib.hf_decode_token.argtypes = [ctypes.c_int, _I64, ctypes.POINTER(ctypes.POINTER(_Block)),
                                    ctypes.POINTER(_P), ctypes.POINTER(_I64), _I64, _P, _I64,
                                    ctypes.POINTER(_Ends), _P, _P, _P]


_LIB = NativeLibrary("decode_block.c", "hf_block_best_isa", _ATEN_CAP, _bind,
                     includes=("decode_attention.c", "int8_kernel.c", "scratch.h"))
_OFF = threading.local()  # .depth > 0 inside disabled()
# block → its binding; weak, so a dropped model frees its binding (which holds its tensors)
_BOUND: weakref.WeakKeyDictionary[nn.Module, _Binding] = weakref.WeakKeyDictionary()


def block_step_status() -> str | None:
    """Why the block kernel cannot run in this process, or None (it can)."""
    _LIB.lib()
    return _LIB.broken


@contextmanager
def disabled() -> Iterator[None]:
    """Within the block (this thread), every block runs module by module."""
    _OFF.depth = getattr(_OFF, "depth", 0) + 1
    try:
        yield
    finally:
        _OFF.depth -= 1


def _watched(module: nn.Module) -> bool:
    """Whether anything hooks ``module`` or has replaced its ``forward``."""
    return bool(module._forward_hooks or module._forward_pre_hooks
                or "forward" in module.__dict__)


def _hooked_globally() -> bool:
    """Whether a hook is registered for every module (``nn.modules.module``'s global ones)."""
    g = nn.modules.module
    return bool(g._global_forward_hooks or g._global_forward_pre_hooks)


def _parts(block: nn.Module) -> tuple[nn.Module, ...] | None:
    """(self_attn, in_proj, out_proj, norm1, ffn, fc_in, fc_out, norm2), or None where the
    block is not one the kernel runs or a module of it is watched. Dict reads, not
    attribute lookups: this runs once per block and token."""
    mods = block._modules  # a stack may hold a module of the user's in a block's place
    attn, ffn = mods.get("self_attn"), mods.get("ffn")
    if mods.get("cross_attn") is not None or attn is None or ffn is None:
        return None
    a, f = attn._modules, ffn._modules
    parts = (attn, a.get("in_proj"), a.get("out_proj"), mods.get("norm1"), ffn, f.get("fc_in"),
             f.get("fc_out"), mods.get("norm2"))
    for p in parts:
        if p is None or _watched(p):
            return None
    return parts  # type: ignore[return-value]


def _norm_tensors(norm: nn.Module) -> tuple[int, float, Tensor, Tensor | None] | None:
    if isinstance(norm, nn.LayerNorm) and norm.elementwise_affine and len(
            norm.normalized_shape) == 1:
        return 0, norm.eps, norm.weight, norm.bias
    if isinstance(norm, RMSNorm):
        return 1, norm.eps, norm.weight, None
    return None


def _linear(layer: Int8Linear) -> _Linear:
    q, scale, bias = layer.qweight, layer.scale, layer.bias
    n, k = q.shape
    return _Linear(q.data_ptr(), scale.data_ptr(), None if bias is None else bias.data_ptr(),
                   n, k)


class _Binding:
    """One block's tensors, checked once and laid out as the C struct. ``tensors`` are the
    ones it read (kept alive: the C loop reads their memory); a binding whose tensors are no
    longer the block's (replaced, moved, re-quantized) is made again."""

    __slots__ = ("block", "key", "tensors")

    def __init__(self, block: _Block | None, tensors: tuple[Tensor, ...]) -> None:
        self.block = block  # None: the block is not one the kernel runs
        self.tensors = tensors
        self.key = _key(tensors)


def _key(tensors: tuple[Tensor, ...]) -> tuple[tuple[int, int], ...]:
    """Which tensors, at which addresses: a binding holds while this stays the same."""
    return tuple([(id(t), t.data_ptr()) for t in tensors])


def _tensors(parts: tuple[nn.Module, ...]) -> tuple[Tensor, ...]:
    """Every tensor of the block's modules the kernel would read, in a fixed order."""
    return tuple([t for m in parts for d in (m._parameters, m._buffers) for t in d.values()
                  if t is not None])


def _parts_key(parts: tuple[nn.Module, ...]) -> tuple[tuple[int, int], ...]:
    """``_key(_tensors(parts))`` in one pass: what every call checks."""
    return tuple([(id(t), t.data_ptr()) for m in parts for d in (m._parameters, m._buffers)
                  for t in d.values() if t is not None])


def _readable(tensors: tuple[Tensor, ...]) -> bool:
    """Whether the C loops can read every tensor as it lies: on the CPU, float32 (or the
    products' int8), contiguous."""
    return all(t.is_cpu and t.dtype in (torch.float32, torch.int8) and t.is_contiguous()
               for t in tensors)


def _bind_block(block: nn.Module, parts: tuple[nn.Module, ...],
                tensors: tuple[Tensor, ...]) -> _Binding:
    attn, in_proj, out_proj, norm1, ffn, fc_in, fc_out, norm2 = parts
    n1, n2 = _norm_tensors(norm1), _norm_tensors(norm2)
    linears = (in_proj, out_proj, fc_in, fc_out)
    ok = (getattr(block, "norm", None) == "pre" and n1 is not None and n2 is not None
          and n1[:2] == n2[:2] and isinstance(attn, MultiHeadAttention)
          and isinstance(ffn, FeedForward) and attn.positional == "none"
          and attn.q_norm is None and attn.k_norm is None
          and ffn.activation in ACTIVATIONS
          and all(isinstance(m, Int8Linear) and m.kernel in ("auto", "native")
                  for m in linears)
          and _readable(tensors))
    if not ok or n1 is None or n2 is None:
        return _Binding(None, tensors)
    d = attn.head_dim
    c = attn.d_model
    f_width = fc_out.in_features
    shapes_fit = (
        in_proj.in_features == c and in_proj.out_features == attn.q_dim + 2 * attn.kv_dim
        and out_proj.in_features == attn.q_dim and out_proj.out_features == c
        and fc_in.in_features == c
        and fc_in.out_features == (2 * f_width if ffn.activation == "swiglu" else f_width)
        and fc_out.out_features == c
        and all(w.shape == (c,) for w in (n1[2], n2[2], n1[3], n2[3]) if w is not None))
    if not shapes_fit:
        return _Binding(None, tensors)
    c_block = _Block(
        c, attn.n_heads, attn.n_kv_heads, d, n1[0],
        ACTIVATIONS.index(ffn.activation),  # decode_block.c's ACT_* follow this order
        n1[1], 1.0 / math.sqrt(d),
        n1[2].data_ptr(), None if n1[3] is None else n1[3].data_ptr(),
        n2[2].data_ptr(), None if n2[3] is None else n2[3].data_ptr(),
        *(_linear(m) for m in linears))  # type: ignore[arg-type]
    return _Binding(c_block, tensors)


def _kernel_on() -> bool:
    """The kernel is on, with nothing recording or differentiating the call."""
    return not (getattr(_OFF, "depth", 0) or torch.is_grad_enabled()
                or torch.compiler.is_compiling() or torch.jit.is_tracing()
                or _hooked_globally())


def _serves(x: Tensor) -> bool:
    """What every block of a call shares: the kernel is on, and x is one float32 token on
    the CPU."""
    return (x.dtype == torch.float32 and x.is_cpu and x.is_contiguous()
            and _kernel_on())


def _bound_block(block: nn.Module, width: int, cache: object, start: int) -> _Block | None:
    """The block's C struct where the kernel serves this block, an input of ``width`` and
    this cache for column ``start``, else None (rebinding first where the block's tensors
    changed)."""
    if type(cache) is not KVCache or cache.row_spans is not None:
        return None
    parts = _parts(block)
    if parts is None:
        return None
    kv = cache.buffer  # (1, 2, L, Hkv, D): a float32 CPU cache is stored column by column
    if (kv.dtype != torch.float32 or not kv.is_cpu or not kv.is_contiguous()
            or not 0 <= start < kv.shape[2]):
        return None  # the modules' path says what is wrong (an overflow, a dtype)
    binding = _BOUND.get(block)
    if binding is None or binding.key != _parts_key(parts):
        binding = _bind_block(block, parts, _tensors(parts))
        _BOUND[block] = binding
    c_block = binding.block
    if (c_block is None or parts[0].attention == "manual" or kv.shape[0] != 1
            or kv.shape[3] != c_block.n_kv_heads or kv.shape[4] != c_block.head_dim
            or width != c_block.d_model):
        return None  # attention's kind is read per call: forced_attention_kind switches it
    return c_block


def _no_scratch(start: int) -> MemoryError:
    """What a C step that could not allocate its scratch raises (it wrote nothing)."""
    return MemoryError(f"block decoding step: no memory for the scratch of {start + 1} keys")


def step(block: nn.Module, x: Tensor, cache: KVCache, start: int) -> Tensor | None:
    """The block's decoding step for x (1, 1, C) with its keys and values written at column
    ``start`` of ``cache`` → (1, 1, C); None where the kernel does not serve this call (see
    the module docstring): the caller then runs the modules."""
    if not _serves(x):
        return None
    c_block = _bound_block(block, x.shape[2], cache, start)
    lib = None if c_block is None else _LIB.lib()
    if c_block is None or lib is None:
        return None
    y = torch.empty_like(x)  # (1, 1, C)
    if lib.hf_decode_block(_LIB.default, ctypes.byref(c_block), x.data_ptr(),
                           cache.buffer.data_ptr(), cache.buffer.shape[2], start,
                           y.data_ptr()) != 0:
        raise _no_scratch(start)
    return y


class _Stack:
    """A served stack's C arguments, built once its blocks and caches passed every check:
    kept by a ``checks_held`` block so that later calls of the same stack skip the checks."""

    __slots__ = ("blocks", "caches", "capacity", "caps", "kvs", "lib", "read", "structs",
                 "work")

    def __init__(self, lib: ctypes.CDLL, blocks: Sequence[nn.Module], caches: Sequence[object],
                 structs: ctypes.Array, kvs: ctypes.Array, caps: ctypes.Array,
                 width: int) -> None:
        self.lib = lib
        self.blocks, self.caches = blocks, caches  # held: their ids key the hold
        self.structs, self.kvs, self.caps = structs, kvs, caps
        self.read: list[torch.UntypedStorage] = []
        self.capacity = min(caps)  # the fewest columns a block's cache has
        self.work = torch.empty(2 * width)  # (2·C,) the hidden states between blocks

    def keep_memory(self) -> None:
        """Hold the storage of every tensor the arguments point into (the blocks' weights,
        the caches' buffers): a held stack is not checked again, so even a weight whose
        ``.data`` is swapped meanwhile must not free the memory the C call reads."""
        tensors = [t for b in self.blocks for t in _BOUND[b].tensors]
        tensors += [c.buffer for c in self.caches]  # type: ignore[attr-defined]
        self.read = [t.untyped_storage() for t in tensors]

    def run(self, x: Tensor, start: int) -> Tensor:
        y = torch.empty_like(x)  # (1, 1, C)
        if self.lib.hf_decode_stack(_LIB.default, len(self.blocks), self.structs, self.kvs,
                               self.caps, start, x.data_ptr(), self.work.data_ptr(),
                               y.data_ptr()) != 0:
            raise _no_scratch(start)
        return y


class StackHold:
    """What ``checks_held`` yields: ``forget()`` drops the stacks it keeps, so that the next
    call checks everything again (call it whenever code other than the loop's own ran)."""

    def __init__(self) -> None:
        self.stacks: dict[tuple[int, int], _Stack | _Token | _Greedy | _Declined] = {}

    def forget(self) -> None:
        self.stacks.clear()


_HOLDS = threading.local()  # .open: this thread's open holds, innermost last


@contextmanager
def checks_held() -> Iterator[StackHold]:
    """Within the block (this thread), a stack ``stack_step`` served is checked once: while the
    same blocks and caches come back, its C arguments are reused and only the column is
    checked. For a loop that owns its model and caches and runs no other code between steps
    (``generate``'s token loop): whatever could change a block — a hook, a new weight, a
    module swapped, ``disabled()``, a forced attention kind, grad mode — would come from other
    code, so the loop calls ``forget()`` after running any (``on_token``). Checking a stack
    touches every tensor and module of every block, and between tokens the weights' stream
    has pushed all of them out of the caches."""
    hold = StackHold()
    holds = getattr(_HOLDS, "open", None)
    if holds is None:
        holds = _HOLDS.open = []
    holds.append(hold)
    try:
        yield hold
    finally:
        holds.remove(hold)
        hold.forget()


def _held(key: tuple[int, int]) -> object | None:
    """What this thread's innermost hold keeps under ``key``, unless ``disabled()``."""
    holds = getattr(_HOLDS, "open", None)
    if not holds or getattr(_OFF, "depth", 0):
        return None
    return holds[-1].stacks.get(key)


def _hold(key: tuple[int, int], kept: _Stack | _Token | _Greedy | _Declined) -> None:
    """Keep ``kept`` in this thread's innermost hold, if one is open."""
    holds = getattr(_HOLDS, "open", None)
    if holds:
        kept.keep_memory()
        holds[-1].stacks[key] = kept


def _build_stack(blocks: Sequence[nn.Module], width: int, caches: Sequence[object],
                 start: int) -> _Stack | None:
    """The stack's C arguments where the kernel serves every block and cache (see
    ``stack_step``), else None."""
    if not blocks or len(blocks) != len(caches):
        return None
    n = len(blocks)
    structs = (ctypes.POINTER(_Block) * n)()
    kvs, caps = (_P * n)(), (_I64 * n)()
    for i, (block, cache) in enumerate(zip(blocks, caches, strict=True)):
        own = block.training or _watched(block)  # its own forward: dropout, hooks
        c_block = None if own else _bound_block(block, width, cache, start)
        if c_block is None:
            return None
        kv = cache.buffer  # type: ignore[attr-defined]
        structs[i], kvs[i], caps[i] = ctypes.pointer(c_block), kv.data_ptr(), kv.shape[2]
    lib = _LIB.lib()
    if lib is None:
        return None
    return _Stack(lib, blocks, caches, structs, kvs, caps, width)


def stack_step(blocks: Sequence[nn.Module], x: Tensor, caches: Sequence[object],
               start: int) -> Tensor | None:
    """Every block's decoding step in turn, as one C call: x (1, 1, C) → (1, 1, C), block
    i's keys and values written at column ``start`` of ``caches[i]``. None unless the kernel
    serves every block, no block is in training mode and nothing hooks a block itself (whose
    hooks a C call would skip): the caller then calls the blocks one by one, each of which
    may still take ``step``. Inside ``checks_held`` a stack served once is not checked again."""
    key = (id(blocks), id(caches))
    held = _held(key)
    if (type(held) is _Stack and held.blocks is blocks and held.caches is caches
            and 0 <= start < held.capacity):
        return held.run(x, start)
    stack = _build_stack(blocks, x.shape[2], caches, start) if _serves(x) else None
    if stack is None:
        return None
    _hold(key, stack)
    return stack.run(x, start)


class _Token:
    """A served model's whole token (``token_step``): its stack's C arguments and its ends'
    (the embedding's tables, the final norm, the head)."""

    __slots__ = ("ends", "model", "read", "stack", "tensors", "vocab", "work")

    def __init__(self, model: nn.Module, stack: _Stack, ends: _Ends,
                 tensors: tuple[Tensor, ...], vocab: int, width: int) -> None:
        self.model, self.stack, self.ends = model, stack, ends
        self.tensors = tensors  # the ends' tensors, read by the C call
        self.vocab = vocab
        self.read: list[torch.UntypedStorage] = []
        self.work = torch.empty(5 * width)  # see hf_decode_token

    def keep_memory(self) -> None:
        """As ``_Stack.keep_memory``, for the stack's tensors and the ends'."""
        self.stack.keep_memory()
        self.read = [t.untyped_storage() for t in self.tensors]

    def run(self, ids: Tensor, start: int) -> Tensor | None:
        """Logits (1, 1, V) for the token ``ids`` (1, 1) at column and position ``start``;
        None where the id or the position lies outside its table (nothing was written)."""
        s = self.stack
        logits = torch.empty(1, 1, self.vocab)
        code = s.lib.hf_decode_token(_LIB.default, len(s.blocks), s.structs, s.kvs, s.caps,
                                     start, ids.data_ptr(), start, ctypes.byref(self.ends),
                                     self.work.data_ptr(), logits.data_ptr(), None)
        if code == -1:
            raise _no_scratch(start)
        return logits if code == 0 else None


def _ends(model: nn.Module) -> tuple[_Ends, tuple[Tensor, ...], int, int] | None:
    """The C struct of ``model``'s embedding, final norm and head, the tensors it points
    into, the vocabulary and the width; None unless the embedding is a plain sum of table
    rows (it says so: ``table_rows``), the final norm one the blocks' kernel knows, the head
    an int8 product the C loop serves, the logits not soft-capped, and nothing watches any
    of them."""
    mods = model._modules
    embed, final, head = mods.get("embed"), mods.get("final_norm"), mods.get("lm_head")
    config = getattr(model, "config", None)
    table_rows = getattr(embed, "table_rows", None)
    if (embed is None or table_rows is None or not isinstance(head, Int8Linear)
            or final is None or config is None or getattr(config, "logit_softcap", 1.0) != 0.0
            or head.kernel not in ("auto", "native")):
        return None
    rows = table_rows()
    norm = _norm_tensors(final)
    if (rows is None or norm is None
            or any(_watched(m) for m in (*embed.modules(), final, head))):
        return None
    token, pos = rows  # (V_in, C), (P, C) or None
    width = token.shape[1]
    tensors = tuple(t for t in (token, pos, norm[2], norm[3], head.qweight, head.scale,
                                head.bias) if t is not None)
    if (not _readable(tensors) or token.dtype != torch.float32
            or (pos is not None and pos.shape[1] != width)
            or norm[2].shape != (width,) or head.in_features != width):
        return None
    ends = _Ends(token.data_ptr(), token.shape[0],
                 None if pos is None else pos.data_ptr(), 0 if pos is None else pos.shape[0],
                 norm[0], norm[1], norm[2].data_ptr(),
                 None if norm[3] is None else norm[3].data_ptr(), _linear(head))
    return ends, tensors, head.out_features, width


def token_step(model: nn.Module, ids: Tensor, caches: Sequence[object],
               start: int) -> Tensor | None:
    """A whole decoding token of ``model`` (a ``DecoderLM``) as one C call: the embedding of
    ``ids`` (1, 1) int64 at position ``start``, every block (keys and values written at
    column ``start`` of ``caches[i]``), the final norm and the head → logits (1, 1, V). For
    one real token of one request whose cache holds no padding (its position is then its
    column). None wherever ``stack_step`` would decline the blocks, or ``_ends`` the rest,
    or the id or the position lies outside its table (nothing is written then): the caller
    runs the modules. Inside ``checks_held`` a model served once is not checked again."""
    if ids.dtype != torch.int64 or ids.shape != (1, 1) or not ids.is_cpu:
        return None
    key = (id(model), id(caches))
    held = _held(key)
    if (type(held) is _Token and held.model is model and held.stack.caches is caches
            and 0 <= start < held.stack.capacity):
        return held.run(ids, start)
    token = _token(model, caches, start)
    if token is None:
        return None
    _hold(key, token)
    return token.run(ids, start)


def _token(model: nn.Module, caches: Sequence[object], start: int) -> _Token | None:
    """The model's token kernel arguments where it serves the model (see ``token_step``),
    else None."""
    if model.training or not _kernel_on():
        return None
    ends = _ends(model)
    blocks = model._modules.get("blocks")
    stack = None if ends is None or not isinstance(blocks, nn.ModuleList) else _build_stack(
        blocks, ends[3], caches, start)
    if ends is None or stack is None:
        return None
    return _Token(model, stack, ends[0], ends[1], ends[2], ends[3])


class _Greedy:
    """Greedy decoding's token (``greedy_token``) for one model, cache and token buffer: the
    token kernel's arguments with every pointer but the column's made once, so that a token
    costs one C call and a few integer operations."""

    __slots__ = ("args", "base", "cache", "capacity", "columns", "fn", "logits", "model",
                 "read", "token", "tokens", "where")

    def __init__(self, token: _Token, cache: DecoderCache, tokens: Tensor) -> None:
        s = token.stack
        self.token, self.model, self.cache, self.tokens = token, token.model, cache, tokens
        self.logits = torch.empty(token.vocab)  # (V,) overwritten by every token
        self.fn = s.lib.hf_decode_token
        self.args = (_LIB.default, len(s.blocks), s.structs, s.kvs, s.caps)
        self.where = (ctypes.byref(token.ends), token.work.data_ptr(), self.logits.data_ptr())
        self.capacity, self.columns = s.capacity, tokens.shape[1]
        self.base = tokens.data_ptr()  # the buffer is held (keep_memory) and never resized
        self.read: list[torch.UntypedStorage] = []

    def keep_memory(self) -> None:
        """As ``_Token.keep_memory``, and the token buffer the call reads and writes."""
        self.token.keep_memory()
        self.read = [self.tokens.untyped_storage()]

    def run(self, length: int) -> bool:
        cache = self.cache
        start = cache.length
        if not (0 < length < self.columns and 0 <= start < self.capacity) or cache.has_padding:
            return False
        at = self.base + 8 * length  # tokens[0, length]: int64, contiguous
        code = self.fn(*self.args, start, at - 8, start, *self.where, at)
        if code == -1:
            raise _no_scratch(start)
        if code != 0:  # the id outside its table, or logits that cannot be sampled from
            return False
        cache.add_decoded_token()
        return True


def greedy_token(model: nn.Module, tokens: Tensor, length: int, cache: object) -> bool:
    """Greedy decoding's next token as one C call: the token ``tokens[0, length - 1]`` run
    as ``token_step`` runs it (keys and values at column ``cache.length``, which the cache
    then counts), and the first index of its logits' largest value — torch's argmax —
    written at ``tokens[0, length]``. No tensor op runs: between tokens each one would run
    with caches the weights just streamed through. ``tokens`` (1, N) int64, contiguous, on
    the CPU; ``cache`` the model's ``DecoderCache`` without padding.

    True when done. False where ``token_step`` would decline, or the logits hold a NaN or
    +inf or no finite value: nothing is counted or written in ``tokens`` (the cache's column
    past its filled length may be), and the caller runs the model and samples, which name
    the fault. Inside ``checks_held`` the model is checked once, as ``token_step`` checks it.
    """
    if type(cache) is not DecoderCache:
        return False
    caches = cache.layers
    key = (id(tokens), id(caches))
    held = _held(key)
    if (type(held) is _Greedy and held.tokens is tokens and held.model is model
            and held.cache is cache):
        return held.run(length)
    if type(held) is _Declined and held.model is model:
        return False
    if cache.has_padding or not 0 <= cache.length < cache.capacity:
        return False  # this call only: the modules' path
    if (tokens.dtype != torch.int64 or tokens.dim() != 2 or tokens.shape[0] != 1
            or not tokens.is_cpu or not tokens.is_contiguous() or _watched(model)):
        _hold(key, _Declined(model))
        return False
    token = _token(model, caches, cache.length)
    if token is None:  # not a model the kernel serves: not checked again while held
        _hold(key, _Declined(model))
        return False
    greedy = _Greedy(token, cache, tokens)
    _hold(key, greedy)
    return greedy.run(length)


class _Declined:
    """A model ``greedy_token`` found the kernel does not serve, held so that a loop's later
    tokens do not pay the checks again (each runs the modules' path)."""

    __slots__ = ("model",)

    def __init__(self, model: nn.Module) -> None:
        self.model = model

    def keep_memory(self) -> None:
        """Nothing is read from it."""
