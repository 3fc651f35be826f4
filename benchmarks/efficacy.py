"""Learning efficacy on a synthetic task or with the real model, through the real train.py loop.

    python benchmarks/efficacy.py                      # 60 outer steps on this machine
    python benchmarks/efficacy.py --steps 20 --quick   # a short check
    python benchmarks/efficacy.py --task bracket       # the task whose teacher never saw the key
    python benchmarks/efficacy.py --task easy_word_problems --steps 400 --time-limit-s 560 --trace-rate 0.05
                                                       # SmolLM2-135M-Instruct on real language (one GPU)

The task is the suffix task (data/synthetic_suffix.jsonl) unless `--task` names another
(docs/tasks.md); it selects the data, templates and small model in scripts/run_synthetic.sh, or,
for `easy_word_problems` and `champ`, the data of scripts/run_real.sh (the real model, default
prompts, the built-in verifier; R_oracle is the student's grade with the hand-written or human hint).

The student is a frozen copy of the starting model (its own pool) unless `--shared-student`: in
shared mode the student is the model being trained, and train.py's shared-student defaults add
the terms that keep its own skill from drifting in long runs (`--adv-tau 1 --kl-loss-coef 0.1`;
docs/performance.md, section 6).

Normalised gain = (R - R_no_info) / (R_oracle - R_no_info), where R is the holdout grade with the
teacher's info (mean of the last `--window` steps), R_no_info the no-info control measured in the
same steps, and R_oracle the student's grade with the perfect hint (the `oracle_hint` column,
measured before training by `--eval-baseline`). Writes JSON and the run's curve (PNG) to --out.

Gain over the start = (R_end - R_start) / (R_oracle - R_start), from the same run: R_start the
holdout grade of the first `--window` steps, R_end that of the last. It is the share of the room
left at the start that RL closed; the normalised gain also counts what the starting teacher
already knew (on the suffix task the small model is pretrained with the correct hint half of the
time; on the bracket task never, so there the two figures nearly agree).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from statistics import fmean
from typing import Callable

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # slime_meta.artifacts.plot from this checkout

from slime_meta.artifacts.plot import plot_run  # noqa: E402
from slime_meta.artifacts.tracking import (  # noqa: E402
    gain_interval,
    read_metrics,
    reference_grade_se,
    reference_grades,
    step_records,
)
from slime_meta.artifacts.train_state import POINTER  # noqa: E402

SYNTHETIC_TASKS = ("synthetic_suffix", "bracket")  # tiny models built by the project (scripts/run_synthetic.sh)
# A real model on real language (scripts/run_real.sh).
REAL_TASKS = ("easy_word_problems", "price_lists", "price_keys", "house_rules", "champ")
LEGACY_BASELINE_PROBLEMS = 32  # --eval-baseline before --eval-baseline-problems: 32 problems, one attempt each


def gpu_name() -> str | None:
    """The first GPU's name as nvidia-smi gives it (None without one): the run's card, in its JSON."""
    try:
        done = subprocess.run(
            ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True, timeout=30
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.splitlines()[0].strip() if done.returncode == 0 and done.stdout.strip() else None


def resume_step(checkpoints: Path) -> int | None:
    """The first step a run resumed from `checkpoints` trains (None: no checkpoint there yet)."""
    pointer = checkpoints / POINTER
    if not pointer.exists():
        return None
    try:
        iteration = int(pointer.read_text().strip())
        state = json.loads((checkpoints / f"iter_{iteration:07d}" / "state.json").read_text())
        return int(state["next_rollout_id"])
    except (OSError, ValueError, KeyError) as error:  # json's errors are ValueErrors
        print(
            f"--run-dir: {checkpoints} holds no readable checkpoint ({error}); give a run dir whose "
            f"{POINTER} names a complete iter_* directory, or a new run dir",
            file=sys.stderr,
        )
        raise SystemExit(2) from None


def resume_steps(run_dir: Path) -> list[int]:
    """The steps at which this run dir was resumed, oldest first (kept in the run dir)."""
    path = run_dir / "efficacy_resumes.json"
    return json.loads(path.read_text()) if path.exists() else []


def training_elapsed(records: list[dict], run_dir: Path) -> list[float]:
    """Training time at each step's end: the time between consecutive steps' records, except that
    the first step of the run and of each resume counts its own step time (not the restart)."""
    restarts = {records[0]["step"], *resume_steps(run_dir)}
    elapsed, total = [], 0.0
    for previous, r in zip([None, *records], records):
        # A record without the local backend's step time (slime's) starts its count at 0.
        total += r.get("perf/step_time", 0.0) if r["step"] in restarts else r["time"] - previous["time"]
        elapsed.append(total)
    return elapsed


def legacy_oracle_se(r_oracle: float) -> tuple[float | None, str]:
    """R_oracle's standard error for runs that did not record it. --eval-baseline then graded one attempt
    (0 or 1) at each of 32 problems: the binomial error of that proportion, where the grade is a multiple
    of 1/32; otherwise (an older measure) it is not known."""
    hits = r_oracle * LEGACY_BASELINE_PROBLEMS
    if abs(hits - round(hits)) > 1e-6:
        return None, "not recorded, and not one attempt at each of 32 problems: unknown"
    # Agresti-Coull's adjusted proportion: 32 hits of 32 do not make an error of 0.
    n = LEGACY_BASELINE_PROBLEMS + 4
    adjusted = (round(hits) + 2) / n
    se = math.sqrt(adjusted * (1 - adjusted) / n)
    return se, f"binomial (Agresti-Coull): one 0/1 attempt at each of {LEGACY_BASELINE_PROBLEMS} problems (older runs)"


def run_figures(records: list[dict], run_dir: Path, args: argparse.Namespace) -> dict:
    """The run's figures from its metrics records: per-step figures from the step records, the
    eval curve from every record (an eval-only record, the final eval's or one evaluated just
    before a stop, holds an eval and no step)."""
    steps = step_records(records)
    if not steps:
        raise SystemExit(f"[efficacy] {run_dir / 'metrics.jsonl'} holds no finished step; nothing to report")
    name = args.task  # the eval set is named after the data file's stem: data/<task>.jsonl
    # --eval-baseline's figures are named after the training data file: data/<task>.jsonl locally, the
    # converted prompts.slime.jsonl on slime; either way the first step holds exactly one set of them.
    oracles = reference_grades([dict(steps[0])])
    r_oracle = oracles[name] if name in oracles else oracles[next(iter(oracles))] if len(oracles) == 1 else None
    if r_oracle is None:
        raise SystemExit(f"[efficacy] {run_dir}: the first step holds no single R_oracle (--eval-baseline): {oracles}")
    r_final = fmean(r["meta_learning/avg_holdout_grade"] for r in steps[-args.window :])
    r_start = fmean(r["meta_learning/avg_holdout_grade"] for r in steps[: args.window])
    r_no_info = fmean(r["meta_learning/holdout_grade_no_info"] for r in steps)

    def gain(r: float) -> float:
        return (r - r_no_info) / (r_oracle - r_no_info) if r_oracle > r_no_info else float("nan")

    # What RL added: the share of the room left at the start (R_start to R_oracle) that it closed.
    gain_over_start = (r_final - r_start) / (r_oracle - r_start) if r_oracle > r_start else float("nan")

    # Elapsed training time at each step's end, from the start of step 0 (the model build and the
    # workers' start are in `wall_s`, not here); a resumed run's restart is not training time.
    elapsed = training_elapsed(steps, run_dir)
    within = [r for r, t in zip(steps, elapsed) if args.budget_s is None or t <= args.budget_s]
    r_budget = fmean(r["meta_learning/avg_holdout_grade"] for r in within[-args.window :]) if within else float("nan")
    # Gain and no-info control per consecutive block of --block steps: does the gain hold?
    blocks = [steps[i : i + args.block] for i in range(0, len(steps), args.block)]
    by_block = [
        {
            "first_step": b[0]["step"],
            "last_step": b[-1]["step"],
            "holdout": fmean(r["meta_learning/avg_holdout_grade"] for r in b),
            "no_info": fmean(r["meta_learning/holdout_grade_no_info"] for r in b),
            "normalised_gain": gain(fmean(r["meta_learning/avg_holdout_grade"] for r in b)),
        }
        for b in blocks
    ]
    # The fixed eval sets of problems never trained on, when the run has them: `eval_curve` that of
    # data/<task>_eval.jsonl, `eval_curves` every one by name (the shop tasks' new shops beside it).
    eval_names = sorted({k.split("/")[1] for r in records for k in r if re.fullmatch(r"eval/[^/]+/holdout_grade", k)})
    eval_curves = {
        eval_name: [
            {
                "step": r["step"],
                "holdout": r[f"eval/{eval_name}/holdout_grade"],
                "no_info": r[f"eval/{eval_name}/holdout_grade_no_info"],
            }
            for r in records
            if f"eval/{eval_name}/holdout_grade" in r
        ]
        for eval_name in eval_names
    }
    eval_curve = eval_curves.get(f"{name}_eval", [])
    curve = [
        {
            "step": r["step"],
            "elapsed_s": round(t, 2),
            "holdout": r["meta_learning/avg_holdout_grade"],
            "no_info": r["meta_learning/holdout_grade_no_info"],
        }
        for r, t in zip(steps, elapsed)
    ]
    # Each gain's 95% interval: the holdout's and the control's errors over their steps, R_oracle's over its
    # problems (recorded by --eval-baseline since it measures several attempts a problem; absent before).
    oracle_ses = reference_grade_se([dict(steps[0])])
    r_oracle_se = oracle_ses.get(name, next(iter(oracle_ses.values()), None))
    r_oracle_se_source = "recorded: over --eval-baseline-problems, each the mean of its attempts"
    if r_oracle_se is None:
        r_oracle_se, r_oracle_se_source = legacy_oracle_se(r_oracle)
    holdout = [r["meta_learning/avg_holdout_grade"] for r in steps]
    controls = [r["meta_learning/holdout_grade_no_info"] for r in steps]
    intervals = {
        f"normalised_gain_{which}_steps_interval": [
            bound if math.isfinite(bound) else None
            for bound in gain_interval(part, controls, r_oracle, r_oracle_se)[1:]
        ]
        for which, part in (("first", holdout[: args.window]), ("last", holdout[-args.window :]))
    }
    return {
        "steps": len(steps),
        "r_oracle": r_oracle,
        "r_oracle_se": r_oracle_se,
        "r_oracle_se_source": r_oracle_se_source,
        "r_no_info": r_no_info,
        "r_first_steps": r_start,
        "r_last_steps": r_final,
        "normalised_gain_first_steps": gain(r_start),
        "normalised_gain_last_steps": gain(r_final),
        **intervals,
        "gain_over_start": gain_over_start,
        "budget_s": args.budget_s,
        "steps_within_budget": len(within),
        "training_s": elapsed[-1],
        "resumed_at_steps": resume_steps(run_dir),
        "normalised_gain_within_budget": gain(r_budget),
        "block_steps": args.block,
        "by_block": by_block,
        "curve": curve,
        "eval_curve": eval_curve,
        "eval_curves": eval_curves,
    }


def _interrupt(signum: int, frame) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def run_to_the_end(start: Callable[[], subprocess.Popen], time_limit_s: float | None) -> int | None:
    """Start the run (`start`, a session of its own) and wait: its exit code, or None when
    `time_limit_s` stopped it (SIGTERM to its session).

    The run has a session of its own, so that the time limit stops every process of it; the same
    makes it deaf to a Ctrl-C or a SIGTERM meant for this script. Both are passed on, and this
    script waits for the run to stop before it ends: a stopped benchmark leaves no run going. A
    signal while the run starts is held until `start` has handed the run back, so that it too is
    passed on (raised at once, it would leave a run started but not yet known here)."""
    held: list[int] = []
    previous_int = signal.signal(signal.SIGINT, lambda signum, frame: held.append(signum))
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: held.append(signum))
    process = None
    try:
        try:
            process = start()
        finally:
            signal.signal(signal.SIGINT, previous_int)
            signal.signal(signal.SIGTERM, _interrupt)
        if held:
            raise KeyboardInterrupt(f"signal {held[0]}")
        try:
            return process.wait(timeout=time_limit_s)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGTERM)
            process.wait()
            return None
    except KeyboardInterrupt:
        print("[efficacy] stopping the run (its checkpoint and metrics so far stay)", flush=True)
        if process is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGTERM)
            process.wait()
        raise
    finally:
        signal.signal(signal.SIGTERM, previous)


def run(args: argparse.Namespace) -> dict:
    out = Path(args.out)
    run_dir = Path(args.run_dir) if args.run_dir else out / f"efficacy-{time.strftime('%Y%m%d-%H%M%S')}"
    # A run dir with a checkpoint is resumed from it (--load): its weights, optimizer, data cursor.
    resumed_at = resume_step(run_dir / "checkpoints")
    if resumed_at is not None:
        args.extra = [*args.extra, "--load", str(run_dir / "checkpoints")]
        print(f"[efficacy] resuming {run_dir} at step {resumed_at}", flush=True)
    if args.task in REAL_TASKS:  # the real model; run_real.sh measures R_oracle and R_no_info itself
        command = ["bash", str(ROOT / "scripts/run_real.sh"), "--trace-sample-rate", str(args.trace_rate), *args.extra]
    else:
        command = [
            "bash",
            str(ROOT / "scripts/run_synthetic.sh"),
            "--context-key",
            "oracle_hint",
            "--eval-baseline",  # R_oracle and R_no_info before training
            "--trace-sample-rate",
            str(args.trace_rate),
            *args.extra,
        ]
    # FROZEN_STUDENT from the caller's environment never leaks in: --shared-student decides.
    env = {k: v for k, v in os.environ.items() if k != "FROZEN_STUDENT"}
    env.update(RUN_DIR=str(run_dir), NUM_ROLLOUT=str(args.steps), PYTHON=sys.executable, TASK=args.task, DATA=args.task)
    if not args.shared_student:
        env["FROZEN_STUDENT"] = "1"
    if args.model_dir:
        env["MODEL_DIR"] = args.model_dir
    if args.model:
        env["MODEL"] = args.model
    if resumed_at is not None:
        run_dir.joinpath("efficacy_resumes.json").write_text(json.dumps([*resume_steps(run_dir), resumed_at]))
    started = time.perf_counter()
    # A time limit ends the run early (SIGTERM: its processes stop, the steps so far stay in
    # metrics.jsonl) and the figures are read from the steps it finished.
    returncode = run_to_the_end(
        lambda: subprocess.Popen(command, cwd=ROOT, env=env, start_new_session=True), args.time_limit_s
    )
    if returncode is None:
        print(f"[efficacy] stopped at the --time-limit-s of {args.time_limit_s:.0f} s", flush=True)
    elif returncode != 0:
        raise SystemExit(f"[efficacy] the run failed (exit code {returncode}); its output is above")
    wall = time.perf_counter() - started
    figures = run_figures(read_metrics(run_dir), run_dir, args)
    result = {
        "benchmark": "efficacy",
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{platform.node()} {platform.machine()} ({os.cpu_count()} cpus)",
        "gpu": gpu_name(),
        "command": " ".join(sys.argv),
        "wall_s": wall,
        **figures,
        "task": args.task,
        "model": args.model or ("from --model-dir" if args.model_dir else None),
        "student": "shared" if args.shared_student else "frozen",
        "run_dir": str(run_dir),
        "plot": str(out / "efficacy.png"),
    }
    # The run's picture next to the JSON: holdout with info, the no-info control, R_oracle's line,
    # and the eval sets' panel when the run had any.
    plot_run(run_dir, out / "efficacy.png")
    (out / "efficacy.json").write_text(json.dumps(result, indent=2))
    return result


def summarise(args: argparse.Namespace) -> dict:
    """The figures of a run directory already there (a run on a cluster, say), without running anything."""
    out, run_dir = Path(args.out), Path(args.summarise)
    if not (run_dir / "metrics.jsonl").is_file():
        print(f"--summarise: {run_dir / 'metrics.jsonl'} not found; give the run's directory", file=sys.stderr)
        raise SystemExit(2)
    result = {
        "benchmark": "efficacy",
        "summarised_from": str(run_dir),
        "command": " ".join(sys.argv),
        "wall_s": None,
        **run_figures(read_metrics(run_dir), run_dir, args),
        "task": args.task,
        "plot": str(out / "efficacy.png"),
    }
    plot_run(run_dir, out / "efficacy.png")
    (out / "efficacy.json").write_text(json.dumps(result, indent=2))
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument(
        "--task",
        default="synthetic_suffix",
        choices=SYNTHETIC_TASKS + REAL_TASKS,
        help="The task (default synthetic_suffix; bracket: a teacher that never saw the key; "
        "easy_word_problems, price_lists, price_keys, house_rules or champ: a real model, scripts/run_real.sh).",
    )
    parser.add_argument(
        "--time-limit-s",
        type=float,
        default=None,
        help="Stop the run after this many seconds (model start included) and report the steps done.",
    )
    parser.add_argument(
        "--trace-rate",
        type=float,
        default=0.0,
        help="--trace-sample-rate of the run (traces of the teacher's hints; 0: none).",
    )
    parser.add_argument("--window", type=int, default=10, help="Steps averaged for the first and last grades.")
    parser.add_argument(
        "--block", type=int, default=50, help="Steps per block of the per-block gain and no-info control."
    )
    parser.add_argument("--out", default="runs/benchmarks")
    parser.add_argument(
        "--run-dir",
        default=None,
        help="The run's directory (default: a new one under --out). If it holds a checkpoint, the run "
        "resumes from it and the figures cover all its steps, its training time without the restarts.",
    )
    parser.add_argument(
        "--shared-student",
        action="store_true",
        help="The student is the model being trained (the demo's setting, with its solver GRPO and k3 KL terms); "
        "default: a frozen copy of the start model.",
    )
    parser.add_argument(
        "--budget-s",
        type=float,
        default=None,
        help="Also report the gain of the last window of steps that ended within this many seconds of training.",
    )
    parser.add_argument(
        "--model-dir", default=None, help="A built tiny checkpoint (default: build or reuse the cached one)."
    )
    parser.add_argument(
        "--model",
        default=None,
        choices=("smollm2-135m", "qwen2.5-coder-0.5b"),
        help="The real model of a real task, by name (python -m slime_meta.models.real; default smollm2-135m).",
    )
    parser.add_argument("--quick", action="store_true", help="3 steps, window 1: checks that it runs.")
    parser.add_argument("extra", nargs="*", help="Extra train.py flags after --, e.g. -- --lr 3e-4")
    parser.add_argument(
        "--summarise",
        metavar="RUN_DIR",
        default=None,
        help="Run nothing: the figures of a finished run's directory (any backend), as JSON and PNG in --out.",
    )
    args = parser.parse_args()
    if args.quick:
        args.steps, args.window = 3, 1
    Path(args.out).mkdir(parents=True, exist_ok=True)
    r = summarise(args) if args.summarise else run(args)
    print()
    print(
        f"{'steps':>6} {'wall s':>7} {'train s':>7} {'R_no_info':>9} {'R_oracle':>8} {'R first':>7} {'R last':>7} "
        f"{'gain first':>10} {'gain last':>9} {'gain in budget':>14} {'over start':>10}"
    )
    print(
        f"{r['steps']:>6} {r['wall_s'] or float('nan'):>7.0f} {r['training_s']:>7.0f} "
        f"{r['r_no_info']:>9.3f} {r['r_oracle']:>8.3f} "
        f"{r['r_first_steps']:>7.3f} {r['r_last_steps']:>7.3f} {r['normalised_gain_first_steps']:>10.3f} "
        f"{r['normalised_gain_last_steps']:>9.3f} {r['normalised_gain_within_budget']:>14.3f} "
        f"{r['gain_over_start']:>10.3f}"
    )
    # Each eval set's first and last eval: with the teacher's info and without (the lift is the difference).
    for eval_name, curve in r["eval_curves"].items():
        if curve:
            first, last = curve[0], curve[-1]
            print(
                f"eval {eval_name}: step {first['step']} {first['holdout']:.3f} (no info {first['no_info']:.3f}), "
                f"step {last['step']} {last['holdout']:.3f} (no info {last['no_info']:.3f})"
            )


if __name__ == "__main__":
    main()
