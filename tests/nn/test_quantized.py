"""handformer.nn.quantized: int8 round-trip error bounds, refusals, and the fused and
dequantizing kernels agreeing with a float64 product of the same quantized weight (the C
loop's own tests: tests/nn/test_int8_native.py)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from handformer.nn.int8_native import NativeProduct, native_isa, native_status
from handformer.nn.quantized import (
    INT8_MAX,
    Int8Linear,
    dequantize_weight,
    fused_kernel_status,
    quantize_weight,
)

FLOAT32_MAX = torch.finfo(torch.float32).max


def check_round_trip(w: torch.Tensor) -> None:
    """Every entry within half a step (scale / 2) of its row, plus float32 rounding."""
    q, scale = quantize_weight(w)
    assert q.dtype == torch.int8 and scale.dtype == torch.float32
    assert q.shape == w.shape and scale.shape == (w.shape[0],)
    assert int(q.abs().max()) <= INT8_MAX if q.numel() else True
    w64 = w.double()
    err = (dequantize_weight(q, scale, torch.float64) - w64).abs()  # (N, K)
    amax = w64.abs().amax(dim=1, keepdim=True)  # (N, 1)
    bound = scale.double()[:, None] / 2 * (1 + 1e-6) + amax * 1e-6 + 1e-45
    assert bool((err <= bound).all()), float((err - bound).max())
    zero_rows = (w == 0).all(dim=1)
    assert bool((q[zero_rows] == 0).all())  # a zero row stays exactly zero


row_values = st.one_of(
    st.floats(-1e3, 1e3, width=32),
    st.floats(-FLOAT32_MAX, FLOAT32_MAX, width=32),  # huge values
    st.floats(-(2.0**-130), 2.0**-130, width=32),  # subnormal: the scale underflows
    st.just(0.0),
)


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 6), st.integers(1, 9), st.data())
def test_round_trip_error_is_at_most_half_a_step(n: int, k: int, data: st.DataObject) -> None:
    rows = [data.draw(st.one_of(st.lists(row_values, min_size=k, max_size=k),
                                st.just([0.0] * k)))  # whole zero rows too
            for _ in range(n)]
    check_round_trip(torch.tensor(rows, dtype=torch.float32))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_round_trip_on_a_realistic_weight(dtype: torch.dtype) -> None:
    w = (torch.randn(64, 48) * torch.logspace(-3, 2, 64)[:, None]).to(dtype)
    check_round_trip(w.float())
    q, scale = quantize_weight(w)
    rel = (dequantize_weight(q, scale) - w.float()).abs().amax(1) / w.float().abs().amax(1)
    assert float(rel.max()) <= 0.5 / INT8_MAX + 1e-6  # half a step of the row's range
    assert bool((q.abs().amax(dim=1) == INT8_MAX).all())  # each row uses the whole range


@pytest.mark.parametrize("bad, what", [(math.nan, "1 NaN"), (math.inf, "1 infinite"),
                                       (-math.inf, "1 infinite")])
@pytest.mark.parametrize("k, column", [(5, 3), (1024, 517), (1027, 1026)])
def test_non_finite_weights_are_refused_by_name(bad: float, what: str, k: int,
                                                 column: int) -> None:
    """Wide rows too: the check reads the row maxima, so a NaN in a vector lane or in the
    scalar tail must reach its row's maximum on every CPU path."""
    w = torch.randn(4, k)
    w[2, column] = bad
    with pytest.raises(ValueError, match=r"blocks\.0\.fc_in\.weight.*rows \[2\]") as info:
        quantize_weight(w, "blocks.0.fc_in.weight")
    assert what in str(info.value)


@pytest.mark.parametrize("w", [torch.randn(3), torch.randn(2, 3, 4), torch.ones(3, 3).long()])
def test_only_2d_float_weights_quantize(w: torch.Tensor) -> None:
    with pytest.raises(ValueError, match="2-D floating-point"):
        quantize_weight(w)


def float64_product(layer: Int8Linear, x: torch.Tensor) -> torch.Tensor:
    w = dequantize_weight(layer.qweight, layer.scale, torch.float64)
    out = x.double() @ w.t()
    return out if layer.bias is None else out + layer.bias.double()


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape", [(1, 24), (3, 24), (2, 5, 24), (40, 24)])
def test_dequantized_kernel_matches_float64(bias: bool, shape: tuple[int, ...]) -> None:
    layer = Int8Linear.from_linear(torch.nn.Linear(24, 17, bias=bias), kernel="dequantized")
    x = torch.randn(shape)
    with torch.no_grad():
        out = layer(x)
    assert out.shape == (*shape[:-1], 17)
    torch.testing.assert_close(out.double(), float64_product(layer, x), rtol=1e-5, atol=1e-5)


def test_fused_kernel_matches_float64_and_compiles_once_per_shape() -> None:
    """The compiled path (decoding) — seconds the first time in a process: it compiles."""
    from handformer.nn import quantized

    torch.manual_seed(1)
    layer = Int8Linear.from_linear(torch.nn.Linear(40, 33), kernel="fused")
    before = quantized._FUSED.shapes()
    with torch.inference_mode():
        for x in (torch.randn(1, 40), torch.randn(1, 40), torch.randn(3, 40),
                  torch.randn(3, 1, 40)):  # leading dims flatten into rows: (3, 40) again
            torch.testing.assert_close(layer(x).double(), float64_product(layer, x),
                                       rtol=1e-5, atol=1e-5)
    assert fused_kernel_status() is None, fused_kernel_status()
    assert quantized._FUSED.shapes() - before == 2  # (1, 40) and (3, 40), once each


@pytest.mark.parametrize("n, rows", [(64, 5), (33, 2), (48, 20)])
def test_fused_kernel_streams_and_row_blocks_match_float64(n: int, rows: int) -> None:
    """The loop's shapes: N = 64 splits into two weight streams, N = 33 cannot; 20 rows
    (kernel "fused") run as a block of FUSED_MAX_ROWS and one of the rest."""
    torch.manual_seed(n)
    layer = Int8Linear.from_linear(torch.nn.Linear(24, n), kernel="fused")
    x = torch.randn(1, rows, 24)  # a sequence: the positions a speculative step verifies
    with torch.inference_mode():
        out = layer(x)
    assert out.shape == (1, rows, n)
    torch.testing.assert_close(out.double(), float64_product(layer, x), rtol=1e-5, atol=1e-5)


def test_a_rows_result_does_not_depend_on_how_many_rows_share_the_call() -> None:
    """Bit for bit: row i alone and row i among 5 or 9 (a speculative verify step) give the
    same numbers, so verifying proposals in one call cannot change a greedy choice."""
    torch.manual_seed(4)
    layer = Int8Linear.from_linear(torch.nn.Linear(96, 64), kernel="fused")
    x = torch.randn(9, 96)
    with torch.inference_mode():
        alone = torch.cat([layer(x[i : i + 1]) for i in range(9)])  # (9, 64)
        for rows in (5, 9):
            assert torch.equal(layer(x[:rows]), alone[:rows])


def test_auto_fuses_a_few_rows_and_dequantizes_many(monkeypatch: pytest.MonkeyPatch) -> None:
    """auto: up to FUSED_MAX_ROWS rows (one position or several) take a few-row kernel — the
    C loop for float32 where it is built, else the fused one; more rows dequantize, and so
    do wide rows (rows × K past FUSED_MAX_ELEMENTS) unless a vector C loop serves them."""
    from handformer.nn import quantized

    few_rows: list[tuple[str, int]] = []
    real_native, real_fused = NativeProduct.__call__, Int8Linear._fused_forward

    def native_spy(self: NativeProduct, x: torch.Tensor) -> torch.Tensor:
        few_rows.append(("native", x.numel() // self.k))
        return real_native(self, x)

    def fused_spy(self: Int8Linear, x: torch.Tensor, rows: int) -> torch.Tensor | None:
        few_rows.append(("fused", rows))
        return real_fused(self, x, rows)

    monkeypatch.setattr(NativeProduct, "__call__", native_spy)
    monkeypatch.setattr(Int8Linear, "_fused_forward", fused_spy)
    narrow = Int8Linear.from_linear(torch.nn.Linear(16, 8))
    k_wide = quantized.FUSED_MAX_ELEMENTS // 4 + 1  # 4 rows of it pass the element bound
    wide = Int8Linear.from_linear(torch.nn.Linear(k_wide, 8))
    with torch.inference_mode():
        narrow(torch.randn(1, 1, 16))
        narrow(torch.randn(1, 9, 16))  # a verify step of K = 8: a few-row kernel
        narrow(torch.randn(2, quantized.FUSED_MAX_ROWS, 16))  # 32 rows: dequantized
        wide(torch.randn(3, k_wide))  # 3 rows within the bound: a few-row kernel
        wide(torch.randn(4, k_wide))  # 4 rows past it: a vector C loop, else dequantized
        narrow.to(torch.bfloat16)(torch.randn(1, 16, dtype=torch.bfloat16))  # bf16: fused
    first = "native" if native_status() is None else "fused"
    wide_rows = [("native", 4)] if native_status() is None and native_isa() != "scalar" else []
    assert few_rows == [(first, 1), (first, 9), (first, 3), *wide_rows, ("fused", 1)]


def test_autograd_reaches_the_input_and_bias_through_the_dequantized_path() -> None:
    layer = Int8Linear.from_linear(torch.nn.Linear(8, 6))  # auto: would fuse 2 rows
    x = torch.randn(2, 8, requires_grad=True)
    layer(x).sum().backward()
    w = dequantize_weight(layer.qweight, layer.scale)
    torch.testing.assert_close(x.grad, w.sum(0).expand(2, 8))
    torch.testing.assert_close(layer.bias.grad, torch.full((6,), 2.0))
    assert layer.qweight.grad is None and not layer.qweight.requires_grad


def test_weight_property_is_the_dequantized_weight_and_bf16_follows_to() -> None:
    linear = torch.nn.Linear(16, 8)
    layer = Int8Linear.from_linear(linear)
    assert layer.weight.shape == (8, 16) and layer.weight.dtype == torch.float32
    assert float((layer.weight - linear.weight).abs().max()) <= float(layer.scale.max()) / 2
    half = Int8Linear.from_linear(linear).to(torch.bfloat16)
    assert half.qweight.dtype == torch.int8 and half.scale.dtype == torch.bfloat16
    with torch.no_grad():
        out = half(torch.randn(5, 16, dtype=torch.bfloat16))
    assert out.dtype == torch.bfloat16


def test_state_dict_holds_int8_weights_and_scales_not_a_float_weight() -> None:
    layer = Int8Linear.from_linear(torch.nn.Linear(6, 4))
    state = layer.state_dict()
    assert set(state) == {"qweight", "scale", "bias"}
    assert state["qweight"].dtype == torch.int8


@pytest.mark.parametrize("shape", [(2, 7), (7,), ()])
def test_wrong_input_width_is_refused_with_the_shapes(shape: tuple[int, ...]) -> None:
    layer = Int8Linear(6, 4)
    with pytest.raises(ValueError, match=r"\(\.\.\., 6\)"):
        layer(torch.randn(shape))


def test_unknown_kernel_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown int8 kernel 'int4'"):
        Int8Linear(4, 4, kernel="int4")  # type: ignore[arg-type]


def test_a_whole_layer_pickles_without_its_compiled_kernels() -> None:
    import io

    layer = Int8Linear.from_linear(torch.nn.Linear(8, 4))
    layer._kernels[(1, torch.float32)] = lambda *args: args[0]  # a found kernel: a closure
    buffer = io.BytesIO()
    torch.save(layer, buffer)
    buffer.seek(0)
    back = torch.load(buffer, weights_only=False)
    assert back._kernels == {} and torch.equal(back.qweight, layer.qweight)
