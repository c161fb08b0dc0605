"""The nanoGPT race's plumbing: evaluation lines of both programs parse, a contender's wall to
target is the arrival time of its first line at or under the target, order alternates, and
a nanoGPT folder that is not one is refused in one line."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from handformer.bench.race import Contender, _summarise, main, parse_val_loss, race


@pytest.mark.parametrize(("line", "parsed"), [
    ("step 250: train loss 1.9870, val loss 2.0712", (250, 2.0712)),          # nanoGPT
    ("step    200: train loss 1.8634  val loss 1.7178", (200, 1.7178)),      # handformer
    ("iter 250: loss 1.9870, time 20.1ms, mfu 0.01%", None),
    ("reached the target at step 300: val loss 1.8700 <= 1.88", None),
])
def test_evaluation_lines_of_both_programs_parse(line: str, parsed: object) -> None:
    assert parse_val_loss(line) == parsed


def _printer(name: str, losses: list[float], target: float, peer: bool = False) -> Contender:
    body = ";".join(f"print('step {100 * (i + 1)}: train loss 9, val loss {v}')"
                    for i, v in enumerate(losses))
    return Contender(name, [sys.executable, "-c", body], target, "toy", nanogpt=peer)


def test_wall_to_target_is_the_first_line_at_or_under_it(tmp_path: Path) -> None:
    peer = _printer("peer", [3.0, 2.0, 1.5], 1.5, peer=True)
    fast = _printer("fast", [2.0, 1.4, 1.2], 1.5)
    never = _printer("never", [3.0, 2.5], 1.5)
    timings = race([peer, fast, never], 2, tmp_path, {})
    assert [t.name for t in timings] == ["peer", "fast", "never", "never", "fast", "peer"]
    rows = {r["name"]: r for r in _summarise([peer, fast, never], timings)}
    assert rows["fast"]["median_step_at_target"] == 200
    assert rows["fast"]["median_val_at_target"] == 1.4
    assert rows["peer"]["median_step_at_target"] == 300 and rows["peer"]["vs_nanogpt"] == 1.0
    assert rows["never"]["reached"] == 0 and rows["never"]["median_wall_to_target_s"] is None
    assert rows["never"]["vs_nanogpt"] is None
    assert all(w is not None and w > 0 for w in rows["fast"]["walls_to_target_s"])


def test_a_peer_that_ends_above_the_target_is_timed_to_its_own_last_evaluation(
        tmp_path: Path) -> None:
    """nanoGPT's CPU recipe ends at 1.8857 against its published 1.88: the ratios are then
    to its wall at its final evaluation."""
    peer = _printer("peer", [3.0, 2.0, 1.6], 1.5, peer=True)
    fast = _printer("fast", [2.0, 1.4], 1.5)
    timings = race([peer, fast], 1, tmp_path, {})
    rows = {r["name"]: r for r in _summarise([peer, fast], timings)}
    assert rows["peer"]["median_wall_to_target_s"] is None
    assert rows["peer"]["median_wall_to_last_eval_s"] == timings[0].evals[-1][0]
    assert rows["peer"]["vs_nanogpt"] == 1.0
    expected = rows["fast"]["median_wall_to_target_s"] / timings[0].evals[-1][0]
    assert rows["fast"]["vs_nanogpt"] == expected


def test_a_folder_that_is_not_nanogpt_is_refused(tmp_path: Path) -> None:
    data = tmp_path / "input.txt"
    data.write_text("hello\n" * 100, encoding="utf-8")
    with pytest.raises(SystemExit, match="expected a nanoGPT checkout"):
        main(["--nanogpt", str(tmp_path), "--data", str(data), "--only", "nanoGPT (CPU recipe)",
              "--out", str(tmp_path / "r.json")])
