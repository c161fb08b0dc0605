"""TrainConfig: the new engine fields validate with clear errors and round-trip through JSON,
and a config.json written before they existed still loads."""

from __future__ import annotations

import json
import math
import re

import pytest

from handformer.config import TrainConfig


def test_round_trip_through_json() -> None:
    cfg = TrainConfig(grad_accum_steps=3, precision="bf16", compile=True, keep_last=2,
                      checkpoint_interval=50, early_stopping_patience=4, max_nonfinite_steps=7,
                      tensorboard=True, loss_curve=False)
    again = TrainConfig.from_dict(json.loads(cfg.to_json()))
    assert again == cfg and again.betas == cfg.betas


def test_old_config_without_engine_fields_loads_with_defaults() -> None:
    old = {"batch_size": 12, "block_size": 64, "max_steps": 2000, "lr": 1e-3, "min_lr": 1e-4,
           "warmup_steps": 100, "schedule": "cosine", "weight_decay": 0.1, "betas": [0.9, 0.99],
           "grad_clip": 1.0, "eval_interval": 250, "eval_batches": 20, "log_interval": 50,
           "val_fraction": 0.1, "seed": 1337, "device": "auto"}
    cfg = TrainConfig.from_dict(old)
    assert cfg.grad_accum_steps == 1 and cfg.precision == "fp32" and cfg.keep_last == 3
    assert cfg.effective_checkpoint_interval == 250  # 0 means: at every evaluation


@pytest.mark.parametrize(("field", "value", "message"), [
    ("grad_accum_steps", 0, "grad_accum_steps must be a positive int; got 0"),
    ("keep_last", 0, "keep_last must be a positive int; got 0"),
    ("max_nonfinite_steps", -1, "max_nonfinite_steps must be a positive int; got -1"),
    ("checkpoint_interval", -5, "checkpoint_interval must be an int >= 0; got -5"),
    ("early_stopping_patience", 1.5, "early_stopping_patience must be an int >= 0; got 1.5"),
    ("precision", "fp8", "precision='fp8' is not one of ('fp32', 'bf16', 'fp16', 'auto')"),
    ("compile", "yes", "compile must be true or false; got 'yes'"),
    ("grad_clip", -1.0, "grad_clip must be >= 0"),
    ("target_val_loss", -1.0, "target_val_loss must be a finite number >= 0"),
    ("target_val_loss", math.nan, "target_val_loss must be a finite number"),
    ("betas", (0.9, 1.5), "betas must be two numbers in [0, 1)"),
])
def test_bad_values_name_the_field_and_the_value(field: str, value: object,
                                                 message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        TrainConfig(**{field: value})
