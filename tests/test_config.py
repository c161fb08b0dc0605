"""handformer.config and the clear-error contract for bad inputs across the public API."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from handformer.config import ModelConfig, TrainConfig
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
    with pytest.raises(ValueError) as info:
        make()
    message = str(info.value)
    for needle in needles:
        assert needle in message, f"{needle!r} missing from: {message}"


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
