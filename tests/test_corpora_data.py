"""Corpora, data batching, masks, configs, and the clear-error contract for bad inputs."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch

from handformer.config import ModelConfig, TrainConfig
from handformer.data import Batch, LMWindows, collate_sequences, train_val_split
from handformer.data.corpora import CorpusError, builtin_text, read_text_file
from handformer.loss import IGNORE_INDEX
from handformer.masks import (
    causal_mask,
    combine_masks,
    from_torch_key_padding_mask,
    padding_mask,
    to_torch_attn_mask,
    to_torch_key_padding_mask,
)
from handformer.nn.feedforward import FeedForward
from handformer.nn.positional import LearnedPositions


def json_round_trip(data: dict) -> dict:
    """Through real JSON text, as config.json would be."""
    return json.loads(json.dumps(data))


def model_kwargs(**overrides: object) -> dict:
    """A small valid ModelConfig, with overrides."""
    return {"vocab_size": 37, "d_model": 32, "n_heads": 4, "n_layers": 2, "max_len": 16,
            **overrides}


# =========================================================================================
# corpora.py
# =========================================================================================
def test_builtin_text_size_and_determinism() -> None:
    text = builtin_text()
    assert 400_000 < len(text) < 600_000
    assert builtin_text() == text
    assert text.strip()


def _write(content: bytes) -> Callable[[Path], Path]:
    def make(tmp: Path) -> Path:
        path = tmp / "corpus.txt"
        path.write_bytes(content)
        return path

    return make


def _directory(tmp: Path) -> Path:
    path = tmp / "a_folder"
    path.mkdir()
    return path


# (id, make the path, substrings the message must contain besides the path)
READ_ERRORS: list[tuple[str, Callable[[Path], Path], list[str]]] = [
    ("missing", lambda tmp: tmp / "does_not_exist.txt", ["not found"]),
    ("directory", _directory, ["directory"]),
    ("empty", _write(b""), ["empty"]),
    ("whitespace-only", _write(b"  \n\t\r\n  "), ["whitespace"]),
    ("bom-then-whitespace", _write(b"\xef\xbb\xbf \n"), ["whitespace"]),
    ("invalid-utf8", _write(b"hello\nab\xffcd\n"),
     ["not valid UTF-8", "byte 8", "line 2", "column 3"]),
    ("column-counts-characters", _write("é日x".encode() + b"\xff"),
     ["byte 6", "line 1", "column 4"]),
    ("truncated-utf8", _write(b"ok\n\xe6\x97"), ["not valid UTF-8", "byte 3", "line 2",
                                                  "column 1"]),
]


@pytest.mark.parametrize(("make_path", "needles"), [(m, n) for _, m, n in READ_ERRORS],
                         ids=[i for i, _, _ in READ_ERRORS])
def test_read_text_file_errors(tmp_path: Path, make_path: Callable[[Path], Path],
                               needles: list[str]) -> None:
    path = make_path(tmp_path)
    with pytest.raises(CorpusError) as info:
        read_text_file(path)
    assert isinstance(info.value, ValueError)
    message = str(info.value)
    assert str(path) in message
    for needle in needles:
        assert needle in message


def test_read_text_file_strips_bom_and_reads_utf8(tmp_path: Path) -> None:
    path = tmp_path / "bom.txt"
    path.write_bytes("\ufeffhéllo 日本 🎉\n".encode())
    assert read_text_file(path) == "héllo 日本 🎉\n"
    assert read_text_file(str(path)) == "héllo 日本 🎉\n"


# =========================================================================================
# data.py
# =========================================================================================
@pytest.mark.parametrize(("n", "frac", "n_val"), [(100, 0.1, 10), (101, 0.1, 10), (10, 0.5, 5)])
def test_train_val_split_takes_the_last_fraction(n: int, frac: float, n_val: int) -> None:
    ids = np.arange(n)
    train, val = train_val_split(ids, frac)
    assert train.dtype == val.dtype == torch.long
    assert len(val) == n_val
    assert torch.equal(torch.cat([train, val]), torch.arange(n))
    assert torch.equal(val, torch.arange(n - n_val, n))


def test_lm_windows_targets_are_ids_shifted_by_one() -> None:
    tokens = torch.randint(0, 50, (500,))
    windows = LMWindows(tokens, block_size=8)
    assert windows.num_windows == 500 - 8
    batch = windows.random_batch(16, torch.Generator().manual_seed(0))
    assert batch.ids.shape == batch.targets.shape == (16, 8)
    assert batch.padding_mask is None
    assert batch.num_tokens == 16 * 8
    assert torch.equal(batch.ids[:, 1:], batch.targets[:, :-1])
    # Every row is a real slice of the stream: find its start and compare directly.
    unique_stream = torch.arange(1000)
    w = LMWindows(unique_stream, block_size=5)
    b = w.random_batch(32, torch.Generator().manual_seed(1))
    for ids_row, tgt_row in zip(b.ids, b.targets, strict=True):
        start = int(ids_row[0])
        assert torch.equal(ids_row, unique_stream[start : start + 5])
        assert torch.equal(tgt_row, unique_stream[start + 1 : start + 6])


def test_random_batch_reproducible_with_seeded_generator() -> None:
    windows = LMWindows(torch.arange(300), block_size=10)
    a = windows.random_batch(8, torch.Generator().manual_seed(42))
    b = windows.random_batch(8, torch.Generator().manual_seed(42))
    c = windows.random_batch(8, torch.Generator().manual_seed(43))
    assert torch.equal(a.ids, b.ids) and torch.equal(a.targets, b.targets)
    assert not torch.equal(a.ids, c.ids)


def test_random_batch_covers_first_and_last_window() -> None:
    windows = LMWindows(torch.arange(12), block_size=10)  # exactly 2 windows
    batch = windows.random_batch(64, torch.Generator().manual_seed(0))
    assert set(batch.ids[:, 0].tolist()) == {0, 1}


def test_fixed_batches_identical_across_calls_and_in_range() -> None:
    tokens = torch.arange(1000)
    windows = LMWindows(tokens, block_size=16)
    first = windows.fixed_batches(num_batches=3, batch_size=4)
    second = windows.fixed_batches(num_batches=3, batch_size=4)
    assert len(first) == 3
    for a, b in zip(first, second, strict=True):
        assert torch.equal(a.ids, b.ids) and torch.equal(a.targets, b.targets)
        assert torch.equal(a.ids[:, 1:], a.targets[:, :-1])
    starts = torch.cat([b.ids[:, 0] for b in first])
    assert int(starts[0]) == 0
    assert int(starts[-1]) == windows.num_windows - 1  # last window reaches the last token
    assert int(first[-1].targets[-1, -1]) == 999


def test_fixed_batches_capped_by_num_windows() -> None:
    windows = LMWindows(torch.arange(13), block_size=10)  # 3 windows
    batches = windows.fixed_batches(num_batches=5, batch_size=4)
    assert sum(len(b.ids) for b in batches) == 3


def test_fixed_batches_on_long_stream_stay_in_range() -> None:
    n_windows = 2**24 + 4  # n_windows - 1 = 16_777_219 rounds up to 16_777_220 in float32
    windows = LMWindows(torch.zeros(n_windows + 2, dtype=torch.long), block_size=2)
    batch = windows.fixed_batches(num_batches=1, batch_size=2)[0]
    assert batch.ids.shape == (2, 2)


@pytest.mark.parametrize("n_tokens", [0, 5, 8])
def test_lm_windows_too_short_raises(n_tokens: int) -> None:
    with pytest.raises(CorpusError, match="window") as info:
        LMWindows(torch.arange(n_tokens), block_size=8, name="validation split")
    assert "validation split" in str(info.value)
    assert f"{n_tokens} tokens" in str(info.value)


def test_lm_windows_exactly_one_window() -> None:
    windows = LMWindows(torch.arange(9), block_size=8)
    assert windows.num_windows == 1
    assert torch.equal(windows.fixed_batches(2, 2)[0].targets, torch.arange(1, 9)[None])


def test_lm_windows_rejects_2d_stream() -> None:
    with pytest.raises(ValueError, match="1-D"):
        LMWindows(torch.zeros(2, 20, dtype=torch.long), block_size=4)


SEQS = [[5, 6, 7, 8], [9, 10], [11, 12, 13]]


@pytest.mark.parametrize("side", ["right", "left"])
def test_collate_sequences(side: str) -> None:
    batch = collate_sequences(SEQS, pad_id=0, side=side)
    t = max(len(s) for s in SEQS) - 1
    assert batch.ids.shape == batch.targets.shape == batch.padding_mask.shape == (3, t)
    assert batch.padding_mask.dtype == torch.bool
    assert batch.num_tokens == sum(len(s) - 1 for s in SEQS)
    for row, seq in enumerate(SEQS):
        n = len(seq) - 1
        real = slice(0, n) if side == "right" else slice(t - n, t)
        pad = slice(n, t) if side == "right" else slice(0, t - n)
        mask_row = batch.padding_mask[row]
        assert mask_row[real].all() and not mask_row[pad].any()
        assert int(mask_row.sum()) == n
        assert batch.ids[row, real].tolist() == seq[:-1]
        assert batch.targets[row, real].tolist() == seq[1:]
        assert (batch.targets[row, pad] == IGNORE_INDEX).all()
        assert (batch.ids[row, pad] == 0).all()
    # The mask and IGNORE_INDEX targets agree everywhere.
    assert torch.equal(batch.padding_mask, batch.targets != IGNORE_INDEX)


def test_collate_sequences_custom_pad_id() -> None:
    batch = collate_sequences([[1, 2, 3], [4, 5]], pad_id=99)
    assert batch.ids.tolist() == [[1, 2], [4, 99]]
    assert batch.targets.tolist() == [[2, 3], [5, IGNORE_INDEX]]


@pytest.mark.parametrize(
    ("sequences", "kwargs", "needle"),
    [([], {}, "no sequences"),
     ([[1, 2], [3]], {}, "fewer than 2"),
     ([[1, 2], []], {}, "fewer than 2"),
     ([[1, 2, 3]], {"side": "middle"}, "side")],
    ids=["empty-list", "length-1", "length-0", "bad-side"],
)
def test_collate_sequences_errors(sequences: list, kwargs: dict, needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        collate_sequences(sequences, **kwargs)


def test_batch_to_keeps_fields() -> None:
    batch = collate_sequences(SEQS).to("cpu")
    assert isinstance(batch, Batch) and batch.padding_mask is not None
    no_pad = Batch(torch.zeros(1, 2, dtype=torch.long), torch.zeros(1, 2, dtype=torch.long))
    assert no_pad.to("cpu").padding_mask is None


# =========================================================================================
# masks.py
# =========================================================================================
@pytest.mark.parametrize("t", [0, 1, 2, 5, 17])
def test_causal_mask_square(t: int) -> None:
    mask = causal_mask(t)
    assert mask.dtype == torch.bool
    assert torch.equal(mask, torch.tril(torch.ones(t, t)).bool())
    assert torch.equal(causal_mask(t, t), mask)


@pytest.mark.parametrize(("t_q", "t_k"), [(1, 4), (2, 4), (3, 7), (0, 3), (6, 6)])
def test_causal_mask_end_aligned(t_q: int, t_k: int) -> None:
    mask = causal_mask(t_q, t_k)
    assert mask.shape == (t_q, t_k)
    assert torch.equal(mask, causal_mask(t_k)[t_k - t_q :])
    if t_q:
        assert mask[-1].all()  # the newest query sees every key


@pytest.mark.parametrize(("t_q", "t_k"), [(5, 4), (2, 1), (-1, None)])
def test_causal_mask_rejects_more_queries_than_keys(t_q: int, t_k: int | None) -> None:
    with pytest.raises(ValueError, match="t_q"):
        causal_mask(t_q, t_k)


def test_combine_masks_is_pad_and_causal() -> None:
    ids = torch.tensor([[5, 6, 7, 0], [5, 0, 0, 0], [1, 2, 3, 4]])
    pad = padding_mask(ids)
    causal = causal_mask(4)
    combined = combine_masks(pad, causal)
    assert combined.shape == (3, 1, 4, 4)
    for b in range(3):
        for i in range(4):
            for j in range(4):
                assert bool(combined[b, 0, i, j]) == (bool(pad[b, j]) and bool(causal[i, j]))


def test_combine_masks_single_inputs() -> None:
    pad = torch.tensor([[True, False, True]])
    assert combine_masks() is None
    assert combine_masks(None, None) is None
    only_causal = combine_masks(causal=causal_mask(3))
    assert only_causal.shape == (1, 1, 3, 3)
    only_pad = combine_masks(pad, t_q=2)
    assert only_pad.shape == (1, 1, 2, 3)
    assert torch.equal(only_pad[0, 0, 0], pad[0]) and torch.equal(only_pad[0, 0, 1], pad[0])
    assert combine_masks(pad).shape == (1, 1, 1, 3)


def test_combine_masks_end_aligned_with_cache() -> None:
    pad = torch.tensor([[False, True, True, True]])
    combined = combine_masks(pad, causal_mask(2, 4))
    assert combined.shape == (1, 1, 2, 4)
    assert combined[0, 0].tolist() == [[False, True, True, False], [False, True, True, True]]


@pytest.mark.parametrize(
    ("pad", "causal", "needle"),
    [(torch.ones(2, 3, dtype=torch.long), None, "bool"),
     (torch.ones(2, 3, 1, dtype=torch.bool), None, "bool"),
     (None, torch.ones(3, 3), "bool"),
     (torch.ones(2, 4, dtype=torch.bool), causal_mask(3), "key length")],
    ids=["pad-not-bool", "pad-3d", "causal-not-bool", "length-mismatch"],
)
def test_combine_masks_errors(pad: torch.Tensor | None, causal: torch.Tensor | None,
                              needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        combine_masks(pad, causal)


def test_padding_mask_polarity() -> None:
    ids = torch.tensor([[3, 4, 0, 0]])
    assert padding_mask(ids).tolist() == [[True, True, False, False]]
    assert padding_mask(ids, pad_id=4).tolist() == [[True, False, True, True]]
    with pytest.raises(ValueError, match=re.escape("(B, T)")):
        padding_mask(torch.tensor([1, 2, 0]))


def test_polarity_converters_round_trip() -> None:
    mask = torch.tensor([[True, True, False], [True, False, False]])
    torch_mask = to_torch_key_padding_mask(mask)
    assert torch.equal(torch_mask, ~mask)  # torch: True = ignore
    assert torch.equal(from_torch_key_padding_mask(torch_mask), mask)
    assert torch.equal(to_torch_attn_mask(causal_mask(3)), ~causal_mask(3))
    with pytest.raises(ValueError, match="boolean"):
        from_torch_key_padding_mask(torch.zeros(1, 3))


def test_polarity_matches_torch_multihead_attention() -> None:
    """Our (True = attend) masks, converted, reproduce a hand-masked torch MHA result."""
    torch.manual_seed(0)
    mha = torch.nn.MultiheadAttention(8, 2, batch_first=True).eval()
    x = torch.randn(2, 4, 8)
    keep = torch.tensor([[True, True, True, False], [True, True, False, False]])
    out_ours, _ = mha(x, x, x, key_padding_mask=to_torch_key_padding_mask(keep),
                      attn_mask=to_torch_attn_mask(causal_mask(4)))
    float_mask = torch.zeros(2, 4, 4).masked_fill(
        ~combine_masks(keep, causal_mask(4))[:, 0], float("-inf"))
    out_ref, _ = mha(x, x, x, attn_mask=float_mask.repeat_interleave(2, dim=0))
    assert torch.allclose(out_ours, out_ref, atol=1e-6)


# =========================================================================================
# config.py
# =========================================================================================
def test_model_config_json_round_trip() -> None:
    cfg = ModelConfig(**model_kwargs(positional="sinusoidal", norm="post", attention="manual",
                                     activation="relu", tie_weights=False, bias=False,
                                     dropout=0.1))
    again = ModelConfig.from_dict(json_round_trip(cfg.to_dict()))
    assert again == cfg
    assert cfg.d_ff == 4 * cfg.d_model and cfg.head_dim == 8
    assert ModelConfig.from_dict(json.loads(cfg.to_json())) == cfg


def test_train_config_json_round_trip(tmp_path: Path) -> None:
    cfg = TrainConfig(batch_size=3, block_size=7, max_steps=11, betas=(0.8, 0.95),
                      schedule="linear", seed=5, device="cpu")
    again = TrainConfig.from_dict(json_round_trip(cfg.to_dict()))
    assert again == cfg
    assert isinstance(again.betas, tuple)
    path = tmp_path / "train.json"
    path.write_text(cfg.to_json(), encoding="utf-8")
    assert TrainConfig.load(path) == cfg


def _bad_model(**overrides: object) -> Callable[[], object]:
    return lambda: ModelConfig(**model_kwargs(**overrides))


def _bad_train(**overrides: object) -> Callable[[], object]:
    return lambda: TrainConfig(**overrides)


def _learned_positions_too_far() -> object:
    return LearnedPositions(max_len=16, d_model=8)(torch.arange(20)[None])


# (id, callable, substrings the message must contain)
BAD_INPUTS: list[tuple[str, Callable[[], object], list[str]]] = [
    ("d_model-not-divisible", _bad_model(d_model=30, n_heads=4), ["d_model", "n_heads"]),
    ("unknown-positional", _bad_model(positional="rotary"), ["positional", "rotary"]),
    ("unknown-norm", _bad_model(norm="sandwich"), ["norm", "sandwich"]),
    ("unknown-attention", _bad_model(attention="flash3"), ["attention", "flash3"]),
    ("unknown-activation", _bad_model(activation="swish"), ["activation", "swish"]),
    ("negative-dropout", _bad_model(dropout=-0.1), ["dropout"]),
    ("dropout-one", _bad_model(dropout=1.0), ["dropout"]),
    ("zero-layers", _bad_model(n_layers=0), ["n_layers"]),
    ("zero-vocab", _bad_model(vocab_size=0), ["vocab_size"]),
    ("model-unknown-field",
     lambda: ModelConfig.from_dict({**model_kwargs(), "n_experts": 8}), ["n_experts"]),
    ("train-unknown-field", lambda: TrainConfig.from_dict({"learning_rate": 1.0}),
     ["learning_rate"]),
    ("train-zero-batch", _bad_train(batch_size=0), ["batch_size"]),
    ("train-negative-warmup", _bad_train(warmup_steps=-1), ["warmup_steps"]),
    ("train-val-fraction", _bad_train(val_fraction=1.0), ["val_fraction"]),
    ("train-min-lr-above-lr", _bad_train(lr=1e-3, min_lr=1e-2), ["min_lr", "lr"]),
    ("train-unknown-schedule", _bad_train(schedule="step"), ["schedule", "step"]),
    ("learned-positions-too-far", _learned_positions_too_far,
     ["20", "max_len", "sinusoidal"]),
    ("feedforward-activation", lambda: FeedForward(8, 32, activation="swish"),
     ["activation", "swish"]),
    ("collate-bad-side", lambda: collate_sequences([[1, 2]], side="up"), ["side"]),
    ("causal-too-many-queries", lambda: causal_mask(5, 3), ["t_q=5", "t_k=3"]),
]


@pytest.mark.parametrize(("make", "needles"), [(m, n) for _, m, n in BAD_INPUTS],
                         ids=[i for i, _, _ in BAD_INPUTS])
def test_every_bad_input_raises_a_clear_error(make: Callable[[], object],
                                              needles: list[str]) -> None:
    with pytest.raises(ValueError) as info:
        make()
    message = str(info.value)
    for needle in needles:
        assert needle in message, f"{needle!r} missing from: {message}"


def test_learned_positions_accept_last_position() -> None:
    pos = LearnedPositions(max_len=16, d_model=8)
    assert pos(torch.arange(16)[None]).shape == (1, 16, 8)


def test_a_moved_batch_keeps_the_token_count_taken_on_the_cpu() -> None:
    """The trainer reads num_tokens every step; counted on the CPU before ``to``, it never
    has to wait for the device."""
    from handformer.data import Batch
    from handformer.loss import IGNORE_INDEX

    targets = torch.tensor([[1, 2, IGNORE_INDEX], [3, IGNORE_INDEX, IGNORE_INDEX]])
    batch = Batch(ids=torch.zeros(2, 3, dtype=torch.long), targets=targets)
    moved = batch.to("meta")  # a device whose tensors hold no values: counting would fail
    assert moved.num_tokens == 3
    assert batch.num_tokens == 3
