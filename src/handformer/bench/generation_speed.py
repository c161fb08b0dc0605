"""Generation speed at batch 1, greedy: handformer in float32, bfloat16 and int8 weights
against Hugging Face ``GPT2LMHeadModel`` (same shape, random weights, float32,
``use_cache=True``), each row with the floor memory bandwidth sets.

Why a floor: at batch 1 a decoding step multiplies one vector by every weight matrix, so a
step must at least *read* every weight once, and the KV cache of every layer. A row's floor is
those bytes (weights in the dtype they are stored in, plus the mean cache read per step)
divided by the memory bandwidth measured among the contenders (summing a large tensor on
2 MiB pages where the system gives them, once a round: ``_bandwidth_probe``). int8 weights
cut the weight bytes by 4; that is the whole point of them. (A model whose weights fit in
the CPU's last-level cache can beat a DRAM floor.)

Four parts, all in one process, contenders alternated (median of ``--repeats`` after a
warm-up) so machine noise hits them alike, once per thread count in ``--threads``:

* ``kernels``: one (N, K) weight times one vector in each kernel — fp32, bf16,
  ``torch._weight_int8pack_mm``, dequantize-then-matmul, the fused and the native (C) int8
  kernels of ``handformer.nn.quantized`` and, if installed, torchao's int8 weight-only
  linear — with each one's error against a float64 product. This is the measurement the
  int8 kernels were chosen by.
* ``token_products``: the C loop alone on a 12L-768d token's 48 layer products (85 MB of
  int8, from memory), as a share of the measured bandwidth — the product's own floor.
* ``rows``: whole generations, 512 new tokens after a 16-token prompt, at 4L-128d, 6L-384d
  and 12L-768d (GPT-2 small's shape). Contenders come from ``CONTENDER_FACTORIES``: more can
  be registered there (``register_contenders``) and are timed and floored alike. The int8
  row also says where its tokens' time goes, from the same generations run again: inside
  the one C call per token (``decode_block.greedy_token``: embedding, every block, final
  norm, head and argmax; its checks included) and outside it (the prompt's forward, the
  cache's allocation and ``generate``'s own loop, run with the caches the weights just
  streamed through).
* the int8 quality on a *trained* model lives in ``bench.int8_quality`` (it needs a run).

    python benchmarks/generation_speed.py                  # full: three cases, 1 and 2 threads
    python benchmarks/generation_speed.py --quick          # seconds; used in CI so it never rots
    python benchmarks/generation_speed.py --cases 6L-384d --threads 1
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from handformer.config import ModelConfig
from handformer.generate import generate
from handformer.machine import describe_machine, machine_line
from handformer.models.decoder_lm import DecoderLM
from handformer.models.quantize import quantize_int8
from handformer.nn import decode_block, huge_pages
from handformer.nn.int8_native import NativeProduct, native_isa, native_status
from handformer.nn.quantized import Int8Linear, compile_seconds, quantize_weight

__all__ = ["CASES", "CONTENDER_FACTORIES", "Case", "Contender", "Setup", "main",
           "measure_bandwidth", "register_contenders", "step_bytes"]

VOCAB = 96
PROMPT = 16
NEW_TOKENS = 512
HF = "HF GPT2LMHeadModel fp32 (cache)"


@dataclass(frozen=True)
class Case:
    """A model shape (random weights) and how many tokens to generate after the prompt."""

    n_layers: int
    n_heads: int
    d_model: int
    new_tokens: int = NEW_TOKENS


CASES = {"4L-128d": Case(4, 4, 128), "6L-384d": Case(6, 6, 384),
         "12L-768d": Case(12, 12, 768)}
QUICK_CASES = {"2L-64d": Case(2, 4, 64, new_tokens=24)}
# The weight the kernel rows multiply: the issue's probe, 113 MB in fp32 (quick: 0.4 MB).
KERNEL_SHAPE, QUICK_KERNEL_SHAPE = (12288, 2304), (768, 128)


@dataclass
class Setup:
    """What every contender of a case shares: the float32 model (random weights, eval mode),
    the prompt (1, PROMPT) and the case."""

    name: str
    case: Case
    model: DecoderLM
    prompt: Tensor

    @property
    def mean_context(self) -> float:
        """Mean number of cached tokens a decoding step reads."""
        return PROMPT + self.case.new_tokens / 2


@dataclass
class Contender:
    """One way to generate ``case.new_tokens`` greedy tokens from the prompt. ``run`` returns
    the ids (1, PROMPT + new); ``bytes_per_token`` is what a token must read at least (the
    row's floor is that / bandwidth); ``dtype`` how the weights are stored; ``same_weights``
    whether it runs the case's model (else its tokens are not compared with fp32's)."""

    name: str
    dtype: str
    run: Callable[[], Tensor]
    bytes_per_token: float
    note: str = ""
    same_weights: bool = True  # the case's model (agreement with its fp32 tokens is meaningful)
    split_stack: bool = False  # also time its one-call tokens apart (``stack_split``)


ContenderFactory = Callable[[Setup], list[Contender]]


def step_bytes(model: nn.Module, mean_context: float, cache_dtype: torch.dtype) -> float:
    """Bytes one decoding step of ``model`` (a ``DecoderLM``-shaped model) must read at
    least: every weight it multiplies by, in its stored dtype (a tied head counted once, as
    the head), one row of each embedding table, and ``mean_context`` cached keys and values
    of every layer in ``cache_dtype``."""
    seen: set[int] = set()
    total = 0
    embeddings = [m for m in model.modules() if isinstance(m, nn.Embedding)]
    for module in model.modules():
        if isinstance(module, nn.Embedding):
            continue
        for tensor in [*module.parameters(recurse=False), *module.buffers(recurse=False)]:
            if tensor.data_ptr() not in seen:
                seen.add(tensor.data_ptr())
                total += tensor.numel() * tensor.element_size()
    for emb in embeddings:  # one row per step, unless the head reads the table whole
        if emb.weight.data_ptr() not in seen:
            total += emb.weight.shape[1] * emb.weight.element_size()
    cfg = model.config  # type: ignore[union-attr]
    kv_width = 2 * cfg.n_kv_heads * cfg.head_dim
    return total + cfg.n_layers * kv_width * mean_context * torch.empty(
        (), dtype=cache_dtype).element_size()


def _big_tensor(megabytes: int) -> Tensor:
    """A float32 tensor far larger than any cache, on 2 MiB pages where the system gives
    them (``nn.huge_pages``, as the int8 weights and the KV cache are): a read in 4 KiB
    pages pays a page walk every 4 KiB and is slower, which would flatter every floor set
    by it."""
    numel = megabytes * 2**20 // 4
    laid = huge_pages.zeros([(numel,)], torch.float32)
    return torch.ones(numel) if laid is None else laid[0].fill_(1.0)


def measure_bandwidth(repeats: int, megabytes: int = 512) -> float:
    """Bytes per second this process reads from memory, on the current thread count: the
    median time to sum ``_big_tensor`` once, over ``repeats`` sums after a warm-up one."""
    big = _big_tensor(megabytes)
    times = []
    for _ in range(repeats + 1):
        t0 = time.perf_counter()
        big.sum()
        times.append(time.perf_counter() - t0)
    return big.numel() * 4 / statistics.median(times[1:])


BANDWIDTH_PROBE = "memory bandwidth (sum)"
PROBE_SUMS = 3


def _bandwidth_probe(megabytes: int) -> Callable[[], None]:
    """``PROBE_SUMS`` sums of one ``_big_tensor``: timed among a case's contenders, once a
    round, so that its floor is read under the same load as they run."""
    big = _big_tensor(megabytes)

    def probe() -> None:
        for _ in range(PROBE_SUMS):
            big.sum()
    return probe


# -- contenders -------------------------------------------------------------------------------
def _greedy(model: nn.Module, setup: Setup) -> Callable[[], Tensor]:
    return lambda: generate(model, setup.prompt, setup.case.new_tokens, temperature=0)


def _greedy_module_by_module(model: nn.Module, setup: Setup) -> Callable[[], Tensor]:
    """``_greedy`` with the block kernel off (``nn.decode_block``): each module called in
    turn, as every model ran before that kernel — what it gains, in the same run."""
    def run() -> Tensor:
        with decode_block.disabled():
            return generate(model, setup.prompt, setup.case.new_tokens, temperature=0)
    return run


def handformer_contenders(setup: Setup) -> list[Contender]:
    """handformer with the KV cache: float32, bfloat16 and int8 weights (fp32 activations);
    int8 twice, with its block kernel and module by module."""
    fp32 = setup.model
    bf16 = copy.deepcopy(fp32).to(torch.bfloat16)
    int8 = quantize_int8(fp32)
    ctx = setup.mean_context
    return [
        Contender("handformer fp32", "float32", _greedy(fp32, setup),
                  step_bytes(fp32, ctx, torch.float32)),
        Contender("handformer bf16", "bfloat16", _greedy(bf16, setup),
                  step_bytes(bf16, ctx, torch.bfloat16)),
        Contender("handformer int8", "int8", _greedy(int8, setup),
                  step_bytes(int8, ctx, torch.float32), note="weights int8, activations fp32",
                  split_stack=True),
        Contender("handformer int8, module by module", "int8",
                  _greedy_module_by_module(int8, setup), step_bytes(int8, ctx, torch.float32),
                  note="the block kernel off: each module's own call"),
    ]


def torchao_contenders(setup: Setup) -> list[Contender]:
    """torchao's int8 weight-only quantization of the same model, eager (if installed)."""
    try:
        from torchao.quantization import Int8WeightOnlyConfig, quantize_
    except ImportError:
        return []
    model = copy.deepcopy(setup.model)
    quantize_(model, Int8WeightOnlyConfig())
    int8_bytes = step_bytes(quantize_int8(setup.model), setup.mean_context, torch.float32)
    return [Contender("torchao int8 weight-only (eager)", "int8", _greedy(model, setup),
                      int8_bytes)]


def _build_hf(setup: Setup) -> nn.Module | None:
    try:
        from transformers import GPT2Config, GPT2LMHeadModel
    except ImportError:
        return None
    c = setup.case
    cfg = GPT2Config(vocab_size=VOCAB, n_positions=PROMPT + c.new_tokens, n_embd=c.d_model,
                     n_layer=c.n_layers, n_head=c.n_heads, activation_function="gelu",
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0,
                     eos_token_id=None, pad_token_id=0)
    return GPT2LMHeadModel(cfg).eval()


def hf_contenders(setup: Setup) -> list[Contender]:
    """Hugging Face GPT-2 of the same shape, float32, with its cache."""
    hf = _build_hf(setup)
    if hf is None:
        return []
    new = setup.case.new_tokens

    def run() -> Tensor:
        with torch.inference_mode():
            return hf.generate(setup.prompt, attention_mask=torch.ones_like(setup.prompt),
                               max_new_tokens=new, min_new_tokens=new, do_sample=False,
                               use_cache=True, pad_token_id=0)

    # Same shapes as handformer's fp32 model: the same bytes per token.
    return [Contender(HF, "float32", run,
                      step_bytes(setup.model, setup.mean_context, torch.float32),
                      note="its own random weights", same_weights=False)]


CONTENDER_FACTORIES: list[ContenderFactory] = [handformer_contenders, torchao_contenders,
                                               hf_contenders]


def register_contenders(factory: ContenderFactory) -> None:
    """Add contenders to every case (speculative decoding, another library): they run
    alternated with the others and get their floors and ratios the same way."""
    if factory not in CONTENDER_FACTORIES:
        CONTENDER_FACTORIES.append(factory)


# -- timing -----------------------------------------------------------------------------------
def time_alternating(fns: dict[str, Callable[[], Any]],
                     repeats: int) -> tuple[dict[str, list[float]], dict[str, Any]]:
    """Seconds per call of each function and what its first call returned: one warm-up call
    each (compiles, caches), then ``repeats`` rounds calling each in turn, so drift hits
    every contender alike."""
    first = {name: fn() for name, fn in fns.items()}
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return times, first


@contextmanager
def _timed_stack_steps(seconds: list[float]) -> Iterator[None]:
    """Within the block, the seconds of each call that ran every block at once go into
    ``seconds``: ``decode_block.greedy_token`` (greedy decoding's whole token and its
    argmax), ``token_step`` (the whole token: embedding, blocks, final norm and head) or
    ``stack_step`` (the blocks alone, where the model's ends are not the token kernel's).
    Callers look each up on the module at every call; a declined call's time (None or
    False) counts as outside."""
    originals = {name: getattr(decode_block, name)
                 for name in ("greedy_token", "token_step", "stack_step")}

    def timed(original: Callable[..., Any]) -> Callable[..., Any]:
        def run(*args: Any) -> Any:
            t0 = time.perf_counter()
            y = original(*args)
            if y is not None and y is not False:
                seconds.append(time.perf_counter() - t0)
            return y
        return run

    for name, original in originals.items():
        setattr(decode_block, name, timed(original))
    try:
        yield
    finally:
        for name, original in originals.items():
            setattr(decode_block, name, original)


def stack_split(run: Callable[[], Any], repeats: int) -> dict[str, float] | None:
    """Where one generation's time goes: median seconds per run inside the calls that ran
    every block at once (the token kernel's or the stack's) and outside them, and how many
    calls a run made, over ``repeats`` runs; None where no call took the blocks (the kernel
    declined, or is not built here)."""
    inside, outside, calls = [], [], 0
    for _ in range(repeats):
        seconds: list[float] = []
        with _timed_stack_steps(seconds):
            t0 = time.perf_counter()
            run()
            total = time.perf_counter() - t0
        inside.append(sum(seconds))
        outside.append(total - sum(seconds))
        calls = len(seconds)
    if calls == 0:
        return None
    return {"inside_s": statistics.median(inside), "outside_s": statistics.median(outside),
            "calls": calls}


def build_setup(name: str, case: Case) -> Setup:
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=VOCAB, d_model=case.d_model, n_heads=case.n_heads,
                      n_layers=case.n_layers, max_len=PROMPT + case.new_tokens,
                      positional="learned", attention="sdpa", activation="gelu")
    model = DecoderLM(cfg).eval()
    return Setup(name, case, model, torch.randint(1, VOCAB, (1, PROMPT)))


def run_case(name: str, case: Case, repeats: int,
             megabytes: int = 512) -> list[dict[str, Any]]:
    """Every registered contender on one case; a row each, with its floor. The floor's
    bandwidth is measured among them (``_bandwidth_probe``, a ``megabytes`` tensor, once a
    round): the machine's memory speed drifts over the minutes a case takes, which one
    reading before them would miss."""
    setup = build_setup(name, case)
    contenders = [c for factory in CONTENDER_FACTORIES for c in factory(setup)]
    compiled_before = compile_seconds()
    fns: dict[str, Callable[[], Any]] = {c.name: c.run for c in contenders}
    fns[BANDWIDTH_PROBE] = _bandwidth_probe(megabytes)
    times, outputs = time_alternating(fns, repeats)
    bandwidth = PROBE_SUMS * megabytes * 2**20 / statistics.median(times[BANDWIDTH_PROBE])
    reference = outputs[contenders[0].name][0, PROMPT:]  # handformer fp32's greedy tokens
    rows = []
    for c in contenders:
        med = statistics.median(times[c.name])
        floor = c.bytes_per_token / bandwidth
        agree = (float((outputs[c.name][0, PROMPT:] == reference).float().mean())
                 if c.same_weights else None)
        rows.append({
            "case": name, "threads": torch.get_num_threads(), "contender": c.name,
            "dtype": c.dtype, "new_tokens": case.new_tokens, "median_s": med,
            "min_s": min(times[c.name]), "max_s": max(times[c.name]),
            "tokens_per_s": case.new_tokens / med, "ms_per_token": 1000 * med / case.new_tokens,
            "mb_per_token": c.bytes_per_token / 1e6, "floor_ms_per_token": 1000 * floor,
            "fraction_of_floor": floor / (med / case.new_tokens),
            "bandwidth_gb_per_s": bandwidth / 1e9,
            "agreement_with_fp32": agree, "note": c.note})
    for c, r in zip(contenders, rows, strict=True):
        split = stack_split(c.run, repeats) if c.split_stack else None
        if split is not None:
            r["stack_ms_per_token"] = 1000 * split["inside_s"] / case.new_tokens
            r["outside_stack_ms_per_token"] = 1000 * split["outside_s"] / case.new_tokens
            r["stack_calls"] = split["calls"]
            r["stack_fraction_of_floor"] = r["floor_ms_per_token"] / r["stack_ms_per_token"]
    hf = next((r for r in rows if r["contender"] == HF), None)
    for r in rows:
        r["vs_hf"] = None if hf is None else hf["median_s"] / r["median_s"]
        if r["contender"] == "handformer int8":  # its warm-up compiled this model's shapes
            r["compile_s"] = compile_seconds() - compiled_before
    return rows


# -- kernels ----------------------------------------------------------------------------------
def kernel_rows(shape: tuple[int, int], repeats: int) -> list[dict[str, Any]]:
    """One (N, K) weight times one vector in every kernel; milliseconds and max error
    relative to the largest output, against a float64 product of the same (quantized or
    bf16-rounded) weight — the kernels' own error, not the quantization's."""
    torch.manual_seed(0)
    n, k = shape
    linear = nn.Linear(k, n, bias=False)
    w = linear.weight.detach()  # (N, K)
    x = torch.randn(1, k)  # (1, K)
    q, scale = quantize_weight(w)
    fused = Int8Linear.from_linear(linear, kernel="fused")
    wb, xb = w.bfloat16(), x.bfloat16()
    wq64 = q.double() * scale.double()[:, None]  # (N, K)
    fused_name = "handformer int8 fused (compiled)"
    # name → (the product, its input in float64, its weight in float64)
    kernels: dict[str, tuple[Callable[[], Tensor], Tensor, Tensor]] = {
        "fp32 F.linear": (lambda: torch.nn.functional.linear(x, w), x.double(), w.double()),
        "bf16 F.linear": (lambda: torch.nn.functional.linear(xb, wb), xb.double(),
                          wb.double()),
        "torch._weight_int8pack_mm": (lambda: torch._weight_int8pack_mm(x, q, scale),
                                      x.double(), wq64),
        "dequantize, then F.linear": (
            lambda: torch.nn.functional.linear(x, q.float() * scale[:, None]), x.double(),
            wq64),
        fused_name: (lambda: fused(x), x.double(), wq64),
    }
    if native_status() is None:  # the C loop, where this machine can build it
        native = Int8Linear.from_linear(linear, kernel="native")
        kernels[f"handformer int8 native ({native_isa()})"] = (lambda: native(x), x.double(),
                                                                wq64)
    try:
        from torchao.quantization import Int8WeightOnlyConfig, quantize_

        ao = nn.Sequential(copy.deepcopy(linear))
        quantize_(ao, Int8WeightOnlyConfig())
        ao_w64 = ao[0].weight.dequantize().double()  # torchao's own rounding of the weight
        kernels["torchao int8 weight-only (eager)"] = (lambda: ao(x), x.double(), ao_w64)
    except ImportError:
        pass
    rows = []
    with torch.inference_mode():
        t0 = time.perf_counter()
        fused(x)  # compiles this shape once: timed apart from the product
        compile_s = time.perf_counter() - t0
        times, _ = time_alternating({name: fn for name, (fn, _, _) in kernels.items()},
                                    max(repeats, 5) * 4)
        for name, (fn, x64, w64) in kernels.items():
            ref = x64 @ w64.t()  # (1, N)
            err = float((fn().double() - ref).abs().max() / ref.abs().max())
            rows.append({"kernel": name, "shape": [n, k], "threads": torch.get_num_threads(),
                         "median_ms": 1000 * statistics.median(times[name]),
                         "max_rel_error": err,
                         **({"compile_s": compile_s} if name == fused_name else {})})
    return rows


def token_products_row(name: str, case: Case, repeats: int,
                       bandwidth: float) -> dict[str, Any] | None:
    """The C loop on one decoding token's layer products at ``case``'s shapes (per layer: the
    fused q·k·v projection, the output projection, the FFN's two), one row each, back to
    back: as many weights as a token reads, more than the caches hold, so each arrives from
    memory — the loop's own rate, apart from attention and the layers' small ops. None where
    the C loop cannot build."""
    if native_status() is not None:
        return None
    torch.manual_seed(0)
    c = case.d_model
    shapes = [(3 * c, c), (c, c), (4 * c, c), (c, 4 * c)] * case.n_layers  # (N, K) each
    products = [NativeProduct(torch.randint(-127, 128, (n, k), dtype=torch.int8),
                              torch.rand(n) * 1e-2, torch.zeros(n)) for n, k in shapes]
    inputs = {k: torch.randn(1, k) for _, k in shapes}  # (1, K) per input width

    def token() -> None:
        for product in products:
            product(inputs[product.k])

    times, _ = time_alternating({"token": token}, max(repeats, 5) * 4)
    median = statistics.median(times["token"])
    weight_bytes = sum(n * k for n, k in shapes)
    return {"case": name, "isa": native_isa(), "products": len(shapes),
            "threads": torch.get_num_threads(), "weight_mb": weight_bytes / 1e6,
            "median_ms": 1000 * median, "gb_per_s": weight_bytes / median / 1e9,
            "fraction_of_bandwidth": weight_bytes / median / bandwidth}


# -- report -----------------------------------------------------------------------------------
def print_report(result: dict[str, Any]) -> None:
    threads = result["machine"]["threads"]  # every count the run took, one pass each
    print(machine_line({**result["machine"], "threads": ", ".join(map(str, threads))}))
    print(f"torch {torch.__version__}; median of {result['repeats']} alternating repeats after "
          "a warm-up; absolute times on a shared machine are noise, ratios are the figures")
    for kr in result["kernels"]:
        print(f"  kernel {kr['kernel']:<36} {kr['threads']}T {kr['shape']} "
              f"{kr['median_ms']:8.3f} ms  rel. err {kr['max_rel_error']:.1e}"
              + (f"  (compiled in {kr['compile_s']:.1f} s)" if "compile_s" in kr else ""))
    for tr in result.get("token_products", []):
        print(f"  C loop ({tr['isa']}), one {tr['case']} token's {tr['products']} layer products, "
              f"one row, {tr['threads']}T: {tr['median_ms']:.2f} ms for {tr['weight_mb']:.1f} MB "
              f"of int8 = {tr['gb_per_s']:.1f} GB/s, {100 * tr['fraction_of_bandwidth']:.0f} % "
              "of the sum's bandwidth")
    header = (f"{'case':<9} {'thr':>3} {'contender':<36} {'tok/s':>8} {'ms/tok':>8} "
              f"{'MB/tok':>7} {'floor ms':>8} {'% floor':>7} {'vs HF':>6} {'agree':>6}")
    print(header)
    print("-" * len(header))
    for r in result["rows"]:
        vs_hf = "" if r["vs_hf"] is None else f"{r['vs_hf']:.2f}x"
        print(f"{r['case']:<9} {r['threads']:>3} {r['contender']:<36} {r['tokens_per_s']:>8.0f} "
              f"{r['ms_per_token']:>8.3f} {r['mb_per_token']:>7.1f} "
              f"{r['floor_ms_per_token']:>8.3f} {100 * r['fraction_of_floor']:>6.0f}% "
              f"{vs_hf:>6} " + ("" if r["agreement_with_fp32"] is None
                                else f"{100 * r['agreement_with_fp32']:>5.0f}%"))
    for r in result["rows"]:
        if "stack_ms_per_token" in r:
            print(f"  {r['case']} {r['threads']}T {r['contender']}: {r['stack_ms_per_token']:.3f} "
                  f"ms/token inside the one C call per token ({r['stack_calls']} calls a "
                  f"run; {100 * r['stack_fraction_of_floor']:.0f} % of the floor), "
                  f"{r['outside_stack_ms_per_token']:.3f} outside it (the prompt, the cache, "
                  "generate's loop)")
    floors = {(r["case"], r["threads"]): r["bandwidth_gb_per_s"] for r in result["rows"]
              if "bandwidth_gb_per_s" in r}
    for (case, t), gb_per_s in floors.items():
        print(f"floor bandwidth, {case} {t}T: {gb_per_s:.1f} GB/s (summing a large tensor among "
              "the contenders, once a round, median)")
    for b in result["bandwidth"]:
        print(f"memory bandwidth, {b['threads']} thread(s): {b['gb_per_s']:.1f} GB/s "
              f"(sum of a {b['megabytes']} MB float32 tensor, "
              f"{'2 MiB' if huge_pages.huge_pages_supported() else '4 KiB'} pages)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes, few repeats")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--threads", type=int, nargs="+", default=None,
                        help="torch intra-op thread counts, each a full pass (default: 1 2; "
                        "quick: 1)")
    parser.add_argument("--cases", nargs="+", default=None,
                        help=f"subset of the cases to run: {', '.join(CASES)}")
    parser.add_argument("--no-kernels", action="store_true",
                        help="skip the single-matrix kernel rows")
    parser.add_argument("--out", type=Path,
                        default=Path("benchmarks/results/generation_speed.json"))
    args = parser.parse_args(argv)
    cases = QUICK_CASES if args.quick else CASES
    if args.cases:
        unknown = sorted(set(args.cases) - set(cases))
        if unknown:
            parser.error(f"unknown case(s) {unknown}; expected some of {list(cases)}")
        cases = {name: cases[name] for name in args.cases}
    if args.threads is not None and any(t < 1 for t in args.threads):
        parser.error(f"--threads must be positive; got {args.threads}")
    threads = args.threads or ([1] if args.quick else [1, 2])
    repeats = args.repeats or (2 if args.quick else 3)
    before = torch.get_num_threads()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {"machine": {**describe_machine(), "threads": threads},
                              "repeats": repeats, "prompt": PROMPT, "bandwidth": [],
                              "kernels": [], "token_products": [], "rows": []}
    try:
        for t in threads:
            torch.set_num_threads(t)
            megabytes = 64 if args.quick else 512
            bandwidth = measure_bandwidth(5, megabytes)
            result["bandwidth"].append({"threads": t, "gb_per_s": bandwidth / 1e9,
                                        "megabytes": megabytes})
            if not args.no_kernels:
                result["kernels"] += kernel_rows(QUICK_KERNEL_SHAPE if args.quick
                                                 else KERNEL_SHAPE, repeats)
                token = (token_products_row("2L-64d", QUICK_CASES["2L-64d"], repeats, bandwidth)
                         if args.quick else
                         token_products_row("12L-768d", CASES["12L-768d"], repeats, bandwidth))
                if token is not None:
                    result["token_products"].append(token)
            for name, case in cases.items():
                print(f"[{t} thread(s)] {name} …", flush=True)
                result["rows"] += run_case(name, case, repeats, megabytes)
                args.out.write_text(json.dumps(result, indent=2))  # a long run keeps its rows
    finally:
        torch.set_num_threads(before)
    print_report(result)
    args.out.write_text(json.dumps(result, indent=2))
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
