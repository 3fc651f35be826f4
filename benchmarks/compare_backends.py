"""The same run on two backends, side by side: learning (holdout with and without the teacher's info,
normalised gain, the eval set's lift) over the steps both ran, and where a step's time goes.

Reads each run's metrics file (metrics.jsonl, or .jsonl.gz as kept in benchmarks/results); slime's step
split comes from its console log (Megatron's `perf` lines), the local backend's from its metrics.

  python benchmarks/compare_backends.py \\
      --slime benchmarks/results/slime_2gpu_h200x4_qwen05b_price_lists_seed31_metrics.jsonl.gz \\
      --slime-console benchmarks/results/slime_2gpu_h200x4_qwen05b_price_lists_seed31_console.log.gz \\
      --local benchmarks/results/local_1gpu_h200_qwen05b_price_lists_seed31_metrics.jsonl.gz \\
      --out benchmarks/results/slime_vs_local_qwen05b_price_lists_seed31.json
"""

from __future__ import annotations

import argparse
import ast
import gzip
import json
import math
import re
import statistics
from pathlib import Path

HOLDOUT, NO_INFO = "meta_learning/avg_holdout_grade", "meta_learning/holdout_grade_no_info"
EVAL_PREFIX = "eval/price_lists_eval/"
MEGATRON_PERF = re.compile(r"train_metric_utils\.py:\d+ - perf \d+: (\{.*\})")


def read_lines(path: Path) -> list[str]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as handle:
        return handle.read().splitlines()


def records(path: Path) -> list[dict]:
    return [json.loads(line) for line in read_lines(path) if line.strip()]


def mean_se(values: list[float]) -> tuple[float, float]:
    se = statistics.stdev(values) / math.sqrt(len(values)) if len(values) > 1 else float("nan")
    return statistics.fmean(values), se


def r_oracle(recs: list[dict]) -> float | None:
    """--eval-baseline's grade with the reference context (`eval/<set>/baseline_teacher/avg`)."""
    for rec in recs:
        for key, value in rec.items():
            if key.startswith("eval/") and key.endswith("/baseline_teacher/avg"):
                return value
    return None


def learning(recs: list[dict], steps: int, window: int, oracle: float | None) -> dict:
    step_recs = [r for r in recs if HOLDOUT in r][:steps]
    holdout = [r[HOLDOUT] for r in step_recs]
    no_info = statistics.fmean(r[NO_INFO] for r in step_recs)
    first, first_se = mean_se(holdout[:window])
    last, last_se = mean_se(holdout[-window:])
    out = {
        "steps": len(step_recs),
        "r_no_info_mean": no_info,
        "r_oracle": oracle,
        f"holdout_first_{window}": first,
        f"holdout_first_{window}_se_over_steps": first_se,
        f"holdout_last_{window}": last,
        f"holdout_last_{window}_se_over_steps": last_se,
    }
    if oracle is not None and oracle > no_info:
        out["normalised_gain_first"] = (first - no_info) / (oracle - no_info)
        out["normalised_gain_last"] = (last - no_info) / (oracle - no_info)
    out["eval"] = {
        str(r["step"]): {
            "with_info": r[EVAL_PREFIX + "holdout_grade"],
            "no_info": r[EVAL_PREFIX + "holdout_grade_no_info"],
        }
        for r in recs
        if EVAL_PREFIX + "holdout_grade" in r and r["step"] <= steps
    }
    return out


def slime_step_split(console: Path) -> dict:
    perf = []
    for line in read_lines(console):
        match = MEGATRON_PERF.search(line)
        if match:
            perf.append(ast.literal_eval(match.group(1)))
    later = perf[1:]  # the first step holds the NCCL group's set-up and the wait for the first rollout
    keys = ("perf/train_time", "perf/actor_train_time", "perf/log_probs_time", "perf/ref_log_probs_time")
    keys += ("perf/update_weights_time",)
    return {key.split("/")[1] + "_median_s": statistics.median(p[key] for p in later if key in p) for key in keys}


def local_step_split(recs: list[dict]) -> dict:
    later = [r for r in recs if HOLDOUT in r][1:]
    keys = ("perf/step_time", "perf/train_time", "perf/train_forward_backward_time")
    keys += ("perf/train_reference_forward_time", "perf/weight_push_time", "perf/rollout_wait_time")
    keys += ("meta_learning/inner_loop_time",)
    return {key.split("/")[1] + "_median_s": statistics.median(r[key] for r in later if key in r) for key in keys}


def slime_step_interval(recs: list[dict]) -> float:
    times = [r["time"] for r in recs if HOLDOUT in r]
    return statistics.median(b - a for a, b in zip(times[1:], times[2:]))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--slime", type=Path, required=True, help="slime run's metrics (.jsonl or .jsonl.gz)")
    parser.add_argument("--slime-console", type=Path, help="slime run's console log, for Megatron's step split")
    parser.add_argument("--local", type=Path, required=True, help="local run's metrics")
    parser.add_argument("--window", type=int, default=10)
    parser.add_argument("--out", type=Path, required=True)
    ns = parser.parse_args(argv)
    for path in (ns.slime, ns.local, ns.slime_console):
        if path is not None and not path.is_file():
            parser.exit(2, f"error: {path}: no such file\n")
    slime, local = records(ns.slime), records(ns.local)
    steps = min(sum(HOLDOUT in r for r in slime), sum(HOLDOUT in r for r in local))
    result = {
        "common_steps": steps,
        "window": ns.window,
        "slime": learning(slime, steps, ns.window, r_oracle(slime)),
        "local": learning(local, steps, ns.window, r_oracle(local)),
        "local_all_steps": learning(local, 10**9, ns.window, r_oracle(local)),
    }
    split = {"local": local_step_split(local)}
    split["slime"] = {"step_interval_median_s": slime_step_interval(slime)}
    if ns.slime_console:
        split["slime"].update(slime_step_split(ns.slime_console))
    split["slime_over_local_step"] = split["slime"]["step_interval_median_s"] / split["local"]["step_time_median_s"]
    result["step_time"] = split
    ns.out.parent.mkdir(parents=True, exist_ok=True)
    ns.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
