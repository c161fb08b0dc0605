"""Memory budgets: estimates close to what the models really hold, and refusals of absurd
sizes that come from arithmetic alone — nothing here allocates more than a few megabytes."""

from __future__ import annotations

import itertools
import time
import warnings
from pathlib import Path

import pytest
import torch

from handformer.config import ClassifierConfig, ModelConfig, Seq2SeqConfig
from handformer.generate import generate
from handformer.loss import lm_loss
from handformer.models import budget
from handformer.models.budget import (
    MemoryBudgetError,
    activation_bytes,
    check_fits,
    check_training,
    format_bytes,
    generation_estimate,
    kv_cache_bytes,
    parameter_count,
    parameter_estimate,
    training_estimate,
)
from handformer.models.decoder_lm import DecoderLM
from handformer.models.encoder import Encoder, EncoderClassifier
from handformer.models.seq2seq import EncoderDecoder
from handformer.nn.kv_cache import DecoderCache

GiB = 1 << 30


def small(**overrides: object) -> ModelConfig:
    return ModelConfig(**{"vocab_size": 11, "d_model": 16, "n_heads": 4, "n_layers": 2,
                          "max_len": 9, **overrides})  # type: ignore[arg-type]


VARIANTS = [dict(positional=p, norm=n, bias=b, tie_weights=t, n_kv_heads=kv,
                 embedding_norm=e, type_vocab_size=tv)
            for p, n, b, t, kv, e, tv in itertools.product(
                ["learned", "sinusoidal", "rope", "alibi"], ["pre", "post"], [True, False],
                [True, False], [0, 2], [False, True], [0, 2])]


@pytest.mark.parametrize("variant", VARIANTS[::5] + VARIANTS[-1:],
                         ids=lambda v: "-".join(str(x) for x in v.values()))
def test_parameter_count_is_exact_for_every_kind_of_model(variant: dict[str, object]) -> None:
    c = small(**variant)
    assert parameter_count(c) == DecoderLM(c).num_parameters()
    cls = ClassifierConfig(c, num_classes=3)
    assert parameter_count(cls) == sum(p.numel() for p in EncoderClassifier(cls).parameters())
    s2s = Seq2SeqConfig(c, ModelConfig(**{**c.to_dict(), "vocab_size": 13, "n_layers": 3}))
    assert parameter_count(s2s) == EncoderDecoder(s2s).num_parameters()
    assert parameter_estimate(c).total == 4 * parameter_count(c)


def saved_for_backward(model: torch.nn.Module, step: object) -> int:
    """Bytes of the tensors autograd keeps for the backward pass (weights left out)."""
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    kept: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in weights:
            kept[storage.data_ptr()] = max(kept.get(storage.data_ptr(), 0), storage.nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        step()  # type: ignore[operator]
    return sum(kept.values())


@pytest.mark.parametrize("attention", ["manual", "sdpa"])
@pytest.mark.parametrize("b, t, c, layers, v, heads, dropout", [
    (8, 32, 32, 2, 50, 4, 0.0), (4, 64, 64, 3, 100, 4, 0.1), (2, 128, 128, 2, 300, 8, 0.0),
])
def test_activation_estimate_is_an_upper_bound_within_a_small_factor(
        attention: str, b: int, t: int, c: int, layers: int, v: int, heads: int,
        dropout: float) -> None:
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=v, d_model=c, n_heads=heads, n_layers=layers, max_len=t,
                      attention=attention, dropout=dropout)
    model = DecoderLM(cfg).train()
    ids = torch.randint(0, v, (b, t))
    measured = saved_for_backward(model, lambda: lm_loss(model(ids), ids))
    estimate = activation_bytes(cfg, b, t)
    # The formula counts the manual kernel's (T × T) matrices, which sdpa does not keep.
    factor = 2.0 if attention == "manual" else 3.0
    assert measured <= estimate <= factor * measured, (measured, estimate)


def test_activation_estimate_covers_an_encoder_and_a_seq2seq_decoder() -> None:
    torch.manual_seed(0)
    cfg = small(d_model=32, max_len=24, vocab_size=40)
    enc = Encoder(cfg).train()
    ids = torch.randint(0, 40, (6, 24))
    measured = saved_for_backward(enc, lambda: enc(ids).sum())
    estimate = activation_bytes(cfg, 6, 24, vocab_head=False)
    assert measured <= estimate <= 3 * measured, (measured, estimate)

    s2s = Seq2SeqConfig(cfg, ModelConfig(**{**cfg.to_dict(), "max_len": 12}))
    model = EncoderDecoder(s2s).train()
    tgt = torch.randint(0, 40, (6, 12))
    measured = saved_for_backward(model, lambda: lm_loss(model(ids, tgt), tgt))
    estimate = training_estimate(s2s, 6, 12, source_len=24).parts[
        "activations of a 6 × 12 micro-batch"]
    assert measured <= estimate <= 3 * measured, (measured, estimate)


@pytest.mark.parametrize("n_kv_heads", [0, 1])
def test_kv_cache_estimate_is_exact(n_kv_heads: int) -> None:
    cfg = small(n_kv_heads=n_kv_heads, max_len=20)
    cache = DecoderLM(cfg).make_cache(3)
    held = sum(layer.nbytes() for layer in cache.layers)
    held += sum(t.numel() * t.element_size()
                for t in (cache.key_mask, cache.key_positions, cache.next_position))
    assert kv_cache_bytes(cfg, 3) == held


@pytest.mark.parametrize(("prompt", "new", "columns"), [(3, 4, 7), (3, 40, 20), (25, 2, 20)])
def test_generate_sizes_its_cache_to_the_call_and_the_estimate_counts_that_cache(
        prompt: int, new: int, columns: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """``generate`` asks for min(window, prompt + new) columns, no more (a long window and a
    few tokens: a small cache), and the budget counts exactly that cache."""
    model = DecoderLM(small(max_len=20)).eval()
    made: list[DecoderCache] = []
    real = model.make_cache

    def spy(batch_size: int, max_len: int | None = None) -> DecoderCache:
        made.append(real(batch_size, max_len))
        return made[-1]

    monkeypatch.setattr(model, "make_cache", spy)
    ids = torch.randint(0, model.config.vocab_size, (2, prompt))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a prompt longer than the window is cropped
        out = generate(model, ids, new, temperature=0)
    assert out.shape == (2, prompt + new)
    assert [c.capacity for c in made] == [columns]
    held = kv_cache_bytes(model.config, 2, columns)
    assert generation_estimate(model.config, 2, prompt, new).parts["KV cache"] == held
    full = generate(model, ids, new, temperature=0, use_cache=False)
    assert torch.equal(out, full)


def test_training_estimate_counts_weights_gradients_and_adamw() -> None:
    cfg = small()
    est = training_estimate(cfg, 4, 8)
    n = parameter_count(cfg)
    assert est.parts["parameters"] == est.parts["gradients"] == 4 * n
    assert est.parts["AdamW moments"] == 8 * n
    assert est.total == 16 * n + activation_bytes(cfg, 4, 8)


def test_check_fits_says_what_how_much_and_the_limit() -> None:
    est = training_estimate(small(), 4, 8, hint="use a smaller --batch-size")
    check_fits(est, available=est.total)  # exactly enough: fine
    with pytest.raises(MemoryBudgetError) as info:
        check_fits(est, available=est.total - 1)
    text = str(info.value)
    assert text.startswith("not enough memory: training this model needs about ")
    assert "AdamW moments" in text and "is available on this machine" in text
    assert text.endswith("use a smaller --batch-size") and "\n" not in text
    assert isinstance(info.value, MemoryError)


def test_an_unknown_limit_refuses_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(budget, "available_memory", lambda device="cpu": None)
    check_fits(parameter_estimate(small(d_model=1 << 16, n_heads=1)))


def test_available_memory_reads_the_host(monkeypatch: pytest.MonkeyPatch) -> None:
    free = budget.host_available_memory()
    assert free is None or 0 < free < 1 << 50
    # The host's free memory moves between two reads (other processes run), so the routing is
    # checked against a pinned probe rather than a second live read.
    monkeypatch.setattr(budget, "host_available_memory", lambda: 12345)
    assert budget.available_memory("cpu") == 12345
    assert budget.available_memory("mps") == 12345
    assert budget.available_memory("meta") is None


def test_format_bytes() -> None:
    assert format_bytes(512) == "512 B"
    assert format_bytes(3 * GiB) == "3.00 GiB"
    assert format_bytes(1536 * GiB) == "1.50 TiB"
    assert format_bytes(10**30) == "1.00e+30 B"


# Within config.MODEL_LIMITS (which refuses d_model 10⁹ or n_layers 10⁶ outright) and still
# hundreds of gigabytes to terabytes of weights.
HUGE = [
    ("d_model 65536", dict(d_model=1 << 16, n_heads=1)),
    ("n_layers 4096", dict(d_model=1024, n_layers=1 << 12)),
    ("vocab_size 2^24", dict(vocab_size=1 << 24, d_model=1 << 14)),
    ("learned max_len 2^24", dict(max_len=1 << 24, d_model=1 << 14)),
]


@pytest.mark.parametrize("name, fields", HUGE, ids=[h[0] for h in HUGE])
def test_huge_models_are_refused_before_anything_is_allocated(
        name: str, fields: dict[str, int]) -> None:
    cfg = small(**fields)
    start = time.perf_counter()
    for build in (lambda: DecoderLM(cfg), lambda: Encoder(cfg),
                  lambda: EncoderClassifier(ClassifierConfig(cfg, num_classes=2)),
                  lambda: EncoderDecoder(Seq2SeqConfig(cfg, cfg))):
        with pytest.raises(MemoryBudgetError, match="not enough memory: building this"):
            build()
    assert time.perf_counter() - start < 1.0  # arithmetic, not allocation


def test_huge_training_requests_are_refused() -> None:
    cfg = small()
    with pytest.raises(MemoryBudgetError, match="activations of a 100000000 × 8"):
        check_training(cfg, 10**8 * 1, 8, hint="smaller")  # --batch-size 1e8
    with pytest.raises(MemoryBudgetError, match="activations"):
        check_training(ClassifierConfig(small(max_len=10**6), num_classes=2), 32, 10**6)
    with pytest.raises(MemoryBudgetError):  # seq2seq --max-len 1e6
        check_training(Seq2SeqConfig(small(max_len=10**6), small(max_len=10**6)), 64, 10**6)
    with pytest.raises(MemoryBudgetError, match="token ids"):  # a text too large to tokenize
        check_training(cfg, 2, 8, host_extra={"the text's token ids": 1 << 60})


def test_generate_refuses_an_absurd_max_new_tokens_up_front() -> None:
    model = DecoderLM(small())
    prompt = torch.zeros(1, 3, dtype=torch.long)
    start = time.perf_counter()
    with pytest.raises(MemoryBudgetError, match="output tokens") as info:
        generate(model, prompt, 10**12)
    assert "--max-new-tokens" in str(info.value)
    assert time.perf_counter() - start < 1.0
    est = generation_estimate(model.config, 1, 3, 10**12)
    assert est.parts["output tokens"] == (3 + 10**12) * 9
    assert generate(model, prompt, 4, temperature=0).shape == (1, 7)  # sane sizes still run


def test_load_run_checks_memory_before_building_the_model(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The consistency checks build a skeleton on the meta device (no memory, no check); the
    real model is refused when it cannot fit."""
    from handformer.runs import load_run, save_run
    from handformer.tokenizers import CharTokenizer

    tok = CharTokenizer.from_text("abc")
    run = save_run(tmp_path / "run", DecoderLM(small(vocab_size=tok.vocab_size)), tok)
    assert load_run(run).kind == "lm"
    monkeypatch.setattr(budget, "available_memory", lambda device="cpu": 1000)
    with pytest.raises(MemoryBudgetError, match="building this DecoderLM"):
        load_run(run)


def test_a_skeleton_on_the_meta_device_is_not_checked() -> None:
    with torch.device("meta"):
        model = DecoderLM(small(**dict(HUGE[0][1])))
    assert next(model.parameters()).device.type == "meta"
