"""Soak (slow, run separately): 50 outer steps of the embedded default without resident memory
or file descriptors growing after warm-up.

    python -m pytest -q -s -m slow tests/test_reliability_soak.py

The run is `scripts/run_synthetic.sh` (what `scripts/demo.sh` runs: the demo model, four teacher
prompts x eight infos, checkpoints every two steps) with `NUM_ROLLOUT=50`. After every step
(a new line in metrics.jsonl) the test samples the resident set size and the open file
descriptors of the trainer and of each child (router, worker). Warm-up is the first
`WARMUP_STEPS` steps (allocator arenas, torch caches, the optimizer's state, the router's
connection pool); the figure is the median of the last five samples before the final step (which
is taken while the run shuts down) against the median of the five samples after warm-up: at
most 10% more. The samples are written to `soak.json` in the run
directory and printed.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
NUM_ROLLOUT = 50
WARMUP_STEPS = 10
WINDOW = 5
MAX_GROWTH = 0.10


def rss_kib(pid: int) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


def fd_count(pid: int) -> int | None:
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return None


def descendants(pid: int) -> dict[int, str]:
    """Child processes (recursively) of `pid`: pid -> a short name (router / worker port)."""
    parents = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parents[int(entry.name)] = int((entry / "stat").read_text().rsplit(") ", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
    found, frontier = {}, [pid]
    while frontier:
        parent = frontier.pop()
        for child, child_parent in parents.items():
            if child_parent == parent and child not in found:
                try:
                    argv = (Path(f"/proc/{child}/cmdline").read_bytes().split(b"\0"))
                except OSError:
                    continue
                words = [a.decode(errors="replace") for a in argv]
                role = ("router" if any("sglang" in w and "router" in w for w in words) else  # it renames itself sglang::router
                        "worker" if any(w == "slime_meta.serving" for w in words) else
                        "trainer" if any(w.endswith("train.py") for w in words) else "other")  # fmt: skip
                port = words[words.index("--port") + 1] if "--port" in words else "?"
                found[child] = f"{role}:{port}"
                frontier.append(child)
    return found


def growth(samples: list[int]) -> tuple[float, float, float]:
    """(median after warm-up, median at the end, relative growth). The sample of the last step
    is left out: the run is already shutting down when it is taken."""
    early = statistics.median(samples[WARMUP_STEPS : WARMUP_STEPS + WINDOW])
    late = statistics.median(samples[-WINDOW - 1 : -1])
    return early, late, (late - early) / early


@pytest.mark.slow
def test_fifty_outer_steps_without_memory_or_fd_growth(tmp_path):
    run_dir = tmp_path / "soak"
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "NUM_ROLLOUT": str(NUM_ROLLOUT), "RUN_DIR": str(run_dir),
           "PYTHON": sys.executable, "MODEL_CACHE": str(ROOT / ".cache" / "models")}  # fmt: skip
    env.pop("OPENAI_API_KEY", None)
    log = (tmp_path / "soak.log").open("w")
    process = subprocess.Popen(["bash", str(ROOT / "scripts/run_synthetic.sh")], cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    samples: dict[str, list[int]] = {}
    fds: dict[str, list[int]] = {}
    seen_steps, trainer_pid, started = 0, None, time.monotonic()
    try:
        while process.poll() is None and time.monotonic() - started < 1800:
            time.sleep(0.1)
            if trainer_pid is None:
                trainer_pid = next((p for p, name in descendants(process.pid).items() if name.startswith("trainer")), None)
                continue
            metrics = run_dir / "metrics.jsonl"
            steps = metrics.read_text().count("\n") if metrics.exists() else 0
            if steps > seen_steps:
                seen_steps = steps
                who = {trainer_pid: "trainer", **{p: n for p, n in descendants(trainer_pid).items()}}
                for pid, name in who.items():
                    rss, count = rss_kib(pid), fd_count(pid)
                    if rss is not None and count is not None:
                        samples.setdefault(name, []).append(rss)
                        fds.setdefault(name, []).append(count)
        process.wait(timeout=120)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        log.close()
    output = (tmp_path / "soak.log").read_text()
    assert process.returncode == 0, output[-3000:]
    assert seen_steps == NUM_ROLLOUT
    report = {}
    for name, values in samples.items():
        if len(values) < WARMUP_STEPS + 2 * WINDOW:
            continue  # a process that did not live through the run (none expected)
        early, late, relative = growth(values)
        report[name] = {
            "rss_kib_after_warmup": early, "rss_kib_end": late, "growth": round(relative, 4),
            "rss_kib_first": values[0], "fds_after_warmup": fds[name][WARMUP_STEPS], "fds_end": fds[name][-2],
            "fds_max": max(fds[name]),
        }  # fmt: skip
    (run_dir / "soak.json").write_text(json.dumps({"samples": samples, "fds": fds, "report": report}, indent=1))
    step_times = [r["perf/step_time"] for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())]
    print(f"\nsoak: {NUM_ROLLOUT} steps in {time.monotonic() - started:.0f}s (median step {statistics.median(step_times):.1f}s)")
    for name, figures in sorted(report.items()):
        print(f"  {name}: {json.dumps(figures)}")
    assert "trainer" in report and any(name.startswith("worker") for name in report)
    for name, figures in report.items():
        assert figures["growth"] <= MAX_GROWTH, (name, figures)
        assert figures["fds_end"] <= figures["fds_after_warmup"] + 8, (name, figures)
