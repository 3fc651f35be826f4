"""The grader is never chosen silently, and its failures say why: through a real `python train.py` process."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
KEY_ENV = "SLIME_META_TEST_CHOICE_KEY"


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def train(tmp_path: Path, checkpoint: Path, *flags: str) -> subprocess.CompletedProcess:
    data = tmp_path / "rows.jsonl"
    data.write_text(
        "".join(json.dumps({"prompt": f"q{i}", "label": str(i), "rubric": "exact"}) + "\n" for i in range(8))
    )
    env = {k: v for k, v in os.environ.items() if k not in (KEY_ENV, "OPENAI_API_KEY")}
    command = [
        sys.executable,
        str(ROOT / "train.py"),
        "--use-meta-learning",
        "--hf-checkpoint",
        str(checkpoint),
        "--prompt-data",
        str(data),
        "--run-dir",
        str(tmp_path / "run"),
        *flags,
    ]
    return subprocess.run(command, capture_output=True, text=True, cwd=ROOT, env=env, timeout=180)


@pytest.mark.parametrize(
    "flags, asked",
    [
        (["--grader-model", "judge-x", "--grader-api-key-env", KEY_ENV], "--grader-model judge-x"),
        (["--grader", "openai", "--grader-api-key-env", KEY_ENV], "--grader openai"),
    ],
)
def test_a_named_llm_grader_without_its_key_exits_2_naming_the_variable(flags, asked, tmp_path, tiny_checkpoint):
    result = train(tmp_path, tiny_checkpoint, *flags)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and f"${KEY_ENV}" in lines[0] and asked in lines[0], result.stderr
    assert "verifier (" not in result.stdout  # it never started grading with the verifier


def test_the_start_line_says_which_grader_and_that_the_verifier_ignores_rubrics(tmp_path, tiny_checkpoint):
    # The unreachable student server stops the run right after the grader is chosen.
    port = str(closed_port())
    result = train(tmp_path, tiny_checkpoint, "--external-student-url", f"http://127.0.0.1:{port}")
    grader_lines = [line for line in result.stdout.splitlines() if line.startswith("grader:")]
    assert grader_lines == [
        "grader: the built-in verifier (normalized) against the labels; it does not read rubrics "
        "(column 'rubric' is not used for grading; an LLM grader would use it)"
    ], result.stdout + result.stderr
    assert result.returncode == 2 and "--external-student-url" in result.stderr


def test_a_named_llm_grader_with_a_server_says_so_at_start(tmp_path, tiny_checkpoint):
    port = str(closed_port())
    result = train(
        tmp_path,
        tiny_checkpoint,
        "--grader-model",
        "judge-x",
        "--grader-base-url",
        "http://127.0.0.1:9/v1",
        "--external-student-url",
        f"http://127.0.0.1:{port}",
    )
    grader_lines = [line for line in result.stdout.splitlines() if line.startswith("grader:")]
    assert len(grader_lines) == 1 and "LLM grader judge-x at http://127.0.0.1:9/v1" in grader_lines[0]
    assert "rubrics from column 'rubric'" in grader_lines[0]


def test_a_run_whose_self_hosted_grader_answers_too_slowly_names_grader_timeout(tmp_path, tiny_checkpoint):
    """A timed test, as the case needs: the server answers after 5 s, the run's grader waits 0.5 s."""
    from openai_server import run_openai_server

    synthetic_task = [
        "--prompt-data",
        str(ROOT / "data" / "synthetic_suffix.jsonl"),  # replaces the helper's rows
        "--generator-template",
        "slime_meta.data.tasks.synthetic.SyntheticGeneratorTemplate",
        "--teacher-template",
        "slime_meta.data.tasks.synthetic.SyntheticTeacherTemplate",
        "--rollout-batch-size",
        "4",
        "--n-samples-per-prompt",
        "2",
        "--num-inner-iterations",
        "1",
        "--n-samples-per-inner-prompt",
        "1",
        "--rollout-max-response-len",
        "8",
        "--teacher-max-tokens",
        "4",
        "--num-rollout",
        "1",
    ]
    with run_openai_server(slow=1.0, slow_seconds=5.0) as (base_url, server):
        grader = ["--grader-model", "judge", "--grader-base-url", base_url, "--grader-timeout", "0.5"]
        result = train(tmp_path, tiny_checkpoint, *synthetic_task, *grader, "--request-timeout", "900")
    assert result.returncode == 2, result.stderr[-2000:]
    # After the progress bar's carriage returns: the error ends the line the bar was drawing.
    errors = [line[line.index("error:") :] for line in result.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1 and "timed out after 0.5 s (--grader-timeout)" in errors[0], result.stderr[-2000:]
    assert base_url in errors[0] and "key" not in errors[0].lower()
    assert server.requests  # the student answered and the grader was asked
