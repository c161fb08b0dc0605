"""One trunk for all three models: every ``ModelConfig`` lever means the same thing in the
decoder LM, the encoder and the encoder–decoder's decoder (the copies had drifted: the seq2seq
decoder's final norm dropped ``layer_norm_eps`` and it never soft-capped)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from handformer.config import ModelConfig
from handformer.models.decoder_lm import DecoderLM
from handformer.models.encoder import Encoder
from handformer.models.seq2seq import Decoder
from handformer.nn.attention import MultiHeadAttention
from handformer.nn.norm import RMSNorm

LEVERS = [
    dict(layer_norm_eps=0.3),
    dict(layer_norm_eps=0.2, norm_type="rmsnorm", qk_norm=True, positional="rope"),
    dict(norm="post", layer_norm_eps=0.1),
    dict(head_dim=12, n_kv_heads=2, positional="rope", rope_scaling="llama3", rope_factor=4.0,
         rope_original_max_len=4, rope_base=50.0),
    dict(logit_softcap=0.5, bias=False),
]


def _models(**lever) -> dict[str, nn.Module]:
    cfg = ModelConfig(vocab_size=23, d_model=32, n_heads=4, n_layers=2, max_len=16, **lever)
    torch.manual_seed(0)
    return {"lm": DecoderLM(cfg), "encoder": Encoder(cfg), "decoder": Decoder(cfg)}


@pytest.mark.parametrize("lever", LEVERS, ids=lambda d: ",".join(f"{k}={v}" for k, v in d.items()))
def test_every_lever_builds_the_same_layers_in_every_model(lever: dict) -> None:
    models = _models(**lever)
    cfg = models["lm"].config
    for name, model in models.items():
        norms = [m for m in model.modules() if isinstance(m, nn.LayerNorm | RMSNorm)]
        assert norms and all(m.eps == cfg.layer_norm_eps for m in norms), name
        want = RMSNorm if cfg.norm_type == "rmsnorm" else nn.LayerNorm
        assert all(isinstance(m, want) for m in norms
                   if not (isinstance(m, RMSNorm) and m.weight.shape[0] == cfg.head_dim
                           and cfg.qk_norm)), name
        attns = [m for m in model.modules() if isinstance(m, MultiHeadAttention)]
        assert all(a.head_dim == cfg.head_dim for a in attns), name
        rotaries = [a.rotary for a in attns if a.rotary is not None]
        if cfg.positional == "rope":
            expected = rotaries[0].inv_freq
            assert all(torch.equal(r.inv_freq, expected) for r in rotaries), name
        has_bias = any(p.endswith(".bias") for p, _ in model.named_parameters())
        assert has_bias == cfg.bias, name
        final = model.final_norm
        if name == "decoder" or cfg.norm == "pre":  # seq2seq ends in a norm either way
            assert isinstance(final, want) and final.eps == cfg.layer_norm_eps, name
        else:
            assert isinstance(final, nn.Identity), name


def test_soft_cap_applies_in_both_models_with_a_head() -> None:
    cap = 0.5
    models = _models(logit_softcap=cap)
    ids = torch.randint(0, 23, (2, 7))
    memory = torch.randn(2, 5, 32)
    for name, model in (("lm", models["lm"]), ("decoder", models["decoder"])):
        with torch.no_grad():
            model.lm_head.weight.mul_(200.0)  # raw logits far beyond the cap
            hidden: list[torch.Tensor] = []
            handle = model.final_norm.register_forward_hook(
                lambda m, a, out, seen=hidden: seen.append(out))
            logits = model(ids) if name == "lm" else model(ids, memory)
            handle.remove()
            raw = hidden[0] @ model.lm_head.weight.T  # (B, T, V)
        assert raw.abs().max() > 10 * cap
        torch.testing.assert_close(logits, cap * torch.tanh(raw / cap))
