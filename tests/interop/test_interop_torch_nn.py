"""handformer.interop.torch_nn, both ways: a handformer layer turned into torch's own module
computes what the handformer layer computes, a torch module turned into a handformer layer
computes what the torch module computes, a round trip gives the weights back exactly, and
what one side cannot express is refused with its name."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from handformer.config import ModelConfig, Seq2SeqConfig
from handformer.interop.torch_nn import (
    from_torch_decoder_layer,
    from_torch_encoder_layer,
    from_torch_multihead_attention,
    from_torch_transformer,
    from_torch_transformer_encoder,
    to_torch_decoder_layer,
    to_torch_encoder_layer,
    to_torch_multihead_attention,
    to_torch_transformer,
    to_torch_transformer_encoder,
)
from handformer.masks import (
    causal_mask,
    combine_masks,
    to_torch_attn_mask,
    to_torch_key_padding_mask,
)
from handformer.models.encoder import Encoder
from handformer.models.seq2seq import EncoderDecoder
from handformer.nn.attention import MultiHeadAttention
from handformer.nn.block import TransformerBlock

C, H, F = 32, 4, 48


def randomise(module: nn.Module) -> nn.Module:
    """Every parameter moved off its initial value (LayerNorm gains off 1, biases off 0), so a
    swapped or skipped copy shows in the output."""
    with torch.no_grad():
        for p in module.parameters():
            p.add_(torch.randn_like(p) * 0.2)
    return module


def padding(lengths: list[int]) -> torch.Tensor:
    """(B, T) bool, True on the real tokens."""
    return torch.arange(max(lengths))[None, :] < torch.tensor(lengths)[:, None]


def same_weights(a: nn.Module, b: nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for name in sa:
        assert torch.equal(sa[name], sb[name]), name


# -- attention ----------------------------------------------------------------------------------
@pytest.mark.parametrize("bias", [True, False])
def test_attention_both_ways_self_and_cross(bias: bool) -> None:
    ours = randomise(MultiHeadAttention(C, H, bias=bias)).eval()
    theirs = randomise(nn.MultiheadAttention(C, H, bias=bias, batch_first=True)).eval()
    x, memory, pad = torch.randn(3, 5, C), torch.randn(3, 7, C), padding([7, 4, 1])
    for hf, ref in ((ours, to_torch_multihead_attention(ours)),
                    (from_torch_multihead_attention(theirs), theirs)):
        assert isinstance(hf, MultiHeadAttention) and isinstance(ref, nn.MultiheadAttention)
        assert not hf.training and not ref.training
        out, _ = hf(x, memory, mask=combine_masks(pad))
        expected, _ = ref(x, memory, memory, key_padding_mask=to_torch_key_padding_mask(pad))
        torch.testing.assert_close(out, expected)
        out, _ = hf(x, is_causal=True)
        expected, _ = ref(x, x, x, attn_mask=to_torch_attn_mask(causal_mask(5)))
        torch.testing.assert_close(out, expected)
    same_weights(from_torch_multihead_attention(to_torch_multihead_attention(ours)), ours)


def test_attention_from_torch_runs_the_kernel_asked_for() -> None:
    theirs = randomise(nn.MultiheadAttention(C, H, batch_first=True)).eval()
    x = torch.randn(2, 6, C)
    manual = from_torch_multihead_attention(theirs)
    sdpa = from_torch_multihead_attention(theirs, attention="sdpa")
    assert (manual.attention, sdpa.attention) == ("manual", "sdpa")
    torch.testing.assert_close(sdpa(x, is_causal=True)[0], manual(x, is_causal=True)[0])


# -- blocks -------------------------------------------------------------------------------------
@pytest.mark.parametrize("norm", ["pre", "post"])
@pytest.mark.parametrize(("activation", "bias"), [("relu", True), ("gelu", False)])
def test_encoder_layer_both_ways(norm: str, activation: str, bias: bool) -> None:
    ours = randomise(TransformerBlock(C, H, F, norm=norm, activation=activation,
                                      bias=bias, layer_norm_eps=1e-6)).eval()
    theirs = randomise(nn.TransformerEncoderLayer(
        C, H, F, activation=activation, layer_norm_eps=1e-6, batch_first=True,
        norm_first=norm == "pre", bias=bias)).eval()
    x, pad = torch.randn(3, 6, C), padding([6, 4, 2])
    for hf, ref in ((ours, to_torch_encoder_layer(ours)), (from_torch_encoder_layer(theirs),
                                                           theirs)):
        assert isinstance(hf, TransformerBlock) and hf.norm == norm
        out = hf(x, mask=combine_masks(pad))
        expected = ref(x, src_key_padding_mask=to_torch_key_padding_mask(pad))
        torch.testing.assert_close(out[pad], expected[pad])  # pad rows: torch may zero them
    same_weights(from_torch_encoder_layer(to_torch_encoder_layer(ours)), ours)


@pytest.mark.parametrize("norm", ["pre", "post"])
def test_decoder_layer_both_ways(norm: str) -> None:
    ours = randomise(TransformerBlock(C, H, F, norm=norm, cross_attention=True)).eval()
    theirs = randomise(nn.TransformerDecoderLayer(C, H, F, activation="gelu", batch_first=True,
                                                  norm_first=norm == "pre")).eval()
    x, memory, mem_pad = torch.randn(2, 5, C), torch.randn(2, 7, C), padding([7, 3])
    for hf, ref in ((ours, to_torch_decoder_layer(ours)), (from_torch_decoder_layer(theirs),
                                                           theirs)):
        assert isinstance(ref, nn.TransformerDecoderLayer) and hf.cross_attn is not None
        out = hf(x, is_causal=True, context=memory, context_mask=combine_masks(mem_pad))
        expected = ref(x, memory, tgt_mask=to_torch_attn_mask(causal_mask(5)),
                       tgt_is_causal=True,
                       memory_key_padding_mask=to_torch_key_padding_mask(mem_pad))
        torch.testing.assert_close(out, expected)
    same_weights(from_torch_decoder_layer(to_torch_decoder_layer(ours)), ours)


def test_a_block_goes_to_the_layer_kind_it_is() -> None:
    with pytest.raises(ValueError, match=r"maps to nn\.TransformerDecoderLayer"):
        to_torch_encoder_layer(TransformerBlock(C, H, F, cross_attention=True))
    with pytest.raises(ValueError, match=r"maps to nn\.TransformerEncoderLayer"):
        to_torch_decoder_layer(TransformerBlock(C, H, F))
    with pytest.raises(ValueError, match=r"expected an nn\.TransformerEncoderLayer"):
        from_torch_encoder_layer(nn.TransformerDecoderLayer(C, H, F))  # type: ignore[arg-type]


# -- whole stacks -------------------------------------------------------------------------------
def enc_config(**overrides: object) -> ModelConfig:
    base: dict = dict(vocab_size=23, d_model=C, n_heads=H, d_ff=F, n_layers=2, max_len=16,
                      tie_weights=False)
    base.update(overrides)
    return ModelConfig(**base)


@pytest.mark.parametrize("norm", ["pre", "post"])
def test_encoder_stack_both_ways(norm: str) -> None:
    config = enc_config(norm=norm, activation="relu")
    ours = randomise(Encoder(config)).eval()
    layer = nn.TransformerEncoderLayer(C, H, F, activation="relu", batch_first=True,
                                       norm_first=norm == "pre")
    theirs = randomise(nn.TransformerEncoder(
        layer, num_layers=2, norm=nn.LayerNorm(C) if norm == "pre" else None,
        enable_nested_tensor=False)).eval()
    x, pad = torch.randn(3, 6, C), padding([6, 5, 2])
    for hf, ref in ((ours, to_torch_transformer_encoder(ours)),
                    (from_torch_transformer_encoder(theirs, config), theirs)):
        assert isinstance(hf, Encoder) and isinstance(ref, nn.TransformerEncoder)
        out = hf.encode_embedded(x, pad)
        expected = ref(x, src_key_padding_mask=to_torch_key_padding_mask(pad))
        torch.testing.assert_close(out[pad], expected[pad])
    back = from_torch_transformer_encoder(to_torch_transformer_encoder(ours), config)
    for a, b in zip(back.blocks, ours.blocks, strict=True):
        same_weights(a, b)


def s2s_config(**overrides: object) -> Seq2SeqConfig:
    base: dict = dict(d_model=C, n_heads=H, d_ff=F, max_len=16, activation="relu")
    base.update(overrides)
    return Seq2SeqConfig(encoder=ModelConfig(vocab_size=19, n_layers=2, **base),
                         decoder=ModelConfig(vocab_size=13, n_layers=3, **base))


def run_transformer(ref: nn.Transformer, src_x: torch.Tensor, tgt_x: torch.Tensor,
                    src_pad: torch.Tensor) -> torch.Tensor:
    return ref(src_x, tgt_x, tgt_mask=to_torch_attn_mask(causal_mask(tgt_x.shape[1])),
               src_key_padding_mask=to_torch_key_padding_mask(src_pad),
               memory_key_padding_mask=to_torch_key_padding_mask(src_pad), tgt_is_causal=True)


@pytest.mark.filterwarnings("ignore:enable_nested_tensor is True")  # torch's own, at build
@pytest.mark.parametrize("norm", ["pre", "post"])
def test_transformer_both_ways(norm: str) -> None:
    config = s2s_config(norm=norm)
    theirs = randomise(nn.Transformer(C, H, num_encoder_layers=2, num_decoder_layers=3,
                                      dim_feedforward=F, batch_first=True,
                                      norm_first=norm == "pre")).eval()
    ours = from_torch_transformer(theirs, config)
    assert isinstance(ours, EncoderDecoder) and not ours.training
    src_x, tgt_x, src_pad = torch.randn(3, 7, C), torch.randn(3, 5, C), padding([7, 4, 2])
    memory = ours.encoder.encode_embedded(src_x, src_pad)  # (B, S, C)
    hidden = ours.decoder.decode_embedded(tgt_x, memory, memory_mask=src_pad)  # (B, T, C)
    torch.testing.assert_close(hidden, run_transformer(theirs, src_x, tgt_x, src_pad))
    # ... and back: torch's module rebuilt from the handformer one computes the same again
    again = run_transformer(to_torch_transformer(ours), src_x, tgt_x, src_pad)
    torch.testing.assert_close(again, hidden)


def test_the_config_must_describe_torchs_layers_and_each_difference_is_named() -> None:
    theirs = nn.Transformer(C, H, num_encoder_layers=2, num_decoder_layers=3,
                            dim_feedforward=F, batch_first=True)
    with pytest.raises(ValueError, match=r"d_ff 64 \(handformer\) vs 48 \(torch\)"):
        from_torch_transformer(theirs, s2s_config(d_ff=64, norm="post"))
    with pytest.raises(ValueError, match="n_layers=2; torch's stack has 3 layers"):
        config = s2s_config(norm="post")
        config.decoder = ModelConfig(**{**config.decoder.to_dict(), "n_layers": 2})
        from_torch_transformer(theirs, config)
    layer = nn.TransformerEncoderLayer(C, H, F, batch_first=True)
    stack = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
    with pytest.raises(ValueError, match=r"norm 'pre' \(handformer\) vs 'post' \(torch\)"):
        from_torch_transformer_encoder(stack, enc_config(norm="pre", activation="relu"))


# -- refusals -----------------------------------------------------------------------------------
@pytest.mark.parametrize(("kwargs", "message"), [
    ({"positional": "rope"}, "positional='rope'"),
    ({"n_kv_heads": 2}, "grouped-query"),
    ({"qk_norm": True}, "QK-norm"),
])
def test_attention_torch_cannot_express_is_refused(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        to_torch_multihead_attention(MultiHeadAttention(C, H, **kwargs))
    with pytest.raises(ValueError, match=message):
        to_torch_encoder_layer(TransformerBlock(C, H, F, **kwargs))


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"norm_type": "rmsnorm"}, "RMSNorm"),
    ({"activation": "swiglu"}, "activation='swiglu'"),
    ({"activation": "gelu_tanh"}, "activation='gelu_tanh'"),
])
def test_blocks_torch_cannot_express_are_refused(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        to_torch_encoder_layer(TransformerBlock(C, H, F, **kwargs))


@pytest.mark.parametrize(("module", "message"), [
    (nn.MultiheadAttention(C, H, kdim=16, vdim=16, batch_first=True), "kdim/vdim"),
    (nn.MultiheadAttention(C, H, add_bias_kv=True, batch_first=True), "add_bias_kv"),
    (nn.TransformerEncoderLayer(C, H, F, activation=nn.GELU(approximate="tanh")),
     "only ReLU and the exact GELU"),
    (nn.TransformerEncoderLayer(C, H, F, activation=torch.sigmoid), "only ReLU"),
])
def test_torch_modules_handformer_cannot_express_are_refused(module: nn.Module,
                                                             message: str) -> None:
    convert = (from_torch_multihead_attention if isinstance(module, nn.MultiheadAttention)
               else from_torch_encoder_layer)
    with pytest.raises(ValueError, match=message):
        convert(module)  # type: ignore[arg-type]


def test_the_result_keeps_the_sources_dtype() -> None:
    ours = TransformerBlock(C, H, F).to(torch.bfloat16)
    ref = to_torch_encoder_layer(ours)
    assert {p.dtype for p in ref.parameters()} == {torch.bfloat16}
    assert {p.dtype for p in from_torch_encoder_layer(ref).parameters()} == {torch.bfloat16}
