"""A randomly initialised Hugging Face GPT-2 runs inside handformer with the same numbers,
and a handformer model exported to GPT-2 runs inside ``transformers``.

Tolerance: fp32, rtol 1e-4 / atol 1e-4 on logits (different kernels sum in different order).
"""

from __future__ import annotations

import pytest
import torch

from handformer.generate import generate
from handformer.interop.gpt2 import (
    ConversionError,
    config_to_gpt2,
    from_gpt2_state_dict,
    to_gpt2_state_dict,
)
from handformer.models.decoder_lm import DecoderLM
from tests.conftest import tiny_config

transformers = pytest.importorskip(
    "transformers", reason="the 'transformers' test extra is not installed "
    "(pip install -r requirements-dev.txt)")

TOL = {"rtol": 1e-4, "atol": 1e-4}


def _hf_model(activation: str = "gelu_new") -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=53, n_positions=24, n_embd=32, n_layer=2,
                                  n_head=4, activation_function=activation,
                                  bos_token_id=None, eos_token_id=None)
    model = transformers.GPT2LMHeadModel(cfg).eval()
    with torch.no_grad():  # non-trivial LayerNorm parameters and biases
        for name, p in model.named_parameters():
            if name.endswith("bias") or "ln_" in name:
                p.add_(torch.randn_like(p) * 0.1)
    return model


@pytest.mark.parametrize("activation", ["gelu_new", "gelu", "relu"])
@pytest.mark.parametrize("path", ["manual", "sdpa"])
def test_gpt2_weights_give_the_same_logits_in_handformer(activation: str, path: str) -> None:
    hf = _hf_model(activation)
    ours = from_gpt2_state_dict(hf.state_dict(), hf.config.to_dict())
    for block in ours.blocks:
        block.self_attn.attention = path
    ids = torch.randint(0, 53, (3, 24))
    with torch.no_grad():
        torch.testing.assert_close(ours(ids), hf(input_ids=ids).logits, **TOL)


def test_greedy_continuations_identical() -> None:
    hf = _hf_model()
    ours = from_gpt2_state_dict(hf.state_dict(), hf.config.to_dict())
    prompt = torch.randint(0, 53, (1, 5))
    with torch.no_grad():
        theirs = hf.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=15,
                             do_sample=False, pad_token_id=0)
    assert generate(ours, prompt, 15, temperature=0).tolist() == theirs.tolist()


def test_handformer_model_exports_to_gpt2_and_back() -> None:
    ours = DecoderLM(tiny_config(vocab_size=41, positional="learned", activation="gelu_tanh",
                                 max_len=16)).eval()
    hf_cfg = transformers.GPT2Config(**config_to_gpt2(ours.config))
    hf = transformers.GPT2LMHeadModel(hf_cfg).eval()
    hf.load_state_dict(to_gpt2_state_dict(ours), strict=True)
    ids = torch.randint(0, 41, (2, 16))
    with torch.no_grad():
        torch.testing.assert_close(hf(input_ids=ids).logits, ours(ids), **TOL)
    back = from_gpt2_state_dict(hf.state_dict(), hf.config.to_dict())
    for (name, a), b in zip(ours.state_dict().items(), back.state_dict().values(), strict=True):
        assert torch.equal(a, b), name


def test_unmappable_models_and_checkpoints_are_clear_errors() -> None:
    with pytest.raises(ConversionError, match="positional='rope'"):
        config_to_gpt2(tiny_config(positional="rope"))
    with pytest.raises(ConversionError, match="n_kv_heads=2"):
        config_to_gpt2(tiny_config(positional="learned", n_kv_heads=2))
    hf = _hf_model()
    state = dict(hf.state_dict())
    del state["transformer.h.1.mlp.c_fc.bias"]
    with pytest.raises(ConversionError, match=r"missing \['transformer.h.1.mlp.c_fc.bias'\]"):
        from_gpt2_state_dict(state, hf.config.to_dict())
    with pytest.raises(ConversionError, match="activation_function='silu'"):
        from_gpt2_state_dict(hf.state_dict(), {**hf.config.to_dict(),
                                               "activation_function": "silu"})


def test_integer_tensors_are_refused_not_cast_into_weights() -> None:
    hf = _hf_model()
    state = dict(hf.state_dict())
    key = "transformer.h.0.mlp.c_fc.weight"
    state[key] = state[key].long()
    with pytest.raises(ConversionError, match=rf"x\.safetensors: tensor '{key}' holds int64"):
        from_gpt2_state_dict(state, hf.config.to_dict(), source="x.safetensors")
