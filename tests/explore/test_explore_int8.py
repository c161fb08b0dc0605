"""The explorer opens an int8 run folder like any other: attention pictures and cached
generation steps work on the quantized layers."""

from __future__ import annotations

from pathlib import Path

import torch

from handformer.config import ModelConfig
from handformer.explore.explorer import Explorer
from handformer.explore.generation import Generator
from handformer.explore.run import load_explore_run
from handformer.models.decoder_lm import DecoderLM
from handformer.models.quantize import is_quantized, quantize_int8
from handformer.nn.quantized import Int8Linear
from handformer.runs import save_run
from handformer.tokenizers import CharTokenizer

TEXT = "the quick brown fox jumps over the lazy dog.\n"


def test_an_int8_run_explores_and_generates(tmp_path: Path) -> None:
    tok = CharTokenizer.from_text(TEXT)
    model = DecoderLM(ModelConfig(vocab_size=tok.vocab_size, d_model=32, n_heads=4,
                                  n_layers=2, max_len=16))
    save_run(tmp_path / "run", quantize_int8(model), tok)
    run = load_explore_run(tmp_path / "run")
    assert is_quantized(run.model)
    for layer in run.model.modules():  # the kernel choice is tested in tests/nn
        if isinstance(layer, Int8Linear):
            layer.kernel = "dequantized"
    explorer = Explorer(run)
    picture = explorer.attention("the fox", 1, "all")
    weights = torch.tensor(picture["weights"])  # (H, T, T)
    torch.testing.assert_close(weights.sum(-1), torch.ones(4, 7), atol=1e-4, rtol=0)
    generator = Generator(explorer)
    start = generator.start("the qu", 0, 0)
    step = generator.step(start["session"], 0, 0, 0.0, None)
    assert step["chosen"]["id"] == start["next"][0]["id"]  # greedy = the top bar
    assert step["cache"]["filled"] == len("the qu") + 1
