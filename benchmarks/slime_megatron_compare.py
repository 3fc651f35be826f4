"""The compare stage of benchmarks/slime_megatron.py (any machine): each run's first step against the
reference run's (relative and absolute differences of the loss terms and grad norm), step time and
peak memory per GPU, as one JSON and a table on stdout."""

from __future__ import annotations

import json
from pathlib import Path

# First-step metrics the comparison puts against the reference run (each channel's term as slime logs it).
COMPARED = (
    "train/loss",
    "train/pg_loss",
    "train/loss/grpo",
    "train/loss/sdpo_kl",
    "train/kl_loss",
    "train/ppo_kl",
    "train/grad_norm",
    "train/entropy_loss",
    "train/train_rollout_logprob_abs_diff",
)


def relative_difference(value: float | None, reference: float | None) -> float | None:
    if value is None or reference is None:
        return None
    return abs(value - reference) / max(abs(reference), 1e-12)


def gpu_peaks(out: Path, tag: str) -> dict | None:
    """Per GPU, the most memory in use (MiB) in nvidia-smi's samples of this run (nvsmi_<tag>.csv:
    `index, memory.used` lines, written by the device driver script), or None without that file."""
    path = out / f"nvsmi_{tag}.csv"
    if not path.exists():
        return None
    peaks: dict[str, float] = {}
    for line in path.read_text().splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 2 and parts[0].isdigit():
            with_unit = parts[1].split()
            if with_unit and with_unit[0].replace(".", "", 1).isdigit():
                peaks[parts[0]] = max(peaks.get(parts[0], 0.0), float(with_unit[0]))
    return peaks


def run_compare(out: Path, reference_tag: str, tags=None, name: str = "compare_parallel.json") -> dict:
    """The runs' first steps against the reference's; `tags`: only these runs (default every train_*.json)."""
    runs = {p.stem.removeprefix("train_"): json.loads(p.read_text()) for p in sorted(out.glob("train_*.json"))}
    if tags is not None:
        runs = {tag: run for tag, run in runs.items() if tag in tags}
    if reference_tag not in runs:
        raise SystemExit(f"error: {out}/train_{reference_tag}.json is missing: the reference run")
    reference = runs[reference_tag].get("first_step") or {}
    # The reference first, then in the order given, or by GPU count.
    if tags is not None:
        order = [reference_tag, *(t for t in tags if t in runs and t != reference_tag)]
    else:
        order = sorted(runs, key=lambda t: (t != reference_tag, runs[t].get("gpus", 1), t))
    runs = {tag: runs[tag] for tag in order}
    table = {}
    for tag, run in runs.items():
        first = run.get("first_step") or {}
        perf = run.get("perf") or {}
        table[tag] = {
            "tensor_parallel": run.get("tensor_parallel", 1),
            "data_parallel": run.get("data_parallel", 1),
            "returncode": run.get("returncode"),
            "metrics": {k: first.get(k) for k in COMPARED},
            "rel_diff_vs_reference": {k: relative_difference(first.get(k), reference.get(k)) for k in COMPARED},
            # for the terms near 0 at the first step (the KL to the start weights), where a ratio says nothing
            "abs_diff_vs_reference": {
                k: None if first.get(k) is None or reference.get(k) is None else abs(first[k] - reference[k])
                for k in COMPARED
            },
            "step_time_s": perf.get("perf/step_time"),
            "actor_train_time_s": perf.get("perf/actor_train_time"),
            "log_probs_time_s": perf.get("perf/log_probs_time"),
            "command_seconds": run.get("seconds"),
            "peak_memory_per_rank": run.get("peak_memory"),
            "nvidia_smi_peak_MiB_per_gpu": gpu_peaks(out, tag),
        }
    result = {"reference": reference_tag, "runs": table}
    (out / name).write_text(json.dumps(result, indent=1) + "\n")
    print_table(result)
    return result


def print_table(result: dict) -> None:
    def number(x, fmt):
        return "-" if x is None else format(x, fmt)

    short = {
        "train/loss": "loss",
        "train/pg_loss": "pg_loss",
        "train/loss/grpo": "grpo",
        "train/loss/sdpo_kl": "sdpo_kl",
        "train/kl_loss": "kl",
        "train/grad_norm": "grad_norm",
    }
    head = f"{'run':10} {'TPxDP':6} {'rc':>4}" + "".join(f" {s:>11} {'rel':>8}" for s in short.values())
    print(head + f" {'step s':>7} {'peak alloc GiB/rank':>20} {'smi peak MiB/GPU':>18}")
    for tag, row in result["runs"].items():
        cells = "".join(
            f" {number(row['metrics'][k], '.7g'):>11} {number(row['rel_diff_vs_reference'][k], '.1e'):>8}"
            for k in short
        )
        allocated = "/".join(
            f"{v.get('max_allocated_GiB', 0):.2f}" for v in (row["peak_memory_per_rank"] or {}).values()
        )
        smi = "/".join(f"{v:.0f}" for v in (row["nvidia_smi_peak_MiB_per_gpu"] or {}).values())
        layout = f"{row['tensor_parallel']}x{row['data_parallel']}"
        print(
            f"{tag:10} {layout:6} {number(row['returncode'], 'd'):>4}{cells} {number(row['step_time_s'], '.2f'):>7}"
            f" {allocated or '-':>20} {smi or '-':>18}"
        )
    print(f"(rel: relative difference to {result['reference']}; bf16 noise is about 1e-3 to 1e-2)")
