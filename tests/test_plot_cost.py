"""benchmarks/plot_cost.py: one redraw of a run's plot per history length, each in a fresh process."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from test_plot import _write_run

ROOT = Path(__file__).resolve().parents[1]


def run_plot_cost(*args: str) -> subprocess.CompletedProcess:
    command = [sys.executable, str(ROOT / "benchmarks" / "plot_cost.py"), *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=ROOT)


def test_each_history_length_is_drawn_once_and_measured(tmp_path):
    _write_run(tmp_path, with_eval=True)
    out = tmp_path / "plot_cost.json"
    result = run_plot_cost("--metrics", str(tmp_path / "metrics.jsonl"), "--records", "30", "300", "--out", str(out))
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["settings"]["source_records"] == 3 and report["bytes_per_record"] > 50
    first, second = report["redraws"]
    assert (first["records"], second["records"]) == (30, 300) and second["file_mib"] >= first["file_mib"]
    for row in report["redraws"]:
        assert row["seconds"] > 0 and row["rss_mib_peak"] >= row["rss_mib_before"] > 20  # matplotlib loaded


def test_a_missing_metrics_file_exits_2_naming_the_flag(tmp_path):
    result = run_plot_cost("--metrics", str(tmp_path / "none.jsonl"))
    assert result.returncode == 2 and "--metrics" in result.stderr and len(result.stderr.strip().splitlines()) == 1
