"""ONNX export run by onnxruntime: logits equal handformer's for every positional kind, with
dynamic batch and sequence axes; the cached graph decodes token by token to
``handformer generate``'s greedy text; bad input gets a clear error."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from handformer.cli import main
from handformer.generate import generate
from handformer.interop.gpt2 import ConversionError
from handformer.interop.onnx_decode import OnnxLM
from handformer.interop.onnx_export import export_onnx
from handformer.models.decoder_lm import DecoderLM
from handformer.runs import save_run
from handformer.tokenizers import CharTokenizer
from tests.conftest import tiny_config

ort = pytest.importorskip("onnxruntime", reason="the 'onnx' test extra is not installed "
                          "(pip install -r requirements-dev.txt)")
pytest.importorskip("onnxscript", reason="the 'onnx' test extra is not installed "
                    "(pip install -r requirements-dev.txt)")

TOLERANCE = 1e-5  # float32 logits, onnxruntime vs handformer
TEXT = "".join(f"def f{i}(x):\n\treturn x * {i % 7}  # é\n" for i in range(300))


def _trained_run(folder: Path, steps: int = 40, **overrides) -> tuple[DecoderLM, CharTokenizer]:
    """A tiny model trained here for a few dozen steps (a second), saved as a run."""
    tok = CharTokenizer.from_text(TEXT)
    model = DecoderLM(tiny_config(vocab_size=tok.vocab_size, **overrides))
    data = torch.tensor(tok.encode(TEXT))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    generator = torch.Generator().manual_seed(0)
    t = model.config.max_len
    for _ in range(steps):
        starts = torch.randint(0, len(data) - t - 1, (8,), generator=generator)
        x = torch.stack([data[s : s + t] for s in starts])  # (B, T)
        y = torch.stack([data[s + 1 : s + t + 1] for s in starts])  # (B, T)
        loss = torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.eval()
    save_run(folder, model, tok)
    return model, tok


def _session(path: Path) -> ort.InferenceSession:
    return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])


CASES = {  # every positional kind, and the head layouts and norms around them
    "learned": dict(positional="learned"),
    "sinusoidal": dict(positional="sinusoidal", norm="post"),
    "rope-gqa": dict(positional="rope", n_kv_heads=2),
    "alibi-mqa": dict(positional="alibi", n_kv_heads=1, attention="manual"),
    "rope-tiled": dict(positional="rope", attention="tiled"),
    # The Hugging Face families' twins (interop.families), head_dim set apart as Qwen3 does.
    "llama": dict(positional="rope", norm_type="rmsnorm", activation="swiglu", bias=False,
                  n_kv_heads=2, rope_scaling="llama3", rope_factor=8.0,
                  rope_original_max_len=8),
    "qwen3": dict(positional="rope", norm_type="rmsnorm", activation="swiglu", bias=False,
                  n_kv_heads=2, qk_norm=True, head_dim=16, layer_norm_eps=1e-6),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_onnx_logits_equal_handformer_s_with_dynamic_batch_and_sequence(
        tmp_path: Path, case: str) -> None:
    model, _ = _trained_run(tmp_path / "run", **CASES[case])
    path = export_onnx(tmp_path / "run", tmp_path / "lm.onnx")
    session = _session(path)
    generator = torch.Generator().manual_seed(1)
    for b, t in [(1, 1), (3, 5), (2, model.config.max_len)]:  # none of them the traced (2, 3)
        ids = torch.randint(0, model.config.vocab_size, (b, t), generator=generator)
        (logits,) = session.run(["logits"], {"input_ids": ids.numpy()})
        with torch.no_grad():
            expected = model(ids).numpy()
        assert logits.shape == expected.shape
        assert np.abs(logits - expected).max() <= TOLERANCE, (case, b, t)


@pytest.mark.parametrize("case", ["learned", "qwen3",
                                  pytest.param("rope-gqa", marks=pytest.mark.slow),
                                  pytest.param("alibi-mqa", marks=pytest.mark.slow)])
def test_cached_onnx_decoding_equals_handformer_generate(tmp_path: Path, case: str) -> None:
    """Greedy, token by token through past → present, past the window (the slide and
    refill) — the same ids as ``generate``, and the same logits per step as the plain
    graph."""
    model, tok = _trained_run(tmp_path / "run", **CASES[case])
    cached = OnnxLM(export_onnx(tmp_path / "run", tmp_path / "c.onnx", with_cache=True))
    plain = OnnxLM(export_onnx(tmp_path / "run", tmp_path / "p.onnx"))
    assert cached.with_cache and not plain.with_cache
    prompts = torch.tensor([tok.encode("def f1"), tok.encode("return")])  # (2, 6)
    new = 2 * model.config.max_len + 3  # slides the 16-token window several times
    expected = generate(model, prompts, new, temperature=0).numpy()
    np.testing.assert_array_equal(cached.greedy(prompts.numpy(), new), expected)
    np.testing.assert_array_equal(plain.greedy(prompts.numpy(), new), expected)
    assert len(set(expected[0, 6:].tolist())) > 3  # varied text: the comparison means something
    past = np.zeros((2, 2, 2 * model.config.n_kv_heads, 0, model.config.head_dim), np.float32)
    ids = prompts.numpy()
    logits, present = cached.session.run(["logits", "present"], {"input_ids": ids, "past": past})
    assert present.shape[3] == 6
    step, _ = cached.session.run(["logits", "present"],
                                 {"input_ids": ids[:, -1:], "past": present[:, :, :, :5]})
    np.testing.assert_allclose(step[:, -1], logits[:, -1], rtol=0, atol=TOLERANCE)


def test_convert_to_onnx_decodes_what_handformer_generate_prints(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _trained_run(tmp_path / "run", steps=60)
    out = tmp_path / "lm-cached.onnx"
    assert main(["convert", "--to", "onnx", "--with-cache", str(tmp_path / "run"),
                 str(out)]) == 0
    capsys.readouterr()
    assert main(["generate", "--run", str(tmp_path / "run"), "--prompt", "def f",
                 "--temperature", "0", "--max-new-tokens", "40"]) == 0
    printed = capsys.readouterr().out
    assert printed == "def f" + OnnxLM(out).generate_text("def f", 40) + "\n"
    # Written by this command: replaced without --overwrite.
    assert main(["convert", "--to", "onnx", str(tmp_path / "run"), str(out)]) == 0
    assert not OnnxLM(out).with_cache


def test_bad_input_gets_a_clear_error(tmp_path: Path,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    def refused(argv: list[str], code: int, needle: str) -> None:
        assert main(["convert", *argv]) == code
        err = capsys.readouterr().err
        assert needle in err and len(err.strip().splitlines()) == 1, err

    _trained_run(tmp_path / "run", steps=1)
    run = str(tmp_path / "run")
    (tmp_path / "notes").mkdir()
    refused(["--to", "onnx", str(tmp_path / "notes"), str(tmp_path / "a.onnx")], 1, "notes")
    refused(["--to", "onnx", run, str(tmp_path / "a.txt")], 2, "must end in .onnx")
    refused(["--to", "hf", "--with-cache", run, str(tmp_path / "hf")], 2, "--with-cache")
    theirs = tmp_path / "theirs.onnx"
    theirs.write_bytes(b"someone else's model")
    refused(["--to", "onnx", run, str(theirs)], 1, "handformer did not write it")
    assert theirs.read_bytes() == b"someone else's model"
    import onnx
    from onnx import TensorProto, helper

    io = [helper.make_tensor_value_info(n, TensorProto.FLOAT, [1]) for n in ("x", "y")]
    graph = helper.make_graph([helper.make_node("Identity", ["x"], ["y"])], "g", io[:1], io[1:])
    onnx.save(helper.make_model(graph), str(tmp_path / "other.onnx"))  # another tool's model
    with pytest.raises(ConversionError, match="not written by `handformer convert --to onnx`"):
        OnnxLM(tmp_path / "other.onnx")
    refused(["--to", "onnx", run, str(tmp_path / "other.onnx")], 1, "handformer did not write")


def test_a_missing_onnx_extra_says_how_to_install(monkeypatch: pytest.MonkeyPatch,
                                                  tmp_path: Path) -> None:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "onnxscript" else real(name, *a))
    with pytest.raises(ImportError, match=r"pip install 'handformer\[onnx\]'"):
        export_onnx(tmp_path / "run", tmp_path / "x.onnx")


def test_a_traced_forward_has_no_host_read_but_eager_calls_keep_their_checks() -> None:
    """The id-range and learned-position checks read values back to the host: skipped while
    torch traces the model (so it exports), kept in every eager call."""
    model = DecoderLM(tiny_config(positional="learned")).eval()
    torch.export.export(model, (torch.zeros(2, 5, dtype=torch.long),))  # raised before
    with pytest.raises(ValueError, match=r"token ids must lie in \[0, 37\)"):
        model(torch.tensor([[0, 37]]))
    with pytest.raises(ValueError, match=r"learned positions cover 0\.\.15"):
        model(torch.zeros(1, 17, dtype=torch.long))
