"""Typed configuration: what a model is and how it is trained, as plain data.

Configs hold *names* (``positional="learned"``), never classes, so that ``config.json`` in a
run folder is enough to rebuild the model without the code objects that trained it.
"""

from __future__ import annotations

import dataclasses
import json
import math
import numbers
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from handformer.nn.attention import ATTENTION_KINDS
from handformer.nn.block import NORM_KINDS
from handformer.nn.feedforward import ACTIVATIONS, swiglu_hidden
from handformer.nn.norm import NORM_TYPES
from handformer.nn.positional import POSITIONAL_KINDS, ROPE_SCALING_KINDS, RopeScaling

__all__ = ["CLASSIFY_PRESET", "MODEL_LIMITS", "MUON_LR_ADJUST", "OPTIMIZERS", "POOLING_KINDS",
           "PRECISIONS", "PRESETS", "SCHEDULES", "SEQ2SEQ_PRESET", "STRATEGIES",
           "ClassifierConfig", "ModelConfig", "Preset", "Seq2SeqConfig", "TrainConfig",
           "get_preset"]

PRECISIONS: tuple[str, ...] = ("fp32", "bf16", "fp16", "auto")
OPTIMIZERS: tuple[str, ...] = ("adamw", "muon")  # muon: hidden matrices only, AdamW the rest
MUON_LR_ADJUST: tuple[str, ...] = ("original", "match_rms_adamw")  # torch's adjust_lr_fn
SCHEDULES: tuple[str, ...] = ("cosine", "linear", "constant", "wsd")
STRATEGIES: tuple[str, ...] = ("ddp", "fsdp")  # how torchrun ranks share the model

C = TypeVar("C", bound="_DictMixin")


def _check_keys(cls: type, data: Any) -> None:
    """``data`` is a JSON object holding every required field of ``cls`` and no other."""
    if not isinstance(data, dict):
        raise ValueError(f"{cls.__name__} needs a JSON object; got {type(data).__name__}")
    fields = dataclasses.fields(cls)
    names = {f.name for f in fields}
    unknown = sorted(set(data) - names)
    if unknown:
        raise ValueError(
            f"{cls.__name__} got unknown fields {unknown}; known fields: {sorted(names)}"
        )
    missing = sorted(f.name for f in fields if f.name not in data
                     and f.default is dataclasses.MISSING
                     and f.default_factory is dataclasses.MISSING)
    if missing:
        raise ValueError(f"{cls.__name__} is missing the required fields {missing}")


class _DictMixin:
    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)  # type: ignore[call-overload]

    @classmethod
    def from_dict(cls: type[C], data: dict[str, Any]) -> C:
        """Rebuild from JSON data; ``ValueError`` names unknown, missing or invalid fields."""
        _check_keys(cls, data)
        return cls(**data)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)

    @classmethod
    def load(cls: type[C], path: str | Path) -> C:
        return cls.from_dict(json.loads(Path(path).read_text(encoding="utf-8")))


def _check_choice(name: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{name}={value!r} is not one of {choices}")


def _is_real(value: Any) -> bool:
    """A real number that is not a bool (JSON's ``true`` must not count as 1)."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _is_int(value: Any) -> bool:
    """An integer (NumPy's too) that is not a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _check_types(config: Any) -> None:
    """Every field holds the type its annotation names, or ``ValueError`` naming the field.

    Configs arrive from JSON files a person may have edited: ``"tie_weights": "false"`` is a
    non-empty string, so it would silently *tie* the weights, and ``"lr": NaN`` (which
    Python's JSON reader accepts) would compare False with every bound and slip through
    them all. So booleans must be real booleans, ints real ints (``4.0`` is refused, as is
    ``true``; stored as ``int``), floats finite numbers (stored as ``float``), strings
    strings. The checks follow the annotations, so a field added later is checked too.
    """
    cls = type(config).__name__
    for f in dataclasses.fields(config):
        value, where = getattr(config, f.name), f"{cls}.{f.name}"
        kind = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", "")
        if kind == "bool" and not isinstance(value, bool):
            raise ValueError(f"{where} must be true or false; got {value!r} (a JSON "
                             "boolean: true or false, unquoted)")
        if kind == "int":
            if not _is_int(value):
                raise ValueError(f"{where} must be an integer; got {value!r}")
            setattr(config, f.name, int(value))  # a NumPy int would not serialise to JSON
        if kind == "str" and not isinstance(value, str):
            raise ValueError(f"{where} must be a string; got {value!r}")
        if kind == "float":
            if not _is_real(value) or not math.isfinite(value):
                raise ValueError(f"{where} must be a finite number; got {value!r}")
            setattr(config, f.name, float(value))
        if kind.startswith("tuple[float"):
            if (not isinstance(value, list | tuple)
                    or not all(_is_real(v) and math.isfinite(v) for v in value)):
                raise ValueError(f"{where} must be a list of finite numbers; got {value!r}")
            setattr(config, f.name, tuple(float(v) for v in value))


# Upper bounds far above any real model (the largest vocabularies hold ~256k tokens, the
# widest models d_model 16384): a value past one is a typo or a damaged config.json, and
# refusing it here stops a loader from allocating terabytes before it could compare the
# config with the weights.
MODEL_LIMITS: dict[str, int] = {
    "vocab_size": 1 << 24, "d_model": 1 << 16, "n_heads": 1 << 12, "n_layers": 1 << 12,
    "d_ff": 1 << 20, "max_len": 1 << 24, "n_kv_heads": 1 << 12, "type_vocab_size": 1 << 16,
    "head_dim": 1 << 16,
}


@dataclass
class ModelConfig(_DictMixin):
    """The architecture. ``d_ff`` defaults to 4 × d_model (for ``swiglu``: ≈ 8/3 × d_model,
    the width with the same parameter count, see ``swiglu_hidden``) and ``n_kv_heads`` to
    ``n_heads`` (plain multi-head attention) when left at 0.

    ``layer_norm_eps``, ``embedding_norm`` (a LayerNorm right after the embeddings) and
    ``type_vocab_size`` (segment embeddings) exist so BERT-style checkpoints map exactly.

    Choices are names: ``positional`` in sinusoidal / learned (default) / rope / alibi,
    ``norm`` pre (default) / post, ``attention`` sdpa (default) / manual / tiled, ``activation``
    gelu (default) / relu / gelu_tanh / relu2 (ReLU²) / swiglu, ``norm_type`` layernorm
    (default) / rmsnorm. ``max_len`` (default 64) is the longest window the model attends
    over.

    Published checkpoints' details (``handformer.interop.llama`` maps them): ``head_dim``
    (0 = d_model / n_heads; a published config may set it apart, and then ``n_heads`` need not
    divide ``d_model``), ``rope_base`` (RoPE's θ), ``rope_scaling`` none (default) / linear /
    llama3 with ``rope_factor``, ``rope_low_freq_factor``, ``rope_high_freq_factor`` and
    ``rope_original_max_len`` (see ``handformer.nn.positional.RopeScaling``), and
    ``layer_norm_eps``, every norm's epsilon (QK-norm's too).

    Speedrun levers, all off by default: ``qk_norm`` (RMSNorm on each head's queries and
    keys, before RoPE), ``zero_init_out`` (attention and FFN output projections start at
    zero), ``logit_softcap`` (> 0: logits become ``cap·tanh(logits/cap)``; 0 = off) and
    ``tie_weights=False`` (an untied output head). Invalid values raise ``ValueError``
    naming the field, e.g. a ``d_model`` that ``n_heads`` does not divide or an unknown
    ``positional``.
    """

    vocab_size: int
    d_model: int = 128
    n_heads: int = 4
    n_layers: int = 4
    d_ff: int = 0
    max_len: int = 64
    dropout: float = 0.0
    positional: str = "learned"
    norm: str = "pre"
    attention: str = "sdpa"
    activation: str = "gelu"
    tie_weights: bool = True
    bias: bool = True
    n_kv_heads: int = 0
    rope_base: float = 10000.0
    layer_norm_eps: float = 1e-5
    embedding_norm: bool = False
    type_vocab_size: int = 0
    norm_type: str = "layernorm"
    qk_norm: bool = False
    zero_init_out: bool = False
    logit_softcap: float = 0.0
    head_dim: int = 0
    rope_scaling: str = "none"
    rope_factor: float = 1.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_len: int = 0

    def __post_init__(self) -> None:
        if self.d_ff == 0 and _is_int(self.d_model):
            self.d_ff = (swiglu_hidden(self.d_model) if self.activation == "swiglu"
                         else 4 * self.d_model)
        if self.n_kv_heads == 0:
            self.n_kv_heads = self.n_heads
        explicit_head_dim = _is_int(self.head_dim) and self.head_dim != 0
        if (self.head_dim == 0 and _is_int(self.d_model) and _is_int(self.n_heads)
                and self.n_heads > 0):
            self.head_dim = self.d_model // self.n_heads
        for name in ("vocab_size", "d_model", "n_heads", "n_layers", "d_ff", "max_len",
                     "n_kv_heads", "head_dim"):
            value = getattr(self, name)
            if not _is_int(value) or value <= 0:
                raise ValueError(f"ModelConfig.{name} must be a positive int; got {value!r}")
        _check_types(self)
        for name, limit in MODEL_LIMITS.items():
            if getattr(self, name) > limit:
                raise ValueError(f"ModelConfig.{name}={getattr(self, name)} is beyond the "
                                 f"sane limit {limit} (see config.MODEL_LIMITS): a typo or a "
                                 "damaged config?")
        if not explicit_head_dim and self.d_model % self.n_heads != 0:
            raise ValueError(
                f"d_model={self.d_model} must be divisible by n_heads={self.n_heads} "
                "(or set head_dim explicitly)"
            )
        if self.n_heads % self.n_kv_heads != 0:
            raise ValueError(f"n_kv_heads={self.n_kv_heads} must divide n_heads={self.n_heads}")
        if self.rope_base <= 1.0:
            raise ValueError(f"ModelConfig.rope_base must be > 1; got {self.rope_base}")
        if not 0.0 < self.layer_norm_eps < 1.0:
            raise ValueError(f"ModelConfig.layer_norm_eps must be in (0, 1); got "
                             f"{self.layer_norm_eps}")
        if self.type_vocab_size < 0:
            raise ValueError(f"ModelConfig.type_vocab_size must be >= 0; got "
                             f"{self.type_vocab_size}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"ModelConfig.dropout must be in [0, 1); got {self.dropout}")
        _check_choice("positional", self.positional, POSITIONAL_KINDS)
        _check_choice("norm", self.norm, NORM_KINDS)
        _check_choice("attention", self.attention, ATTENTION_KINDS)
        _check_choice("activation", self.activation, ACTIVATIONS)
        _check_choice("norm_type", self.norm_type, NORM_TYPES)
        if self.logit_softcap < 0:
            raise ValueError(f"ModelConfig.logit_softcap must be >= 0 (0 = off); got "
                             f"{self.logit_softcap}")
        _check_choice("rope_scaling", self.rope_scaling, ROPE_SCALING_KINDS)
        if self.rope_scaling != "none" and self.positional != "rope":
            raise ValueError(f"ModelConfig.rope_scaling={self.rope_scaling!r} needs "
                             f"positional='rope'; got positional={self.positional!r}")
        if self.rope_original_max_len < 0:
            raise ValueError(f"ModelConfig.rope_original_max_len must be >= 0; got "
                             f"{self.rope_original_max_len}")
        self.rope_scaling_spec  # noqa: B018 — RopeScaling checks its own numbers

    @property
    def rope_scaling_spec(self) -> RopeScaling | None:
        """The RoPE frequency scaling as ``RopeScaling``, or ``None`` when off; a bad number
        is a ``ValueError`` naming this config's fields."""
        if self.rope_scaling == "none":
            return None
        try:
            return RopeScaling(self.rope_scaling, self.rope_factor, self.rope_low_freq_factor,
                               self.rope_high_freq_factor,
                               self.rope_original_max_len or self.max_len)
        except ValueError as err:
            raise ValueError(f"ModelConfig rope_scaling={self.rope_scaling!r}: {err} (fields "
                             "rope_factor, rope_low_freq_factor, rope_high_freq_factor, "
                             "rope_original_max_len)") from None


@dataclass
class TrainConfig(_DictMixin):
    """The optimisation recipe, saved in every run folder and checkpoint so a run can resume.

    ``block_size`` is the training window (≤ the model's max_len). ``batch_size`` is the
    micro-batch: each optimiser step sees ``batch_size × grad_accum_steps`` windows. Under
    ``torchrun`` it is the *global* micro-batch, split evenly over the ranks, so a recipe means
    the same on any number of processes; ``strategy`` (``ddp`` or ``fsdp``) says how they
    share the model.
    ``checkpoint_interval=0`` checkpoints at every evaluation; ``early_stopping_patience=0``
    never stops early. ``target_val_loss`` (> 0) stops at the first evaluation at or under it —
    what a speedrun measures: the time to a loss, not the time to a step count.

    The learning rate warms up linearly for ``warmup_steps`` (default 100), then follows
    ``schedule`` (cosine by default) down to ``min_lr``; gradients are clipped to
    ``grad_clip`` (default 1.0, 0 = off); ``precision`` is fp32 (default), bf16, fp16
    (CUDA only) or auto (bf16 where the hardware multiplies it natively, else fp32).
    ``schedule="wsd"`` (warm-up–stable–decay) holds ``lr`` after the warm-up and decays
    linearly to ``min_lr`` over the last ``decay_fraction`` of the steps.

    ``optimizer="muon"`` trains the hidden 2-D weight matrices (those inside the blocks) with
    ``torch.optim.Muon`` at ``muon_lr`` (momentum ``muon_momentum``, ``adjust_lr_fn`` =
    ``muon_lr_adjust``, ``muon_ns_steps`` Newton–Schulz iterations) and everything else —
    embeddings, head, gains, biases — with AdamW at ``lr``; both follow the one schedule.
    Muon is refused under ``strategy="fsdp"`` (its Newton–Schulz step needs each whole
    matrix; FSDP gives a rank a shard).
    ``embed_lr`` (> 0) gives the token embedding (and a tied head) its own AdamW rate.
    ``seq_warmup_steps`` (> 0) trains on the first ``seq_warmup_start`` tokens of each window
    at step 0, growing linearly to ``block_size`` at that step (language models only).
    ``batch_warmup_steps`` (> 0) trains on the first ``batch_warmup_start`` windows of each
    drawn batch at step 0, growing linearly to ``batch_size`` at that step: cheap steps while
    the loss falls fast. The full batch is still drawn, so the data a seed sees, and exact
    resume, do not depend on it.
    Invalid values raise ``ValueError`` naming the field.
    """

    batch_size: int = 12
    block_size: int = 64
    max_steps: int = 2000
    lr: float = 1e-3
    min_lr: float = 1e-4
    warmup_steps: int = 100
    schedule: str = "cosine"
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.99)
    grad_clip: float = 1.0
    eval_interval: int = 250
    eval_batches: int = 20
    log_interval: int = 50
    val_fraction: float = 0.1
    seed: int = 1337
    device: str = "auto"
    grad_accum_steps: int = 1
    precision: str = "fp32"
    compile: bool = False
    checkpoint_interval: int = 0
    keep_last: int = 3
    early_stopping_patience: int = 0
    target_val_loss: float = 0.0
    max_nonfinite_steps: int = 10
    loss_curve: bool = True
    tensorboard: bool = False
    strategy: str = "ddp"
    optimizer: str = "adamw"
    muon_lr: float = 0.02
    muon_momentum: float = 0.95
    muon_lr_adjust: str = "match_rms_adamw"
    muon_ns_steps: int = 5
    decay_fraction: float = 0.2
    embed_lr: float = 0.0
    seq_warmup_steps: int = 0
    seq_warmup_start: int = 16
    batch_warmup_steps: int = 0
    batch_warmup_start: int = 4

    def __post_init__(self) -> None:
        for name in ("batch_size", "block_size", "max_steps", "eval_interval", "eval_batches",
                     "log_interval", "grad_accum_steps", "keep_last", "max_nonfinite_steps"):
            value = getattr(self, name)
            if not _is_int(value) or value <= 0:
                raise ValueError(f"TrainConfig.{name} must be a positive int; got {value!r}")
        for name in ("warmup_steps", "checkpoint_interval", "early_stopping_patience",
                     "seq_warmup_steps", "batch_warmup_steps"):
            value = getattr(self, name)
            if not _is_int(value) or value < 0:
                raise ValueError(f"TrainConfig.{name} must be an int >= 0; got {value!r}")
        _check_types(self)  # the other fields; betas from JSON (a list) becomes a tuple
        if not 0.0 < self.val_fraction < 1.0:
            raise ValueError(f"TrainConfig.val_fraction must be in (0, 1); got "
                             f"{self.val_fraction}")
        if self.lr <= 0 or self.min_lr < 0 or self.min_lr > self.lr:
            raise ValueError(f"TrainConfig needs 0 <= min_lr <= lr and lr > 0; got "
                             f"lr={self.lr}, min_lr={self.min_lr}")
        if self.weight_decay < 0:
            raise ValueError(f"TrainConfig.weight_decay must be >= 0; got {self.weight_decay}")
        if not (math.isfinite(self.target_val_loss) and self.target_val_loss >= 0):
            raise ValueError(f"TrainConfig.target_val_loss must be a finite number >= 0 "
                             f"(0 = train every step); got {self.target_val_loss}")
        if self.grad_clip < 0:
            raise ValueError(f"TrainConfig.grad_clip must be >= 0 (0 = no clipping); got "
                             f"{self.grad_clip}")
        if len(self.betas) != 2 or not all(0.0 <= b < 1.0 for b in self.betas):
            raise ValueError(f"TrainConfig.betas must be two numbers in [0, 1); got "
                             f"{self.betas}")
        _check_choice("schedule", self.schedule, SCHEDULES)
        _check_choice("precision", self.precision, PRECISIONS)
        _check_choice("strategy", self.strategy, STRATEGIES)
        _check_choice("optimizer", self.optimizer, OPTIMIZERS)
        _check_choice("muon_lr_adjust", self.muon_lr_adjust, MUON_LR_ADJUST)
        if self.muon_lr <= 0 or self.embed_lr < 0:
            raise ValueError(f"TrainConfig needs muon_lr > 0 and embed_lr >= 0 (0 = lr); got "
                             f"muon_lr={self.muon_lr}, embed_lr={self.embed_lr}")
        if not 1 <= self.muon_ns_steps <= 20:
            raise ValueError(f"TrainConfig.muon_ns_steps must be in [1, 20]; got "
                             f"{self.muon_ns_steps}")
        if not 0.0 <= self.muon_momentum < 1.0:
            raise ValueError(f"TrainConfig.muon_momentum must be in [0, 1); got "
                             f"{self.muon_momentum}")
        if not 0.0 < self.decay_fraction <= 1.0:
            raise ValueError(f"TrainConfig.decay_fraction must be in (0, 1]; got "
                             f"{self.decay_fraction}")
        if self.seq_warmup_start <= 0 or (self.seq_warmup_steps > 0
                                          and self.seq_warmup_start > self.block_size):
            raise ValueError(f"TrainConfig.seq_warmup_start must be in [1, block_size="
                             f"{self.block_size}]; got {self.seq_warmup_start}")
        if self.batch_warmup_start <= 0 or (self.batch_warmup_steps > 0
                                            and self.batch_warmup_start > self.batch_size):
            raise ValueError(f"TrainConfig.batch_warmup_start must be in [1, batch_size="
                             f"{self.batch_size}]; got {self.batch_warmup_start}")
        if self.optimizer == "muon" and self.strategy == "fsdp":
            raise ValueError("optimizer='muon' cannot train under strategy='fsdp': Muon "
                             "orthogonalises each whole weight matrix, and FSDP gives every "
                             "rank only a shard of it; use strategy='ddp', or optimizer='adamw' "
                             "(--optimizer adamw)")

    @property
    def effective_checkpoint_interval(self) -> int:
        """Steps between regular checkpoints (0 in the config means: at every evaluation)."""
        return self.checkpoint_interval or self.eval_interval


def _sub_config(value: Any, where: str) -> ModelConfig:
    """A nested ``ModelConfig``, built from its JSON object; ``ValueError`` names ``where``."""
    if isinstance(value, ModelConfig):
        return value
    if not isinstance(value, dict):
        raise ValueError(f"{where} must be a ModelConfig or its JSON object; got "
                         f"{type(value).__name__}")
    try:
        return ModelConfig.from_dict(value)
    except TypeError as err:  # a required field (vocab_size) is missing
        raise ValueError(f"{where}: {err}") from None
    except ValueError as err:
        raise ValueError(f"{where}: {err}") from None


# How a classifier summarises a sequence; "last" is a causal (decoder) trunk's last real token.
POOLING_KINDS: tuple[str, ...] = ("cls", "mean", "last")


@dataclass
class ClassifierConfig:
    """An ``EncoderClassifier``: the encoder's ``ModelConfig`` plus the head.

    ``encoder.tie_weights`` is unused (an encoder has no output vocabulary). With
    ``pooling="cls"`` the data pipeline prepends ``<bos>`` so the first token is a
    dedicated summary slot, as BERT's [CLS]. ``causal=True`` runs the trunk with a causal
    mask — a decoder LM's body (its head dropped) turned classifier — and then only the last
    real token has read the whole text, so it pools ``"last"``.
    """

    encoder: ModelConfig
    num_classes: int
    pooling: str = "cls"
    head_dropout: float = 0.0
    causal: bool = False

    def __post_init__(self) -> None:
        self.encoder = _sub_config(self.encoder, "ClassifierConfig.encoder")
        if not _is_int(self.num_classes) or self.num_classes < 2:
            raise ValueError(f"ClassifierConfig.num_classes must be an int >= 2; got "
                             f"{self.num_classes!r}")
        _check_types(self)
        if self.pooling not in POOLING_KINDS:
            raise ValueError(f"pooling={self.pooling!r} is not one of {POOLING_KINDS}")
        if not 0.0 <= self.head_dropout < 1.0:
            raise ValueError(f"ClassifierConfig.head_dropout must be in [0, 1); got "
                             f"{self.head_dropout}")
        if self.causal and self.pooling != "last":
            raise ValueError(f"a causal classifier pools its last real token (the only one "
                             f"that saw the whole text): pooling='last', not {self.pooling!r}")

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-ready data (the encoder's config nested), as saved in config.json."""
        return {"encoder": self.encoder.to_dict(), "num_classes": self.num_classes,
                "pooling": self.pooling, "head_dropout": self.head_dropout,
                **({"causal": True} if self.causal else {})}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ClassifierConfig:
        """Rebuild from ``to_dict``'s data; ``ValueError`` names unknown, missing or invalid
        fields."""
        _check_keys(cls, data)
        return cls(**data)


@dataclass
class Seq2SeqConfig:
    """Two ``ModelConfig``s: the encoder's (source vocabulary, its depth) and the decoder's
    (target vocabulary, its depth; ``tie_weights`` ties its embedding to its output head).
    The two must share ``d_model``: the decoder's cross-attention reads the encoder's output.
    """

    encoder: ModelConfig
    decoder: ModelConfig

    def __post_init__(self) -> None:
        self.encoder = _sub_config(self.encoder, "Seq2SeqConfig.encoder")
        self.decoder = _sub_config(self.decoder, "Seq2SeqConfig.decoder")
        if self.encoder.d_model != self.decoder.d_model:
            raise ValueError(
                f"encoder d_model={self.encoder.d_model} != decoder d_model="
                f"{self.decoder.d_model}; cross-attention needs one model dim C"
            )

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-ready data (both ``ModelConfig``s nested), as saved in config.json."""
        return {"encoder": self.encoder.to_dict(), "decoder": self.decoder.to_dict()}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Seq2SeqConfig:
        """Rebuild from ``to_dict``'s data; exactly ``encoder`` and ``decoder`` are needed."""
        if not isinstance(data, dict) or set(data) != {"encoder", "decoder"}:
            got = sorted(data) if isinstance(data, dict) else type(data).__name__
            raise ValueError(f"Seq2SeqConfig needs exactly the fields ['decoder', 'encoder']; "
                             f"got {got}")
        return cls(**data)


@dataclass
class Preset:
    """A named recipe: model shape (vocabulary filled in from the data) + training."""

    description: str
    model: dict[str, Any] = field(default_factory=dict)
    train: dict[str, Any] = field(default_factory=dict)


PRESETS: dict[str, Preset] = {
    "default": Preset(
        description="character LM on the built-in text; 4 layers, d_model 128, window 64, "
        "Qwen3's block (RMSNorm, SwiGLU, RoPE, QK-norm, no biases: `convert --to hf` writes a "
        "Qwen3ForCausalLM folder), Muon for the blocks' matrices, 800 steps, bf16 where the "
        "CPU multiplies it natively; under a minute on 2 CPU cores (val ≈ 1.25 nats/char)",
        model=dict(d_model=128, n_heads=4, n_layers=4, max_len=64, dropout=0.0,
                   positional="rope", norm="pre", norm_type="rmsnorm", attention="auto",
                   activation="swiglu", bias=False, qk_norm=True),
        train=dict(batch_size=12, block_size=64, max_steps=800, lr=3e-3, min_lr=1e-4,
                   warmup_steps=100, eval_interval=200, eval_batches=20, optimizer="muon",
                   muon_lr=0.01, precision="auto"),
    ),
    "default-adamw": Preset(
        description="the first default recipe (AdamW, learned positions, 4000 steps; about 3 "
        "minutes on 2 CPU cores, val ≈ 1.25 nats/char), kept to compare with",
        model=dict(d_model=128, n_heads=4, n_layers=4, max_len=64, dropout=0.0,
                   positional="learned", norm="pre", attention="sdpa", activation="gelu"),
        train=dict(batch_size=12, block_size=64, max_steps=4000, lr=1e-3, min_lr=1e-4,
                   warmup_steps=100, eval_interval=250, eval_batches=20),
    ),
    "shakespeare-char": Preset(
        description="the well-known small CPU recipe for tinyshakespeare (published val 1.88)",
        model=dict(d_model=128, n_heads=4, n_layers=4, max_len=64, dropout=0.0,
                   positional="learned", norm="pre", attention="sdpa", activation="gelu",
                   tie_weights=True, bias=False),
        train=dict(batch_size=12, block_size=64, max_steps=2000, lr=1e-3, min_lr=1e-4,
                   warmup_steps=100, eval_interval=250, eval_batches=200),
    ),
    "shakespeare-fast": Preset(
        description="reaches shakespeare-char's validation loss in a fraction of its time: "
        "2 wider layers (d_model 160) with Llama's block (RMSNorm, SwiGLU, RoPE, no biases), "
        "lr 3e-3, batch 16, 900 steps, bf16 where the CPU multiplies it natively (see "
        "benchmarks/time_to_loss.py)",
        model=dict(d_model=160, n_heads=5, n_layers=2, max_len=64, dropout=0.0,
                   positional="rope", norm="pre", norm_type="rmsnorm", attention="auto",
                   activation="swiglu", tie_weights=True, bias=False),
        train=dict(batch_size=16, block_size=64, max_steps=900, lr=3e-3, min_lr=1e-4,
                   warmup_steps=50, eval_interval=100, eval_batches=200, precision="auto"),
    ),
    "medium": Preset(
        description="6 layers, d_model 384, window 64 on the built-in text: a model whose "
        "per-token cost is dominated by reading its weights, the target that speculative "
        "decoding is measured on; bf16 where the CPU multiplies it natively, 3000 steps (about "
        "12 minutes on one CPU thread with native bf16; val ≈ 1.23 nats/char)",
        model=dict(d_model=384, n_heads=6, n_layers=6, max_len=64, dropout=0.0,
                   positional="learned", norm="pre", attention="sdpa", activation="gelu"),
        train=dict(batch_size=12, block_size=64, max_steps=3000, lr=1e-3, min_lr=1e-4,
                   warmup_steps=100, eval_interval=250, eval_batches=20, precision="auto"),
    ),
    "draft": Preset(
        description="a 2-layer, d_model 128 draft for speculative decoding (`handformer "
        "generate --draft`); with --draft-for RUN it trains on that run's text with that "
        "run's tokenizer and window, as a draft must",
        model=dict(d_model=128, n_heads=4, n_layers=2, max_len=64, dropout=0.0,
                   positional="learned", norm="pre", attention="sdpa", activation="gelu"),
        train=dict(batch_size=12, block_size=64, max_steps=3000, lr=2e-3, min_lr=1e-4,
                   warmup_steps=100, eval_interval=250, eval_batches=20, precision="auto"),
    ),
    "speedrun": Preset(
        description="the levers that won the speedrun log on shakespeare-fast's 2 wider layers, "
        "with Qwen3's block (RMSNorm, SwiGLU, RoPE, QK-norm, no biases): Muon (momentum 0.9) "
        "for the blocks' matrices, a 25-step warm-up, cosine over 300 steps, bf16 where the CPU "
        "multiplies it natively, a cheap evaluation every 25 steps (15 × 1,024 held-out tokens, "
        "as many as nanoGPT's CPU recipe) — race it with --until-val-loss (see README, Measured "
        "on tinyshakespeare)",
        model=dict(d_model=160, n_heads=5, n_layers=2, max_len=64, dropout=0.0,
                   positional="rope", norm="pre", norm_type="rmsnorm", attention="auto",
                   activation="swiglu", tie_weights=True, bias=False, qk_norm=True),
        train=dict(batch_size=16, block_size=64, max_steps=300, lr=3e-3, min_lr=1e-4,
                   warmup_steps=25, eval_interval=25, eval_batches=15, precision="auto",
                   optimizer="muon", muon_lr=0.01, muon_momentum=0.9),
    ),
    "tiny": Preset(
        description="a seconds-long smoke run: 2 layers, d_model 32, window 32",
        model=dict(d_model=32, n_heads=4, n_layers=2, max_len=32, dropout=0.0),
        train=dict(batch_size=8, block_size=32, max_steps=60, lr=3e-3, min_lr=3e-4,
                   warmup_steps=10, eval_interval=30, eval_batches=4, log_interval=10),
    ),
}


# The encoder jobs' recipes (``handformer classify train`` / ``seq2seq train``); the window
# (``max_len`` / ``block_size``) and the vocabulary come from the data.
CLASSIFY_PRESET = Preset(
    description="encoder classifier: pre-norm, warm-up, RoPE (relative positions let a head "
    "compare 'is this key before that query' at any length, which the built-in brackets task "
    "needs)",
    model=dict(d_model=64, n_heads=4, n_layers=2, d_ff=256, dropout=0.0, positional="rope",
               norm="pre", attention="sdpa", activation="gelu", tie_weights=False),
    train=dict(batch_size=32, max_steps=600, lr=1e-3, min_lr=1e-4, warmup_steps=50,
               weight_decay=0.01, eval_interval=100, log_interval=50, eval_batches=1,
               seed=1337),
)
SEQ2SEQ_PRESET = Preset(
    description="encoder-decoder: sinusoidal positions as in the original paper, with the "
    "pre-norm + warm-up recipe",
    model=dict(d_model=64, n_heads=4, n_layers=2, d_ff=256, dropout=0.0,
               positional="sinusoidal", norm="pre", attention="sdpa", activation="gelu",
               tie_weights=True),
    train=dict(batch_size=64, max_steps=1500, lr=2e-3, min_lr=1e-4, warmup_steps=100,
               weight_decay=0.01, eval_interval=250, log_interval=50, eval_batches=1,
               seed=1337),
)


def get_preset(name: str) -> Preset:
    """The named recipe from ``PRESETS``; ``ValueError`` listing the names if unknown."""
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown preset {name!r}; available: {sorted(PRESETS)}") from None
