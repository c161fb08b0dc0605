"""handformer.nn.int8_native: the hand-written int8 loop equals, bit for bit, the same
arithmetic written in torch (rows rounded to an int16 grid, an exact integer dot product, a
float64 epilogue) on every instruction-set path this CPU runs; stays within the grid's
error bound of the float64 product; and refuses what it cannot read."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from handformer.nn import int8_native
from handformer.nn.int8_native import ISA_NAMES, native_isa, native_linear, native_status
from handformer.nn.quantized import Int8Linear
from tests.nn.native_run import run_python

pytestmark = pytest.mark.skipif(native_status() is not None,
                                reason=f"the C loop cannot be built here: {native_status()}")

XQ_MAX = 32767


def paths() -> list[str]:
    """Every path this CPU runs, scalar first."""
    return list(ISA_NAMES[: int8_native._NATIVE.best + 1])


def reference(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor,
              bias: torch.Tensor | None) -> torch.Tensor:
    """The C file's arithmetic in torch: float32 grid per row, int64 dot, float64 epilogue."""
    amax = x.abs().amax(dim=1)  # (M,)
    sx = amax / XQ_MAX  # float32, as the C loop divides
    sx = torch.where(sx == 0, torch.ones_like(sx), sx)
    xq = torch.round(x / sx[:, None]).clamp(-XQ_MAX, XQ_MAX).long()  # (M, K)
    dot = xq @ q.long().T  # (M, N), exact
    y = (dot.double() * sx.double()[:, None] * scale.double()).float()  # (M, N)
    return y if bias is None else y + bias


@settings(max_examples=40, deadline=None)
@given(st.one_of(st.just(1), st.integers(1, 9)), st.integers(1, 11), st.integers(1, 140),
       st.booleans(), st.data())
def test_every_path_equals_the_reference_bit_for_bit(m: int, n: int, k: int, with_bias: bool,
                                                     data: st.DataObject) -> None:
    """Odd sizes on purpose: one row (the sequential row-by-row order) as often as the rest,
    partial tiles of 4 rows and 4 weight rows, K tails past the last pair of vectors and the
    last full vector (32 on AVX-512, 16 on AVX2)."""
    torch.manual_seed(data.draw(st.integers(0, 2**16)))
    x = torch.randn(m, k) * data.draw(st.sampled_from([1e-30, 1.0, 1e30]))
    q = torch.randint(-127, 128, (n, k), dtype=torch.int8)
    scale = torch.rand(n) + 1e-3
    bias = torch.randn(n) if with_bias else None
    want = reference(x, q, scale, bias)
    for isa in paths():
        assert torch.equal(native_linear(x, q, scale, bias, isa=isa), want), isa


@pytest.mark.parametrize("rows", [1, 2])
@pytest.mark.parametrize("k", [4096, 4097, 20000])
def test_the_integer_sum_is_exact_where_int32_would_overflow(k: int, rows: int) -> None:
    """The largest products everywhere: 20000 · 32767 · 127 ≈ 8.3e10 overflows int32 40
    times over; chunks of 4096 summed in int64 keep it exact on every path, in the one-row
    order (two int32 sums a row, added before they widen) and in tiles. Weight -128 too."""
    for sign in (1.0, -1.0):
        x = torch.full((rows, k), sign)
        q = torch.full((5, k), 127, dtype=torch.int8)
        q[4] = -128
        scale = torch.ones(5)
        exact = sign * float(k * XQ_MAX * 127) * (1.0 / XQ_MAX)  # sx = 1 / 32767
        for isa in paths():
            y = native_linear(x, q, scale, isa=isa)
            assert torch.equal(y, reference(x, q, scale, None)), isa
            assert y[0, 0].item() == pytest.approx(exact, rel=1e-6), isa
            assert y[-1, 4].item() == pytest.approx(-exact * 128 / 127, rel=1e-6), isa


def test_within_the_grid_bound_of_the_float64_product() -> None:
    """The one rounding is x's to its grid (≤ sx / 2 an entry), so per output
    |y − x·Wᵀ| ≤ scale · Σ|q| · sx / 2, plus float32's rounding of y."""
    torch.manual_seed(3)
    x = torch.randn(16, 768) * torch.logspace(-3, 3, 16)[:, None]
    q = torch.randint(-127, 128, (300, 768), dtype=torch.int8)
    scale = torch.rand(300) / 127
    y = native_linear(x, q, scale)
    exact = x.double() @ (q.double() * scale.double()[:, None]).T  # (16, 300)
    sx = x.double().abs().amax(dim=1) / XQ_MAX  # (16,)
    bound = sx[:, None] / 2 * (q.double().abs().sum(dim=1) * scale.double())[None, :]
    err = (y.double() - exact).abs()
    assert bool((err <= bound * (1 + 1e-6) + exact.abs() * 2.0**-23).all())
    assert float(err.max()) > 0  # it does round: the bound is not vacuous here


def test_a_rows_result_does_not_depend_on_the_rows_beside_it() -> None:
    """Each row has its own grid and an exact sum: row i alone equals row i among 9."""
    torch.manual_seed(4)
    layer = Int8Linear.from_linear(torch.nn.Linear(96, 64), kernel="native")
    x = torch.randn(9, 96) * torch.arange(1, 10)[:, None]
    with torch.inference_mode():
        alone = torch.cat([layer(x[i : i + 1]) for i in range(9)])  # (9, 64)
        assert torch.equal(layer(x), alone)
        assert torch.equal(layer(x[:5]), alone[:5])


def test_non_finite_rows_give_nan_and_leave_the_others_alone() -> None:
    """NaN and ±inf inside the vector loops (columns 0 and 7) and in the tail past the last
    full vector (column 39 of 40), on every path."""
    x = torch.randn(5, 40)
    x[1, 7], x[2, 0], x[4, 39] = float("nan"), float("inf"), float("-inf")
    x[3] = 0.0
    q = torch.randint(-127, 128, (6, 40), dtype=torch.int8)
    scale, bias = torch.rand(6), torch.randn(6)
    for isa in paths():
        y = native_linear(x, q, scale, bias, isa=isa)
        assert bool(y[1:3].isnan().all()) and bool(y[4].isnan().all()), isa
        assert torch.equal(y[3], bias), isa  # a zero row: exactly the bias
        assert torch.equal(y[0], reference(x[:1], q, scale, bias)[0]), isa


def test_the_layer_takes_the_c_loop_for_float32_and_matches_the_reference() -> None:
    torch.manual_seed(5)
    layer = Int8Linear.from_linear(torch.nn.Linear(50, 21))
    x = torch.randn(2, 3, 50)
    with torch.inference_mode():
        out = layer(x)
    want = reference(x.reshape(6, 50), layer.qweight, layer.scale, layer.bias.detach())
    assert torch.equal(out, want.view(2, 3, 21))


@pytest.mark.parametrize("bad", ["dtype", "layout", "width"])
def test_what_the_loop_cannot_read_is_refused_in_one_line(bad: str) -> None:
    x, q, scale = torch.randn(3, 8), torch.zeros(4, 8, dtype=torch.int8), torch.ones(4)
    if bad == "dtype":
        x = x.double()
    elif bad == "layout":
        x = torch.randn(8, 3).T  # (3, 8), not contiguous
    else:
        x = torch.randn(3, 9)
    with pytest.raises(ValueError, match="int8 kernel: "):
        native_linear(x, q, scale)


def test_a_path_the_cpu_lacks_is_refused() -> None:
    with pytest.raises(ValueError, match="int8 kernel path 'avx9000'"):
        native_linear(torch.ones(1, 4), torch.ones(2, 4, dtype=torch.int8), torch.ones(2),
                      isa="avx9000")


def test_aten_s_level_caps_the_path_so_the_knob_runs_reach_the_older_ones(
        tmp_path: Path) -> None:
    code = ("from handformer.nn.int8_native import native_isa; import torch; "
            "print(torch.backends.cpu.get_cpu_capability(), native_isa())")
    assert run_python(code, tmp_path, ATEN_CPU_CAPABILITY="default") == "DEFAULT scalar"
    assert native_isa() in paths()


def test_without_a_compiler_the_layer_falls_back_and_says_why(tmp_path: Path) -> None:
    code = ("import torch; from handformer.nn.int8_native import native_status; "
            "from handformer.nn.quantized import Int8Linear; "
            "layer = Int8Linear.from_linear(torch.nn.Linear(8, 4), kernel='dequantized'); "
            "x = torch.randn(1, 8); want = layer(x); layer.kernel = 'auto'; "
            "print(native_status()); "
            "print(torch.allclose(layer(x), want, rtol=1e-5, atol=1e-5))")
    out = run_python(code, tmp_path / "empty", CC=str(tmp_path / "no-such-cc"))
    status, agrees = out.splitlines()
    assert "no-such-cc" in status and agrees == "True"


def test_a_bound_product_checks_its_input_and_a_layer_binds_again_when_its_weight_changes(
        ) -> None:
    """``NativeProduct`` checks the stored tensors once and the input every call; a layer
    whose weight is replaced (assigned, or loaded in place) computes with the new one."""
    torch.manual_seed(6)
    q, scale = torch.randint(-127, 128, (5, 24), dtype=torch.int8), torch.rand(5)
    product = int8_native.NativeProduct(q, scale)
    x = torch.randn(3, 24)
    assert torch.equal(product(x), reference(x, q, scale, None))
    rows = torch.randn(2, 3, 24)  # leading dims are rows: (2, 3, 24) → (2, 3, 5)
    assert torch.equal(product(rows), reference(rows.view(6, 24), q, scale, None).view(2, 3, 5))
    for bad in (x.double(), torch.randn(24, 3).T, torch.randn(3, 25), torch.tensor(1.0),
                torch.randn(2, 24, 3).transpose(1, 2)):  # a layout no (M, K) view can read
        with pytest.raises(ValueError, match="int8 kernel: "):
            product(bad)
    with pytest.raises(ValueError, match="int8 kernel: "):
        int8_native.NativeProduct(q.float(), scale)

    layer = Int8Linear.from_linear(torch.nn.Linear(24, 5))
    with torch.inference_mode():
        before = layer(x)
        other = Int8Linear.from_linear(torch.nn.Linear(24, 5))
        layer.load_state_dict(other.state_dict())  # copied in place: same tensors, new values
        assert torch.equal(layer(x), other(x)) and not torch.equal(layer(x), before)
        layer.qweight = -other.qweight  # a new tensor in the buffer's place
        want = reference(x, -other.qweight, other.scale, other.bias.detach())
        assert torch.equal(layer(x), want)
