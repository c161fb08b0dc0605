"""Memory budgets: what a model, a training run or a generation will need, checked before
torch allocates any of it.

torch finds out that memory is short only while allocating — with a C++ ``RuntimeError``, or,
on Linux with overcommit, not at all: the allocation "succeeds", the first write faults the
pages in and the kernel kills the process. A config with ``d_model`` 10⁹ or a request for 10¹²
new tokens must therefore be refused from arithmetic alone. Every estimate here is computed
with Python integers from the config and the request (nothing is built), split into named
parts so the refusal can say where the bytes go:

* ``parameter_count(config)`` — exact, the count ``model.num_parameters()`` gives (a tied
  head counted once), for a ``ModelConfig`` (a ``DecoderLM``), ``ClassifierConfig`` or
  ``Seq2SeqConfig``; ``parameter_estimate`` turns it into bytes.
* ``training_estimate`` — parameters, gradients and AdamW's two moments (4 + 4 + 8 bytes per
  parameter: weights and optimizer state stay float32 under every ``precision``) plus the
  activations one micro-batch keeps for the backward pass (``activation_bytes``).
* ``generation_estimate`` — the KV cache and the output tokens of ``generate``.

``check_fits(estimate, device)`` compares an estimate with ``available_memory(device)`` and
raises ``MemoryBudgetError`` (a ``MemoryError``) naming the total, its parts, the limit and
what to change. Where the free memory cannot be read (an unknown platform or device) nothing
is refused.

Shape legend: ``B`` batch, ``T`` tokens per sequence, ``S`` source tokens (cross-attention),
``C`` model dim, ``H`` heads, ``Hkv`` key/value heads, ``D`` head dim, ``V`` vocabulary,
``L`` layers, ``F`` feed-forward width.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch

from handformer.config import ClassifierConfig, ModelConfig, Seq2SeqConfig

__all__ = [
    "TEXT_BYTES_PER_CHAR", "Estimate", "MemoryBudgetError", "activation_bytes",
    "available_memory", "check_fits", "check_model_fits", "check_training", "format_bytes",
    "generation_estimate", "host_available_memory", "kv_cache_bytes", "parameter_count",
    "parameter_estimate", "training_estimate",
]

FLOAT32 = 4  # bytes: weights, gradients, optimizer moments and (counted so) activations
ADAMW_MOMENTS = 2  # exp_avg and exp_avg_sq, one float32 each per parameter
# A training text in memory, per character: its code points (4 bytes) and int64 ids (8) while
# tokenizing, rounded up for the train/validation split's bookkeeping.
TEXT_BYTES_PER_CHAR = 16

AnyModelConfig = ModelConfig | ClassifierConfig | Seq2SeqConfig


class MemoryBudgetError(MemoryError):
    """An estimate exceeds the memory available; raised before anything is allocated."""


@dataclass(frozen=True)
class Estimate:
    """Bytes that one piece of work needs, by part (``{"parameters": …, "activations": …}``).

    ``what`` completes the sentence "… needs about N bytes" (e.g. "training this model");
    ``hint`` says what would make it smaller, in the caller's terms (options or fields).
    """

    what: str
    parts: dict[str, int]
    hint: str = ""

    @property
    def total(self) -> int:
        return sum(self.parts.values())

    def describe(self) -> str:
        """``"about 1.5 GiB (parameters 512.0 MiB, activations 1.0 GiB)"``."""
        parts = ", ".join(f"{name} {format_bytes(n)}" for name, n in self.parts.items() if n)
        return f"about {format_bytes(self.total)}" + (f" ({parts})" if parts else "")


def format_bytes(n: int | float) -> str:
    """Binary units, three significant figures: ``format_bytes(3 << 30) == "3.00 GiB"``."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"):
        if abs(value) < 1024 or unit == "EiB":
            break
        value /= 1024
    if unit == "B":
        return f"{int(value)} B"
    if value >= 1e4:  # beyond exbibytes (d_model 10⁹ gets there): say it in powers of ten
        return f"{float(n):.2e} B"
    return f"{value:.3g} {unit}" if value >= 100 else f"{value:.2f} {unit}"


# -- parameters (exact) ---------------------------------------------------------------------
def _linear(n_in: int, n_out: int, bias: bool) -> int:
    return n_in * n_out + (n_out if bias else 0)


def _layer_norm(c: int, bias: bool, norm_type: str = "layernorm") -> int:
    return c + (c if bias and norm_type == "layernorm" else 0)  # RMSNorm: a gain, no bias


def _attention(c: ModelConfig, n_kv_heads: int) -> int:
    q_dim, kv_dim = c.n_heads * c.head_dim, n_kv_heads * c.head_dim
    n = (_linear(c.d_model, q_dim + 2 * kv_dim, c.bias)  # fused q, k, v projection
         + _linear(q_dim, c.d_model, c.bias))  # output projection
    return n + (2 * c.head_dim if c.qk_norm else 0)  # QK-norm's two gains


def _block(c: ModelConfig, *, cross_attention: bool) -> int:
    """One ``TransformerBlock`` (nn/block.py): self-attention, [cross-attention], FFN, norms."""
    norm = _layer_norm(c.d_model, c.bias, c.norm_type)
    n = _attention(c, c.n_kv_heads) + 2 * norm
    gated = 2 if c.activation == "swiglu" else 1  # SwiGLU's fc_in holds gate and up
    n += _linear(c.d_model, gated * c.d_ff, c.bias) + _linear(c.d_ff, c.d_model, c.bias)
    if cross_attention:  # plain multi-head (n_kv_heads = n_heads) and its own norm
        n += _attention(c, c.n_heads) + norm
    return n


def _embedding(c: ModelConfig) -> int:
    """``TokenEmbedding``: tokens, learned positions, segment vectors, the optional norm."""
    n = c.vocab_size * c.d_model
    if c.positional == "learned":
        n += c.max_len * c.d_model  # sinusoidal, RoPE and ALiBi have no parameters
    n += c.type_vocab_size * c.d_model
    if c.embedding_norm:
        n += _layer_norm(c.d_model, c.bias)
    return n


def _stack(c: ModelConfig, *, cross_attention: bool = False, final_norm: bool,
           head: bool) -> int:
    n = _embedding(c) + c.n_layers * _block(c, cross_attention=cross_attention)
    if final_norm:
        n += _layer_norm(c.d_model, c.bias, c.norm_type)
    if head and not c.tie_weights:
        n += c.vocab_size * c.d_model  # the LM head (bias-free); tied: the embedding's matrix
    return n


def parameter_count(config: AnyModelConfig) -> int:
    """Exactly what the model built from ``config`` holds (tied weights counted once): a
    ``ModelConfig`` describes a ``DecoderLM``, a ``ClassifierConfig`` an
    ``EncoderClassifier``, a ``Seq2SeqConfig`` an ``EncoderDecoder``."""
    if isinstance(config, ModelConfig):
        return _stack(config, final_norm=config.norm == "pre", head=True)
    if isinstance(config, ClassifierConfig):
        e = config.encoder
        return (_stack(e, final_norm=e.norm == "pre", head=False)
                + _linear(e.d_model, config.num_classes, True))
    if isinstance(config, Seq2SeqConfig):
        return (_stack(config.encoder, final_norm=True, head=False)
                + _stack(config.decoder, cross_attention=True, final_norm=True, head=True))
    raise TypeError(f"expected a ModelConfig, ClassifierConfig or Seq2SeqConfig; got "
                    f"{type(config).__name__}")


def parameter_estimate(config: AnyModelConfig, *, what: str = "building this model",
                       bytes_per_value: int = FLOAT32) -> Estimate:
    """The weights of the model ``config`` describes (float32 unless told otherwise)."""
    return Estimate(what, {"parameters": parameter_count(config) * bytes_per_value},
                    hint="make the model smaller (d_model, n_layers, d_ff, vocab_size, or "
                         "max_len with learned positions)")


def check_model_fits(config: AnyModelConfig, who: str) -> None:
    """Refuse to build ``who`` (a model class's name) whose weights cannot fit in the host's
    memory, where every model is first built. Model constructors call this first: a config
    read from a file (a run folder, ``doctor --config``) may ask for anything. An encoder or
    decoder's ``ModelConfig`` is counted as a ``DecoderLM``'s (within one head matrix). On
    the ``meta`` device (a skeleton: shapes without memory) nothing is checked."""
    if torch.get_default_device().type == "meta":
        return
    check_fits(parameter_estimate(config, what=f"building this {who}"), "cpu")


# -- activations (a conservative formula) ----------------------------------------------------
def _per_token_layer_values(c: ModelConfig, keys: int) -> int:
    """Float values one block stores per query token for its backward pass, attending over
    ``keys`` tokens — counted for the manual kernel, which keeps the most:

        norm inputs and outputs   4·C
        q, k, v                   C + 2·Hkv·D
        attention scores, probabilities and the dropout mask on them   3·H·keys
        attention output, output projection, residual   3·C
        FFN: first linear, activation   2·F;   second linear, residual   2·C

    about 10·C + 2·Hkv·D + 2·F + 3·H·keys, rounded up to 12·C + 2·Hkv·D + 2·F + 3·H·keys for
    what the formula leaves out (bias and GELU temporaries); with dropout, its masks add
    4·C + F. The fused kernels (sdpa, tiled) keep no (T × S) matrices, so for them this is
    an upper bound.
    """
    kv = 2 * c.n_kv_heads * c.head_dim
    values = 12 * c.d_model + kv + 2 * c.d_ff + 3 * c.n_heads * keys
    if c.dropout > 0:  # the masks of the residual, FFN and output dropouts
        values += 4 * c.d_model + c.d_ff
    return values


def activation_bytes(config: ModelConfig, batch_size: int, seq_len: int, *,
                     source_len: int | None = None, vocab_head: bool = True) -> int:
    """Bytes one training micro-batch of ``batch_size`` × ``seq_len`` tokens keeps for the
    backward pass through a stack built from ``config`` (float32 counted; bf16 autocast
    stores less):

        B·T · (2·C  +  L · per-layer values  +  3·V)  ×  4 bytes

    ``2·C`` is the embedding output, the per-layer values are ``_per_token_layer_values``
    (causal attention counted as full: ``keys = T``), and ``3·V`` the logits, their
    log-softmax and their gradient (``vocab_head=False`` for an encoder, whose head is
    small). ``source_len`` (S) adds cross-attention to every layer, as in a seq2seq decoder:
    per target token a norm, a query, an output and scores over S keys (``6·C + 3·H·S``).
    """
    c = config
    per_token = 2 * c.d_model + c.n_layers * _per_token_layer_values(c, seq_len)
    if source_len is not None:
        per_token += c.n_layers * (6 * c.d_model + 3 * c.n_heads * source_len)
    if vocab_head:
        per_token += 3 * c.vocab_size
    return batch_size * seq_len * per_token * FLOAT32


def training_estimate(config: AnyModelConfig, batch_size: int, seq_len: int, *,
                      source_len: int | None = None, extra: dict[str, int] | None = None,
                      what: str = "training this model", hint: str = "") -> Estimate:
    """Weights, gradients and AdamW moments (4 + 4 + 8 bytes per parameter) plus one
    micro-batch's activations (``activation_bytes``; for a seq2seq model the encoder's over
    ``source_len`` and the decoder's over ``seq_len`` with cross-attention). ``extra`` adds
    named parts (token ids of the training text, …)."""
    n = parameter_count(config)
    if isinstance(config, ModelConfig):
        acts = activation_bytes(config, batch_size, seq_len)
    elif isinstance(config, ClassifierConfig):
        acts = activation_bytes(config.encoder, batch_size, seq_len, vocab_head=False)
    else:
        s = seq_len if source_len is None else source_len
        acts = (activation_bytes(config.encoder, batch_size, s, vocab_head=False)
                + activation_bytes(config.decoder, batch_size, seq_len, source_len=s))
    parts = {"parameters": n * FLOAT32, "gradients": n * FLOAT32,
             "AdamW moments": ADAMW_MOMENTS * n * FLOAT32,
             f"activations of a {batch_size} × {seq_len} micro-batch": acts, **(extra or {})}
    return Estimate(what, parts, hint=hint or "make the batch or the window smaller, or the "
                    "model (d_model, n_layers)")


# -- generation -----------------------------------------------------------------------------
def kv_cache_bytes(config: ModelConfig, batch_size: int, capacity: int | None = None, *,
                   bytes_per_value: int = FLOAT32) -> int:
    """A ``DecoderCache`` (nn/kv_cache.py) for ``batch_size`` rows of ``capacity`` tokens
    (default ``max_len``): L × B × 2·Hkv × capacity × D values, plus per column a key mask
    (bool) and a position (long), plus the next position of each row."""
    c, cap = config, config.max_len if capacity is None else capacity
    buffers = c.n_layers * batch_size * 2 * c.n_kv_heads * cap * c.head_dim * bytes_per_value
    return buffers + batch_size * cap * (1 + 8) + batch_size * 8


def generation_estimate(config: ModelConfig, batch_size: int, prompt_len: int,
                        max_new_tokens: int, *, use_cache: bool = True,
                        bytes_per_value: int = FLOAT32) -> Estimate:
    """What ``generate`` allocates besides the model: the output tokens (B × (T + new) ids,
    8 bytes, and a bool mask beside them) and, with ``use_cache``, the KV cache of
    ``min(max_len, T + new)`` columns (the window, or the call's tokens where fewer); the
    logits of one step (B × T × V) for the first, prompt-long step."""
    total_len = prompt_len + max_new_tokens
    window = min(total_len, config.max_len)
    parts = {"output tokens": batch_size * total_len * (8 + 1),
             "KV cache": kv_cache_bytes(config, batch_size, window,
                                        bytes_per_value=bytes_per_value) if use_cache else 0,
             "logits": batch_size * window * config.vocab_size * FLOAT32}
    return Estimate("generating this many tokens", parts,
                    hint="ask for fewer new tokens (--max-new-tokens) or fewer prompts")


# -- what is available ----------------------------------------------------------------------
def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text(encoding="ascii").strip()
    except (OSError, UnicodeDecodeError):
        return None
    return int(text) if text.isdigit() else None  # "max" (cgroup v2): no limit


def _cgroup_headroom() -> int | None:
    """Limit minus usage of this process's memory cgroup and its ancestors (the tightest),
    cgroup v2 or v1; ``None`` when no limit is set or none can be read."""
    try:
        lines = Path("/proc/self/cgroup").read_text(encoding="utf-8").splitlines()
    except OSError:
        return None
    best: int | None = None
    for line in lines:
        _, controllers, rel = [*line.split(":", 2), "", ""][:3]
        if controllers == "":  # cgroup v2
            root, limit_name, usage_name = Path("/sys/fs/cgroup"), "memory.max", \
                "memory.current"
        elif "memory" in controllers.split(","):  # cgroup v1
            root, limit_name, usage_name = Path("/sys/fs/cgroup/memory"), \
                "memory.limit_in_bytes", "memory.usage_in_bytes"
        else:
            continue
        parts = [p for p in rel.split("/") if p]
        for depth in range(len(parts), -1, -1):  # the process's own group, then each parent
            folder = root.joinpath(*parts[:depth])
            limit, usage = _read_int(folder / limit_name), _read_int(folder / usage_name)
            if limit is None or usage is None or limit >= 1 << 60:  # v1 "no limit": ~2⁶³
                continue
            headroom = max(0, limit - usage)
            best = headroom if best is None else min(best, headroom)
    return best


def host_available_memory() -> int | None:
    """Bytes of RAM this process could still take: ``MemAvailable`` from /proc/meminfo
    (free plus reclaimable cache) or else free pages (``SC_AVPHYS_PAGES``), capped by the
    memory cgroup's headroom inside a container; ``None`` where neither can be read."""
    found: int | None = None
    try:
        for line in Path("/proc/meminfo").read_text(encoding="ascii").splitlines():
            if line.startswith("MemAvailable:"):
                found = int(line.split()[1]) * 1024  # the kernel writes kB
                break
    except (OSError, ValueError, IndexError):
        found = None
    if found is None:
        try:
            found = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (AttributeError, ValueError, OSError):
            found = None
    headroom = _cgroup_headroom()
    if headroom is not None:
        found = headroom if found is None else min(found, headroom)
    return found


def available_memory(device: str | torch.device = "cpu") -> int | None:
    """Free bytes on ``device``: the host's for ``cpu`` (and for ``mps``, whose memory is the
    host's), ``torch.cuda.mem_get_info`` for ``cuda``; ``None`` when it cannot be told."""
    dev = torch.device(device)
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            return None
        free, _total = torch.cuda.mem_get_info(dev)
        return int(free)
    if dev.type in ("cpu", "mps"):
        return host_available_memory()
    return None


def check_fits(estimate: Estimate, device: str | torch.device = "cpu", *,
               available: int | None = None) -> None:
    """Raise ``MemoryBudgetError`` if ``estimate`` exceeds the memory free on ``device``
    (``available`` overrides the probe, for tests and for callers that split memory)."""
    limit = available_memory(device) if available is None else available
    if limit is None or estimate.total <= limit:
        return
    where = "on this machine" if torch.device(device).type == "cpu" else f"on {device}"
    message = (f"not enough memory: {estimate.what} needs {estimate.describe()}, but "
               f"{format_bytes(limit)} is available {where}")
    if estimate.hint:
        message += f"; {estimate.hint}"
    raise MemoryBudgetError(message)


def _uses_host_memory(device: torch.device) -> bool:
    return device.type in ("cpu", "mps")


def check_training(config: AnyModelConfig, batch_size: int, seq_len: int,
                   device: str | torch.device = "cpu", *, source_len: int | None = None,
                   host_extra: dict[str, int] | None = None, hint: str = "",
                   what: str = "training this model") -> None:
    """Refuse a training run that cannot fit, before its model is built: the whole
    ``training_estimate`` on a CPU (or MPS: the host's memory); on a GPU, the estimate on the
    GPU and, on the host, the model as first built there plus ``host_extra`` (the text's
    token ids, …)."""
    device = torch.device(device)
    host_extra = host_extra or {}
    if _uses_host_memory(device):
        check_fits(training_estimate(config, batch_size, seq_len, source_len=source_len,
                                     extra=host_extra, what=what, hint=hint), device)
        return
    check_fits(training_estimate(config, batch_size, seq_len, source_len=source_len,
                                 what=what, hint=hint), device)
    host = parameter_estimate(config, what=f"{what} (on the host, before it moves to "
                              f"{device})")
    check_fits(Estimate(host.what, {**host.parts, **host_extra}, host.hint), "cpu")
