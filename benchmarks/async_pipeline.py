"""Async pipeline: outer-step time with --max-async-level 1 against 0, in one run.

    python benchmarks/async_pipeline.py --steps 20
    python benchmarks/async_pipeline.py --quick -- --rollout-batch-size 10   # extra train.py flags after --

Both arms run the demo's configuration (scripts/run_synthetic.sh) from the same model and seed;
reported: median step time after the first step, speedup, and the holdout grade of the last
`--window` steps of each arm (the learning must not suffer). Writes JSON to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from statistics import fmean, median

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # slime_meta from this checkout

from slime_meta.artifacts.tracking import read_metrics  # noqa: E402


def arm(level: int, args: argparse.Namespace, out: Path) -> dict:
    run_dir = out / f"async{level}-{time.strftime('%Y%m%d-%H%M%S')}"
    env = {**os.environ, "RUN_DIR": str(run_dir), "NUM_ROLLOUT": str(args.steps), "PYTHON": sys.executable}
    if args.model_dir:
        env["MODEL_DIR"] = args.model_dir
    started = time.perf_counter()
    subprocess.run(
        [
            "bash",
            str(ROOT / "scripts/run_synthetic.sh"),
            "--max-async-level",
            str(level),
            "--trace-sample-rate",
            "0",
            *args.extra,
        ],
        cwd=ROOT,
        env=env,
        check=True,
        stdout=subprocess.DEVNULL,
    )
    wall = time.perf_counter() - started
    records = read_metrics(run_dir)
    steps = [r["perf/step_time"] for r in records[1:]]
    return {
        "max_async_level": level,
        "wall_s": wall,
        "median_step_s": median(steps),
        "holdout_last": fmean(r["meta_learning/avg_holdout_grade"] for r in records[-args.window :]),
        "holdout_no_info": fmean(r["meta_learning/holdout_grade_no_info"] for r in records),
        "max_staleness": max(r.get("async/max_staleness", 0.0) for r in records),
        "run_dir": str(run_dir),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--window", type=int, default=5)
    parser.add_argument("--out", default="runs/benchmarks")
    parser.add_argument("--model-dir", default=None)
    parser.add_argument("--quick", action="store_true", help="3 steps per arm: checks that it runs.")
    parser.add_argument("extra", nargs="*", help="Extra train.py flags of both arms after --, e.g. -- --lr 3e-4")
    args = parser.parse_args()
    if args.quick:
        args.steps, args.window = 3, 1
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    sync, overlapped = arm(0, args, out), arm(1, args, out)
    result = {
        "benchmark": "async_pipeline",
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{platform.node()} {platform.machine()} ({os.cpu_count()} cpus)",
        "command": " ".join(sys.argv),
        "arms": [sync, overlapped],
        "speedup_median_step": sync["median_step_s"] / overlapped["median_step_s"],
    }
    (out / "async_pipeline.json").write_text(json.dumps(result, indent=2))
    print(f"{'async':>5} {'median step s':>13} {'wall s':>7} {'holdout last':>12} {'no info':>7} {'staleness':>9}")
    for a in (sync, overlapped):
        print(
            f"{a['max_async_level']:>5} {a['median_step_s']:>13.2f} {a['wall_s']:>7.0f} {a['holdout_last']:>12.3f} "
            f"{a['holdout_no_info']:>7.3f} {a['max_staleness']:>9.0f}"
        )
    print(f"speedup (median step): {result['speedup_median_step']:.2f}x")


if __name__ == "__main__":
    main()
