"""Run records stay readable whatever text the models wrote into them."""

from __future__ import annotations

import json

import pytest

from slime_meta.artifacts.tracking import Tracker, jsonl_lines, read_metrics
from slime_meta.config.tracking import TrackingConfig

# Line separators that JSON leaves raw with ensure_ascii=False and str.splitlines() splits at.
ODD_TEXT = "a\u2028b\u2029c\x85d\x1ce\x0bf"


def test_traces_with_unicode_line_separators_survive_a_resume(tmp_path):
    config = TrackingConfig(
        run_dir=str(tmp_path), use_wandb=False, wandb_project="p", wandb_group=None, wandb_mode="disabled"
    )
    tracker = Tracker(config, tmp_path, {})
    for step in range(3):
        tracker.log(step, {"meta_learning/avg_holdout_grade": 0.5})
        tracker.write_traces([{"type": "chain", "rollout_id": step, "response": ODD_TEXT}])
    traces = [json.loads(line) for line in jsonl_lines((tmp_path / "traces.jsonl").read_text(encoding="utf-8"))]
    assert [t["response"] for t in traces] == [ODD_TEXT] * 3

    Tracker(config, tmp_path, {}, start_step=2)  # a resume at step 2 drops the later records, reading every line
    kept = [json.loads(line) for line in jsonl_lines((tmp_path / "traces.jsonl").read_text(encoding="utf-8"))]
    assert [t["rollout_id"] for t in kept] == [0, 1] and kept[1]["response"] == ODD_TEXT
    assert [r["step"] for r in read_metrics(tmp_path)] == [0, 1]


def test_a_new_run_in_a_used_run_dir_sets_the_earlier_records_aside(tmp_path, capsys):
    config = TrackingConfig(
        run_dir=str(tmp_path), use_wandb=False, wandb_project="p", wandb_group=None, wandb_mode="disabled"
    )
    first = Tracker(config, tmp_path, {})
    first.log(0, {"meta_learning/avg_holdout_grade": 0.25})
    first.write_traces([{"type": "chain", "rollout_id": 0}])

    second = Tracker(config, tmp_path, {})  # a new run (step 0) in the same directory
    second.log(0, {"meta_learning/avg_holdout_grade": 0.75})
    assert [r["meta_learning/avg_holdout_grade"] for r in read_metrics(tmp_path)] == [0.75]
    earlier = (tmp_path / "metrics.jsonl.earlier-1").read_text()
    assert '"meta_learning/avg_holdout_grade": 0.25' in earlier  # nothing lost
    assert (tmp_path / "traces.jsonl.earlier-1").exists() and not (tmp_path / "traces.jsonl").exists()
    assert "metrics.jsonl.earlier-1" in capsys.readouterr().out

    Tracker(config, tmp_path, {}, start_step=None).log(1, {"meta_learning/avg_holdout_grade": 0.5})  # appended
    assert [r["step"] for r in read_metrics(tmp_path)] == [0, 1]


def test_the_summary_line_gives_the_first_and_last_windows_and_their_gain():
    from slime_meta.artifacts.tracking import summary_line

    records = [
        {"step": 0, "eval/x/baseline_teacher/avg": 0.9, "eval/x_eval/holdout_grade": 0.5},
        *(
            {"step": s, "meta_learning/avg_holdout_grade": 0.5 + 0.1 * s, "meta_learning/holdout_grade_no_info": 0.5}
            for s in range(4)
        ),
        {"step": 4, "eval/x_eval/holdout_grade": 0.9},  # the final eval alone: not a step
    ]
    records[1]["eval/x/baseline_teacher/avg"] = 0.9  # --eval-baseline rides with the first step
    line = summary_line(records)
    assert line.startswith("summary: 4 steps; holdout with the teacher's info 0.550 over the first 2 -> 0.750 over")
    assert line.endswith("(no info 0.500, oracle 0.900: normalised gain 0.13 -> 0.62)")
    assert summary_line([{"step": 0, "eval/x_eval/holdout_grade": 0.5}]) is None


def test_the_summary_line_gives_each_gain_with_its_interval_when_r_oracle_has_an_error():
    from slime_meta.artifacts.tracking import gain_interval, summary_line

    holdout = [0.5, 0.6, 0.7, 0.8]
    no_info = [0.45, 0.55, 0.5, 0.5]
    records = [
        {"step": s, "meta_learning/avg_holdout_grade": h, "meta_learning/holdout_grade_no_info": n}
        for s, (h, n) in enumerate(zip(holdout, no_info))
    ]
    records[0].update({"eval/x/baseline_teacher/avg": 0.9, "eval/x/baseline_teacher/se": 0.03})
    line = summary_line(records)
    gain, low, high = gain_interval(holdout[-2:], no_info, 0.9, 0.03)
    assert gain == pytest.approx((0.75 - 0.5) / (0.9 - 0.5))
    assert low < gain < high and high - low > 0.1  # two steps a window: a wide interval
    assert line.endswith(
        f"oracle 0.900 ± 0.030: normalised gain 0.13 [{gain_interval(holdout[:2], no_info, 0.9, 0.03)[1]:.2f}, "
        f"{gain_interval(holdout[:2], no_info, 0.9, 0.03)[2]:.2f}] -> 0.62 [{low:.2f}, {high:.2f}])"
    )
    # R_oracle's error widens the interval: none of it, a narrower one.
    assert gain_interval(holdout[-2:], no_info, 0.9, 0.0)[2] < high
    # Without a recorded error (an older run) the gain is given alone.
    assert gain_interval(holdout, no_info, 0.9, None)[1] != gain_interval(holdout, no_info, 0.9, None)[1]  # NaN
