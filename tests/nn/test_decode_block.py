"""The block's decoding step as one C call (``nn.decode_block``): equal to the modules' path,
the same bits on every path, and declined wherever it was not written for the call.

Tolerance: the kernel's products and attention are the modules' own loops (same bits for the
same input); its norms and activation are plain C, whose last-bit differences from torch's
move the next product's int16 grid of its input by at most half a step. Every logit, block
output and cached key or value below stays within 5e-5 of the largest one (measured: up to
2.0e-5 for logits, 1.0e-5 for the cache; RMSNorm blocks ~1e-7).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

import pytest
import torch
from torch import Tensor

from handformer.capture import capture_attention, forced_attention_kind
from handformer.config import ModelConfig
from handformer.models.decoder_lm import DecoderLM
from handformer.models.quantize import quantize_int8
from handformer.nn import decode_block
from handformer.nn.int8_native import ISA_NAMES
from handformer.nn.kv_cache import KVCache
from tests.conftest import TokenKernelSpy

pytestmark = pytest.mark.skipif(decode_block.block_step_status() is not None,
                                reason=f"no C kernel here: {decode_block.block_step_status()}")

REL = 5e-5


def _model(**overrides: object) -> DecoderLM:
    torch.manual_seed(0)
    fields: dict[str, object] = dict(vocab_size=61, d_model=64, n_heads=4, n_layers=2,
                                     max_len=48, positional="learned", attention="sdpa",
                                     activation="gelu")
    fields.update(overrides)
    return quantize_int8(DecoderLM(ModelConfig(**fields)).eval())  # type: ignore[arg-type]


def _steps(model: DecoderLM, n: int = 12) -> tuple[Tensor, Tensor]:
    """A prompt of 5 and ``n`` cached steps: the logits (n + 1, V) and the first layer's
    cache (its filled columns)."""
    torch.manual_seed(1)
    prompt = torch.randint(0, model.config.vocab_size, (1, 5))
    with torch.inference_mode():
        cache = model.make_cache(1, 5 + n)
        out = [model(prompt, cache=cache)[0, -1]]
        for i in range(n):
            out.append(model(torch.tensor([[(7 * i + 3) % model.config.vocab_size]]),
                             cache=cache)[0, -1])
        return torch.stack(out), cache.layers[0].buffer[:, :, : 5 + n].clone()


class _Spy:
    """Wraps ``decode_block.step``, ``stack_step`` and ``token_step``: how many block steps
    the kernel served (a served stack or token counts each of its blocks; ``stacks`` counts
    the stack and token calls served, ``tokens`` the token calls) and how many ``step``
    declined (a declined token falls back to the stack, a declined stack to ``step`` per
    block)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.served = self.declined = self.stacks = self.tokens = 0
        original: Callable[..., Tensor | None] = decode_block.step
        original_stack: Callable[..., Tensor | None] = decode_block.stack_step
        original_token: Callable[..., Tensor | None] = decode_block.token_step

        def spy(*args: object) -> Tensor | None:
            y = original(*args)
            if y is None:
                self.declined += 1
            else:
                self.served += 1
            return y

        def stack_spy(blocks: list[object], *args: object) -> Tensor | None:
            y = original_stack(blocks, *args)
            if y is not None:
                self.served += len(blocks)
                self.stacks += 1
            return y

        def token_spy(model: DecoderLM, *args: object) -> Tensor | None:
            y = original_token(model, *args)
            if y is not None:
                self.served += len(model.blocks)
                self.stacks += 1
                self.tokens += 1
            return y

        monkeypatch.setattr(decode_block, "step", spy)
        monkeypatch.setattr(decode_block, "stack_step", stack_spy)
        monkeypatch.setattr(decode_block, "token_step", token_spy)


CONFIGS = {
    "gpt2-like": {},
    "swiglu-rmsnorm-gqa": dict(activation="swiglu", norm_type="rmsnorm", n_kv_heads=2,
                               bias=False),
    "gelu_tanh": dict(activation="gelu_tanh"),
    "relu": dict(activation="relu", n_kv_heads=1),
    "relu2-head-dim-12": dict(activation="relu2", d_model=48, n_heads=4),
    "layernorm-no-bias": dict(bias=False),
}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_the_kernel_step_equals_the_modules_step(name: str,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    model = _model(**CONFIGS[name])
    spy = _Spy(monkeypatch)
    fused, fused_kv = _steps(model)
    assert spy.served == 12 * model.config.n_layers and spy.declined == 0
    assert spy.tokens == 12  # the whole token: embedding, blocks, final norm and head
    with decode_block.disabled():
        ref, ref_kv = _steps(model)
    assert spy.served == 12 * model.config.n_layers  # disabled: not even asked
    scale = float(ref.abs().max())
    assert float((fused - ref).abs().max()) <= REL * scale, name
    assert float((fused_kv - ref_kv).abs().max()) <= REL * float(ref_kv.abs().max())


@pytest.mark.parametrize("activation", ["gelu", "gelu_tanh", "swiglu"])
def test_activations_far_from_zero_still_match(activation: str) -> None:
    """The kernel's exponential, erf and tanh are its own polynomials: with fc_in's outputs
    pushed to a few hundred (its scale × 300), where they saturate or clamp, the block's
    output still matches the modules'."""
    model = _model(activation=activation)
    block = model.blocks[0]
    block.ffn.fc_in.scale.mul_(300.0)
    torch.manual_seed(3)
    x = torch.randn(1, 1, 64)
    kv, twin = KVCache(1, 4, 4, 16), KVCache(1, 4, 4, 16)
    with torch.inference_mode():
        f = block.ffn.fc_in(block.norm2(x))
        assert float(f.abs().max()) > 100.0  # the activation's inputs are far out
        y = block(x, cache=kv, cache_start=0)
        with decode_block.disabled():
            y_ref = block(x, cache=twin, cache_start=0)
    assert torch.isfinite(y).all()
    assert float((y - y_ref).abs().max()) <= REL * float(y_ref.abs().max())


def test_one_block_output_and_cache_column_match() -> None:
    """The block alone on the same input and cache: output and written column."""
    model = _model(activation="swiglu", norm_type="rmsnorm", n_kv_heads=2)
    block = model.blocks[0]
    torch.manual_seed(2)
    x = torch.randn(1, 1, 64)
    kv = KVCache(1, 2, 9, 16)
    kv.buffer[:, :, :6] = torch.randn(1, 2, 6, 2, 16)  # (B, 2, L, Hkv, D)
    twin = KVCache(1, 2, 9, 16)
    twin.buffer.copy_(kv.buffer)
    with torch.inference_mode():
        y = block(x, cache=kv, cache_start=6)
        with decode_block.disabled():
            y_ref = block(x, cache=twin, cache_start=6)
    assert float((y - y_ref).abs().max()) <= REL * float(y_ref.abs().max())
    assert float((kv.buffer[:, :, 6] - twin.buffer[:, :, 6]).abs().max()) <= REL * float(
        twin.buffer[:, :, 6].abs().max())
    assert torch.equal(kv.buffer[:, :, 7:], twin.buffer[:, :, 7:])  # nothing written past it


def _steps_on_every_path(model: DecoderLM, monkeypatch: pytest.MonkeyPatch
                         ) -> dict[str, tuple[Tensor, Tensor]]:
    """``_steps`` of ``model`` once on every path this CPU runs, by the path's name."""
    lib = decode_block._LIB
    lib.lib()
    outs = {}
    for level in range(lib.best + 1):
        monkeypatch.setattr(lib, "default", level)
        outs[ISA_NAMES[level]] = _steps(model)
    return outs


@pytest.mark.parametrize("activation", ["gelu", "gelu_tanh", "relu", "relu2", "swiglu"])
def test_every_path_gives_the_same_bits(activation: str,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """Each path runs its own copy of the activation (and its own products and attention);
    a width of 100 leaves a tail past the last full vector, and fc_in's scale × 30 puts
    some inputs where the exponential saturates."""
    model = _model(n_kv_heads=2, activation=activation, d_ff=100)
    for block in model.blocks:
        block.ffn.fc_in.scale.mul_(30.0)
    outs = _steps_on_every_path(model, monkeypatch)
    first = next(iter(outs.values()))
    for name, (logits, kv) in outs.items():
        assert torch.equal(logits, first[0]) and torch.equal(kv, first[1]), name


@pytest.mark.parametrize("norm_type", ["layernorm", "rmsnorm"])
def test_every_path_gives_the_same_bits_at_a_width_off_the_lanes(
        norm_type: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The norms add in 8 double lanes, one copy per path: a width of 52 leaves 4 entries
    past the last full set of lanes (and a head dim of 13 sends the attention to its plain
    copy on every path)."""
    model = _model(d_model=52, n_heads=4, norm_type=norm_type)
    spy = _Spy(monkeypatch)
    outs = _steps_on_every_path(model, monkeypatch)
    assert spy.tokens == 12 * len(outs)  # every step was the one C call
    first = next(iter(outs.values()))
    for name, (logits, kv) in outs.items():
        assert torch.equal(logits, first[0]) and torch.equal(kv, first[1]), name
    with decode_block.disabled():
        ref, _ = _steps(model)
    assert float((first[0] - ref).abs().max()) <= REL * float(ref.abs().max())


@pytest.mark.parametrize(("overrides", "new"), [(dict(n_layers=3), 40),
                                                 (dict(max_len=12), 30)],
                         ids=["within the window", "past the window"])
def test_greedy_tokens_are_the_modules_tokens(overrides: dict[str, object], new: int) -> None:
    """Past ``max_len`` generate slides the window and refills the cache: positions restart
    with it, and the token call's position (its column) must follow. Greedy decoding runs
    each token after the prompt's (and a refill's) as one call (``greedy_token``)."""
    from handformer.generate import generate

    model = _model(**overrides)
    with torch.no_grad():  # positions that decide the tokens: a wrong one shows
        model.embed.positions.table.weight.mul_(50.0)
    prompt = torch.randint(0, 61, (1, 4), generator=torch.Generator().manual_seed(3))
    greedy = _GreedySpy()
    with greedy.spying():
        fused = generate(model, prompt, new, temperature=0.0)
    with decode_block.disabled():
        ref = generate(model, prompt, new, temperature=0.0)
    assert torch.equal(fused, ref)
    # every step but the prompt's and each refill's was one greedy call
    refills = 0 if model.config.max_len >= 4 + new else -(-(4 + new - 12) // 6)
    assert greedy.served == new - 1 - refills and greedy.declined == 0


class _GreedySpy:
    """Counts ``decode_block.greedy_token``'s calls that ran the token (``served``) and
    those that left it to the modules (``declined``), while ``spying()``."""

    def __init__(self) -> None:
        self.served = self.declined = 0

    @contextmanager
    def spying(self) -> Iterator[None]:
        original = decode_block.greedy_token

        def spy(*args: Any) -> bool:
            done = original(*args)
            if done:
                self.served += 1
            else:
                self.declined += 1
            return done

        decode_block.greedy_token = spy
        try:
            yield
        finally:
            decode_block.greedy_token = original


DECLINED: dict[str, Callable[[], DecoderLM]] = {
    "float weights": lambda: DecoderLM(ModelConfig(vocab_size=61, d_model=64, n_heads=4,
                                                   n_layers=2, max_len=48)).eval(),
    "rope": lambda: _model(positional="rope"),
    "alibi": lambda: _model(positional="alibi"),
    "qk-norm": lambda: _model(qk_norm=True),
    "post-norm": lambda: _model(norm="post"),
    "manual attention": lambda: _model(attention="manual"),
}


@pytest.mark.parametrize("name", sorted(DECLINED))
def test_blocks_it_was_not_written_for_run_their_modules(
        name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    model = DECLINED[name]()
    spy = _Spy(monkeypatch)
    _steps(model, 3)
    assert spy.served == 0 and spy.declined == 3 * model.config.n_layers


def test_a_batch_a_gradient_or_bfloat16_runs_the_modules(
        monkeypatch: pytest.MonkeyPatch) -> None:
    model = _model()
    spy = _Spy(monkeypatch)
    with torch.inference_mode():
        cache = model.make_cache(2, 8)
        model(torch.randint(0, 61, (2, 3)), cache=cache)
        model(torch.randint(0, 61, (2, 1)), cache=cache)  # two requests: not asked
    assert spy.served == spy.declined == 0
    cache = model.make_cache(1, 8)
    with torch.no_grad():
        model(torch.randint(0, 61, (1, 3)), cache=cache)
    x = model(torch.randint(0, 61, (1, 1)), cache=cache)  # gradients on: declined
    assert spy.declined == 2 and spy.served == 0 and x.requires_grad
    half = copy.deepcopy(model).to(torch.bfloat16)
    with torch.inference_mode():
        cache = half.make_cache(1, 8)  # bfloat16, as the parameters
        half(torch.randint(0, 61, (1, 3)), cache=cache)
        half(torch.randint(0, 61, (1, 1)), cache=cache)
    assert spy.served == 0


def test_hooks_and_attention_captures_still_see_every_step(
        monkeypatch: pytest.MonkeyPatch) -> None:
    model = _model()
    spy = _Spy(monkeypatch)
    seen: list[tuple[int, ...]] = []
    handle = model.blocks[1].ffn.fc_in.register_forward_hook(
        lambda _m, _a, out: seen.append(tuple(out.shape)))
    _steps(model, 4)
    handle.remove()
    assert len(seen) == 5 and spy.served == 4  # block 0 fused, block 1 watched
    with capture_attention(model) as records:
        _steps(model, 4)
    assert len(records) == 2 * 5
    assert spy.served == 4  # captures: every block ran its modules


def test_the_stack_is_one_call_per_token_with_the_blocks_own_bits(
        monkeypatch: pytest.MonkeyPatch) -> None:
    model = _model(n_layers=3)
    monkeypatch.setattr(decode_block, "token_step", lambda *args: None)  # the stack alone
    spy = _Spy(monkeypatch)
    stacked = _steps(model, 6)
    assert spy.stacks == 6 and spy.tokens == 0 and spy.served == 6 * 3 and spy.declined == 0
    monkeypatch.setattr(decode_block, "stack_step", lambda *args: None)
    by_block = _steps(model, 6)
    assert spy.served == 2 * 6 * 3  # now block by block, every block still the kernel's
    assert torch.equal(stacked[0], by_block[0]) and torch.equal(stacked[1], by_block[1])


def test_a_hook_on_a_block_itself_sees_every_step(monkeypatch: pytest.MonkeyPatch) -> None:
    model = _model()
    spy = _Spy(monkeypatch)
    seen: list[tuple[int, ...]] = []
    handle = model.blocks[0].register_forward_hook(
        lambda _m, _a, out: seen.append(tuple(out.shape)))
    _steps(model, 4)
    handle.remove()
    # the stack declined (a C call would skip the block's hook); each block still took
    # the kernel alone, inside its own forward, so the hook saw all 5 calls
    assert len(seen) == 5 and spy.stacks == 0 and spy.served == 2 * 4


class _Wrapped(torch.nn.Module):
    """A module of the user's in a block's place: calls the block it wraps."""

    def __init__(self, block: torch.nn.Module) -> None:
        super().__init__()
        self.inner = block

    def forward(self, x: Tensor, **kwargs: object) -> Tensor:
        return self.inner(x, **kwargs)


def test_a_module_of_the_users_in_the_stack_is_run_as_it_is(
        monkeypatch: pytest.MonkeyPatch) -> None:
    model = _model()
    # the model's ends run as modules on both sides: only the stack's handling differs
    monkeypatch.setattr(decode_block, "token_step", lambda *args: None)
    reference = _steps(model, 4)
    model.blocks[0] = _Wrapped(model.blocks[0])
    spy = _Spy(monkeypatch)
    wrapped = _steps(model, 4)
    # the stack declined (block 0 is not a block it knows); the wrapped block and the other
    # still took the kernel alone, through their own forward
    assert spy.stacks == 0 and spy.served == 2 * 4
    assert torch.equal(wrapped[0], reference[0]) and torch.equal(wrapped[1], reference[1])


def test_a_block_in_training_mode_keeps_its_own_forward(
        monkeypatch: pytest.MonkeyPatch) -> None:
    model = _model(dropout=0.5)
    model.blocks[1].train()  # its dropout is on, though the model is in eval mode
    spy = _Spy(monkeypatch)
    _steps(model, 4)
    assert spy.stacks == 0 and spy.served == 4  # block 0 alone; block 1 ran its modules


def test_a_stack_whose_caches_do_not_match_its_blocks_is_declined() -> None:
    model = _model()
    x = torch.randn(1, 1, 64)
    cache = model.make_cache(1, 8)
    with torch.inference_mode():
        assert decode_block.stack_step(list(model.blocks), x, cache.layers[:1], 0) is None
        assert decode_block.stack_step([], x, [], 0) is None
        y = decode_block.stack_step(list(model.blocks), x, cache.layers, 0)
    assert y is not None and y.shape == (1, 1, 64) and torch.isfinite(y).all()


def test_new_weights_are_read_and_replaced_layers_rebound() -> None:
    model = _model()
    before, _ = _steps(model, 3)
    other = _model()
    with torch.no_grad():
        for p in other.parameters():
            p.mul_(1.5)
        for b in other.buffers():
            if b.dtype == torch.float32:
                b.mul_(1.5)
    model.load_state_dict(other.state_dict())  # copied in place: same memory, new values
    after, _ = _steps(model, 3)
    with decode_block.disabled():
        ref, _ = _steps(model, 3)
    assert not torch.allclose(before, after)
    assert float((after - ref).abs().max()) <= REL * float(ref.abs().max())
    swapped = _model(activation="relu")  # a layer replaced by another object
    model.blocks[0].ffn = swapped.blocks[0].ffn
    after, _ = _steps(model, 3)
    with decode_block.disabled():
        ref, _ = _steps(model, 3)
    assert float((after - ref).abs().max()) <= REL * float(ref.abs().max())


def test_a_full_cache_is_the_modules_overflow_error() -> None:
    model = _model()
    with torch.inference_mode():
        cache = model.make_cache(1, 4)
        model(torch.randint(0, 61, (1, 4)), cache=cache)
        with pytest.raises(ValueError, match="KV cache overflow"):
            model(torch.randint(0, 61, (1, 1)), cache=cache)


def test_a_non_finite_input_gives_nan_not_a_crash() -> None:
    block = _model().blocks[0]
    x = torch.full((1, 1, 64), float("nan"))
    with torch.inference_mode():
        y = block(x, cache=KVCache(1, 4, 3, 16), cache_start=0)
    assert torch.isnan(y).all()


def test_a_kind_forced_to_manual_after_binding_runs_the_modules(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """``forced_attention_kind`` flips a bound block's kind: read per call, not at binding."""
    model = _model()
    _steps(model, 2)  # bound
    spy = _Spy(monkeypatch)
    with forced_attention_kind(model, "manual"):
        _steps(model, 3)
    assert spy.served == 0 and spy.declined == 3 * model.config.n_layers
    _steps(model, 3)
    assert spy.served == 3 * model.config.n_layers


def test_one_row_against_a_two_row_cache_is_the_modules_error() -> None:
    block = _model().blocks[0]
    with torch.inference_mode(), pytest.raises(ValueError, match="do not fit the cache"):
        block(torch.randn(1, 1, 64), cache=KVCache(2, 4, 3, 16), cache_start=0)


def test_a_held_stack_is_checked_once_with_the_same_bits(
        monkeypatch: pytest.MonkeyPatch) -> None:
    model = _model(n_layers=3)
    reference = _steps(model, 6)
    checked: list[object] = []
    original = decode_block._bound_block

    def counting(*args: object) -> object:
        checked.append(args[0])
        return original(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(decode_block, "_bound_block", counting)
    with decode_block.checks_held():
        held = _steps(model, 6)
    # the first one-token step checked the 3 blocks; the 5 after it reused that
    assert checked == list(model.blocks)
    assert torch.equal(held[0], reference[0]) and torch.equal(held[1], reference[1])
    _steps(model, 2)  # the hold closed: every call checks again
    assert len(checked) == 3 + 2 * 3


def test_a_held_stack_checks_again_after_forget_or_past_its_capacity() -> None:
    model = _model()
    seen: list[int] = []
    torch.manual_seed(1)
    with torch.inference_mode(), decode_block.checks_held() as hold:
        cache = model.make_cache(1, 8)
        model(torch.randint(0, 61, (1, 5)), cache=cache)
        model(torch.tensor([[3]]), cache=cache)  # served, and held
        handle = model.blocks[1].ffn.fc_in.register_forward_hook(lambda *_: seen.append(1))
        hold.forget()
        model(torch.tensor([[4]]), cache=cache)
        handle.remove()
        hold.forget()
        x = torch.randn(1, 1, 64)
        assert decode_block.stack_step(model.blocks, x, cache.layers, 7) is not None  # held
        # a column past the caches is not taken from the hold: the full checks decline it
        assert decode_block.stack_step(model.blocks, x, cache.layers, 8) is None
    assert seen == [1]


@pytest.mark.parametrize("watched", ["blocks.1.ffn.fc_in", "lm_head"])
def test_generate_checks_again_after_on_token(watched: str) -> None:
    """``on_token`` is the caller's code: a hook it adds — on a block's module (the stack's
    checks) or on the head (the token's) — is seen by every later step."""
    from handformer.generate import generate

    model = _model()
    seen: list[int] = []
    calls: list[int] = []

    def on_token(ids: Tensor) -> None:
        calls.append(int(ids[0]))
        if len(calls) == 2:  # after one held one-token step
            model.get_submodule(watched).register_forward_hook(lambda *_: seen.append(1))

    generate(model, torch.tensor([[1, 2, 3]]), 6, temperature=0.0, on_token=on_token)
    assert len(calls) == 6 and len(seen) == 4  # tokens 3 to 6: one step each


@pytest.mark.parametrize("keeps", [False, True])
def test_a_callback_that_keeps_the_model_keeps_the_one_check(
        monkeypatch: pytest.MonkeyPatch, keeps: bool) -> None:
    """``on_token_keeps_model=True``: the token is checked once for the whole generation, as
    without ``on_token``; by default again after every call of the callback. The same tokens
    either way."""
    from handformer.generate import generate

    model = _model()
    spy = TokenKernelSpy(monkeypatch)
    prompt = torch.tensor([[1, 2, 3]])
    alone = generate(model, prompt, 6, temperature=0.0)
    assert len(spy.checks) == 1 and spy.calls == 5  # five one-token steps, checked at the first
    calls: list[int] = []
    streamed = generate(model, prompt, 6, temperature=0.0, on_token=calls.append,
                        on_token_keeps_model=keeps)
    assert torch.equal(streamed, alone) and len(calls) == 6
    assert len(spy.checks) == 1 + (1 if keeps else 5)


def test_a_held_stack_holds_the_memory_it_reads() -> None:
    """A held stack is not checked again, so the memory its C arguments point into must stay
    alive whatever is done to the modules meanwhile: every pointer lies in a storage the stack
    holds, even after a weight's ``.data`` was swapped (read as it was until ``forget()``)."""
    model = _model()
    torch.manual_seed(2)
    x = torch.randn(1, 1, 64)
    with torch.inference_mode(), decode_block.checks_held() as hold:
        cache = model.make_cache(1, 8)
        first = decode_block.stack_step(model.blocks, x, cache.layers, 0)
        norm = model.blocks[1].norm2
        with torch.no_grad():
            norm.weight.data = torch.full_like(norm.weight, 2.0)
        (stack,) = hold.stacks.values()
        spans = [(s.data_ptr(), s.data_ptr() + s.nbytes()) for s in stack.read]
        pointers = [stack.kvs[i] for i in range(len(stack.kvs))]
        for i in range(len(stack.structs)):
            block = stack.structs[i].contents
            pointers += [block.norm1_w, block.norm1_b, block.norm2_w, block.norm2_b]
            for linear in (block.in_proj, block.out_proj, block.fc_in, block.fc_out):
                pointers += [linear.q, linear.scale, linear.bias]
        pointers = [p for p in pointers if p]  # NULL (no bias) reads nothing
        again = decode_block.stack_step(model.blocks, x, cache.layers, 0)
        hold.forget()
        fresh = decode_block.stack_step(model.blocks, x, cache.layers, 0)
    assert len(pointers) == 2 + 2 * (4 + 4 * 3)
    assert all(any(lo <= p < hi for lo, hi in spans) for p in pointers)
    assert first is not None and again is not None and fresh is not None
    assert torch.equal(again, first)  # held: the old weight, from memory still alive
    assert not torch.equal(fresh, first)  # checked again: the new weight


def test_a_token_writes_the_stacks_cache_and_the_modules_logits(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The token call runs the stack's C with the embedding's own float add before it: the
    cache holds the same bits as the stack alone writes; the logits differ from the stack
    path's only by the final norm, plain C against torch's (within the module's tolerance)."""
    model = _model(n_layers=3)
    spy = _Spy(monkeypatch)
    token = _steps(model, 6)
    assert spy.tokens == 6 and spy.served == 6 * 3
    monkeypatch.setattr(decode_block, "token_step", lambda *args: None)
    stack = _steps(model, 6)
    assert spy.tokens == 6 and spy.stacks == 12
    assert torch.equal(token[1], stack[1])
    assert float((token[0] - stack[0]).abs().max()) <= REL * float(stack[0].abs().max())


def test_a_token_leaves_the_caches_bookkeeping_as_the_modules_do(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The token call counts its token without a tensor op (``add_decoded_token``); what the
    cache then reads — length, mask, positions, next position — is what the modules' path
    leaves, and a longer chunk after the run continues from it alike."""
    model = _model()
    spy = _Spy(monkeypatch)
    states = []
    for off in (False, True):
        cache = model.make_cache(1, 16)
        with torch.inference_mode(), (decode_block.disabled() if off else nullcontext()):
            model(torch.tensor([[1, 2, 3]]), cache=cache)
            for i in range(5):
                model(torch.tensor([[4 + i]]), cache=cache)
            model(torch.tensor([[9, 8]]), cache=cache)
            n = cache.length
            states.append((n, cache.next_position.tolist(), cache.key_mask[:, :n].tolist(),
                           cache.key_positions[:, :n].tolist()))
    assert spy.tokens == 5
    assert states[0] == states[1] == (10, [10], [[True] * 10], [list(range(10))])


def _hook(module_name: str) -> Callable[[DecoderLM], object]:
    def hook(model: DecoderLM) -> object:
        return model.get_submodule(module_name).register_forward_hook(lambda *_: None)
    return hook


def _float_head(model: DecoderLM) -> None:
    head = torch.nn.Linear(64, 61, bias=False)
    model.lm_head = head


# name → (model overrides, what is done to the model after it is built)
ENDS_DECLINED: dict[str, tuple[dict[str, object], Callable[[DecoderLM], object] | None]] = {
    "hooked embedding": ({}, _hook("embed")),
    "hooked token table": ({}, _hook("embed.token")),
    "hooked positions": ({}, _hook("embed.positions.table")),
    "hooked final norm": ({}, _hook("final_norm")),
    "hooked head": ({}, _hook("lm_head")),
    "float head": ({}, _float_head),
    "soft-capped logits": (dict(logit_softcap=3.0), None),
    "embedding norm": (dict(embedding_norm=True), None),
}


@pytest.mark.parametrize("name", sorted(ENDS_DECLINED))
def test_ends_it_was_not_written_for_leave_the_blocks_to_the_stack(
        name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    overrides, change = ENDS_DECLINED[name]
    model = _model(**overrides)
    if change is not None:
        change(model)
    spy = _Spy(monkeypatch)
    served = _steps(model, 3)
    assert spy.tokens == 0 and spy.stacks == 3, name
    with decode_block.disabled():
        ref = _steps(model, 3)
    assert float((served[0] - ref[0]).abs().max()) <= REL * float(ref[0].abs().max()), name


def test_an_id_outside_the_table_is_the_modules_error_and_int32_ids_run_the_stack(
        monkeypatch: pytest.MonkeyPatch) -> None:
    model = _model()
    spy = _Spy(monkeypatch)

    def prefilled() -> object:
        cache = model.make_cache(1, 8)
        model(torch.randint(0, 61, (1, 3)), cache=cache)
        return cache

    with torch.inference_mode():
        with pytest.raises(IndexError):  # unchecked: the embedding's own error, nothing read
            model(torch.tensor([[61]]), cache=prefilled(), validate=False)
        logits = model(torch.tensor([[5]], dtype=torch.int32), cache=prefilled())
    assert spy.tokens == 0 and spy.stacks == 1 and logits.shape == (1, 1, 61)


def test_a_held_token_is_checked_once_and_holds_the_memory_it_reads(
        monkeypatch: pytest.MonkeyPatch) -> None:
    model = _model()
    reference = _steps(model, 6)
    spy = TokenKernelSpy(monkeypatch)
    with decode_block.checks_held() as hold:
        held = _steps(model, 6)
        (token,) = hold.stacks.values()
    assert spy.checks == [model]
    assert torch.equal(held[0], reference[0]) and torch.equal(held[1], reference[1])
    spans = [(s.data_ptr(), s.data_ptr() + s.nbytes()) for s in token.read]
    ends = token.ends
    pointers = [p for p in (ends.token, ends.positions, ends.norm_w, ends.norm_b, ends.head.q,
                            ends.head.scale, ends.head.bias) if p]
    assert len(pointers) == 6  # the head has no bias
    assert all(any(lo <= p < hi for lo, hi in spans) for p in pointers)
    assert token.stack.read  # and the stack's own


def test_a_nan_in_the_token_table_is_named_by_generate(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A damaged embedding row read by the token call gives NaN logits, which ``generate``
    refuses by name — not a crash in C, not a token sampled from NaN."""
    from handformer.generate import generate
    from handformer.generate.plain import NonFiniteLogitsError

    model = _model()
    model.lm_head.bias = torch.nn.Parameter(torch.zeros(61))
    with torch.no_grad():
        model.embed.token.weight[7] = float("nan")
        model.lm_head.bias[7] = 1e4  # greedy decoding picks id 7; the prompt avoids it
    spy = _Spy(monkeypatch)
    with pytest.raises(NonFiniteLogitsError, match="generated token 2"):
        generate(model, torch.tensor([[1, 2, 3]]), 4, temperature=0.0)
    assert spy.tokens == 1  # the NaN row went through the token call


def _greedy_setup(logits: list[float]) -> tuple[DecoderLM, Tensor, object]:
    """A model whose head gives exactly ``logits`` (its int8 weights zero, its bias those
    values), a cache holding a 3-token prompt, and a token buffer (1, 6) with the prompt and
    one token at column 3 (ids below 3)."""
    model = _model(vocab_size=len(logits))
    with torch.no_grad():
        model.lm_head.qweight.zero_()
    model.lm_head.bias = torch.nn.Parameter(torch.tensor(logits))
    tokens = torch.tensor([[1, 2, 0, 1, 0, 0]])
    cache = model.make_cache(1, 8)
    with torch.inference_mode():
        model(tokens[:, :3], cache=cache)
    return model, tokens, cache


INF = float("inf")


@pytest.mark.parametrize(("logits", "want"), [
    ([0.5, 2.0, -1.0, 2.0, 1.0], 1),  # a tie: the first, as torch's argmax
    ([-INF, -INF, 3.0, -INF, 1.0], 2),  # banned tokens (-inf) next to finite ones
    ([-7.0, -7.0, -7.0, -7.0, -7.0], 0),
    ([0.0, -3.0e38, 3.0e38, 1.0, 2.0], 2),
])
def test_greedy_token_writes_torchs_argmax(logits: list[float], want: int) -> None:
    model, tokens, cache = _greedy_setup(logits)
    with torch.inference_mode():
        assert decode_block.greedy_token(model, tokens, 4, cache)
    assert int(torch.tensor(logits).argmax()) == want
    assert tokens.tolist() == [[1, 2, 0, 1, want, 0]] and cache.length == 4


@pytest.mark.parametrize("logits", [[0.0, float("nan"), 1.0, 2.0], [0.0, INF, 1.0, 2.0],
                                    [-INF, -INF, -INF, -INF]],
                         ids=["nan", "+inf", "no finite value"])
def test_logits_sampling_refuses_are_left_to_generate_which_names_them(
        logits: list[float]) -> None:
    """What ``sample_next`` refuses the kernel does not pick from: nothing is counted or
    written, and ``generate`` (which then runs the modules) raises its own error."""
    from handformer.generate import generate
    from handformer.generate.plain import NonFiniteLogitsError

    model, tokens, cache = _greedy_setup(logits)
    with torch.inference_mode():
        assert not decode_block.greedy_token(model, tokens, 4, cache)
    assert tokens.tolist() == [[1, 2, 0, 1, 0, 0]] and cache.length == 3
    greedy = _GreedySpy()
    with greedy.spying(), pytest.raises(NonFiniteLogitsError, match="non-finite logits"):
        generate(model, torch.tensor([[1, 2]]), 3, temperature=0.0)
    assert greedy.served == 0


def test_greedy_token_declines_what_it_cannot_run_and_writes_nothing() -> None:
    """An id outside the table (the embedding's error is the modules'), a token buffer
    that is not one contiguous int64 row, a padded cache, a hooked or training model."""
    model, tokens, cache = _greedy_setup([0.0, 1.0, 2.0])
    with torch.inference_mode():
        bad = tokens.clone()
        bad[0, 3] = 3  # vocab 3: outside the table
        assert not decode_block.greedy_token(model, bad, 4, cache)
        assert bad[0, 4] == 0 and cache.length == 3
        for other in (tokens.int(), tokens.repeat(2, 1), torch.stack([tokens, tokens], 2)[..., 0]):
            assert not decode_block.greedy_token(model, other, 4, cache)
        assert not decode_block.greedy_token(model, tokens, 6, cache)  # no column to write
        padded = model.make_cache(1, 8)
        model(tokens[:, :3], torch.tensor([[False, True, True]]), cache=padded)
        assert not decode_block.greedy_token(model, tokens, 4, padded)
        handle = model.register_forward_hook(lambda *_: None)
        assert not decode_block.greedy_token(model, tokens, 4, cache)
        handle.remove()
        model.train()
        assert not decode_block.greedy_token(model, tokens, 4, cache)
        model.eval()
        assert decode_block.greedy_token(model, tokens, 4, cache)
    assert cache.length == 4 and tokens[0, 4] == 2


def test_generate_leaves_greedy_decoding_to_a_model_whose_call_is_its_own() -> None:
    """A hook on the model sees every step, a subclass's forward is what is called, and the
    ids each ``on_token`` gets are its own tensor (changing them changes nothing)."""
    from handformer.generate import generate

    class AlwaysFive(DecoderLM):
        def forward(self, ids: Tensor, *args: Any, **kwargs: Any) -> Tensor:
            logits = super().forward(ids, *args, **kwargs)
            logits[..., 5] = 1e9
            return logits

    model = _model()
    prompt = torch.tensor([[1, 2, 3]])
    five = copy.deepcopy(model)
    five.__class__ = AlwaysFive
    greedy = _GreedySpy()
    with greedy.spying():
        assert generate(five, prompt, 4, temperature=0.0)[0, 3:].tolist() == [5] * 4
    assert greedy.served == greedy.declined == 0  # not even asked
    seen: list[int] = []
    handle = model.register_forward_hook(lambda *_: seen.append(1))
    with greedy.spying():
        hooked = generate(model, prompt, 5, temperature=0.0)
    handle.remove()
    assert len(seen) == 5 and greedy.served == 0
    with greedy.spying():
        meddled = generate(model, prompt, 5, temperature=0.0,
                           on_token=lambda ids: ids.add_(1) and None)
    assert torch.equal(meddled, hooked) and greedy.served == 4


def test_greedy_decoding_stops_at_eos_as_the_modules_do() -> None:
    from handformer.generate import generate

    model = _model()
    prompt = torch.tensor([[1, 2, 3]])
    with decode_block.disabled():
        ref = generate(model, prompt, 12, temperature=0.0)
    eos = int(ref[0, 6])  # the fourth new token
    first = ref[0, 3:].tolist().index(eos)
    greedy = _GreedySpy()
    with greedy.spying():
        out = generate(model, prompt, 12, temperature=0.0, eos_id=eos)
    assert torch.equal(out, ref[:, : 3 + first + 1]) and greedy.served == first
