"""benchmarks/shape_memory.py on the CPU: each token count run twice, memory read between, and bad
flags refused in one line."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def shape_memory(*arguments: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "benchmarks/shape_memory.py", *arguments],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_two_passes_over_the_same_token_counts_are_sampled_and_fitted(tmp_path):
    out = tmp_path / "shapes.json"
    result = shape_memory("--device", "cpu", "--shapes", "48", "--max-tokens", "64", "--every", "16", "--out", str(out))
    assert result.returncode == 0, result.stderr
    report = json.loads(out.read_text())
    # one sample before each pass and one every 16 shapes: 0, 16, 32, 48 twice
    assert [(s["pass"], s["shapes"]) for s in report["samples"]] == [(p, n) for p in (1, 2) for n in (0, 16, 32, 48)]
    assert all(s["rss_kib"] > 0 and s["anon_kib"] > 0 for s in report["samples"])
    for name in ("pass_1", "pass_2"):
        figures = report[name]
        assert isinstance(figures["rss_kib_per_shape"], float) and figures["rss_mib_end"] >= 1.0
    assert report["settings"]["ops"] == "both" and report["settings"]["device"] == "cpu"
    assert "pass_2: RSS" in result.stdout


def test_more_token_counts_than_there_are_exits_2_naming_the_flags():
    result = shape_memory("--device", "cpu", "--shapes", "100", "--max-tokens", "64")
    assert result.returncode == 2 and result.stderr.strip().splitlines()[-1].count("--shapes") == 1
    assert "--max-tokens" in result.stderr.strip().splitlines()[-1]
