"""The run plot: holdout with info, the no-info control, the oracle line, the normalised gain, the
eval sets' panel; steps numbered as the console numbers them."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import matplotlib
import pytest

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


def drawn_figure(run_dir: Path, monkeypatch) -> plt.Figure:
    figures = []
    savefig = plt.Figure.savefig
    monkeypatch.setattr(plt.Figure, "savefig", lambda fig, *a, **k: (figures.append(fig), savefig(fig, *a, **k)))
    out = plot_run(run_dir)
    assert out.stat().st_size > 0
    return figures[0]


def panel(figure: plt.Figure, title: str):
    found = [ax for ax in figure.axes if ax.get_title().startswith(title)]
    assert len(found) == 1, [ax.get_title() for ax in figure.axes]
    return found[0]


def test_the_oracle_line_and_the_eval_panel_are_drawn(tmp_path, monkeypatch):
    _write_run(tmp_path, with_eval=True)
    assert reference_grades([json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]) == {
        "synthetic_suffix": 0.97
    }
    figure = drawn_figure(tmp_path, monkeypatch)
    holdout_ax = figure.axes[0]
    labels = holdout_ax.get_legend_handles_labels()[1]
    assert "with teacher's info" in labels and "no info (control)" in labels
    oracle = [line for line in holdout_ax.get_lines() if "oracle" in str(line.get_label())]
    assert len(oracle) == 1 and list(oracle[0].get_ydata()) == [0.97, 0.97]
    assert len(figure.axes) == 4  # holdout, gain, inner iterations, eval sets
    eval_labels = panel(figure, "Fixed eval sets").get_legend_handles_labels()[1]
    assert eval_labels == ["fixed: with info", "fixed: no info"]


def test_steps_are_numbered_from_1_on_whole_number_ticks_as_the_console_does(tmp_path, monkeypatch):
    _write_run(tmp_path, with_eval=False)  # records of steps 0, 1, 2: the console's steps 1/3, 2/3, 3/3
    figure = drawn_figure(tmp_path, monkeypatch)
    holdout = panel(figure, "Holdout grade")
    with_info = next(line for line in holdout.get_lines() if line.get_label() == "with teacher's info")
    assert list(with_info.get_xdata()) == [1, 2, 3]
    for ax in figure.axes:
        ticks = [t for t in ax.get_xticks() if ax.get_xlim()[0] <= t <= ax.get_xlim()[1]]
        assert ticks and all(float(t).is_integer() for t in ticks), (ax.get_title(), ticks)


def test_the_normalised_gain_is_drawn_where_the_run_has_an_oracle(tmp_path, monkeypatch):
    _write_run(tmp_path, with_eval=False)  # holdout 0.80, 0.81, 0.82; no info 0.68; oracle 0.97
    gain_ax = panel(drawn_figure(tmp_path, monkeypatch), "Normalised gain")
    per_step = next(line for line in gain_ax.get_lines() if line.get_label() == "one step")
    assert list(per_step.get_xdata()) == [1, 2, 3]
    expected = [(0.8 + 0.01 * step - 0.68) / (0.97 - 0.68) for step in range(3)]
    assert list(per_step.get_ydata()) == pytest.approx(expected)
    running = next(line for line in gain_ax.get_lines() if str(line.get_label()).startswith("mean of the last"))
    assert running.get_ydata()[-1] == pytest.approx(sum(expected) / 3)


def test_no_gain_panel_without_an_oracle(tmp_path, monkeypatch):
    _write_run(tmp_path, with_eval=False)
    records = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    for record in records:
        record.pop("eval/synthetic_suffix/baseline_teacher/avg", None)
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    figure = drawn_figure(tmp_path, monkeypatch)
    assert [ax.get_title() for ax in figure.axes] == ["Holdout grade", "Grade per inner iteration"]


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
