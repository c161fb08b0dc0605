"""DecoderLM end to end: both attention paths equal, causality, padding, loss, learning."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from handformer.data import collate_sequences
from handformer.loss import IGNORE_INDEX, lm_loss
from handformer.models.decoder_lm import DecoderLM
from tests.conftest import tiny_config

POSITIONALS = ["sinusoidal", "learned", "rope", "alibi"]
PATHS = ["manual", "sdpa", "tiled"]


@pytest.mark.parametrize("positional", POSITIONALS)
@pytest.mark.parametrize("norm", ["pre", "post"])
def test_manual_and_sdpa_paths_agree_on_whole_model(positional: str, norm: str) -> None:
    manual = DecoderLM(tiny_config(positional=positional, norm=norm, attention="manual")).eval()
    fused = DecoderLM(tiny_config(positional=positional, norm=norm, attention="sdpa")).eval()
    fused.load_state_dict(manual.state_dict())
    ids = torch.randint(0, 37, (3, 16))
    torch.testing.assert_close(fused(ids), manual(ids))
    pad = torch.ones(3, 16, dtype=torch.bool)
    pad[1, 10:] = False
    torch.testing.assert_close(fused(ids, pad), manual(ids, pad))


@pytest.mark.parametrize("positional", POSITIONALS)
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("t", [0, 5, 14])
def test_causality_future_tokens_do_not_move_past_logits(positional: str, path: str,
                                                         t: int) -> None:
    model = DecoderLM(tiny_config(positional=positional, attention=path)).eval()
    ids = torch.randint(0, 37, (2, 16))
    changed = ids.clone()
    changed[:, t + 1 :] = torch.randint(0, 37, (2, 16 - t - 1))
    before, after = model(ids), model(changed)
    torch.testing.assert_close(before[:, : t + 1], after[:, : t + 1])
    if t < 15:
        assert not torch.allclose(before[:, t + 1 :], after[:, t + 1 :])


@pytest.mark.parametrize("positional", POSITIONALS)
@pytest.mark.parametrize("path", PATHS)
def test_padding_does_not_change_real_positions(positional: str, path: str) -> None:
    model = DecoderLM(tiny_config(positional=positional, attention=path)).eval()
    seq = torch.randint(4, 37, (1, 9))
    alone = model(seq)  # (1, 9, V)
    for side in ("right", "left"):
        batch = collate_sequences([[*seq[0].tolist(), 5], list(range(4, 17))], side=side)
        logits = model(batch.ids, batch.padding_mask)
        real = batch.padding_mask[0]
        torch.testing.assert_close(logits[0, real], alone[0], msg=f"{side} padding")


@pytest.mark.parametrize("positional", POSITIONALS)
def test_loss_at_initialisation_is_close_to_ln_vocab(positional: str) -> None:
    for vocab in (37, 101):
        model = DecoderLM(tiny_config(vocab_size=vocab, positional=positional))
        ids = torch.randint(0, vocab, (8, 16))
        targets = torch.randint(0, vocab, (8, 16))
        with torch.no_grad():
            loss = float(lm_loss(model(ids), targets))
        assert abs(loss - math.log(vocab)) < 0.1, (loss, math.log(vocab))


def test_loss_ignores_padding_targets() -> None:
    logits = torch.randn(2, 4, 11)
    targets = torch.randint(0, 11, (2, 4))
    padded = targets.clone()
    padded[1, 2:] = IGNORE_INDEX
    keep = padded != IGNORE_INDEX
    expected = torch.nn.functional.cross_entropy(logits[keep], targets[keep])
    torch.testing.assert_close(lm_loss(logits, padded), expected)
    with pytest.raises(ValueError, match=r"logits \(B, T, V\) and targets \(B, T\)"):
        lm_loss(logits, targets[:, :3])


@pytest.mark.parametrize("path", PATHS)
def test_tiny_model_overfits_one_batch(path: str) -> None:
    model = DecoderLM(tiny_config(attention=path))
    ids = torch.randint(4, 37, (4, 17))
    inputs, targets = ids[:, :-1], ids[:, 1:]
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    first = None
    for _ in range(150):
        loss = lm_loss(model(inputs), targets)
        first = float(loss.detach()) if first is None else first
        opt.zero_grad()
        loss.backward()
        opt.step()
    final = float(loss.detach())
    assert first > 3.0 and final < 0.1, (first, final)


def _reference_forward(model: DecoderLM, ids: torch.Tensor) -> torch.Tensor:
    """GPT-style logits from scratch, with torch.nn.functional ops on the model's parameters
    (learned positions, causal attention through F.scaled_dot_product_attention, GELU FFN,
    pre- or post-norm, the final LayerNorm of a pre-norm stack, the tied head)."""
    c = model.config
    p = dict(model.named_parameters())  # the tied head appears once, as embed.token.weight
    b, t = ids.shape
    h, d = c.n_heads, c.d_model // c.n_heads

    def norm(x: torch.Tensor, name: str) -> torch.Tensor:
        return F.layer_norm(x, (c.d_model,), p[f"{name}.weight"], p[f"{name}.bias"],
                            c.layer_norm_eps)

    def heads(z: torch.Tensor) -> torch.Tensor:
        return z.reshape(b, t, h, d).transpose(1, 2)  # (B, H, T, D)

    x = F.embedding(ids, p["embed.token.weight"]) + p["embed.positions.table.weight"][:t]
    for i in range(c.n_layers):
        blk = f"blocks.{i}"

        def attn(z: torch.Tensor, blk: str = blk) -> torch.Tensor:
            qkv = F.linear(z, p[f"{blk}.self_attn.in_proj.weight"],
                           p[f"{blk}.self_attn.in_proj.bias"])  # (B, T, 3C)
            q, k, v = (heads(part) for part in qkv.split(c.d_model, dim=-1))
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, H, T, D)
            return F.linear(out.transpose(1, 2).reshape(b, t, c.d_model),
                            p[f"{blk}.self_attn.out_proj.weight"],
                            p[f"{blk}.self_attn.out_proj.bias"])

        def ffn(z: torch.Tensor, blk: str = blk) -> torch.Tensor:
            hidden = F.gelu(F.linear(z, p[f"{blk}.ffn.fc_in.weight"], p[f"{blk}.ffn.fc_in.bias"]))
            return F.linear(hidden, p[f"{blk}.ffn.fc_out.weight"], p[f"{blk}.ffn.fc_out.bias"])

        if c.norm == "pre":
            x = x + attn(norm(x, f"{blk}.norm1"))
            x = x + ffn(norm(x, f"{blk}.norm2"))
        else:
            x = norm(x + attn(x), f"{blk}.norm1")
            x = norm(x + ffn(x), f"{blk}.norm2")
    if c.norm == "pre":
        x = norm(x, "final_norm")
    return F.linear(x, p["embed.token.weight"])  # (B, T, V)


@pytest.mark.parametrize("norm", ["pre", "post"])
@pytest.mark.parametrize("path", PATHS)
def test_logits_match_a_from_scratch_functional_forward(norm: str, path: str) -> None:
    """The whole model against ``_reference_forward``, in one pass and as a KV-cached
    prefill plus one-token steps. Every LayerNorm gets random weights first, so a norm
    skipped (the final one of a pre-norm stack, say) or applied twice cannot go unseen."""
    model = DecoderLM(tiny_config(positional="learned", norm=norm, attention=path)).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.copy_(torch.randn_like(param) * 0.5 + (1.0 if name.endswith("weight")
                                                            else 0.0))
    ids = torch.randint(0, 37, (2, 12))
    with torch.no_grad():
        expected = _reference_forward(model, ids)
        torch.testing.assert_close(model(ids), expected, rtol=1e-4, atol=1e-5)
        cache = model.make_cache(2)
        pieces = [model(ids[:, :5], cache=cache)]
        pieces += [model(ids[:, i : i + 1], cache=cache, validate=False) for i in range(5, 12)]
    torch.testing.assert_close(torch.cat(pieces, dim=1), expected, rtol=1e-4, atol=1e-5)


def test_tied_weights_share_storage_and_untied_do_not() -> None:
    tied = DecoderLM(tiny_config(tie_weights=True))
    assert tied.lm_head.weight is tied.embed.token.weight
    untied = DecoderLM(tiny_config(tie_weights=False))
    assert untied.lm_head.weight is not untied.embed.token.weight
    assert untied.num_parameters() == tied.num_parameters() + 37 * 32


def test_bad_inputs_raise_clear_errors() -> None:
    model = DecoderLM(tiny_config(positional="learned"))
    with pytest.raises(ValueError, match=r"max_len=16.*position 19.*sinusoidal"):
        model(torch.zeros(1, 20, dtype=torch.long))
    with pytest.raises(ValueError, match=r"ids of shape \(B, T\)"):
        model(torch.zeros(20, dtype=torch.long))
    with pytest.raises(ValueError, match=r"token ids must lie in \[0, 37\)"):
        model(torch.full((1, 4), 37))
    with pytest.raises(ValueError, match=r"padding_mask must be bool \(B, T\) = \(1, 4\)"):
        model(torch.zeros(1, 4, dtype=torch.long), torch.ones(1, 3, dtype=torch.bool))
    with pytest.raises(ValueError, match="padding_mask must be bool"):
        model(torch.zeros(1, 4, dtype=torch.long), torch.ones(1, 4, dtype=torch.long))
    with pytest.raises(ValueError, match=r"no tokens \(T = 0\)"):
        model(torch.zeros(1, 0, dtype=torch.long))
    with pytest.raises(ValueError, match=r"token ids must lie in \[0, 37\)"):
        model(torch.tensor([[-1, 3]]), cache=model.make_cache(1))  # the cached call checks too
    sinusoidal = DecoderLM(tiny_config(positional="sinusoidal")).eval()
    assert sinusoidal(torch.zeros(1, 20, dtype=torch.long)).shape == (1, 20, 37)


def test_all_padding_batch_gives_zero_loss_not_nan() -> None:
    logits = torch.randn(2, 3, 11, requires_grad=True)
    targets = torch.full((2, 3), IGNORE_INDEX)
    loss = lm_loss(logits, targets)
    loss.backward()
    assert float(loss.detach()) == 0.0 and torch.all(logits.grad == 0)


@pytest.mark.parametrize("tie", [True, False])
def test_checkpoints_with_the_old_embedding_names_still_load(tie: bool, tmp_path) -> None:
    """Before models/embedding.py the parameters were ``token_embedding.weight`` and
    ``positions.table.weight``: such state dicts and safetensors files still load."""
    from safetensors.torch import load_model, save_file

    model = DecoderLM(tiny_config(positional="learned", tie_weights=tie))
    legacy = {("token_embedding.weight" if k == "embed.token.weight" else
               "positions.table.weight" if k == "embed.positions.table.weight" else k): v
              for k, v in model.state_dict().items()}
    fresh = DecoderLM(tiny_config(positional="learned", tie_weights=tie))
    fresh.load_state_dict(legacy, strict=True)
    ids = torch.randint(0, 37, (2, 8))
    torch.testing.assert_close(fresh(ids), model(ids))
    if tie:  # save_model stored the tied pair once, under its first name: lm_head.weight
        del legacy["token_embedding.weight"]
    save_file({k: v.contiguous() for k, v in legacy.items()}, tmp_path / "model.safetensors")
    again = DecoderLM(tiny_config(positional="learned", tie_weights=tie))
    load_model(again, tmp_path / "model.safetensors")
    torch.testing.assert_close(again(ids), model(ids))
    assert (again.lm_head.weight is again.embed.token.weight) == tie
