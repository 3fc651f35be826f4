"""benchmarks/step.py's figures from a finished run: the lower bound from measured parts, the
verdicts against the targets, and the tables it prints (see step.py's docstring)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import _common as C  # noqa: E402 (puts the repo root on sys.path)
from step_shapes import REAL_SHAPES  # noqa: E402

TARGETS = {
    "peak_gpu_gib_0.5b": 24.0,
    "peak_gpu_gib_1.5b": 60.0,
    "step_s_0.5b": 6.0,
    "step_s_1.5b": 9.0,
    "weight_push_share": 0.05,
    "step_vs_bound": 1.5,
    "step_vs_floor_real": 3.0,  # the real models' step within 3x of its physical floor
}
TRAINER_MEMORY_SHAPE = {"0.5b": "0.5B", "1.5b": "1.5B", "tiny": "tiny"}  # the shape names trainer_memory.py writes


def lower_bound(name: str, args: argparse.Namespace, result: dict) -> dict[str, Any]:
    """bound = generated tokens / served tokens/s + trained tokens / trainer tokens/s (see the docstring);
    `bound_with_prefill_s` adds the step's measured prefill time (the served figure's 128-token
    prompts leave most of this step's prefill work out; one worker does prefill and decode in turn)."""
    per, rp = result["per_step"], result["replay"]
    out: dict[str, Any] = {"formula": "generated tokens / served tokens/s + trained tokens / trainer tokens/s"}
    out["served_tokens_per_s"] = rp["served_tokens_per_s"]
    gen = read_json(args.generation_json)
    if gen and gen.get("model") == "qwen0.5b" and name == "0.5b":  # the same shape's figure, for comparison
        out["served_tokens_per_s_generation_json"] = gen["served"]["concurrent"]["tokens_per_s"]
    memory = read_json(args.trainer_json)
    # The trainer benchmark's row at the loop's own setting (recomputed layers or kept activations).
    recompute = result.get("trainer_plan", {}).get("recompute_granularity", "full") == "full"
    setting = "dynamic_tokens_recompute" if recompute else "dynamic_tokens"
    row = next(
        (
            r
            for r in (memory or {}).get("rows", [])
            if r["shape"] == TRAINER_MEMORY_SHAPE.get(name) and r["setting"] == setting and not r.get("oom")
        ),
        None,
    )
    if row:
        out["trainer_tokens_per_s"] = memory["batch"] * memory["seq"] / row["step_s"]
        machine = memory.get("machine")  # trainer_memory.py writes a string, the other benchmarks a dict
        gpu = machine.get("gpu", "?") if isinstance(machine, dict) else machine
        out["trainer_source"] = f"{args.trainer_json}: {row['shape']} {setting}, {gpu}"
        out["train_s"] = per["train/tokens"] / out["trainer_tokens_per_s"]
        out["trainer_json_max_tokens_per_gpu"] = memory.get("max_tokens_per_gpu")
        out["loop_train_vs_trainer_json"] = (
            per["perf/train_time"] / out["train_s"]
        )  # the loop's train part, same tokens
    else:
        out["trainer_source"] = "no trainer JSON row for this shape: this run's own train/step_time"
        out["train_s"] = per["train/step_time"]
    out["generation_s"] = per["generated_tokens"] / rp["served_tokens_per_s"]
    out["bound_s"] = out["generation_s"] + out["train_s"]
    out["bound_with_prefill_s"] = out["bound_s"] + rp["prefill_only_s"]
    out["step_vs_bound"] = per["perf/step_time"] / out["bound_s"]
    out["step_vs_bound_with_prefill"] = per["perf/step_time"] / out["bound_with_prefill_s"]
    return out


def read_json(path: str | None) -> dict | None:
    return json.loads(Path(path).read_text()) if path and Path(path).exists() else None


def verdicts(result: dict) -> dict[str, Any]:
    if not {"per_step", "replay", "bound"} <= set(result):
        return {"ran": False}
    per, mem, bound = result["per_step"], result["gpu_memory"], result["bound"]
    prefill_s = result["replay"]["prefill_only_s"]
    saving = prefill_s / per["perf/step_time"] * result["prefix"]["repeated_share"]
    out = {
        "weight_push_share": per["perf/weight_push_time"] / per["perf/step_time"],
        "prefill_share_of_step": prefill_s / per["perf/step_time"],
        "prefill_share_of_rollout": prefill_s / per["meta_learning/inner_loop_time"],
        "prefix_cache_max_saving_share_of_step": saving,
        "prefix_cache_pays": saving >= 0.05,
        "meets": {
            "weight_push_share": per["perf/weight_push_time"] / per["perf/step_time"] <= TARGETS["weight_push_share"],
            "step_vs_bound": bound["step_vs_bound"] <= TARGETS["step_vs_bound"],
        },
    }
    target = TARGETS.get(f"peak_gpu_gib_{result['shape']}")
    if mem.get("available") and target:
        out["meets"]["peak_gpu_gib"] = mem["peak_device_gib"] <= target
    if result["shape"] in REAL_SHAPES and result.get("floor", {}).get("step_vs_floor"):
        out["meets"]["step_vs_floor"] = result["floor"]["step_vs_floor"] <= TARGETS["step_vs_floor_real"]
    if f"step_s_{result['shape']}" in TARGETS:
        out["meets"]["step_s"] = per["perf/step_time"] <= TARGETS[f"step_s_{result['shape']}"]
    return out


def print_table(report: dict) -> None:
    rows, notes = [], []
    for r in report["shapes"]:
        v = r["verdicts"]
        if not v.get("meets"):
            why = "see error" if r.get("error") else f"rc {r.get('returncode')}"
            rows.append([r["shape"], f"failed: {why}"] + [None] * 12)
            continue
        p, b, m, pre = r["per_step"], r["bound"], r["gpu_memory"], r["prefix"]
        rows.append(
            [
                r["shape"],
                p["perf/step_time"],
                p["perf/rollout_wait_time"],
                p["perf/train_time"],
                p["perf/weight_push_time"],
                p["generated_tokens"],
                pre["prefilled_tokens"],
                p["train/tokens"],
                m.get("peak_device_gib"),
                r.get("floor", {}).get("floor_s"),
                b["bound_s"],
                b["step_vs_bound"],
                v["weight_push_share"],
                pre["repeated_share"],
            ]
        )
        procs = ", ".join(f"{p['role']} {p['peak_gib']:.1f}" for p in m.get("processes", {}).values()) or "-"
        pays = "pays" if v["prefix_cache_pays"] else "does not pay"
        notes.append(
            f"{r['shape']}: per process peak GiB: {procs}; prefill {r['replay']['prefill_only_s']:.2f}s = "
            f"{v['prefill_share_of_step']:.1%} of a step; a prefix cache would save at most "
            f"{v['prefix_cache_max_saving_share_of_step']:.1%} of a step ({pays}); meets: "
            + ", ".join(f"{k}={'yes' if ok else 'NO'}" for k, ok in v["meets"].items())
        )
    print(
        C.table(
            rows,
            [
                "shape",
                "step s",
                "rollout s",
                "train s",
                "push s",
                "gen tok",
                "prefill tok",
                "train tok",
                "peak GiB",
                "floor s",
                "bound s",
                "step/bound",
                "push share",
                "prefix repeat",
            ],
        )
    )
    print_phases(report)
    print("\n".join(notes))


def print_phases(report: dict) -> None:
    """The step by phase (seconds, means over the measured steps): the rollout's dependent phases
    (the step's prefills replayed apart, inside them), the trainer's parts, the push, idle, and
    what ran at once (rollouts ahead of training)."""
    shapes = [r for r in report["shapes"] if r.get("phases")]
    if not shapes:
        return
    rollout_names = list(dict.fromkeys(n for r in shapes for n in r["phases"]["rollout_phases"]))
    rows = []
    for r in shapes:
        ph, floor = r["phases"], r["floor"]
        rows.append(
            [
                r["shape"],
                floor["floor_s"],
                r["bound"]["bound_s"],
                ph["step"],
                ph["prefill_replayed_s"],
                *[ph["rollout_phases"].get(n) for n in rollout_names],
                ph["trainer"]["forward_backward"],
                ph["trainer"]["reference_forward"],
                ph["trainer"]["optimizer"],
                ph["push"],
                ph["idle"],
                ph.get("overlapped", 0.0),
            ]
        )
    print(
        C.table(
            rows,
            [
                "shape",
                "floor s",
                "bound s",
                "step s",
                "(prefill)",
                *rollout_names,
                "fwd+bwd",
                "ref fwd",
                "optimizer",
                "push",
                "idle",
                "overlapped",
            ],
        )
    )
    for r in shapes:
        f = r["floor"]
        print(
            f"{r['shape']}: floor {f['floor_s']:.2f}s = train {f['train_s']:.2f} ({f['train_passes']} passes) + "
            f"prefill {f['prefill_s']:.2f} + decode {f['decode_s']:.3f} ({f['decode_steps']} steps) at "
            f"{f['peak_tflops']:g} TFLOP/s, {f['bandwidth_tbs']:g} TB/s; step / floor {f['step_vs_floor']:.1f}; "
            f"trainer: {r.get('trainer_plan', {}).get('line') or r.get('trainer_plan')}"
        )
        per = r["per_step"]
        for pool in sorted({k.split("/")[1].rsplit("_busy_share")[0] for k in per if k.endswith("_busy_share")}):
            seconds = {
                kind: per.get(f"worker/{pool}_{kind}_time", 0.0)
                for kind in ("prefill", "fast_decode", "dynamic_decode", "idle")
            }
            decode_steps = per.get(f"worker/{pool}_decode_steps", 0)
            rows_per_step = per.get(f"worker/{pool}_tokens_generated", 0) / max(decode_steps, 1)
            print(
                f"{r['shape']}: {pool} worker per step: "
                + ", ".join(f"{k} {v:.2f}s" for k, v in seconds.items())
                + f" (busy {per[f'worker/{pool}_busy_share']:.0%} of the step; the rollout waited"
                f" {per['perf/rollout_wait_time']:.2f}s); {decode_steps:.0f} decode"
                f" steps of {rows_per_step:.1f}"
                f" rows, {per.get(f'worker/{pool}_prefill_batches', 0):.0f} prefills"
            )
