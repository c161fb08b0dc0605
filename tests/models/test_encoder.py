"""Encoder and EncoderClassifier: parity with nn.TransformerEncoder, padding invariance,
pooling, and clear errors. Eval mode (dropout off); fp32 at ``assert_close`` defaults."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from handformer.config import ClassifierConfig, ModelConfig
from handformer.interop.torch_nn import to_torch_transformer_encoder
from handformer.loss import IGNORE_INDEX, classification_loss
from handformer.masks import to_torch_key_padding_mask
from handformer.models.encoder import (
    Encoder,
    EncoderClassifier,
    pool,
)

POSITIONALS = ["learned", "sinusoidal", "rope", "alibi"]
PATHS = ["manual", "sdpa"]
V = 23


def enc_config(**overrides: object) -> ModelConfig:
    base: dict = dict(vocab_size=V, d_model=32, n_heads=4, n_layers=2, max_len=16,
                      tie_weights=False)
    base.update(overrides)
    return ModelConfig(**base)


def classifier(pooling: str = "cls", **overrides: object) -> EncoderClassifier:
    return EncoderClassifier(ClassifierConfig(enc_config(**overrides), num_classes=3,
                                              pooling=pooling)).eval()


def randomise(module: torch.nn.Module) -> None:
    """Move every parameter off its initial value (LayerNorm gains too), so a swapped or
    skipped norm changes the output."""
    with torch.no_grad():
        for p in module.parameters():
            p.add_(torch.randn_like(p) * 0.2)


def padded(seqs: list[torch.Tensor], side: str = "right") -> tuple[torch.Tensor, torch.Tensor]:
    """Pad with id 0 on ``side``: ids (B, T) and the padding mask (B, T)."""
    t = max(len(s) for s in seqs)
    ids = torch.zeros((len(seqs), t), dtype=torch.long)
    mask = torch.zeros(len(seqs), t, dtype=torch.bool)
    for i, s in enumerate(seqs):
        cols = slice(0, len(s)) if side == "right" else slice(t - len(s), t)
        ids[i, cols] = s
        mask[i, cols] = True
    return ids, mask


# -- parity with torch ------------------------------------------------------------------
@pytest.mark.parametrize("norm", ["pre", "post"])
@pytest.mark.parametrize("activation", ["relu", "gelu"])
@pytest.mark.parametrize("path", PATHS)
def test_encoder_matches_torch_transformer_encoder(norm: str, activation: str, path: str) -> None:
    encoder = Encoder(enc_config(norm=norm, activation=activation, attention=path)).eval()
    randomise(encoder)
    ref = to_torch_transformer_encoder(encoder)
    assert (ref.norm is not None) == (norm == "pre")  # pre-norm stacks end in a LayerNorm
    ids, pad = padded([torch.randint(4, V, (n,)) for n in (7, 5, 2)])
    ours = encoder(ids, pad)  # (B, T, C)
    x, _ = encoder.embed(ids, pad)
    expected = ref(x, src_key_padding_mask=to_torch_key_padding_mask(pad))
    # torch's fast path may write zeros at padded positions: compare real tokens.
    torch.testing.assert_close(ours[pad], expected[pad])


def test_forced_final_norm_matches_torch_norm_after_post_norm_stack() -> None:
    encoder = Encoder(enc_config(norm="post"), final_norm=True).eval()
    randomise(encoder)
    ref = to_torch_transformer_encoder(encoder)
    assert ref.norm is not None
    ids = torch.randint(4, V, (2, 6))
    x, _ = encoder.embed(ids)
    torch.testing.assert_close(encoder(ids), ref(x))


def test_converter_refuses_what_torch_cannot_express() -> None:
    with pytest.raises(ValueError, match="positional='rope'"):
        to_torch_transformer_encoder(Encoder(enc_config(positional="rope")))
    with pytest.raises(ValueError, match="grouped-query"):
        to_torch_transformer_encoder(Encoder(enc_config(n_kv_heads=2)))


# -- padding ----------------------------------------------------------------------------
@pytest.mark.parametrize("positional", POSITIONALS)
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("pooling", ["cls", "mean"])
def test_padding_invariance(positional: str, path: str, pooling: str) -> None:
    """A sequence alone vs. padded into a longer batch (either side): the same encoder
    outputs at its real positions and the same classifier logits."""
    model = classifier(pooling, positional=positional, attention=path)
    randomise(model)
    seq = torch.randint(4, V, (9,))
    alone_hidden = model.encoder(seq[None])[0]  # (T, C)
    alone_logits = model(seq[None])[0]  # (K,)
    others = [torch.randint(4, V, (n,)) for n in (14, 3)]
    for side in ("right", "left"):
        ids, pad = padded([seq, *others], side)
        hidden = model.encoder(ids, pad)
        torch.testing.assert_close(hidden[0, pad[0]], alone_hidden, msg=f"{side} padding")
        torch.testing.assert_close(model(ids, pad)[0], alone_logits, msg=f"{side} padding")


def test_pad_token_values_never_reach_real_positions() -> None:
    """Whatever sits at padded positions (pad ids or garbage) cannot move real outputs."""
    model = classifier("mean", attention="manual")
    randomise(model)
    ids, pad = padded([torch.randint(4, V, (n,)) for n in (10, 4, 7)])
    garbage = ids.clone()
    garbage[~pad] = torch.randint(4, V, (int((~pad).sum()),))
    torch.testing.assert_close(model.encoder(garbage, pad)[pad], model.encoder(ids, pad)[pad])
    torch.testing.assert_close(model(garbage, pad), model(ids, pad))
    # …while without the mask the same garbage does change them: the mask is what works.
    assert not torch.allclose(model(garbage), model(ids))


@pytest.mark.parametrize("pooling", ["cls", "mean"])
def test_manual_and_sdpa_paths_agree(pooling: str) -> None:
    manual = classifier(pooling, attention="manual")
    fused = classifier(pooling, attention="sdpa")
    fused.load_state_dict(manual.state_dict())
    ids, pad = padded([torch.randint(4, V, (n,)) for n in (12, 5)])
    torch.testing.assert_close(fused(ids, pad), manual(ids, pad))


def test_pool_reads_only_real_tokens() -> None:
    hidden = torch.randn(2, 5, 4)
    mask = torch.tensor([[False, False, True, True, True], [True, True, False, False, False]])
    cls = pool(hidden, mask, "cls")
    torch.testing.assert_close(cls, torch.stack([hidden[0, 2], hidden[1, 0]]))
    mean = pool(hidden, mask, "mean")
    torch.testing.assert_close(mean, torch.stack([hidden[0, 2:].mean(0), hidden[1, :2].mean(0)]))
    torch.testing.assert_close(pool(hidden, None, "mean"), hidden.mean(1))
    with pytest.raises(ValueError, match="unknown pooling 'max'"):
        pool(hidden, mask, "max")


def test_bidirectional_every_position_sees_the_last_token() -> None:
    """An encoder is not causal: changing the last token moves the first position."""
    encoder = Encoder(enc_config()).eval()
    ids = torch.randint(4, V, (1, 8))
    changed = ids.clone()
    changed[0, -1] = 4 if int(ids[0, -1]) != 4 else 5
    assert not torch.allclose(encoder(ids)[0, 0], encoder(changed)[0, 0])


# -- config, loss, errors ---------------------------------------------------------------
def test_classifier_config_json_round_trip_and_validation() -> None:
    import json

    config = ClassifierConfig(enc_config(positional="rope"), num_classes=4, pooling="mean",
                              head_dropout=0.1)
    again = ClassifierConfig.from_dict(json.loads(json.dumps(config.to_dict())))
    assert again == config
    model = EncoderClassifier(again)
    assert model.head.out_features == 4
    with pytest.raises(ValueError, match="num_classes must be an int >= 2"):
        ClassifierConfig(enc_config(), num_classes=1)
    with pytest.raises(ValueError, match="pooling='max'"):
        ClassifierConfig(enc_config(), num_classes=2, pooling="max")
    with pytest.raises(ValueError, match="unknown fields \\['colour'\\]"):
        ClassifierConfig.from_dict({**config.to_dict(), "colour": "red"})


def test_classification_loss_ignores_ignored_labels() -> None:
    logits = torch.randn(5, 3)
    targets = torch.tensor([0, 2, IGNORE_INDEX, 1, IGNORE_INDEX])
    keep = targets != IGNORE_INDEX
    torch.testing.assert_close(classification_loss(logits, targets),
                               F.cross_entropy(logits[keep], targets[keep]))
    with pytest.raises(ValueError, match=r"logits \(B, K\) and targets \(B,\)"):
        classification_loss(logits, targets[:4])


def test_loss_at_initialisation_is_close_to_ln_classes() -> None:
    model = EncoderClassifier(ClassifierConfig(enc_config(), num_classes=5))
    ids = torch.randint(4, V, (64, 10))
    with torch.no_grad():
        loss = float(classification_loss(model(ids), torch.randint(0, 5, (64,))))
    assert abs(loss - torch.log(torch.tensor(5.0)).item()) < 0.05


@pytest.mark.parametrize(
    ("ids", "mask", "message"),
    [
        (torch.zeros(5, dtype=torch.long), None, r"expects ids of shape \(B, T\); got \(5,\)"),
        (torch.zeros(2, 3), None, "ids must be an integer tensor"),
        (torch.zeros(2, 0, dtype=torch.long), None, "no tokens"),
        (torch.full((2, 3), V, dtype=torch.long), None, rf"\[0, {V}\); got min {V}"),
        (torch.ones(2, 3, dtype=torch.long), torch.ones(2, 4, dtype=torch.bool),
         r"padding_mask must be bool \(B, T\) = \(2, 3\)"),
        (torch.ones(2, 3, dtype=torch.long), torch.ones(2, 3, dtype=torch.long),
         "padding_mask must be bool"),
        (torch.ones(2, 3, dtype=torch.long), torch.tensor([[1, 1, 0], [0, 0, 0]]).bool(),
         r"rows \[1\] of the batch have no real token"),
    ],
)
def test_bad_inputs_are_clear_errors(ids: torch.Tensor, mask: torch.Tensor | None,
                                     message: str) -> None:
    with pytest.raises(ValueError, match=message):
        classifier()(ids, mask)
