"""Classification: the built-in brackets task, labelled files, batches, metrics, a short
run that must learn, the run folder, and the bad-input contract of ``handformer classify``."""

from __future__ import annotations

import csv
import json
import random
import warnings
from collections import Counter
from pathlib import Path

import pytest
import torch

from handformer.cli import main
from handformer.data.classification import (
    ClassificationBatches,
    DatasetError,
    DataWarning,
    LabelVocab,
    collate_classification,
    encode_texts,
    read_examples,
)
from handformer.data.tasks import (
    BRACKETS_CHANCE,
    balanced_brackets,
    brackets_examples,
    is_balanced,
    unbalanced_brackets,
)
from handformer.jobs.classify import (
    ClassifyData,
    builtin_brackets_data,
    confusion_matrix,
    load_classifier_run,
    predict_texts,
    scores_from_confusion,
    train_classifier,
)
from handformer.tokenizers import CharTokenizer


def write_csv(path: Path, rows: list[dict[str, str]], columns: list[str]) -> Path:
    with path.open("w", encoding="utf-8", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=columns)
        writer.writeheader()
        writer.writerows(rows)
    return path


def write_jsonl(path: Path, rows: list[object]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


# -- the built-in task ------------------------------------------------------------------
def reduces_to_empty(text: str) -> bool:
    """An independent balance check: repeatedly delete '()' pairs."""
    while "()" in text:
        text = text.replace("()", "")
    return text == ""


def test_brackets_labels_are_right_and_shortcuts_carry_no_signal() -> None:
    texts, labels = brackets_examples(2000, min_len=6, max_len=40, seed=3)
    assert Counter(labels) == {"balanced": 1000, "unbalanced": 1000}  # chance = 50 %
    for text, label in zip(texts, labels, strict=True):
        assert reduces_to_empty(text) == (label == "balanced") == is_balanced(text)
        # Order-blind features are identical across classes: equal counts, '(' first,
        # ')' last — so only the order tells the classes apart.
        assert text.count("(") == text.count(")")
        assert text[0] == "(" and text[-1] == ")"
        assert len(text) % 2 == 0 and 6 <= len(text) <= 40
    by_class = {y: Counter(len(t) for t, lab in zip(texts, labels, strict=True) if lab == y)
                for y in ("balanced", "unbalanced")}
    mean_len = {y: sum(n * c for n, c in cnt.items()) / sum(cnt.values())
                for y, cnt in by_class.items()}
    assert abs(mean_len["balanced"] - mean_len["unbalanced"]) < 1.5
    assert BRACKETS_CHANCE == 0.5


def test_balanced_strings_are_uniform() -> None:
    """Cycle-lemma sampling: the 5 balanced strings of 3 pairs appear equally often."""
    rng = random.Random(0)
    counts = Counter(balanced_brackets(3, rng) for _ in range(5000))
    assert set(counts) == {"((()))", "(()())", "(())()", "()(())", "()()()"}
    assert all(abs(c / 5000 - 0.2) < 0.03 for c in counts.values()), counts
    assert not is_balanced(unbalanced_brackets(3, rng))
    with pytest.raises(ValueError, match="pairs >= 3"):
        unbalanced_brackets(2, rng)


def test_builtin_validation_strings_never_appear_in_training() -> None:
    data = builtin_brackets_data(seq_len=12, n_train=800, n_val=100)
    assert not set(data.val_texts) & set(data.train_texts)
    assert data.chance == 0.5 and "lengths 6..12" in data.source


# -- reading files ----------------------------------------------------------------------
def test_read_csv_tsv_and_jsonl(tmp_path: Path) -> None:
    rows = [{"review": "good, really", "stars": "pos"}, {"review": "bad", "stars": "neg"}]
    texts, labels = read_examples(write_csv(tmp_path / "a.csv", rows, ["review", "stars"]),
                                  text_col="review", label_col="stars")
    assert texts == ["good, really", "bad"] and labels == ["pos", "neg"]
    (tmp_path / "a.tsv").write_text("text\tlabel\nhello there\tx\nbye\ty\n", encoding="utf-8")
    assert read_examples(tmp_path / "a.tsv") == (["hello there", "bye"], ["x", "y"])
    path = write_jsonl(tmp_path / "a.jsonl", [{"text": "t1", "label": 1}, {"text": "t2",
                                                                            "label": 0}])
    assert read_examples(path) == (["t1", "t2"], ["1", "0"])
    assert read_examples(path, label_col=None) == (["t1", "t2"], None)


def test_missing_label_column_names_the_columns_it_found(tmp_path: Path) -> None:
    path = write_csv(tmp_path / "d.csv", [{"text": "a", "sentiment": "pos"}],
                     ["text", "sentiment"])
    with pytest.raises(DatasetError, match=r"column\(s\) \['label'\] not found; the file has "
                                           r"columns \['text', 'sentiment'\]"):
        read_examples(path)


def test_empty_rows_are_skipped_with_a_counted_warning(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "d.jsonl", [{"text": "a", "label": "x"},
                                              {"text": "  ", "label": "y"},
                                              {"text": "b", "label": ""},
                                              {"text": "c", "label": "y"}])
    with open(path, "a", encoding="utf-8") as fh:
        fh.write("\n")  # a blank line: line 5
    with pytest.warns(DataWarning, match=r"skipped 3 row\(s\) with an empty text or label "
                                         r"\(line 2, 3, 5\)"):
        texts, labels = read_examples(path)
    assert texts == ["a", "c"] and labels == ["x", "y"]


@pytest.mark.parametrize(
    ("name", "content", "message"),
    [
        ("d.jsonl", '{"text": "a", "label": "x"}\n{"text": oops}\n',
         "line 2: not valid JSON"),
        ("d.jsonl", '["a", "x"]\n', "line 1: expected a JSON object"),
        ("d.txt", "text,label\n", "unsupported file type '.txt'"),
        ("d.csv", "text,label\n", "holds no data rows"),
        ("d.csv", "text,label\n,x\n", "no usable rows"),
    ],
)
def test_malformed_files_are_clear_errors(tmp_path: Path, name: str, content: str,
                                          message: str) -> None:
    (tmp_path / name).write_text(content, encoding="utf-8")
    with pytest.raises(DatasetError, match=message), warnings.catch_warnings():
        warnings.simplefilter("ignore", DataWarning)
        read_examples(tmp_path / name)
    with pytest.raises(DatasetError, match="data file not found"):
        read_examples(tmp_path / "missing.csv")


# -- labels, encoding, batches ----------------------------------------------------------
def test_label_vocab_is_sorted_and_strict(tmp_path: Path) -> None:
    vocab = LabelVocab.from_labels(["pos", "neg", "pos", "neutral"])
    assert vocab.labels == ["neg", "neutral", "pos"]
    assert vocab.encode(["pos", "neg"]) == [2, 0] and vocab.decode([1]) == ["neutral"]
    vocab.save(tmp_path / "labels.json")
    assert LabelVocab.load(tmp_path / "labels.json") == vocab
    with pytest.raises(DatasetError, match=r"label\(s\) \['angry'\] that this model was not "
                                           r"trained on; it knows \['neg', 'neutral', 'pos'\]"):
        vocab.encode(["pos", "angry"], source="predict.csv")
    with pytest.raises(DatasetError, match=r"one class only \(\['pos'\] in all 3 rows\)"):
        LabelVocab.from_labels(["pos", "pos", "pos"])


def test_truncation_is_counted_in_one_warning() -> None:
    tok = CharTokenizer.from_text("abc")
    with pytest.warns(DataWarning, match="2 of 3 texts are longer than max_len=4 tokens .* "
                                         "the longest has 7 tokens"):
        ids = encode_texts(["ab", "abcabc", "abcd"], tok, 4)
    assert [len(x) for x in ids] == [3, 4, 4] and all(x[0] == tok.bos_id for x in ids)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing truncated: no warning at all
        encode_texts(["ab"], tok, 4)


def test_collate_pads_to_the_longest_in_the_batch() -> None:
    batch = collate_classification([[5, 6, 7], [8]], [1, 0], pad_id=0)
    assert batch.ids.tolist() == [[5, 6, 7], [8, 0, 0]]
    assert batch.padding_mask.tolist() == [[True, True, True], [True, False, False]]
    assert batch.targets.tolist() == [1, 0] and batch.num_tokens == 2
    with pytest.raises(ValueError, match=r"sequences \[1\] are empty"):
        collate_classification([[5], []], [0, 1])


def test_batches_cover_each_example_once_per_epoch_and_bucketing_cuts_padding() -> None:
    rng = random.Random(0)
    seqs = [[4] * rng.randint(2, 60) for _ in range(256)]
    labels = list(range(256))  # the label identifies the example
    gen = torch.Generator().manual_seed(0)
    plain = ClassificationBatches(seqs, labels, 16, bucket=False)
    bucketed = ClassificationBatches(seqs, labels, 16, bucket=True)
    for sampler in (plain, bucketed):
        seen = [y for _ in range(16) for y in sampler(gen).targets.tolist()]
        assert sorted(seen) == labels
    epoch_plain = [plain(gen) for _ in range(16)]
    epoch_bucketed = [bucketed(gen) for _ in range(16)]
    assert bucketed.padding_fraction(epoch_bucketed) < 0.1
    assert plain.padding_fraction(epoch_plain) > 0.3
    first, again = bucketed.fixed_batches(), bucketed.fixed_batches()
    assert all(torch.equal(a.ids, b.ids) for a, b in zip(first, again, strict=True))


# -- metrics ----------------------------------------------------------------------------
def test_confusion_matrix_and_macro_f1_against_a_direct_count() -> None:
    gen = torch.Generator().manual_seed(1)
    y_true = torch.randint(0, 4, (300,), generator=gen)
    y_pred = torch.where(torch.rand(300, generator=gen) < 0.6, y_true,
                         torch.randint(0, 4, (300,), generator=gen))
    cm = confusion_matrix(y_true, y_pred, 4)
    for i in range(4):
        for j in range(4):
            assert cm[i, j] == int(((y_true == i) & (y_pred == j)).sum())
    f1s = []
    for k in range(4):
        tp = int(((y_pred == k) & (y_true == k)).sum())
        precision = tp / int((y_pred == k).sum())
        recall = tp / int((y_true == k).sum())
        f1s.append(2 * precision * recall / (precision + recall))
    scores = scores_from_confusion(cm)
    assert scores["macro_f1"] == pytest.approx(sum(f1s) / 4)
    assert scores["accuracy"] == pytest.approx(float((y_true == y_pred).float().mean()))


def test_macro_f1_punishes_ignoring_a_rare_class() -> None:
    y_true = torch.tensor([0] * 95 + [1] * 5)
    always_zero = torch.zeros(100, dtype=torch.long)
    scores = scores_from_confusion(confusion_matrix(y_true, always_zero, 2))
    assert scores["accuracy"] == pytest.approx(0.95)
    assert scores["macro_f1"] == pytest.approx((2 * 0.95 / 1.95 + 0.0) / 2)


# -- learning and the run folder --------------------------------------------------------
@pytest.fixture(scope="module")
def brackets_run(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """One short run on the built-in task, shared by the tests below (~15 s)."""
    out = tmp_path_factory.mktemp("classify") / "run"
    data = builtin_brackets_data(seq_len=24, n_train=6000, n_val=400)
    run = train_classifier(data, out_dir=out, max_len=25,
                           train_overrides=dict(max_steps=350, eval_interval=175,
                                                device="cpu"),
                           progress=False)
    return {"run": run, "out": out, "data": data}


@pytest.mark.slow
def test_classifier_learns_the_builtin_task_well_above_chance(brackets_run: dict) -> None:
    """Chance is 50 % and every order-blind shortcut scores 50 %; a 2-layer encoder must
    reach 90 % on unseen strings (lengths 12..24) within 350 steps (it reaches ~96 %)."""
    run = brackets_run["run"]
    assert run.history[0]["val_accuracy"] < run.history[-1]["val_accuracy"]
    assert run.summary["val_accuracy"] >= 0.90, run.summary
    assert run.summary["val_macro_f1"] >= 0.90
    assert run.summary["chance"] == 0.5 and run.summary["majority_baseline"] == 0.5


@pytest.mark.slow
def test_run_folder_rebuilds_the_same_classifier(brackets_run: dict) -> None:
    out: Path = brackets_run["out"]
    names = {p.name for p in out.iterdir()}
    assert names >= {"model.safetensors", "config.json", "tokenizer.json", "labels.json",
                     "metrics.jsonl", "summary.json", "confusion.png"}
    evals = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()
             if json.loads(line)["kind"] == "eval"]
    assert [e["step"] for e in evals] == [175, 350] and "val_accuracy" in evals[0]
    loaded = load_classifier_run(out)
    data: ClassifyData = brackets_run["data"]
    texts = data.val_texts[:64]
    ids = encode_texts(texts, loaded.tokenizer, loaded.max_len)
    batch = ClassificationBatches(ids, None, 64, bucket=False).fixed_batches()[0]
    run = brackets_run["run"]
    torch.testing.assert_close(loaded.model(batch.ids, batch.padding_mask),
                               run.model.eval()(batch.ids, batch.padding_mask))
    predictions = predict_texts(loaded, texts)
    assert {p.label for p in predictions} <= {"balanced", "unbalanced"}
    assert all(0.5 <= p.confidence <= 1.0 for p in predictions)


@pytest.mark.slow
def test_cli_predict_text_and_file_and_unknown_label(brackets_run: dict, tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    out = str(brackets_run["out"])
    assert main(["classify", "predict", "--run", out, "--text", "(()())", "--text",
                 "())(()"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert [line.split("\t")[2] for line in lines] == ["(()())", "())(()"]
    data = brackets_run["data"]
    rows = [{"text": t, "label": y} for t, y in zip(data.val_texts[:40], data.val_labels[:40],
                                                     strict=True)]
    scored = write_csv(tmp_path / "val.csv", rows, ["text", "label"])
    assert main(["classify", "predict", "--run", out, "--data", str(scored),
                 "--label-col", "label", "--confusion", str(tmp_path / "cm.png")]) == 0
    assert "accuracy:" in capsys.readouterr().out
    assert (tmp_path / "cm.png").stat().st_size > 1000
    bad = write_csv(tmp_path / "bad.csv", [*rows[:3], {"text": "(())", "label": "maybe"}],
                    ["text", "label"])
    assert main(["classify", "predict", "--run", out, "--data", str(bad),
                 "--label-col", "label"]) == 1
    err = capsys.readouterr().err
    assert "label(s) ['maybe'] that this model was not trained on" in err
    assert "it knows ['balanced', 'unbalanced']" in err


# -- the command line on user files -----------------------------------------------------
def sentiment_rows(n: int, seed: int = 0) -> list[dict[str, str]]:
    rng = random.Random(seed)
    words = {"pos": ["good", "great", "fine"], "neg": ["bad", "awful", "poor"]}
    rows = []
    for _ in range(n):
        label = rng.choice(["pos", "neg"])
        rows.append({"body": " ".join(rng.choice(words[label]) for _ in range(rng.randint(1, 6))),
                     "y": label})
    return rows


def test_cli_train_on_a_csv_with_named_columns(tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    train = write_csv(tmp_path / "train.csv", sentiment_rows(200), ["body", "y"])
    val = write_csv(tmp_path / "val.csv", sentiment_rows(40, seed=1), ["body", "y"])
    out = tmp_path / "run"
    code = main(["classify", "train", "--data", str(train), "--val", str(val),
                 "--text-col", "body", "--label-col", "y", "--out", str(out), "--max-len", "12",
                 "--max-steps", "4", "--device", "cpu", "--no-progress", "--pooling", "mean"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert "validation accuracy" in captured.out and "confusion matrix" in captured.out
    assert "texts are longer than max_len=12 tokens" in captured.err  # truncation, counted
    assert (out / "confusion.png").stat().st_size > 1000
    config = json.loads((out / "config.json").read_text())
    assert config["classifier"]["pooling"] == "mean"
    assert json.loads((out / "labels.json").read_text()) == {"labels": ["neg", "pos"]}


@pytest.mark.parametrize(
    ("rows", "columns", "extra", "message", "exit_code"),
    [  # a bad file is refused at run time (1); contradictory options are a usage error (2)
        ([{"text": "a", "y": "x"}] * 5, ["text", "y"], [],
         r"column\(s\) \['label'\] not found; the file has columns \['text', 'y'\]", 1),
        ([{"text": "a", "label": "x"}] * 5, ["text", "label"], [],
         r"one class only \(\['x'\] in all 5 rows\)", 1),
        ([{"text": "a", "label": "x"}, {"text": "b", "label": "y"}] * 3, ["text", "label"],
         ["--seq-len", "10"], "--seq-len sets the built-in task's length", 2),
    ],
)
def test_cli_train_bad_input_is_a_clear_error(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                             rows: list, columns: list, extra: list,
                                             message: str, exit_code: int) -> None:
    data = write_csv(tmp_path / "d.csv", rows, columns)
    code = main(["classify", "train", "--data", str(data), "--out", str(tmp_path / "r"),
                 "--max-steps", "2", "--device", "cpu", "--no-progress", *extra])
    assert code == exit_code
    err = capsys.readouterr().err
    assert err.startswith("handformer classify train: error: ")
    assert len(err.splitlines()) == 1 and "Traceback" not in err
    assert __import__("re").search(message, err), err
    assert not (tmp_path / "r" / "model.safetensors").exists()


def test_cli_train_warns_about_empty_rows(tmp_path: Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    rows = sentiment_rows(30)
    rows[3]["body"] = ""
    data = write_csv(tmp_path / "d.csv", rows, ["body", "y"])
    code = main(["classify", "train", "--data", str(data), "--text-col", "body", "--label-col",
                 "y", "--out", str(tmp_path / "r"), "--max-steps", "2", "--device", "cpu",
                 "--no-progress"])
    assert code == 0
    assert ("handformer classify train: warning: " in (err := capsys.readouterr().err)
            and "skipped 1 row(s) with an empty text or label (line 5)" in err)


def test_cli_predict_needs_a_complete_run_folder(tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "half").mkdir()
    (tmp_path / "half" / "config.json").write_text("{}")
    assert main(["classify", "predict", "--run", str(tmp_path / "half"), "--text", "x"]) == 1
    assert "not a complete run folder: missing ['model.safetensors'" in capsys.readouterr().err
