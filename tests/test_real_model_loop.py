"""The shipped real model (SmolLM2-135M-Instruct) through train.py, as a user runs it.

Real parts throughout: the model converted from its PyPI GGUF (tests/helpers_real.py), train.py
in a subprocess with the default prompts and the default chat-template handling, worker processes
behind the real sglang-router, the built-in verifier or an LLM grader the run serves itself
(`--grader local`), the torch trainer. What is checked is what a user needs from the first step:
answers the grader can read (some grade above 0) and a gradient that is not zero.
"""

from __future__ import annotations

import json

from test_train_e2e import ROOT, processes_mentioning, run_train

EASY_DATA = ROOT / "data/easy_word_problems.jsonl"


def read_jsonl(path):
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def small_step_args(checkpoint, run_dir, *extra: str) -> list[str]:
    return [
        "--use-meta-learning",
        "--hf-checkpoint",
        str(checkpoint),
        "--prompt-data",
        str(EASY_DATA),
        "--rollout-batch-size",
        "4",
        "--heldout-ipb",
        "2",
        "--n-samples-per-prompt",
        "4",
        "--num-inner-iterations",
        "1",
        "--n-samples-per-inner-prompt",
        "3",
        "--num-rollout",
        "1",
        "--teacher-max-tokens",
        "48",
        "--rollout-max-response-len",
        "96",
        "--seed",
        "1",
        "--trace-sample-rate",
        "1",
        "--run-dir",
        str(run_dir),
        *extra,
    ]


def test_one_outer_step_with_default_prompts_gives_grades_and_a_gradient(real_checkpoint, tmp_path):
    # About 1 in 10 of this model's sampled answers is right, so a step of 34 answers is all wrong,
    # or its right answers fall where no teacher sample's reward differs from another's (no gradient),
    # in a few runs of a hundred (sampling order varies with batching whatever the seed): a second,
    # independent step is drawn only then. Both without a signal fails.
    for seed in ("1", "2"):
        run_dir = tmp_path / f"real-step-{seed}"
        args = small_step_args(real_checkpoint, run_dir, "--grader", "verifier", "--seed", seed)
        result = run_train(args, timeout=900)
        assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
        (record,) = read_jsonl(run_dir / "metrics.jsonl")
        grades = [
            record["meta_learning/avg_inner_grade"],
            record["meta_learning/avg_holdout_grade"],
            record["meta_learning/holdout_grade_no_info"],
        ]
        if max(grades) > 0 and not record.get("train/skipped_no_signal", 0):
            break
    assert max(grades) > 0, (grades, result.stdout[-3000:])
    # The default renders every role with the model's own chat template (the tokenizer has one).
    (line,) = [x for x in result.stdout.splitlines() if x.startswith("prompts:")]
    assert "chat template" in line and "student the same" in line, line
    assert record["train/grad_norm"] > 0 and record.get("train/skipped_no_signal", 0) == 0, record
    # The student saw its problems in the model's chat format and answered (not an instant end of turn).
    traces = (run_dir / "traces.jsonl").read_text()
    assert "<|im_start|>assistant" in traces
    assert processes_mentioning(str(run_dir)) == []


def test_grader_local_serves_the_real_model_and_grades_every_attempt(real_checkpoint, tmp_path):
    # What is checked is that the run serves the grader and every attempt reaches it, not what the
    # grades are: the smallest step (one teacher prompt, one holdout problem, short generations)
    # sends every kind of attempt (inner, holdout, no-info control) to it.
    run_dir = tmp_path / "local-grader"
    args = small_step_args(
        real_checkpoint,
        run_dir,
        "--grader",
        "local",
        "--grader-max-tokens",
        "8",
        "--rollout-batch-size",
        "2",
        "--heldout-ipb",
        "1",
        "--n-samples-per-prompt",
        "2",
        "--n-samples-per-inner-prompt",
        "1",
        "--teacher-max-tokens",
        "16",
        "--rollout-max-response-len",
        "16",
    )
    result = run_train(args, timeout=900)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    (line,) = [x for x in result.stdout.splitlines() if x.startswith("grader:")]
    assert "served by this run" in line and str(real_checkpoint) in line and "no API key" in line
    (record,) = read_jsonl(run_dir / "metrics.jsonl")
    # 1 teacher prompt x G=2 chains x (K=1 x m=1 inner + 1 holdout problem) + 1 no-info control answer
    assert record["grader/calls"] == 1 * 2 * (1 + 1) + 1
    assert any(path.name.startswith("grader") for path in (run_dir / "logs").iterdir())
    assert processes_mentioning(str(run_dir)) == []
