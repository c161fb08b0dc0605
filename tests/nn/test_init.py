"""handformer.nn.init.skip_init: a model built to be loaded draws no random start, and still
computes everything that is not a fill."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from torch import nn

from handformer.config import ModelConfig
from handformer.models.decoder_lm import DecoderLM
from handformer.nn.init import skip_init

SHAPE = dict(vocab_size=13, d_model=16, n_heads=2, n_layers=2, max_len=12)


def test_random_fills_leave_their_tensor_and_the_generator_alone() -> None:
    torch.manual_seed(0)
    before = torch.get_rng_state()
    t = torch.zeros(4, 8)
    with skip_init():
        assert nn.init.normal_(t, std=1.0) is t
        assert nn.init.uniform_(t, -1.0, 1.0) is t
        assert nn.init.kaiming_uniform_(tensor=t, a=1.0) is t
        nn.Linear(8, 4), nn.Embedding(13, 4)
    assert torch.equal(t, torch.zeros(4, 8))
    assert torch.equal(torch.get_rng_state(), before)
    nn.init.normal_(t)  # outside, the fill happens again
    assert not torch.equal(t, torch.zeros(4, 8))


def test_other_calls_still_run_inside() -> None:
    with skip_init():
        x = torch.arange(6.0).reshape(2, 3) * 2  # (2, 3)
        norm = nn.LayerNorm(3)
    assert torch.equal(x, torch.tensor([[0.0, 2.0, 4.0], [6.0, 8.0, 10.0]]))
    assert torch.equal(norm.weight, torch.ones(3)) and torch.equal(norm.bias, torch.zeros(3))


@pytest.mark.parametrize("extra", [dict(positional="rope"), dict(positional="alibi"),
                                   dict(positional="rope", rope_scaling="llama3",
                                        rope_original_max_len=8)])
def test_buffers_computed_from_the_config_match_a_normal_build(extra: dict) -> None:
    cfg = ModelConfig(**{**SHAPE, **extra})
    normal = DecoderLM(cfg)
    with skip_init():
        skipped = DecoderLM(cfg)
    want, got = dict(normal.named_buffers()), dict(skipped.named_buffers())
    assert want.keys() == got.keys() and want
    for name in want:
        assert torch.equal(want[name], got[name]), name
    assert skipped.lm_head.weight is skipped.embed.token.weight  # tying is construction


def test_a_meta_skeleton_does_not_import_torch_compiler() -> None:
    """``normal_`` on the meta device runs through torch's decompositions, whose first call
    imports torch._dynamo; a skeleton draws nothing, so loading a run never pays that."""
    code = ("import sys\n"
            "from handformer.config import ModelConfig\n"
            "from handformer.models.decoder_lm import DecoderLM\n"
            "from handformer.runs.consistency import build_skeleton\n"
            f"m = build_skeleton(lambda: DecoderLM(ModelConfig(**{SHAPE!r})))\n"
            "assert m.embed.token.weight.is_meta\n"
            "print('torch._dynamo' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=120)
    assert out.stdout.strip() == "False"
