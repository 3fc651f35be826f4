"""`train.py` end to end on the batch split, the fixed eval sets and the holdout samples.

Real worker processes behind the real sglang-router, the random-init tiny model, the built-in
verifier: what is checked is what a step draws, sends and logs, not learning.
"""

from __future__ import annotations

import json
import os
import re
import signal
import struct
import subprocess
import sys
from pathlib import Path
from statistics import fmean

import pytest
from test_train_e2e import ROOT, VERIFIER, processes_mentioning, read_jsonl, run_train

SYNTHETIC = ROOT / "data/synthetic_suffix.jsonl"


def base_args(checkpoint: Path, run_dir: Path, *extra: str) -> list[str]:
    return [
        "--use-meta-learning",
        "--hf-checkpoint",
        str(checkpoint),
        "--prompt-data",
        str(SYNTHETIC),
        "--rollout-shuffle",
        "--n-samples-per-prompt",
        "2",
        "--num-inner-iterations",
        "1",
        "--n-samples-per-inner-prompt",
        "1",
        "--generator-template",
        "slime_meta.data.tasks.synthetic.SyntheticGeneratorTemplate",
        "--teacher-template",
        "slime_meta.data.tasks.synthetic.SyntheticTeacherTemplate",
        "--teacher-temperature",
        "1.0",
        "--teacher-max-tokens",
        "4",
        "--rollout-max-response-len",
        "8",
        *VERIFIER,
        "--seed",
        "5",
        "--run-dir",
        str(run_dir),
        *extra,
    ]


def eval_every_step(eval_file: Path) -> list[str]:
    """The fixed eval set `held`, evaluated before step 0 and after every step; no traces."""
    return ["--trace-sample-rate", "0", "--eval-prompt-data", "held", str(eval_file), "--eval-interval", "1"]


def png_width(path: Path) -> int:
    return struct.unpack(">I", path.read_bytes()[16:20])[0]


def test_the_batch_is_split_75_25_with_holdout_samples_averaged_into_the_reward(tiny_checkpoint, tmp_path):
    run_dir = tmp_path / "split"
    # 8 problems at the default ratio 0.75: 6 train (6 teacher prompts of k=1) + 2 holdout; 3 attempts each.
    result = run_train(
        base_args(
            tiny_checkpoint,
            run_dir,
            "--rollout-batch-size",
            "8",
            "--n-holdout-samples",
            "3",
            "--num-rollout",
            "1",
            "--trace-sample-rate",
            "1.0",
        )
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.count("plan per step:") == 1
    assert (
        "plan per step: 8 problems = 6 train + 2 holdout; 6 teacher prompts (GRPO groups) of 1 x 2 infos = 12 chains; "
        "requests: 12 teacher, 12 student inner + 72 holdout + 6 no-info control (each graded), in 38 student "
        "requests (n = attempts per problem)"
    ) in result.stdout
    # The student shares the teacher's weights: the terms that keep it a good student are on by default.
    assert (
        "student: shares the teacher's weights; solver-role GRPO --adv-tau 1 and k3 KL to the start weights "
        "--kl-loss-coef 0.1"
    ) in result.stdout
    objectives = json.loads((run_dir / "config.json").read_text())["objectives"]
    assert (objectives["adv_tau"], objectives["kl_loss_coef"]) == (1.0, 0.1)
    traces = read_jsonl(run_dir / "traces.jsonl")
    (batch,) = [t for t in traces if t["type"] == "batch"]
    (episode,) = batch["episodes"]
    assert [len(chunk) for chunk in episode["train"]] == [1] * 6 and len(episode["holdout"]) == 2
    assert len({uid for chunk in episode["train"] for uid in chunk} | set(episode["holdout"])) == 8  # distinct

    chains = [t for t in traces if t["type"] == "chain"]
    assert len(chains) == 12
    for chain in chains:
        holdout = chain["steps"][-1]["holdout"]
        assert sorted(a["problem_uid"] for a in holdout) == sorted(episode["holdout"] * 3)
        assert chain["reward"] == pytest.approx(fmean(a["grade"] for a in holdout))  # the mean over all H x S
    (record,) = read_jsonl(run_dir / "metrics.jsonl")
    assert record["meta_learning/num_holdout_evals"] == 12 * 2 * 3
    assert record["meta_learning/num_train_problems"] == 6.0
    assert record["train/distill_tokens"] > 0  # the solver-role GRPO term trained the no-info attempts
    # Shared pool, student client: one request per problem, its S holdout (or control) attempts
    # as n = S completions; every attempt graded on its own.
    assert record["pool/student_requests"] == 12 * 1 + 12 * 2 + 2
    assert record["grader/calls"] == 12 * 1 * 1 + 12 * 2 * 3 + 2 * 3
    assert processes_mentioning(str(run_dir)) == []


def test_fixed_eval_set_is_never_trained_on_and_is_logged_and_plotted(tiny_checkpoint, tmp_path):
    rows = [json.loads(line) for line in SYNTHETIC.read_text().splitlines() if line.strip()]
    held_rows = [i for i, row in enumerate(rows) if row["family"] in ("f00", "f01")]
    eval_file = tmp_path / "held.jsonl"
    # The same problems in other forms: other case, or a dict label. They still leave training.
    reformatted = [
        {**rows[i], "prompt": rows[i]["prompt"].upper()}
        if n % 2
        else {**rows[i], "label": {"answer": rows[i]["label"]}}
        for n, i in enumerate(held_rows)
    ]
    eval_file.write_text("".join(json.dumps(row) + "\n" for row in reformatted))
    run_dir = tmp_path / "eval"
    result = run_train(
        base_args(
            tiny_checkpoint,
            run_dir,
            "--rollout-batch-size",
            "4",
            "--num-rollout",
            "2",
            *eval_every_step(eval_file),
        )
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"{len(held_rows)} problems of {SYNTHETIC} are also in --eval-prompt-data" in result.stdout
    assert "eval held: 4 fixed problems (1 batch(es) of the plan above), every 1 steps" in result.stdout
    # Training never drew an eval problem (uids are the training file's row numbers).
    drawn = {
        uid
        for t in read_jsonl(run_dir / "traces.jsonl")
        if t["type"] == "batch"
        for e in t["episodes"]
        for uid in [*(u for chunk in e["train"] for u in chunk), *e["holdout"]]
    }
    assert drawn and not drawn & {str(i) for i in held_rows}

    records = read_jsonl(run_dir / "metrics.jsonl")
    # Before training (with step 0), after each step, and after the last (a record of its own).
    assert [r["step"] for r in records] == [0, 1, 2]
    for record in records:
        with_info, no_info = record["eval/held/holdout_grade"], record["eval/held/holdout_grade_no_info"]
        assert 0.0 <= with_info <= 1.0 and 0.0 <= no_info <= 1.0
        assert record["eval/held/gain"] == pytest.approx(with_info - no_info)
    assert "meta_learning/avg_holdout_grade" not in records[2]
    for step in (0, 1, 2):
        assert f"eval at step {step}: held holdout" in result.stdout
    assert png_width(run_dir / "holdout.png") > 1500  # the third panel: the eval set
    assert processes_mentioning(str(run_dir)) == []


def test_an_eval_whose_step_never_ran_is_written_when_the_run_is_stopped(tiny_checkpoint, tmp_path):
    """A time limit (SIGTERM) between an eval and the step record it rides with loses no eval: every
    eval the console printed is in metrics.jsonl once, the last one too, whose step was cut short.

    The stop is sent when the console shows step 1's eval; the run keeps going until it arrives (a
    tiny step takes a tenth of a second, and this reader may be seconds behind on a loaded machine),
    so it has many steps left to stop in, and the check holds wherever the stop lands."""
    rows = [json.loads(line) for line in SYNTHETIC.read_text().splitlines() if line.strip()]
    eval_file = tmp_path / "held.jsonl"
    eval_file.write_text("".join(json.dumps(row) + "\n" for row in rows if row["family"] == "f00"))
    run_dir = tmp_path / "stopped"
    steps = 200
    args = base_args(
        tiny_checkpoint,
        run_dir,
        "--rollout-batch-size",
        "4",
        "--num-rollout",
        str(steps),
        *eval_every_step(eval_file),
    )
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("OPENAI_API_KEY", None)
    run = subprocess.Popen(
        [sys.executable, str(ROOT / "train.py"), *args],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    seen = []
    try:
        for line in run.stdout:
            seen.append(line)
            if line.startswith("eval at step 1:"):
                run.send_signal(signal.SIGTERM)
                break
        output = "".join(seen) + run.stdout.read()
        run.wait(timeout=120)
    finally:
        if run.poll() is None:
            run.kill()
    printed = [int(m.group(1)) for m in re.finditer(r"^eval at step (\d+):", output, flags=re.M)]
    assert printed[:2] == [0, 1] and max(printed) < steps, output[-3000:]  # stopped, not finished

    records = read_jsonl(run_dir / "metrics.jsonl")
    with_eval = [r for r in records if "eval/held/holdout_grade" in r]
    assert [r["step"] for r in with_eval] == printed, output[-3000:]
    assert all(0.0 <= r["eval/held/holdout_grade"] <= 1.0 for r in with_eval)
    assert processes_mentioning(str(run_dir)) == []


def test_an_impossible_split_exits_2_naming_the_flags_before_anything_starts(tmp_path):
    run_dir = tmp_path / "bad"
    result = run_train(
        base_args(Path("/nonexistent/ckpt"), run_dir, "--rollout-batch-size", "6", "--n-problems-per-prompt", "2")
    )
    assert result.returncode == 2
    line = result.stderr.strip()
    assert "\n" not in line and "--rollout-batch-size 6" in line and "--n-problems-per-prompt 2" in line
    # 6 x 0.75 rounds to 5 train: not prompts of 2; 5 and 8 problems split into 4 + 1 and 6 + 2.
    assert "nearest --rollout-batch-size that works: 5 (4 train + 1 holdout) or 8 (6 train + 2 holdout)" in line
    assert not run_dir.exists()
