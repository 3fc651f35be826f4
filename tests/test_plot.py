"""The run plot: holdout with info, the no-info control, the oracle line, the eval sets' panel."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from slime_meta.artifacts.plot import plot_run  # noqa: E402
from slime_meta.artifacts.tracking import reference_grades  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def _write_run(run_dir: Path, with_eval: bool) -> None:
    records = []
    for step in range(3):
        record = {
            "step": step,
            "meta_learning/avg_holdout_grade": 0.8 + 0.01 * step,
            "meta_learning/holdout_grade_no_info": 0.68,
            "meta_learning/best_info_holdout_grade": 0.9,
        }
        if step == 0:  # --eval-baseline logs the reference context's grade with the first step
            record["eval/synthetic_suffix/baseline_teacher/avg"] = 0.97
            record["eval/synthetic_suffix/baseline_student/avg"] = 0.69
        if with_eval:
            record.update(
                {"eval/fixed/holdout_grade": 0.7, "eval/fixed/holdout_grade_no_info": 0.6, "eval/fixed/gain": 0.1}
            )
        records.append(record)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


def test_the_oracle_line_and_the_eval_panel_are_drawn(tmp_path, monkeypatch):
    _write_run(tmp_path, with_eval=True)
    assert reference_grades([json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]) == {
        "synthetic_suffix": 0.97
    }
    figures = []
    savefig = plt.Figure.savefig
    monkeypatch.setattr(plt.Figure, "savefig", lambda fig, *a, **k: (figures.append(fig), savefig(fig, *a, **k)))
    out = plot_run(tmp_path)
    assert out.stat().st_size > 0
    holdout_ax = figures[0].axes[0]
    labels = holdout_ax.get_legend_handles_labels()[1]
    assert "with teacher's info" in labels and "no info (control)" in labels
    oracle = [line for line in holdout_ax.get_lines() if "oracle" in str(line.get_label())]
    assert len(oracle) == 1 and list(oracle[0].get_ydata()) == [0.97, 0.97]
    assert len(figures[0].axes) == 3  # the eval sets' panel
    eval_labels = figures[0].axes[2].get_legend_handles_labels()[1]
    assert eval_labels == ["fixed: with info", "fixed: no info"]


def test_no_oracle_line_without_a_reference_context(tmp_path):
    _write_run(tmp_path, with_eval=False)
    records = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    for record in records:
        record.pop("eval/synthetic_suffix/baseline_teacher/avg", None)
    assert reference_grades(records) == {}


def test_the_command_line_writes_the_picture(tmp_path):
    _write_run(tmp_path, with_eval=False)
    result = subprocess.run(
        [sys.executable, "-m", "slime_meta.artifacts.plot", str(tmp_path)], cwd=ROOT, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "holdout.png").stat().st_size > 0
