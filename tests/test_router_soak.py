"""benchmarks/router_soak.py: the real sglang-router, launched as a run launches it, in front of stand-in
workers; its memory read as requests go through, and a slope per request."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def run_router_soak(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "router_soak.py"), *args],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )


def test_requests_through_the_router_give_its_memory_per_request(tmp_path):
    out = tmp_path / "router_soak.json"
    flags = ["--requests", "900", "--every", "150", "--warmup", "300", "--n", "2", "--median-ms", "5"]
    result = run_router_soak(*flags, "--out", str(out))
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["errors"] == 0  # every request answered through the router
    assert [s["requests"] for s in report["samples"]] == [0, 150, 300, 450, 600, 750, 900]
    assert all(s["rss_kib"] > 10_000 for s in report["samples"])  # the router's own process, read from /proc
    assert report["settings"]["median_ms"] == 5.0
    command = report["settings"]["router_command"]
    assert command[command.index("--policy") + 1] == "round_robin" and "--prometheus-port" in command
    rss = report["figures"]["rss"]
    assert rss["mib_end"] > 0 and isinstance(rss["bytes_per_request"], float) and rss["noise_mib"] >= 0
    assert "bytes a request" in result.stdout and f"wrote {out}" in result.stdout


@pytest.mark.parametrize(
    "arguments, named",
    [
        (["--prompt-ids", "20"], "--prompt-ids"),
        (["--prompt-ids", "30-10"], "--prompt-ids"),
        (["--requests", "10"], "--requests"),
        (["--median-ms", "0"], "--median-ms"),
    ],
)
def test_bad_input_exits_2_naming_the_flag(arguments, named):
    result = run_router_soak(*arguments)
    assert result.returncode == 2 and named in result.stderr and len(result.stderr.strip().splitlines()) == 1
