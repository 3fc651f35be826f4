"""Run records stay readable whatever text the models wrote into them."""

from __future__ import annotations

import json

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
