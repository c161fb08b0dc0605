"""models/embedding.py's entry checks, as every model applies them: a padding mask must be
boolean with True on real tokens; a float (torch-style additive) or int mask is refused with
the way to convert it, never cast — cast, an additive mask turns the padding inside out."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from handformer.config import ClassifierConfig, Seq2SeqConfig
from handformer.generate import generate
from handformer.masks import from_additive_mask
from handformer.models.decoder_lm import DecoderLM
from handformer.models.encoder import Encoder, EncoderClassifier
from handformer.models.seq2seq import EncoderDecoder
from tests.conftest import tiny_config

IDS = torch.randint(1, 37, (2, 5))
REAL = torch.tensor([[True, True, True, False, False], [True] * 5])
ADDITIVE = torch.zeros(2, 5).masked_fill(~REAL, float("-inf"))  # torch's convention


def _s2s() -> EncoderDecoder:
    return EncoderDecoder(Seq2SeqConfig(tiny_config(), tiny_config()))


CALLS: dict[str, Callable[[torch.Tensor], object]] = {
    "DecoderLM": lambda m: DecoderLM(tiny_config())(IDS, m),
    "DecoderLM-cached": lambda m: DecoderLM(tiny_config())(
        IDS, m, cache=DecoderLM(tiny_config()).make_cache(2)),
    "Encoder": lambda m: Encoder(tiny_config())(IDS, m),
    "EncoderClassifier": lambda m: EncoderClassifier(ClassifierConfig(tiny_config(), 3))(IDS, m),
    "EncoderDecoder-src": lambda m: _s2s()(IDS, IDS, m, None),
    "EncoderDecoder-tgt": lambda m: _s2s()(IDS, IDS, None, m),
    "Decoder-memory": lambda m: _s2s().decoder(IDS, torch.zeros(2, 5, 32), memory_mask=m),
    "generate": lambda m: generate(DecoderLM(tiny_config()), IDS, 2, padding_mask=m),
}


@pytest.mark.parametrize("mask", [ADDITIVE, REAL.long(), REAL.float()],
                         ids=["additive-float", "int-0/1", "float-0/1"])
@pytest.mark.parametrize("call", list(CALLS.values()), ids=list(CALLS))
def test_a_non_boolean_padding_mask_is_refused_with_the_polarity_and_the_conversion(
        call: Callable[[torch.Tensor], object], mask: torch.Tensor) -> None:
    with pytest.raises(ValueError) as info:
        call(mask)
    message = str(info.value)
    for needle in ("must be bool", "True on real tokens", str(mask.dtype),
                   "handformer.masks.from_additive_mask"):
        assert needle in message, f"{needle!r} missing from: {message}"


def test_the_converted_additive_mask_gives_the_boolean_masks_logits() -> None:
    model = DecoderLM(tiny_config()).eval()
    with torch.no_grad():
        assert torch.equal(model(IDS, from_additive_mask(ADDITIVE)), model(IDS, REAL))


def test_table_rows_are_given_only_where_the_embedding_is_a_sum_of_two_rows() -> None:
    """What ``nn.decode_block.token_step`` computes from them must be ``forward``: a token's
    row plus its position's row — so every other kind of embedding says None."""
    from handformer.config import ModelConfig
    from handformer.models.embedding import TokenEmbedding

    def embedding(**overrides: object) -> TokenEmbedding:
        fields: dict[str, object] = dict(vocab_size=11, d_model=8, n_heads=2, n_layers=1,
                                         max_len=6, positional="learned")
        fields.update(overrides)
        return TokenEmbedding(ModelConfig(**fields)).eval()  # type: ignore[arg-type]

    learned = embedding()
    rows = learned.table_rows()
    assert rows is not None and rows[0] is learned.token.weight
    assert rows[1] is not None and rows[1].shape == (6, 8)
    ids = torch.tensor([[3, 7]])
    assert torch.equal(learned(ids)[0], (rows[0][ids[0]] + rows[1][:2])[None])
    rope = embedding(positional="rope").table_rows()
    assert rope is not None and rope[1] is None  # attention rotates: only the token's row
    for overrides in (dict(positional="sinusoidal"), dict(type_vocab_size=2),
                      dict(embedding_norm=True)):
        assert embedding(**overrides).table_rows() is None, overrides
    assert learned.train().table_rows() is None
