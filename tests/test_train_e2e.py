"""`train.py` end to end: real worker processes behind the real sglang-router, a real small model.

The model is the random-init tiny Llama of `helpers_tiny` (what it writes is noise, which is all
these tests need: they check the plumbing, not learning). Each run starts and stops its own
processes; afterwards none may be left.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SEED_METRICS = (
    "meta_learning/inner_loop_time",
    "meta_learning/avg_inner_grade",
    "meta_learning/avg_holdout_grade",
    "meta_learning/num_train_problems",
    "meta_learning/num_holdout_evals",
)


VERIFIER = ("--grader", "verifier", "--verifier-metric", "char")


def synthetic_args(checkpoint: Path, run_dir: Path, *extra: str, grader: tuple[str, ...] = VERIFIER) -> list[str]:
    return [
        "--use-meta-learning",
        "--hf-checkpoint",
        str(checkpoint),
        "--prompt-data",
        str(ROOT / "data/synthetic_suffix.jsonl"),
        "--group-key",
        "family",
        "--rollout-shuffle",
        "--rollout-batch-size",
        "8",
        "--n-samples-per-prompt",
        "3",  # 2 prompts x (2 train + 2 holdout of a family)
        "--n-problems-per-prompt",
        "2",
        "--heldout-ipb",
        "4",
        "--num-inner-iterations",
        "2",
        "--n-samples-per-inner-prompt",
        "2",
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
        *grader,
        "--lr",
        "1e-3",
        "--trace-sample-rate",
        "0.5",
        "--seed",
        "3",
        "--run-dir",
        str(run_dir),
        *extra,
    ]


def run_train(args: list[str], timeout: int = 240) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("OPENAI_API_KEY", None)  # the verifier, whatever the developer's shell holds
    return subprocess.run(
        [sys.executable, str(ROOT / "train.py"), *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def processes_mentioning(text: str) -> list[int]:
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmdline = (entry / "cmdline").read_bytes().decode(errors="replace")
            except OSError:
                continue
            if text in cmdline and int(entry.name) != os.getpid():
                pids.append(int(entry.name))
    return pids


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def batches(run_dir: Path) -> dict[int, list]:
    return {r["rollout_id"]: r["episodes"] for r in read_jsonl(run_dir / "traces.jsonl") if r["type"] == "batch"}


@pytest.fixture(scope="module")
def full_run(tiny_checkpoint, tmp_path_factory):
    """Three outer steps with a checkpoint after each, the reference for the tests below."""
    run_dir = tmp_path_factory.mktemp("full") / "run"
    result = run_train(
        synthetic_args(
            tiny_checkpoint, run_dir, "--num-rollout", "3", "--save", str(run_dir / "ckpt"), "--save-interval", "1"
        )
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return run_dir, result


def test_outer_steps_write_metrics_traces_plot_config_and_checkpoint(full_run):
    run_dir, result = full_run
    records = read_jsonl(run_dir / "metrics.jsonl")
    assert [r["step"] for r in records] == [0, 1, 2]
    for record in records:
        for name in SEED_METRICS:
            assert isinstance(record[name], float), name
        assert record["meta_learning/num_train_problems"] == 4.0  # 2 prompts x k=2
        assert record["meta_learning/num_holdout_evals"] == 2 * 3 * 2  # prompts x G x holdout
        if record["train/skipped_no_signal"]:  # all advantages 0: no forward ran, so there is no log-prob gap
            assert "train/logprob_abs_diff" not in record and record["train/loss"] == 0.0
        else:
            assert record["train/logprob_abs_diff"] < 1e-3  # trained on the very tokens the engine sampled
        assert 0.0 <= record["meta_learning/avg_holdout_grade"] <= 1.0
        parts = [record[f"perf/{name}_time"] for name in ("rollout_wait", "train", "weight_push")]
        assert all(part > 0.0 for part in parts) and abs(sum(parts) - record["perf/step_time"]) < 1e-6
    # Which steps have a reward spread depends on sampling; at least one of the three trains.
    assert any(not r["train/skipped_no_signal"] for r in records)
    chains = [r for r in read_jsonl(run_dir / "traces.jsonl") if r["type"] == "chain"]
    assert chains, "trace sample rate 0.5 must trace some chains"
    first = chains[0]["steps"][0]
    assert {"info_in", "attempts", "teacher_prompt", "teacher_response", "info_out"} <= set(first)
    assert "holdout" in chains[0]["steps"][-1]
    assert (run_dir / "holdout.png").stat().st_size > 1000
    config = json.loads((run_dir / "config.json").read_text())
    assert config["meta"]["num_inner_iterations"] == 2 and config["seed"] == 3
    assert (run_dir / "ckpt" / "latest_checkpointed_iteration.txt").read_text().strip() == "3"
    assert (run_dir / "ckpt" / "iter_0000003" / "model" / "model.safetensors").is_file()
    assert "step 3/3 [" in result.stdout and " holdout " in result.stdout
    assert "summary: 3 steps; holdout with the teacher's info " in result.stdout  # the run's result at its end
    assert processes_mentioning(str(run_dir)) == []


def test_resume_draws_the_batches_an_uninterrupted_run_would(full_run, tiny_checkpoint, tmp_path):
    reference_dir, _ = full_run
    # A run that stopped after step 2: its checkpoint directory holds iter 2 as the latest.
    stopped = tmp_path / "stopped-ckpt"
    stopped.mkdir()
    shutil.copytree(reference_dir / "ckpt" / "iter_0000002", stopped / "iter_0000002")
    (stopped / "latest_checkpointed_iteration.txt").write_text("2\n")

    # The same run directory, as after a kill during step 2: its records of steps 0-2 exist.
    run_dir = tmp_path / "resumed"
    run_dir.mkdir()
    for name in ("metrics.jsonl", "traces.jsonl"):
        shutil.copy(reference_dir / name, run_dir / name)
    result = run_train(synthetic_args(tiny_checkpoint, run_dir, "--num-rollout", "3", "--load", str(stopped)))
    assert result.returncode == 0, result.stderr[-3000:]
    records = read_jsonl(run_dir / "metrics.jsonl")
    assert [r["step"] for r in records] == [0, 1, 2]
    assert records[2]["time"] > read_jsonl(reference_dir / "metrics.jsonl")[2]["time"]  # step 2 was redone
    assert batches(run_dir)[2] == batches(reference_dir)[2]
    assert len(read_jsonl(run_dir / "metrics.jsonl.before-resume")) == 3  # nothing lost


def test_separate_student_pool_is_started_and_used(tiny_checkpoint, tmp_path):
    run_dir = tmp_path / "separate"
    result = run_train(
        synthetic_args(tiny_checkpoint, run_dir, "--num-rollout", "1", "--student-checkpoint", str(tiny_checkpoint))
    )
    assert result.returncode == 0, result.stderr[-3000:]
    (record,) = read_jsonl(run_dir / "metrics.jsonl")
    # Teacher pool: only teacher calls (2 prompts x G=3 x K=2); student pool: one request per
    # problem, its m attempts (or S holdout samples) as n completions of that one request.
    assert record["pool/teacher_requests"] == 2 * 3 * 2
    problems = 2 * 3 * (2 * 2 + 2)  # prompts x G x (K x k + holdout); one request per attempt made x m = 2
    control = 2 * 2
    assert record["pool/student_requests"] == problems + control
    assert (run_dir / "logs" / "student-worker-0.log").is_file()
    assert processes_mentioning(str(run_dir)) == []


def test_num_rollout_0_evaluates_a_teacher_with_another_student_and_trains_nothing(tiny_checkpoint, tmp_path):
    # How a trained teacher's infos carry to a student it never trained with: its model as --hf-checkpoint,
    # the other model as --student-checkpoint, --num-rollout 0 (slime's evaluation-only convention).
    held = tmp_path / "held.jsonl"
    held.write_text("".join((ROOT / "data/synthetic_suffix.jsonl").read_text().splitlines(keepends=True)[:24]))
    run_dir = tmp_path / "eval-only"
    flags = ("--num-rollout", "0", "--student-checkpoint", str(tiny_checkpoint), "--eval-baseline")
    flags += ("--context-key", "oracle_hint", "--eval-prompt-data", "held", str(held), "--eval-num-batches", "1")
    result = run_train(synthetic_args(tiny_checkpoint, run_dir, *flags))
    assert result.returncode == 0, result.stderr[-3000:]
    assert "evaluation only (--num-rollout 0)" in result.stdout
    (record,) = read_jsonl(run_dir / "metrics.jsonl")
    assert record["step"] == 0 and not any(key.startswith(("train/", "meta_learning/")) for key in record)
    assert 0 <= record["eval/held/holdout_grade"] <= 1 and 0 <= record["eval/held/holdout_grade_no_info"] <= 1
    assert record["eval/synthetic_suffix/baseline_problems"] > 0  # the baseline rides with the eval
    assert not list((run_dir / "weights").glob("v*"))  # no step, no weights pushed
    assert processes_mentioning(str(run_dir)) == []


def test_openai_compatible_grader_with_faults_and_a_key_that_never_reaches_disk(tiny_checkpoint, tmp_path):
    """The grader as a real local OpenAI-compatible server that fails 20% of calls."""
    from openai_server import run_openai_server

    canary = "sk-canary-4f1c9a0e"
    run_dir = tmp_path / "api-grader"
    with run_openai_server(rate_limit=0.1, server_error=0.05, unparseable=0.05, seed=1) as (base_url, state):
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "GRADER_KEY": canary}
        grader = (
            "--grader",
            "openai",
            "--grader-base-url",
            base_url,
            "--grader-api-key-env",
            "GRADER_KEY",
            "--grader-model",
            "judge-1",
        )
        args = synthetic_args(tiny_checkpoint, run_dir, "--num-rollout", "1", grader=grader)
        result = subprocess.run(
            [sys.executable, str(ROOT / "train.py"), *args],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=240,
        )
        assert result.returncode == 0, result.stderr[-3000:]
        assert state.requests and all(r.authorization == f"Bearer {canary}" for r in state.requests)
        assert {r.model for r in state.requests} == {"judge-1"}
        assert sum(state.fault_counts.values()) > 0
    (record,) = read_jsonl(run_dir / "metrics.jsonl")
    assert record["grader/api_retries"] > 0  # the faults were met and retried
    # every attempt was graded once: prompts x G x (K x k x m + holdout) + the no-info control
    assert record["grader/calls"] == 2 * 3 * (2 * 2 * 2 + 2) + 2 * 2
    for path in run_dir.rglob("*"):
        if path.is_file():
            assert canary.encode() not in path.read_bytes(), path
    assert canary not in result.stdout + result.stderr


def test_all_three_channels_and_context_distillation_in_one_run(tiny_checkpoint, tmp_path):
    """GRPO + SDPO + N-teacher replay DPO + context distillation + TIS + KL: 2 outer steps."""
    from openai_server import run_openai_server

    labels = {row["prompt"]: row["label"] for row in read_jsonl(ROOT / "data/synthetic_suffix.jsonl")}

    def teacher_reply(messages: list[dict]) -> str:
        # The solver prompt is `S|word=`: both replay teachers answer the label (pairs need a chosen
        # side that is correct by the label).
        prompt = messages[-1]["content"]
        word = prompt.split("|", 1)[1].rstrip("=")
        return f"{labels[word]}."

    run_dir = tmp_path / "channels"
    with (
        run_openai_server(reply_fn=teacher_reply) as (url_a, _),
        run_openai_server(reply_fn=teacher_reply) as (url_b, _),
    ):
        result = run_train(
            synthetic_args(
                tiny_checkpoint,
                run_dir,
                "--num-rollout",
                "2",
                "--distill-context",
                "additional_info",
                "--teacher-tau",
                "0.5",
                "--student-tau",
                "0.5",
                "--sdpo-alpha",
                "0.5",
                "--sdpo-on",
                "all",
                "--sdpo-topk",
                "8",
                "--no-sdpo-topk-tail",
                "--replay-beta",
                "0.5",
                "--replay-teachers",
                f"ta@{url_a}",
                f"tb@{url_b}",
                "--replay-min-agree",
                "2",
                "--use-tis",
                "--kl-loss-coef",
                "0.01",
                "--kl-loss-type",
                "k3",
                "--entropy-coef",
                "0.001",
            )
        )
    assert result.returncode == 0, result.stderr[-3000:]
    records = read_jsonl(run_dir / "metrics.jsonl")
    assert [r["step"] for r in records] == [0, 1]
    for r in records:
        for key in ("loss/grpo", "loss/sdpo_kl", "loss/trace_replay_dpo", "loss/total", "combined_advantage"):
            assert r[key] is not None and r[key] == r[key], key  # present and not NaN
        assert r["solver/num_samples"] == 2 * 3 * 2 * 2  # prompts x G x k x m first-round attempts
        assert r["train/sdpo_tokens"] > 0 and r["train/kl_ref"] >= 0.0
        assert r["train/replay_pairs"] > 0  # the teachers agree on the label, the random policy does not
        assert r["loss/total"] == pytest.approx(
            r["loss/grpo"] + 0.5 * r["loss/sdpo_kl"] + 0.5 * r["loss/trace_replay_dpo"], rel=1e-5
        )
        assert "distill/teacher_minus_student_logp" in r
    cached = read_jsonl(run_dir / "replay_pairs.jsonl")
    assert cached, "replay decisions are cached in the run dir"
    assert any(r["kind"] == "reference" for r in cached)  # each pair's start-weights log-probs, once


def test_distillation_from_a_context_column_with_baseline_eval(tiny_checkpoint, tmp_path):
    run_dir = tmp_path / "column-context"
    result = run_train(
        synthetic_args(
            tiny_checkpoint,
            run_dir,
            "--num-rollout",
            "1",
            "--context-key",
            "oracle_hint",
            "--teacher-tau",
            "1.0",
            "--student-tau",
            "1.0",
            "--eval-baseline",
        )
    )
    assert result.returncode == 0, result.stderr[-3000:]
    (record,) = read_jsonl(run_dir / "metrics.jsonl")
    student, teacher = (
        record["eval/synthetic_suffix/baseline_student/avg"],
        record["eval/synthetic_suffix/baseline_teacher/avg"],
    )
    assert 0.0 <= student <= 1.0 and 0.0 <= teacher <= 1.0
    assert record["eval/synthetic_suffix/baseline_diff"] == pytest.approx(teacher - student)
    assert record["solver/num_samples"] > 0 and "distill/teacher_minus_student_logp" in record


def test_async_rollouts_draw_the_same_batches_and_stay_within_the_staleness_bound(full_run, tiny_checkpoint, tmp_path):
    reference_dir, _ = full_run
    run_dir = tmp_path / "async"
    result = run_train(
        synthetic_args(
            tiny_checkpoint,
            run_dir,
            "--num-rollout",
            "3",
            "--max-async-level",
            "1",
            "--save",
            str(run_dir / "ckpt"),
            "--save-interval",
            "1",
        )
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert batches(run_dir) == batches(reference_dir)  # drawn in step order, whatever overlaps
    records = read_jsonl(run_dir / "metrics.jsonl")
    # Within the bound; whether a given step's trained samples caught the older weights depends on
    # timing (the push may land before the chain's last teacher call), so only the bound is checked.
    staleness = [(r["step"], r["async/max_staleness"], r["train/skipped_no_signal"]) for r in records]
    assert all(0 <= stale <= 1 for _, stale, _ in staleness), f"(step, max staleness, skipped): {staleness}"
    for step in (1, 2):  # the data cursor saved after step t is the one before step t+1's draw
        ours = json.loads((run_dir / "ckpt" / f"iter_{step:07d}" / "state.json").read_text())
        reference = json.loads((reference_dir / "ckpt" / f"iter_{step:07d}" / "state.json").read_text())
        assert ours == reference
