"""The efficacy curves figure, drawn from the shipped H100 reports."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from efficacy_curves import draw, moving_mean  # noqa: E402


def test_moving_mean_averages_the_steps_seen_so_far_then_the_window():
    assert moving_mean([1.0, 3.0, 5.0, 7.0], 2) == pytest.approx([1.0, 2.0, 4.0, 6.0])


def test_one_panel_per_report_from_the_shipped_results(tmp_path):
    names = ("efficacy_h100_bracket_frozen.json", "efficacy_h100_bracket_shared.json")
    reports = [json.loads((ROOT / "benchmarks/results" / name).read_text()) for name in names]
    for report in reports:  # what the figure draws is in each report
        assert len(report["curve"]) == report["steps"] and report["r_oracle"] > report["r_no_info"]
    out = draw(reports, ["frozen", "shared"], tmp_path / "curves.png")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 20_000
