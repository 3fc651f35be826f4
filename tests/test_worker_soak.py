"""benchmarks/worker_soak.py on the CPU: a worker pushed to and asked, round after round, its memory read."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def run_worker_soak(*arguments: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "benchmarks/worker_soak.py", *arguments],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_a_worker_round_after_round_reports_its_memory_and_slope(tmp_path):
    out = tmp_path / "worker_soak.json"
    result = run_worker_soak("--rounds", "12", "--every", "3", "--warmup", "3", "--out", str(out))
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["settings"]["weight_sync"] == "shared-memory"  # a CPU trainer and a worker of its group
    rounds = [s["round"] for s in report["samples"]]
    assert rounds == [0, 3, 6, 9, 11]
    assert all(s["rss_kib"] > 50_000 for s in report["samples"])  # a worker with torch loaded
    assert report["rss_mib_end"] > 0 and isinstance(report["slope_kib_per_round"], float)
    # 16 prompts of 20-60 tokens and up to 32 new ones a round: the tokens grow with the rounds
    assert 16 * 20 < report["tokens_per_round"] <= 16 * (60 + 32)
    tokens = [s["tokens"] for s in report["samples"]]
    assert tokens == sorted(tokens) and tokens[0] > 0 and isinstance(report["slope_kib_per_1k_tokens"], float)
    assert "KiB a round" in result.stdout and f"wrote {out}" in result.stdout
    # the engine's count of eager prefill shapes: prompts of new lengths each round meet new ones
    shapes = [s["eager_prefill_shapes"] for s in report["samples"]]
    assert shapes == sorted(shapes) and shapes[-1] > shapes[0] >= 1
    assert report["eager_prefill_shapes_end"] == shapes[-1] and "gpu_allocated_mib" not in report["samples"][0]


def test_a_time_limit_stops_the_rounds_and_reports_those_done(tmp_path):
    out = tmp_path / "worker_soak.json"
    result = run_worker_soak(
        *("--rounds", "100000", "--every", "2", "--warmup", "2", "--no-push", "--time-limit-s", "4", "--out", str(out))
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(out.read_text())
    done = report["rounds_done"]
    assert 8 <= done < 100_000 and report["samples"][-1]["round"] == done - 1
    assert f"{done} rounds of 100000" in result.stdout


@pytest.mark.parametrize(
    "arguments, named",
    [
        (["--rounds", "10", "--warmup", "8"], "--rounds 10"),
        (["--model-dir", "/nowhere"], "--model-dir /nowhere"),
        (["--time-limit-s", "0"], "--time-limit-s 0"),
        (["--prompt-tokens", "60-20"], "--prompt-tokens 60-20"),
        (["--prompt-tokens", "long"], "--prompt-tokens long"),
        (["--requests", "9", "--varied-rows"], "--requests 9"),
    ],
)
def test_bad_input_exits_2_naming_the_flag(arguments, named):
    result = run_worker_soak(*arguments, timeout=60)
    assert result.returncode == 2 and named in result.stderr


def test_varied_widths_give_each_round_a_new_longest_prompt():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from worker_soak import prompt_lengths

    # 128 prompts of 20-60 tokens: the round's longest, the prefill's width, is 60 every round
    assert {max(prompt_lengths(r, 128, 20, 60, False)) for r in range(30)} == {60}
    rounds = [prompt_lengths(r, 16, 20, 1500, True) for r in range(50)]
    assert len({max(lengths) for lengths in rounds}) >= 45  # nearly every round a new width
    assert all(len(lengths) == 16 and 20 <= min(lengths) and max(lengths) <= 1500 for lengths in rounds)


def test_varied_rows_give_each_round_a_new_number_of_prompts():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from worker_soak import FEWEST_EAGER_PROMPTS, prompt_lengths

    counts = [len(prompt_lengths(r, 64, 20, 600, True, varied_rows=True)) for r in range(60)]
    assert min(counts) >= FEWEST_EAGER_PROMPTS and max(counts) <= 64
    assert len(set(counts)) >= 40  # nearly every round a new count
    assert {len(prompt_lengths(r, 64, 20, 600, True)) for r in range(20)} == {64}  # fixed without it
