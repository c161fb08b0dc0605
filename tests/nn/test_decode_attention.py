"""handformer.nn.decode_attention: the hand-written decoding loop equals the reference
attention (``_manual_attention``, float64 for the bound) for one query row over any cache
layout — contiguous, a view of a longer buffer, a packed batch of segments — with
multi-head, grouped-query and multi-query heads and any head dim; gives the same bits on
every path this CPU runs; is what attention runs for a decoding step (and only then); and
leaves attention working where it cannot be built."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from handformer.nn import decode_attention as decode
from handformer.nn.attention import _manual_attention, attention
from handformer.nn.kv_cache import KVCache
from tests.nn.native_run import run_python

pytestmark = pytest.mark.skipif(decode.decode_status() is not None,
                                reason=f"the C loop cannot be built here: "
                                       f"{decode.decode_status()}")

# float32 against a float64 reference: a softmax over ≤ 300 keys of scores up to ~100 and
# values ~N(0, 1); a few float32 ulps of outputs that reach ~4.
TOL = 1e-5


def paths() -> list[str]:
    """Every path this CPU runs, plain C first."""
    return list(decode.DECODE_ISA_NAMES[: decode._LIB.best + 1])


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    out, _ = _manual_attention(q.double(), k.double(), v.double(), None, 0.0, is_causal=False)
    return out


def cache_views(b: int, hkv: int, capacity: int, s: int, d: int, *, by_column: bool = True
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """The first S columns of a cache's keys and values: as ``KVCache`` holds them (one
    buffer, keys then values, each column by column: strided views), or ``by_column=False``
    head by head (one (B, 2·Hkv, L, D) buffer) — the loop reads any strides."""
    if by_column:
        cache = KVCache(b, hkv, capacity, d)
        cache.buffer.normal_()
        return cache.k[:, :, :s], cache.v[:, :, :s]
    kv = torch.randn(b, 2 * hkv, capacity, d)
    return kv[:, :hkv, :s], kv[:, hkv:, :s]


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 3), st.sampled_from([(1, 1), (4, 4), (4, 2), (6, 1), (8, 4)]),
       st.integers(1, 300), st.sampled_from([7, 16, 24, 64, 80, 128]), st.data())
def test_one_row_over_a_cache_equals_the_reference_on_every_path_with_the_same_bits(
        b: int, heads: tuple[int, int], s: int, d: int, data: st.DataObject) -> None:
    """Head dims off the vector width take the plain path; 80 and 128 split into chunks of
    sums on the vector paths; the scale of the scores moves the softmax from flat to sharp."""
    torch.manual_seed(data.draw(st.integers(0, 2**16)))
    h, hkv = heads
    k, v = cache_views(b, hkv, s + data.draw(st.integers(0, 5)), s, d,
                       by_column=data.draw(st.booleans()))
    q = torch.randn(b, h, 1, d) * data.draw(st.sampled_from([0.1, 1.0, 8.0]))
    want = reference(q, k, v)
    outs = [decode.decode_attention(q, k, v, isa=isa) for isa in paths()]
    assert outs[0].shape == (b, h, 1, d)
    assert (outs[0].double() - want).abs().max() <= TOL
    for isa, out in zip(paths(), outs, strict=True):
        assert torch.equal(out, outs[0]), isa


def test_a_packed_batch_gives_each_segment_what_it_gets_alone() -> None:
    """``serve``'s layout: one row of segments, token-major keys (a gather from the pool),
    each segment's one query over its own columns — bit for bit its result alone."""
    torch.manual_seed(0)
    h, hkv, d = 8, 2, 64
    lengths = [1, 17, 300, 5]
    full = torch.randn(sum(lengths), 2 * hkv * d).view(1, -1, 2 * hkv, d).permute(0, 2, 1, 3)
    k, v = full[:, :hkv], full[:, hkv:]  # (1, Hkv, S, D) each, token-major
    q = torch.randn(1, len(lengths), h, d).transpose(1, 2)  # (1, H, T, D)
    spans, start = [], 0
    for i, n in enumerate(lengths):
        spans.append((i, 1, start, n))
        start += n
    out = decode.decode_attention(q, k, v, spans)
    assert out.shape == (1, h, len(lengths), d)
    for i, (_, _, start, n) in enumerate(spans):
        alone = decode.decode_attention(q[:, :, i:i + 1].contiguous(),
                                        k[:, :, start:start + n].contiguous(),
                                        v[:, :, start:start + n].contiguous())
        assert torch.equal(out[:, :, i:i + 1], alone), i
        want = reference(q[:, :, i:i + 1], k[:, :, start:start + n], v[:, :, start:start + n])
        assert (alone.double() - want).abs().max() <= TOL
    # Some of the segments, in another order (a step that mixes decoding with prefill
    # chunks sends only its decoding ones): each still gets its result alone.
    some = [spans[3], spans[0], spans[2]]
    picked = decode.decode_attention(q, k, v, some)
    assert picked.shape == (1, h, 3, d)
    for j, (i, *_) in enumerate(some):
        assert torch.equal(picked[:, :, j], out[:, :, i]), i


def test_a_decoding_step_runs_the_loop_and_nothing_else_does(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """attention with one query row and no mask runs the loop under sdpa, tiled and auto;
    manual, a mask, a bias, several query rows, bf16 and a recorded gradient do not."""
    calls: list[int] = []
    real = decode.attend

    def spy(*args: object, **kwargs: object) -> torch.Tensor:
        calls.append(1)
        return real(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(decode, "attend", spy)
    torch.manual_seed(0)
    k, v = cache_views(1, 4, 40, 33, 16)
    q = torch.randn(1, 4, 1, 16)
    for kind in ("sdpa", "tiled", "auto"):
        before = len(calls)
        out, _ = attention(q, k, v, kind=kind, is_causal=True)
        assert len(calls) == before + 1, kind
        assert (out.double() - reference(q, k, v)).abs().max() <= TOL
    before = len(calls)
    attention(q, k, v, kind="manual")
    attention(q, k, v, torch.ones(1, 1, 1, 33, dtype=torch.bool), kind="sdpa")
    attention(q, k, v, kind="sdpa", bias=torch.zeros(1, 4, 1, 33))
    attention(torch.randn(1, 4, 2, 16), k, v, kind="sdpa")
    attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), kind="sdpa")
    attention(q.requires_grad_(), k, v, kind="sdpa")
    # Shapes the loop does not take go to torch's kernel, not to an error: values of a width
    # of their own (views of the keys' buffer, with the keys' strides) and a broadcast batch.
    kv = torch.randn(1, 8, 33, 16)
    out, _ = attention(q.detach(), kv[:, :4], kv[:, 4:, :, :8], kind="sdpa")
    assert out.shape == (1, 4, 1, 8)
    attention(torch.randn(3, 4, 1, 16), k, v, kind="sdpa")
    assert len(calls) == before
    assert not decode.usable(q.detach(), kv[:, :4, :0], kv[:, 4:, :0])  # no keys


def test_what_it_cannot_take_is_refused_in_one_line() -> None:
    k, v = cache_views(1, 2, 8, 8, 16)
    with pytest.raises(ValueError, match="one query row"):
        decode.decode_attention(torch.randn(1, 2, 3, 16), k, v)
    with pytest.raises(ValueError, match="one query column of q"):
        decode.decode_attention(torch.randn(1, 2, 2, 16), k, v, [(0, 2, 0, 8)])
    with pytest.raises(ValueError, match="a run of the 8 key columns"):
        decode.decode_attention(torch.randn(1, 2, 2, 16), k, v, [(0, 1, 0, 4), (1, 1, 4, 5)])
    with pytest.raises(ValueError, match="one query column of q"):
        decode.decode_attention(torch.randn(1, 2, 2, 16), k, v, [(2, 1, 0, 4)])
    with pytest.raises(ValueError, match=r"k, v \(B, Hkv, S, D\) alike"):
        decode.decode_attention(torch.randn(1, 2, 1, 32), k, v)
    with pytest.raises(ValueError, match=r"k, v \(B, Hkv, S, D\) alike"):
        decode.decode_attention(torch.randn(2, 2, 1, 16), k, v)
    with pytest.raises(ValueError, match=r"k, v \(B, Hkv, S, D\) alike"):
        decode.decode_attention(torch.randn(1, 2, 1, 16), k, v[:, :, :4])
    with pytest.raises(ValueError, match="k and v with the same strides"):
        decode.decode_attention(torch.randn(1, 2, 1, 16), k,
                                torch.randn(1, 8, 2, 16).transpose(1, 2))  # token-major
    with pytest.raises(ValueError, match="float32 CPU tensors"):
        decode.decode_attention(torch.randn(1, 2, 1, 16).double(), k.double(), v.double())
    with pytest.raises(ValueError, match="Hkv dividing H"):
        decode.decode_attention(torch.randn(1, 3, 1, 16), k, v)
    with pytest.raises(ValueError, match="≥ 1 key column"):
        decode.decode_attention(torch.randn(1, 2, 1, 16), k[:, :, :0], v[:, :, :0])
    with pytest.raises(ValueError, match="≥ 1 key per row; got keys"):
        decode.decode_attention(torch.randn(1, 2, 2, 16), k, v, [(0, 1, 0, 3), (1, 1, 3, 0)])
    with pytest.raises(ValueError, match="decode attention path 'avx9000'"):
        decode.decode_attention(torch.randn(1, 2, 1, 16), k, v, isa="avx9000")


def test_aten_s_level_caps_the_path_so_the_knob_runs_reach_the_older_ones(
        tmp_path: Path) -> None:
    code = ("from handformer.nn.decode_attention import decode_isa; import torch; "
            "print(torch.backends.cpu.get_cpu_capability(), decode_isa())")
    assert run_python(code, tmp_path, ATEN_CPU_CAPABILITY="default") == "DEFAULT scalar"
    assert decode.decode_isa() in paths()


def test_without_a_compiler_attention_keeps_torch_s_kernel_and_says_why(tmp_path: Path) -> None:
    code = ("import torch; from handformer.nn.decode_attention import decode_status; "
            "from handformer.nn.attention import attention, _manual_attention; "
            "torch.manual_seed(0); q = torch.randn(1, 2, 1, 8); k = torch.randn(1, 2, 5, 8); "
            "v = torch.randn(1, 2, 5, 8); out, _ = attention(q, k, v, kind='sdpa'); "
            "want, _ = _manual_attention(q, k, v, None, 0.0, is_causal=False); "
            "print(decode_status()); print(torch.allclose(out, want, atol=1e-6))")
    status, agrees = run_python(code, tmp_path / "empty",
                                CC=str(tmp_path / "no-such-cc")).splitlines()
    assert "no-such-cc" in status and agrees == "True"
