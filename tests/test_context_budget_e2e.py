"""A full outer step with 2-3k-character problems and rubrics on a 4k-context model completes.

`python train.py` with real worker processes behind the real sglang-router, on the random 4k-context
BPE model of `helpers_context`. The data: two train problems with long rubrics (one teacher prompt
holds both, so their attempts cannot all fit), one holdout problem so long that the student's
request must be clamped, and one row too long for any prompt (reported and skipped). Before the
context budget this step ended in `HTTP 400: prompt (... tokens) + max_new_tokens (...) exceeds
the model's context length (4096)` and exit code 1.

The default variant is sized for the default suite (K=1, m=2, 384-token answers); the `slow` one
is the full shape (K=3, m=4, 512-token answers).
"""

from __future__ import annotations

import json
import os
import random
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers_context import CONTEXT_LENGTH, make_long_context_checkpoint, pseudo_text, pseudo_words, write_jsonl

from slime_meta.assembly import load_tokenizer
from slime_meta.rollout.context_budget import ELISION_MARKER

ROOT = Path(__file__).resolve().parent.parent
TEACHER_MAX_TOKENS = 32


@pytest.fixture(scope="module")
def long_checkpoint(tmp_path_factory):
    return make_long_context_checkpoint(tmp_path_factory.mktemp("long-context-e2e"))


def text_of_tokens(tokenizer, rng, words, tokens: int) -> str:
    """Pseudo-English of exactly about `tokens` tokens (cut at a token's end)."""
    text = pseudo_text(rng, words, tokens * 8)
    ends = [end for _, end in tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]]
    return text[: ends[tokens - 1]]


def dataset(path: Path, tokenizer) -> Path:
    # The holdout problem: 3,625 tokens fit the teacher's prompt (385 tokens of default template,
    # 2 x 32 for --teacher-max-tokens) but leave the student fewer than 384 new tokens.
    rng, words = random.Random(11), pseudo_words(0)
    train = [
        {"prompt": pseudo_text(rng, words, 3000), "label": str(40 + i), "rubric": pseudo_text(rng, words, 3000)}
        for i in range(2)
    ]
    holdout = {"prompt": text_of_tokens(tokenizer, rng, words, 3625), "label": "7", "rubric": ""}
    too_long = {"prompt": text_of_tokens(tokenizer, rng, words, 5000), "label": "8", "rubric": "r"}
    return write_jsonl(path, [*train, holdout, too_long])


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def run_one_step(checkpoint: Path, tmp_path: Path, *, iterations: int, attempts: int, answer_tokens: int):
    data = dataset(tmp_path / "long.jsonl", load_tokenizer(str(checkpoint)))
    run_dir = tmp_path / "run"
    args = [
        "--use-meta-learning",
        "--hf-checkpoint",
        str(checkpoint),
        "--prompt-data",
        str(data),
        "--run-dir",
        str(run_dir),
        "--rollout-batch-size",
        "3",
        "--n-samples-per-prompt",
        "2",
        "--n-problems-per-prompt",
        "2",
        "--heldout-ipb",
        "1",
        "--num-inner-iterations",
        str(iterations),
        "--n-samples-per-inner-prompt",
        str(attempts),
        "--rollout-max-response-len",
        str(answer_tokens),
        "--teacher-max-tokens",
        str(TEACHER_MAX_TOKENS),
        "--grader",
        "verifier",
        "--trace-sample-rate",
        "1",
        "--num-rollout",
        "1",
        "--seed",
        "2",
    ]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("OPENAI_API_KEY", None)
    started = time.perf_counter()
    result = subprocess.run(
        [sys.executable, str(ROOT / "train.py"), *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600
    )
    return result, run_dir, data, time.perf_counter() - started


def check_step(result, run_dir: Path, data: Path, iterations: int, tokenizer) -> dict:
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"{data}: line 4: the student's prompt of this problem needs" in result.stderr  # the row too long
    assert "skipped 1 of 4 rows" in result.stderr
    (metrics,) = read_jsonl(run_dir / "metrics.jsonl")
    # Every teacher prompt was shortened (2 problems' attempts do not fit), and it is counted.
    assert metrics["meta_learning/teacher_prompt_truncated"] == 1.0
    assert metrics["meta_learning/teacher_solutions_elided"] > 0
    # The holdout problem leaves less than --rollout-max-response-len: its requests were clamped.
    assert metrics["meta_learning/student_requests_clamped"] >= 3  # 2 chains' holdout + the control
    assert metrics["meta_learning/student_requests_skipped"] == 0
    chains = [r for r in read_jsonl(run_dir / "traces.jsonl") if r["type"] == "chain"]
    assert len(chains) == 2 and all(len(c["steps"]) == iterations + 1 for c in chains)
    marker = re.escape(ELISION_MARKER).replace(re.escape("{count}"), r"\d+")
    for chain in chains:
        for step in chain["steps"][:-1]:
            assert re.search(marker, step["teacher_prompt"]), "the trace shows where attempts were cut"
            assert len(tokenizer(step["teacher_prompt"])["input_ids"]) + TEACHER_MAX_TOKENS < CONTEXT_LENGTH
    return metrics


def test_one_outer_step_with_long_rows_on_a_4k_model_completes(long_checkpoint, tmp_path):
    result, run_dir, data, seconds = run_one_step(
        long_checkpoint, tmp_path, iterations=1, attempts=2, answer_tokens=384
    )
    metrics = check_step(result, run_dir, data, iterations=1, tokenizer=load_tokenizer(str(long_checkpoint)))
    print(f"4k context, K=1 m=2 384-token answers: step {metrics['perf/step_time']:.1f}s, whole run {seconds:.1f}s")


@pytest.mark.slow
def test_full_shape_k3_m4_512_token_answers_on_a_4k_model_completes(long_checkpoint, tmp_path):
    result, run_dir, data, seconds = run_one_step(
        long_checkpoint, tmp_path, iterations=3, attempts=4, answer_tokens=512
    )
    metrics = check_step(result, run_dir, data, iterations=3, tokenizer=load_tokenizer(str(long_checkpoint)))
    print(f"4k context, K=3 m=4 512-token answers: step {metrics['perf/step_time']:.1f}s, whole run {seconds:.1f}s")
