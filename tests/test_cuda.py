"""On a CUDA GPU, every path a user can take there gives what it gives on the CPU.

The rest of the suite runs on the CPU; these tests repeat its key claims on a GPU — kernels,
the model, cached and speculative decoding, int8 weights, LoRA, the doctor, the training
engine (bf16 autocast, fp16 with its GradScaler, Muon, exact resume across a crash), the
commands (`train`, `generate`, `serve`) and the serving engine. They are skipped where no
GPU is visible (as on CI's machine) and run with `pytest tests/test_cuda.py` on one.

Tolerances: fp32 on the GPU against fp32 on the CPU, with TF32 off (torch's default for
matrix products), at rtol 1e-4 / atol 1e-5 — the two run different kernels that sum in
different orders; bf16 and fp16 are compared by what they must do (learn), not bit for bit.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from handformer.cli import main
from handformer.config import ModelConfig
from handformer.doctor import Status
from handformer.doctor import run as doctor_run
from handformer.generate import generate, generate_text
from handformer.generate.speculative import speculative_generate
from handformer.masks import causal_mask, combine_masks
from handformer.models.decoder_lm import DecoderLM
from handformer.models.quantize import quantize_int8
from handformer.nn.attention import attention
from handformer.nn.lora import LoRAConfig, apply_lora, merge_lora
from handformer.runs import load_run
from handformer.serve.engine import Engine
from handformer.serve.request import SamplingParams
from tests.cli.test_cli import train_tiny
from tests.serve.helpers import TOKENIZER, prompts, run_engine, tiny_lm
from tests.serve.test_engine import ARCHITECTURES  # every positional kind + Qwen3's block
from tests.train.helpers import TOKENIZER as TRAIN_TOKENIZER
from tests.train.helpers import make_trainer, pause_and_resume, train_config, weights

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="needs a CUDA GPU (torch.cuda.is_available() is False)")

CUDA = torch.device("cuda")
TRAIN_VOCAB = TRAIN_TOKENIZER.vocab_size  # ln of it: the loss of a uniform guess


@pytest.fixture(autouse=True)
def _fp32_is_fp32():
    """TF32 off for the test (a user may have turned it on): fp32 must round as fp32 for the
    GPU and the CPU to agree at fp32 tolerances."""
    before = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before


def _close(gpu: torch.Tensor, cpu: torch.Tensor) -> None:
    torch.testing.assert_close(gpu.cpu(), cpu, rtol=1e-4, atol=1e-5)


# --- kernels and the model -----------------------------------------------------------------

@pytest.mark.parametrize("kind", ["manual", "sdpa", "tiled"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attention_kernels_on_cuda_equal_the_cpu_reference(kind: str, dtype: torch.dtype) -> None:
    """Padding and causal masks, grouped-query heads and a row with nothing to attend to
    (zeros, never NaN): outputs and gradients against the manual kernel on the CPU in fp32."""
    b, h, hkv, t, d = 3, 4, 2, 12, 16
    q, k, v = (torch.randn(b, n, t, d) for n in (h, hkv, hkv))
    pad = torch.arange(t)[None] < torch.tensor([12, 7, 0])[:, None]  # (B, S); row 3 empty
    mask = combine_masks(pad, causal_mask(t, t))  # (B, 1, T, S)
    ref_in = [x.clone().requires_grad_() for x in (q, k, v)]
    ref, _ = attention(*ref_in, mask, kind="manual")
    ref.sum().backward()
    gpu_in = [x.to(CUDA, dtype).requires_grad_() for x in (q, k, v)]
    out, _ = attention(*gpu_in, mask.to(CUDA), kind=kind)
    out.float().sum().backward()
    assert out.dtype == dtype and out.device.type == "cuda"
    assert torch.isfinite(out).all() and (out[2] == 0).all()
    tol = dict(rtol=1e-4, atol=1e-5) if dtype == torch.float32 else dict(rtol=3e-2, atol=3e-2)
    torch.testing.assert_close(out.float().cpu(), ref.detach(), **tol)
    for got, want in zip(gpu_in, ref_in, strict=True):
        torch.testing.assert_close(got.grad.float().cpu(), want.grad, **tol)


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_decoder_on_cuda_gives_the_cpu_logits_and_gradients(arch: str) -> None:
    torch.manual_seed(0)
    model = DecoderLM(ModelConfig(vocab_size=41, d_model=64, n_heads=4, n_layers=2,
                                  max_len=32, dropout=0.0, **ARCHITECTURES[arch]))
    ids = torch.randint(0, 41, (2, 20))
    pad = torch.ones(2, 20, dtype=torch.bool)
    pad[1, :6] = False  # left padding
    cpu_logits = model(ids, pad)
    cpu_logits.square().mean().backward()
    cpu_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    model.to(CUDA)
    logits = model(ids.to(CUDA), pad.to(CUDA))
    logits.square().mean().backward()
    _close(logits.detach(), cpu_logits.detach())
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad.cpu(), cpu_grads[name], rtol=1e-3, atol=1e-5,
                                   msg=lambda m, name=name: f"{name}: {m}")


# --- decoding ------------------------------------------------------------------------------

@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_cached_greedy_decoding_on_cuda_equals_the_cpu(arch: str) -> None:
    """Greedy text past the window (the cache slides or refills), a batch with left padding,
    and the cache-free path: the same tokens on the GPU as on the CPU."""
    model = tiny_lm(**ARCHITECTURES[arch])  # window 24, weights scaled: clear-cut choices
    texts = ["the cat sat", "a", "on the mat and then"]
    cpu = generate_text(model, TOKENIZER, texts, 40, temperature=0)
    model.to(CUDA)
    assert generate_text(model, TOKENIZER, texts, 40, temperature=0) == cpu
    ids = torch.tensor([TOKENIZER.encode("hello world")], device=CUDA)
    cached = generate(model, ids, 30, temperature=0)
    assert torch.equal(cached, generate(model, ids, 30, temperature=0, use_cache=False))
    assert cached.device.type == "cuda"


def test_seeded_sampling_on_cuda_repeats_itself() -> None:
    """A seed makes sampling repeatable on the GPU too (its generator lives on the GPU)."""
    model = tiny_lm(positional="rope").to(CUDA)
    ids = torch.tensor([TOKENIZER.encode("the ")] * 3, device=CUDA)
    first = generate(model, ids, 25, temperature=0.9, top_p=0.9, top_k=10, seed=7)
    assert torch.equal(first, generate(model, ids, 25, temperature=0.9, top_p=0.9, top_k=10,
                                       seed=7))
    assert not torch.equal(first, generate(model, ids, 25, temperature=0.9, seed=8))


def test_speculative_greedy_on_cuda_equals_the_target_alone() -> None:
    target = tiny_lm(seed=1, positional="rope", n_layers=3).to(CUDA)
    draft = tiny_lm(seed=2, positional="rope", n_layers=1).to(CUDA)
    ids = torch.tensor([TOKENIZER.encode("abc de")], device=CUDA)
    alone = generate(target, ids, 40, temperature=0)
    for k in (1, 4, 8):
        assert torch.equal(speculative_generate(target, draft, ids, 40, speculate=k,
                                                temperature=0), alone)


def test_int8_weights_on_cuda_equal_int8_on_the_cpu() -> None:
    """int8 weights moved to the GPU: the same logits as int8 on the CPU (no CPU-only
    kernel is picked for a GPU tensor) and greedy text that follows."""
    model = quantize_int8(tiny_lm(positional="rope"))
    ids = torch.tensor([TOKENIZER.encode("hello there")])
    cpu = model(ids)
    text = generate_text(model, TOKENIZER, "hello", 30, temperature=0)
    model.to(CUDA)
    _close(model(ids.to(CUDA)), cpu)
    assert generate_text(model, TOKENIZER, "hello", 30, temperature=0) == text


def test_lora_on_cuda_trains_and_merges_to_the_same_model() -> None:
    torch.manual_seed(0)
    model = apply_lora(DecoderLM(ModelConfig(vocab_size=41, d_model=32, n_heads=4,
                                             n_layers=2, max_len=16, dropout=0.0)),
                       LoRAConfig(r=4, targets=("q", "v", "down"))).to(CUDA)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    ids = torch.randint(0, 41, (4, 16), device=CUDA)
    for _ in range(5):
        loss = torch.nn.functional.cross_entropy(model(ids[:, :-1]).flatten(0, 1),
                                                 ids[:, 1:].flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
    before = model(ids).detach()
    merged = merge_lora(model)
    assert all(p.device.type == "cuda" for p in merged.parameters())
    torch.testing.assert_close(merged(ids), before, rtol=1e-4, atol=1e-5)


def test_doctor_checks_a_model_on_cuda() -> None:
    """The debugging checklist on a model that lives on the GPU: every check passes (the
    fixed-length windows carry no padding, so that one check skips) and the model stays put."""
    from tests.doctor.test_doctor import LR, nan_safe_lm_loss, tiny_model, tiny_windows

    model = tiny_model(attention="sdpa", positional="rope", n_kv_heads=2).to(CUDA)
    report = doctor_run(model, tiny_windows(), loss_fn=nan_safe_lm_loss, lr=LR)
    odd = {c.name: f"{c.status.value}: {c.evidence}" for c in report.checks
           if c.status is not Status.PASS and c.name != "padding mask in the data"}
    assert odd == {}
    assert report.exit_code == 0
    assert all(p.device.type == "cuda" for p in model.parameters())


# --- the training engine -------------------------------------------------------------------

@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_training_on_cuda_learns(precision: str, optimizer: str) -> None:
    """fp32, bf16 autocast and fp16 with its GradScaler, under AdamW and Muon: the validation
    loss falls well below where it starts, and nothing leaves the GPU or turns non-finite."""
    cfg = train_config(device="cuda", precision=precision, optimizer=optimizer,
                       max_steps=60, eval_interval=20)
    trainer = make_trainer(cfg)
    result = trainer.fit()
    losses = [e["val_loss"] for e in result.evals]  # at steps 20, 40, 60
    assert losses[-1] < losses[0] and losses[-1] < 0.75 * math.log(TRAIN_VOCAB), losses
    assert result.nonfinite_steps == 0
    assert all(p.device.type == "cuda" for p in trainer.model.parameters())


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_pause_and_resume_on_cuda_equals_a_straight_run(tmp_path: Path, precision: str) -> None:
    """12 steps straight, or 5 + a fresh Trainer resumed from the checkpoint + 7: the same
    losses and weights bit for bit — dropout's GPU random state included."""
    cfg = train_config(device="cuda", max_steps=12, checkpoint_interval=5,
                       precision=precision, grad_accum_steps=2)
    straight, losses, second, resumed = pause_and_resume(cfg, tmp_path / "ck", pause_at=5)
    assert resumed == losses
    for k, v in weights(straight.model).items():
        assert torch.equal(v, weights(second.model)[k]), k


# --- the commands, as a user runs them -----------------------------------------------------

@pytest.fixture(scope="module")
def cuda_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return train_tiny(tmp_path_factory.mktemp("cuda"), "--max-steps", "60", "--device", "cuda",
                      "--precision", "auto")


def test_train_on_cuda_writes_a_run_that_loads_anywhere(cuda_run: Path) -> None:
    summary = json.loads((cuda_run / "summary.json").read_text())
    assert summary["final_val_loss"] < summary["unigram_val_loss"], summary
    assert summary["precision"] == "bf16", summary  # auto, on a GPU that has bfloat16
    assert "GPU" in summary["precision_why"], summary
    cpu = load_run(cuda_run, device="cpu", kind="lm")
    gpu = load_run(cuda_run, device="cuda", kind="lm")
    assert next(gpu.model.parameters()).device.type == "cuda"
    ids = torch.tensor([cpu.tokenizer.encode("the cat ")])
    _close(gpu.model(ids.to(CUDA)), cpu.model(ids))


def test_generate_command_on_cuda_prints_the_cpu_text(cuda_run: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    def run(*extra: str) -> str:
        capsys.readouterr()
        code = main(["generate", "--run", str(cuda_run), "--prompt", "the ",
                     "--max-new-tokens", "40", "--temperature", "0", *extra])
        captured = capsys.readouterr()
        assert code == 0, captured.err
        return captured.out

    assert run("--device", "cuda") == run("--device", "cpu")
    assert run("--device", "cuda", "--dtype", "bfloat16").startswith("the ")
    assert run("--device", "cuda", "--quantize", "int8").startswith("the ")


def test_resume_command_on_cuda(cuda_run: Path, tmp_path: Path) -> None:
    import shutil

    run = tmp_path / "run"
    shutil.copytree(cuda_run, run)
    assert main(["train", "--resume", str(run), "--max-steps", "80", "--no-progress"]) == 0
    summary = json.loads((run / "summary.json").read_text())
    assert (summary["steps"], summary["resumed_from_step"]) == (80, 60), summary
    assert summary["precision"] == "bf16", summary


# --- serving -------------------------------------------------------------------------------

@pytest.mark.filterwarnings("ignore::handformer.data.classification.DataWarning")
@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_serving_engine_on_cuda_answers_each_request_as_generate_alone(arch: str) -> None:
    """The paged cache on the GPU, a pool small enough to force preemption, windows that
    slide: every greedy text equals `generate_text` on that prompt alone."""
    model = tiny_lm(**ARCHITECTURES[arch]).to(CUDA)
    engine = Engine(model, TOKENIZER, num_blocks=14, block_size=4, max_batch=8,
                    prefill_chunk=5, step_tokens=8)
    assert engine.pool.kv.device.type == "cuda"
    work = prompts(14, seed=1)
    jobs = [(TOKENIZER.encode(p), SamplingParams(max_tokens=n, temperature=0.0))
            for p, n in work]
    texts = run_engine(engine, jobs)
    assert engine.scheduler.preemptions > 0
    assert texts == [generate_text(model, TOKENIZER, p, n, temperature=0)[0] for p, n in work]
    assert engine.blocks.free == engine.blocks.num_blocks


def test_serve_command_on_cuda_answers_over_http(cuda_run: Path) -> None:
    pytest.importorskip("fastapi")
    pytest.importorskip("uvicorn")
    httpx = pytest.importorskip("httpx")
    from tests.serve.server import running_server

    with running_server(cuda_run, "--device", "cuda", timeout=120) as (server, base):
        body = {"model": "run", "prompt": ["the ", "a "], "max_tokens": 30, "temperature": 0}
        reply = httpx.post(base + "/v1/completions", json=body, timeout=60).json()
        texts = [c["text"] for c in sorted(reply["choices"], key=lambda c: c["index"])]
        local = load_run(cuda_run, device="cuda", kind="lm")
        assert texts == [generate_text(local.model, local.tokenizer, p, 30, temperature=0)[0]
                         for p in ("the ", "a ")]
        server.terminate()
        err = server.communicate(timeout=60)[1]
        assert server.returncode == 0, err
        assert "Traceback" not in err, err


# --- the GPU benchmark ---------------------------------------------------------------------

def test_cuda_benchmark_runs_and_reports_shares_of_its_ceilings(tmp_path: Path) -> None:
    from handformer.bench.cuda_speed import main as bench

    out = tmp_path / "cuda.json"
    assert bench(["--quick", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["ceilings"]["copy_bytes_per_s"] > 0
    assert {r["contender"] for r in result["training"]} >= {"handformer sdpa",
                                                           "handformer manual"}
    assert all(0 < r["mfu_bf16"] < 1 for r in result["training"])
    assert all(0 < r["share_of_floor"] < 1 for r in result["decoding"])
    assert result["train_command"]["steps"] == 20, result["train_command"]
