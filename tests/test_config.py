"""handformer.config and the clear-error contract for bad inputs across the public API."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from handformer.config import (
    MODEL_LIMITS,
    ClassifierConfig,
    ModelConfig,
    Seq2SeqConfig,
    TrainConfig,
)
from handformer.data import Batch, collate_sequences
from handformer.loss import IGNORE_INDEX
from handformer.masks import (
    causal_mask,
)
from handformer.nn.feedforward import FeedForward
from handformer.nn.positional import LearnedPositions


def json_round_trip(data: dict) -> dict:
    """Through real JSON text, as config.json would be."""
    return json.loads(json.dumps(data))


def assert_clear_error(make: Callable[[], object], needles: list[str]) -> None:
    """``make()`` raises a ValueError whose message contains every needle."""
    with pytest.raises(ValueError) as info:
        make()
    message = str(info.value)
    for needle in needles:
        assert needle in message, f"{needle!r} missing from: {message}"


def model_kwargs(**overrides: object) -> dict:
    """A small valid ModelConfig, with overrides."""
    return {"vocab_size": 37, "d_model": 32, "n_heads": 4, "n_layers": 2, "max_len": 16,
            **overrides}


# =========================================================================================
# config.py
# =========================================================================================
def test_model_config_json_round_trip() -> None:
    cfg = ModelConfig(**model_kwargs(positional="sinusoidal", norm="post", attention="manual",
                                     activation="relu", tie_weights=False, bias=False,
                                     dropout=0.1))
    again = ModelConfig.from_dict(json_round_trip(cfg.to_dict()))
    assert again == cfg
    assert cfg.d_ff == 4 * cfg.d_model and cfg.head_dim == 8
    assert ModelConfig.from_dict(json.loads(cfg.to_json())) == cfg


def test_train_config_json_round_trip(tmp_path: Path) -> None:
    cfg = TrainConfig(batch_size=3, block_size=7, max_steps=11, betas=(0.8, 0.95),
                      schedule="linear", seed=5, device="cpu")
    again = TrainConfig.from_dict(json_round_trip(cfg.to_dict()))
    assert again == cfg
    assert isinstance(again.betas, tuple)
    path = tmp_path / "train.json"
    path.write_text(cfg.to_json(), encoding="utf-8")
    assert TrainConfig.load(path) == cfg


def _bad_model(**overrides: object) -> Callable[[], object]:
    return lambda: ModelConfig(**model_kwargs(**overrides))


def _bad_train(**overrides: object) -> Callable[[], object]:
    return lambda: TrainConfig(**overrides)


def _learned_positions_too_far() -> object:
    return LearnedPositions(max_len=16, d_model=8)(torch.arange(20)[None])


# (id, callable, substrings the message must contain)
BAD_INPUTS: list[tuple[str, Callable[[], object], list[str]]] = [
    ("d_model-not-divisible", _bad_model(d_model=30, n_heads=4), ["d_model", "n_heads"]),
    ("unknown-positional", _bad_model(positional="rotary"), ["positional", "rotary"]),
    ("unknown-norm", _bad_model(norm="sandwich"), ["norm", "sandwich"]),
    ("unknown-attention", _bad_model(attention="flash3"), ["attention", "flash3"]),
    ("unknown-activation", _bad_model(activation="swish"), ["activation", "swish"]),
    ("negative-dropout", _bad_model(dropout=-0.1), ["dropout"]),
    ("dropout-one", _bad_model(dropout=1.0), ["dropout"]),
    ("zero-layers", _bad_model(n_layers=0), ["n_layers"]),
    ("zero-vocab", _bad_model(vocab_size=0), ["vocab_size"]),
    ("model-unknown-field",
     lambda: ModelConfig.from_dict({**model_kwargs(), "n_experts": 8}), ["n_experts"]),
    ("train-unknown-field", lambda: TrainConfig.from_dict({"learning_rate": 1.0}),
     ["learning_rate"]),
    ("train-zero-batch", _bad_train(batch_size=0), ["batch_size"]),
    ("train-negative-warmup", _bad_train(warmup_steps=-1), ["warmup_steps"]),
    ("train-val-fraction", _bad_train(val_fraction=1.0), ["val_fraction"]),
    ("train-min-lr-above-lr", _bad_train(lr=1e-3, min_lr=1e-2), ["min_lr", "lr"]),
    ("train-unknown-schedule", _bad_train(schedule="step"), ["schedule", "step"]),
    ("learned-positions-too-far", _learned_positions_too_far,
     ["20", "max_len", "sinusoidal"]),
    ("feedforward-activation", lambda: FeedForward(8, 32, activation="swish"),
     ["activation", "swish"]),
    ("collate-bad-side", lambda: collate_sequences([[1, 2]], side="up"), ["side"]),
    ("causal-too-many-queries", lambda: causal_mask(5, 3), ["t_q=5", "t_k=3"]),
]


@pytest.mark.parametrize(("make", "needles"), [(m, n) for _, m, n in BAD_INPUTS],
                         ids=[i for i, _, _ in BAD_INPUTS])
def test_every_bad_input_raises_a_clear_error(make: Callable[[], object],
                                              needles: list[str]) -> None:
    assert_clear_error(make, needles)


NAN, INF = float("nan"), float("inf")

# Typed configs: what JSON (or a hand edit) can put in a field, refused by name. Each would
# have been accepted before: "false" is truthy (ties the weights), NaN compares False with
# every bound, 4.0 is not an int.
TYPED: list[tuple[str, Callable[[], object], list[str]]] = [
    ("bool-as-string", lambda: ModelConfig.from_dict(model_kwargs(tie_weights="false")),
     ["ModelConfig.tie_weights", "'false'"]),
    ("bool-as-int", lambda: ModelConfig.from_dict(model_kwargs(bias=0)), ["ModelConfig.bias"]),
    ("train-bool-as-string", lambda: TrainConfig.from_dict({"compile": "no"}),
     ["TrainConfig.compile", "'no'"]),
    ("int-as-float", lambda: ModelConfig.from_dict(model_kwargs(d_model=32.0)),
     ["ModelConfig.d_model", "32.0"]),
    ("int-as-bool", lambda: ModelConfig.from_dict(model_kwargs(n_layers=True)),
     ["ModelConfig.n_layers"]),
    ("int-as-string", lambda: TrainConfig.from_dict({"batch_size": "8"}),
     ["TrainConfig.batch_size", "'8'"]),
    ("float-as-string", lambda: ModelConfig.from_dict(model_kwargs(rope_base="1e4")),
     ["ModelConfig.rope_base", "'1e4'"]),
    ("float-as-bool", lambda: ModelConfig.from_dict(model_kwargs(dropout=True)),
     ["ModelConfig.dropout"]),
    ("str-as-number", lambda: ModelConfig.from_dict(model_kwargs(norm=1)), ["ModelConfig.norm"]),
    ("nan-rope-base", lambda: ModelConfig.from_dict(model_kwargs(rope_base=NAN)),
     ["ModelConfig.rope_base", "finite", "nan"]),
    ("inf-rope-base", lambda: ModelConfig.from_dict(model_kwargs(rope_base=INF)),
     ["ModelConfig.rope_base", "inf"]),
    ("nan-eps", lambda: ModelConfig.from_dict(model_kwargs(layer_norm_eps=NAN)),
     ["layer_norm_eps"]),
    ("nan-dropout", lambda: ModelConfig.from_dict(model_kwargs(dropout=NAN)), ["dropout"]),
    ("inf-lr", lambda: TrainConfig.from_dict({"lr": INF}), ["TrainConfig.lr", "inf"]),
    ("nan-lr", lambda: TrainConfig.from_dict({"lr": NAN}), ["TrainConfig.lr", "nan"]),
    ("zero-lr", lambda: TrainConfig(lr=0.0), ["lr > 0"]),
    ("nan-min-lr", lambda: TrainConfig(min_lr=NAN), ["TrainConfig.min_lr"]),
    ("nan-grad-clip", lambda: TrainConfig(grad_clip=NAN), ["TrainConfig.grad_clip"]),
    ("negative-weight-decay", lambda: TrainConfig(weight_decay=-0.1),
     ["TrainConfig.weight_decay"]),
    ("inf-weight-decay", lambda: TrainConfig(weight_decay=INF), ["TrainConfig.weight_decay"]),
    ("nan-beta", lambda: TrainConfig.from_dict({"betas": [0.9, NAN]}), ["TrainConfig.betas"]),
    ("beta-string", lambda: TrainConfig.from_dict({"betas": "0.9,0.99"}),
     ["TrainConfig.betas"]),
    ("nan-val-fraction", lambda: TrainConfig(val_fraction=NAN), ["val_fraction"]),
    ("seed-float", lambda: TrainConfig.from_dict({"seed": 1.5}), ["TrainConfig.seed"]),
    ("vocab-beyond-limit", lambda: ModelConfig(**model_kwargs(vocab_size=10**12)),
     ["ModelConfig.vocab_size", str(10**12), str(MODEL_LIMITS["vocab_size"])]),
    ("max-len-beyond-limit", lambda: ModelConfig(**model_kwargs(max_len=2**40)),
     ["ModelConfig.max_len"]),
    ("missing-vocab", lambda: ModelConfig.from_dict({"d_model": 32}),
     ["ModelConfig", "missing", "vocab_size"]),
    ("not-an-object", lambda: ModelConfig.from_dict([1, 2]),  # type: ignore[arg-type]
     ["ModelConfig", "JSON object", "list"]),
    ("classifier-missing-classes",
     lambda: ClassifierConfig.from_dict({"encoder": model_kwargs()}), ["num_classes"]),
    ("classifier-nested-bad-bool",
     lambda: ClassifierConfig.from_dict({"encoder": model_kwargs(bias="yes"),
                                         "num_classes": 2}),
     ["ClassifierConfig.encoder", "ModelConfig.bias"]),
    ("classifier-encoder-string",
     lambda: ClassifierConfig.from_dict({"encoder": "small", "num_classes": 2}),
     ["ClassifierConfig.encoder", "str"]),
    ("classifier-nan-head-dropout",
     lambda: ClassifierConfig(ModelConfig(**model_kwargs()), 2, head_dropout=NAN),
     ["ClassifierConfig.head_dropout"]),
    ("seq2seq-nested-missing-vocab",
     lambda: Seq2SeqConfig.from_dict({"encoder": model_kwargs(), "decoder": {"d_model": 32}}),
     ["Seq2SeqConfig.decoder", "vocab_size"]),
    ("seq2seq-not-an-object", lambda: Seq2SeqConfig.from_dict("x"),  # type: ignore[arg-type]
     ["Seq2SeqConfig", "str"]),
]


@pytest.mark.parametrize(("make", "needles"), [(m, n) for _, m, n in TYPED],
                         ids=[i for i, _, _ in TYPED])
def test_config_fields_are_typed_finite_and_named_when_wrong(make: Callable[[], object],
                                                             needles: list[str]) -> None:
    assert_clear_error(make, needles)


def test_typed_fields_are_normalised_for_json() -> None:
    """Ints in float fields become floats and NumPy ints become ints, so config.json holds
    plain JSON numbers; real booleans go through untouched."""
    import numpy as np

    cfg = ModelConfig(**model_kwargs(d_model=np.int64(32), dropout=0, tie_weights=False))
    assert type(cfg.d_model) is int and type(cfg.dropout) is float
    assert cfg.tie_weights is False
    assert ModelConfig.from_dict(json_round_trip(cfg.to_dict())) == cfg
    assert TrainConfig(lr=1).lr == 1.0 and TrainConfig.from_dict({"betas": [0, 0.5]}).betas == (
        0.0, 0.5)


def test_learned_positions_accept_last_position() -> None:
    pos = LearnedPositions(max_len=16, d_model=8)
    assert pos(torch.arange(16)[None]).shape == (1, 16, 8)


def test_a_moved_batch_keeps_the_token_count_taken_on_the_cpu() -> None:
    """The trainer reads num_tokens every step; counted on the CPU before ``to``, it never
    has to wait for the device."""

    targets = torch.tensor([[1, 2, IGNORE_INDEX], [3, IGNORE_INDEX, IGNORE_INDEX]])
    batch = Batch(ids=torch.zeros(2, 3, dtype=torch.long), targets=targets)
    moved = batch.to("meta")  # a device whose tensors hold no values: counting would fail
    assert moved.num_tokens == 3
    assert batch.num_tokens == 3
