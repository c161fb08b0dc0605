"""benchmarks/time_to_loss.py (through ``handformer bench``) runs end to end in --quick mode
and writes what it promises: both recipes' validation curves on the same windows, the
training clock, the target and the ratio when both reach it. No timing is asserted."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from handformer.bench.time_to_loss import Recipe, race
from handformer.bench.time_to_loss import main as time_to_loss_main
from handformer.cli import main
from handformer.jobs.lm import build_configs
from handformer.models.decoder_lm import DecoderLM


def test_bench_quick_time_to_loss(tmp_path: Path) -> None:
    assert main(["bench", "--quick", "--only", "time_to_loss", "--out-dir", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "time_to_loss.json").read_text())
    assert data["quick"] and data["target"] > 0 and data["threads"] >= 1
    assert data["machine"]["cpu"] and data["machine"]["threads"] == data["threads"]
    ref, fast = data["rows"]
    assert (ref["preset"], fast["preset"]) == ("shakespeare-char", "shakespeare-fast")
    for row in (ref, fast):
        steps = [p["step"] for p in row["curve"]]
        assert steps[0] == 0 and steps == sorted(steps)
        clock = [p["train_seconds"] for p in row["curve"]]
        assert clock == sorted(clock)
        # The quick target is reached (with room to spare): the first evaluation at or below
        # it is reported, and the recipe stops training there.
        assert row["curve"][0]["val_loss"] > data["target"]
        first = next(p for p in row["curve"] if p["val_loss"] <= data["target"])
        assert row["reached"] == first and row["steps_run"] == first["step"] > 0
        assert row["paired_seconds_to_target"] > 0
        # Its share of the floor: model FLOP/s over the matmul FLOP/s measured in its dtype.
        peak = data["peaks_flops"][row["peak_dtype"]]
        assert row["share_of_peak"] == pytest.approx(row["achieved_flops"] / peak)
        assert row["achieved_flops"] == pytest.approx(
            row["model_flops_per_token"] * row["tokens_per_step"] / row["median_step_ms"] * 1e3)
    assert data["ratio"] == pytest.approx(fast["reached"]["train_seconds"]
                                          / ref["reached"]["train_seconds"])
    assert (tmp_path / "bench.png").stat().st_size > 1000


def test_a_target_out_of_reach_is_reported_as_not_reached(tmp_path: Path,
                                                         capsys: pytest.CaptureFixture[str]
                                                         ) -> None:
    out = tmp_path / "time_to_loss.json"
    assert time_to_loss_main(["--quick", "--target", "0.5", "--out", str(out)]) == 0
    assert "did not reach 0.5: no ratio" in capsys.readouterr().out
    data = json.loads(out.read_text())
    assert data["ratio"] is None and data["paired_ratio"] is None
    for row in data["rows"]:  # trained to the end of the budget, never reached
        assert row["reached"] is None and row["paired_seconds_to_target"] is None
        assert row["steps_run"] == row["train"]["max_steps"] == row["curve"][-1]["step"]
        assert row["best_val_loss"] > 0.5


def test_race_stops_each_recipe_at_the_target() -> None:
    text = "to be or not to be, that is the question. " * 200
    tiny = dict(d_model=16, n_heads=2, n_layers=1)
    recipes = [Recipe("a", "shakespeare-char", tiny, dict(max_steps=40, batch_size=4)),
               Recipe("b", "shakespeare-char", tiny, dict(max_steps=40, batch_size=4,
                                                          lr=3e-3, warmup_steps=0))]
    rows = race(text, recipes, target=10.0, eval_every=10, eval_windows=8, eval_block=16,
                verbose=False)
    for row in rows:  # a target above the initial loss is reached at the first evaluation
        assert row["reached"]["step"] == 10 and row["steps_run"] == 10


@pytest.mark.parametrize("preset", ["shakespeare-fast", "speedrun"])
def test_fast_preset_fits_the_budget(preset: str) -> None:
    """The issue's rule for the fast recipe: at most 1 M parameters (tinyshakespeare has 65
    characters)."""
    model_cfg, train_cfg = build_configs(preset, 65)
    assert DecoderLM(model_cfg).num_parameters() <= 1_000_000
    assert train_cfg.block_size <= model_cfg.max_len


def test_eval_from_skips_early_evaluations_and_flags_a_target_met_at_the_first() -> None:
    text = "to be or not to be, that is the question. " * 200
    tiny = dict(d_model=16, n_heads=2, n_layers=1)
    recipes = [Recipe("a", "shakespeare-char", tiny, dict(max_steps=40, batch_size=4),
                      eval_from=20),
               Recipe("b", "shakespeare-char", tiny, dict(max_steps=40, batch_size=4))]
    late, plain = race(text, recipes, target=10.0, eval_every=10, eval_windows=8,
                       eval_block=16, verbose=False)
    assert [p["step"] for p in late["curve"]] == [0, 20]
    assert late["reached"]["step"] == 20 and late["reached_at_first_eval"]
    assert plain["reached"]["step"] == 10 and not plain["reached_at_first_eval"]


def test_ablation_ladder_keeps_the_kept_levers_and_runs_the_final_per_seed() -> None:
    from handformer.bench.time_to_loss import Lever, ladder_recipes

    ladder = [Lever("a", model=dict(qk_norm=True)),
              Lever("b", model=dict(activation="relu2"), kept=False),
              Lever("c", train=dict(max_steps=300))]
    rows = ladder_recipes(ladder, "shakespeare-fast", seeds=(1, 2))
    assert [r.model for r in rows] == [{"qk_norm": True},
                                       {"qk_norm": True, "activation": "relu2"},
                                       {"qk_norm": True}, {"qk_norm": True},
                                       {"qk_norm": True}]
    assert rows[2].train == {"max_steps": 300}
    assert [r.train.get("seed") for r in rows[3:]] == [1, 2]


def test_bench_quick_ablation_races_every_rung_against_one_reference(tmp_path: Path) -> None:
    from handformer.bench.time_to_loss import LADDER

    assert main(["bench", "--quick", "--ablation", "--only", "time_to_loss", "--out-dir",
                 str(tmp_path)]) == 0
    data = json.loads((tmp_path / "time_to_loss.json").read_text())
    labels = [r["label"] for r in data["rows"]]
    assert labels[0] == "reference" and len(labels) == 1 + len(LADDER) + 3
    assert labels[-3:] == ["final, seed 1337", "final, seed 1", "final, seed 2"]
    for row in data["rows"][1:]:
        assert row["command"].startswith("python benchmarks/time_to_loss.py")
        assert row["ratio"] == pytest.approx(row["reached"]["train_seconds"]
                                             / data["rows"][0]["reached"]["train_seconds"])
    assert data["final_seeds"]["n"] == 3


def test_step_cost_times_both_recipes_and_writes_the_ratios(tmp_path: Path) -> None:
    from handformer.bench.step_cost import main as step_cost_main

    out = tmp_path / "cost.json"
    assert step_cost_main([
        "--reference-steps", "12", "--fast", "speedrun", "--fast-steps", "4,6",
        "--fast-model", '{"d_model": 16, "n_heads": 2, "n_layers": 1}',
        "--fast-train", '{"batch_size": 4, "seq_warmup_steps": 4, "seq_warmup_start": 16}',
        "--chunk", "2", "--rounds", "2", "--peak-n", "128", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["machine"]["threads"] == data["threads"]
    assert set(data["share_of_peak"]) == {"reference", "fast"}
    assert all(v > 0 for v in data["share_of_peak"].values())
    assert data["fast_steps"] == [4, 6] and len(data["rounds"]) == 2
    for r in data["rounds"]:
        assert r["reference_step_ms"] > 0 and len(r["ratios"]) == 2
        assert 0 < r["ratios"][0] < r["ratios"][1]  # six steps cost more than four
    assert data["mean_ratio"] == pytest.approx(sum(data["ratios"]) / 2)


def test_the_ladders_final_recipe_is_the_speedrun_preset() -> None:
    """The preset ships what the log measured: every kept lever on top of shakespeare-fast
    (only how often, and on how many batches, a user's run evaluates differs)."""
    from handformer.bench.time_to_loss import LADDER, ladder_recipes

    final = ladder_recipes(LADDER, "shakespeare-fast", seeds=(1337,))[-1]
    model, train = build_configs("shakespeare-fast", 65, final.model, final.train)
    want_model, want_train = build_configs("speedrun", 65)
    assert model == want_model
    evaluation = {"eval_interval": 0, "eval_batches": 0}
    assert {**train.to_dict(), **evaluation} == {**want_train.to_dict(), **evaluation}


def test_plain_race_runs_the_contender_once_per_seed(tmp_path: Path) -> None:
    out = tmp_path / "time_to_loss.json"
    assert time_to_loss_main(["--quick", "--seeds", "3,4", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    labels = [r["label"] for r in data["rows"]]
    assert labels == ["reference", "final, seed 3", "final, seed 4"]
    assert [r["train"]["seed"] for r in data["rows"][1:]] == [3, 4]
    assert data["final_seeds"]["n"] == 2


@pytest.mark.parametrize("bad", [
    ["--fast-steps", "0"], ["--fast-steps", "ten"], ["--chunk", "0"], ["--rounds", "-1"],
    ["--threads", "0"], ["--reference-timed", "-5"], ["--peak-n", "0"],
    ["--data", "no/such/file.txt"],
])
def test_step_cost_refuses_bad_options_in_one_line(bad: list[str], tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    from handformer.bench.step_cost import main as step_cost_main

    args = {"--fast-steps": "5", "--reference-steps": "10"}
    args.update(dict(zip(bad[::2], bad[1::2], strict=True)))
    with pytest.raises(SystemExit) as stop:
        step_cost_main(["--fast", "tiny", "--out", str(tmp_path / "s.json"),
                        *[x for kv in args.items() for x in kv]])
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and "error:" in err
    assert not (tmp_path / "s.json").exists()
