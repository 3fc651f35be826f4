"""No request may end a run for its length: the teacher prompt fits by construction, student
requests are clamped, flags and rows that can never fit are refused or skipped at start.

Real parts throughout: the real default templates, real tokenizers (the character-level demo-size
model of `helpers_tiny`, 256 positions, and the 4k-context BPE model of `helpers_context`), and
`train.main` for what the user sees. The end-to-end runs are in test_context_budget_e2e.py.
"""

from __future__ import annotations

import random
import re

import pytest
from helpers_context import (
    CONTEXT_LENGTH,
    long_rows,
    make_long_context_checkpoint,
    pseudo_text,
    pseudo_words,
    write_jsonl,
)

import train
from slime_meta.assembly import load_tokenizer
from slime_meta.backends.local.data import check_context_fits, load_data
from slime_meta.config.arguments import parse_config
from slime_meta.prompt_templates import TeacherPromptTemplate
from slime_meta.rollout.context_budget import ELISION_MARKER, TokenCounter, context_length_of, metrics_of
from slime_meta.rollout.roles import PromptRenderer, TeacherRole
from slime_meta.types import Grade, GradedAttempt, Problem

MARKER_RE = re.escape(ELISION_MARKER).replace(re.escape("{count}"), r"\d+")


@pytest.fixture(scope="module")
def long_checkpoint(tmp_path_factory):
    return make_long_context_checkpoint(tmp_path_factory.mktemp("long-context"))


@pytest.fixture(scope="module")
def long_tokenizer(long_checkpoint):
    return load_tokenizer(str(long_checkpoint))


def problems_and_attempts(k: int, m: int, solution_chars: int, iterations: int = 1, explanation_chars: int = 40):
    rng, words = random.Random(3), pseudo_words(0)
    rows = long_rows(count=k)
    problems = [
        Problem(uid=str(i), prompt=r["prompt"], label=r["label"], rubric=r["rubric"]) for i, r in enumerate(rows)
    ]
    attempts_K_M = [
        [
            GradedAttempt(
                problem=p,
                iteration=it,
                solution=f"<start {i}.{it}.{j}> " + pseudo_text(rng, words, solution_chars) + f" <end {i}.{it}.{j}>",
                grade=Grade(0.5, f"<why {i}.{it}.{j}> " + pseudo_text(rng, words, explanation_chars)),
            )
            for it in range(iterations)
            for j in range(m)
        ]
        for i, p in enumerate(problems)
    ]
    return problems, attempts_K_M


def teacher_role(tokenizer, max_new_tokens: int = 64, context_length: int = CONTEXT_LENGTH) -> TeacherRole:
    return TeacherRole(
        pool=None,
        template=TeacherPromptTemplate(),
        renderer=PromptRenderer(tokenizer, False),
        temperature=1.0,
        max_new_tokens=max_new_tokens,
        context_length=context_length,
    )


def test_the_context_length_is_read_from_the_checkpoint_config(long_checkpoint, tiny_checkpoint):
    assert context_length_of(str(long_checkpoint)) == CONTEXT_LENGTH
    assert context_length_of(str(tiny_checkpoint)) == 256


def test_long_attempts_are_cut_in_the_middle_to_fit_the_teachers_budget(long_tokenizer):
    # 2 problems x 4 attempts of ~3,000 characters (~650 tokens each) next to 2-3k-character problems and rubrics.
    problems, attempts_K_M = problems_and_attempts(k=2, m=4, solution_chars=3000)
    teacher = teacher_role(long_tokenizer)
    full = teacher.renderer.ids(teacher.template.build(problems, attempts_K_M, ""))
    assert len(full) > CONTEXT_LENGTH  # what today's code sends: an HTTP 400 and the end of the run

    text, ids = teacher.prompt_and_ids(problems, attempts_K_M, "")
    assert len(ids) + teacher.max_new_tokens < CONTEXT_LENGTH  # strictly inside: SGLang refuses a full context
    assert ids == teacher.renderer.ids_of_text(text)  # the ids sent are the text's ids
    # Every attempt is still there, its start and its end, around a marker that says what was cut.
    for attempts in attempts_K_M:
        for attempt in attempts:
            tag = re.search(r"<start (\S+)>", attempt.solution).group(1)
            assert f"<start {tag}>" in text and f"<end {tag}>" in text
    assert len(re.findall(MARKER_RE, text)) >= 8
    assert all(p.prompt in text and p.rubric in text for p in problems)  # problems are never cut while attempts can be
    metrics = metrics_of(teacher)
    assert metrics["meta_learning/teacher_prompt_truncated"] == 1.0
    assert metrics["meta_learning/teacher_solutions_elided"] == 8.0
    assert metrics["meta_learning/teacher_attempts_dropped"] == 0.0
    assert metrics_of(teacher)["meta_learning/teacher_solutions_elided"] == 0.0  # reset after reading


def test_a_prompt_that_fits_is_sent_unchanged(long_tokenizer):
    problems, attempts_K_M = problems_and_attempts(k=1, m=2, solution_chars=300)
    teacher = teacher_role(long_tokenizer)
    text, ids = teacher.prompt_and_ids(problems, attempts_K_M, "previous")
    assert text == teacher.renderer.text(teacher.template.build(problems, attempts_K_M, "previous"))
    assert metrics_of(teacher)["meta_learning/teacher_prompt_truncated"] == 0.0


def test_the_oldest_iterations_attempts_are_dropped_first(long_tokenizer):
    # Three iterations of attempts on one problem: far more than even their shortest forms hold.
    problems, attempts_K_M = problems_and_attempts(k=1, m=4, solution_chars=3000, iterations=3)
    teacher = teacher_role(long_tokenizer, max_new_tokens=64, context_length=2600)
    text, ids = teacher.prompt_and_ids(problems, attempts_K_M, "")
    assert len(ids) + 64 < 2600
    shown = {tuple(map(int, m.split(".")[1:])) for m in re.findall(r"<start (\d+\.\d+\.\d+)>", text)}
    assert shown, "some attempts must still be shown"
    iterations_shown = {it for it, _ in shown}
    assert 2 in iterations_shown and 0 not in iterations_shown  # the newest kept, the oldest dropped
    metrics = metrics_of(teacher)
    assert metrics["meta_learning/teacher_attempts_dropped"] == 12 - len(shown) > 0


def test_long_grader_explanations_are_cut(long_tokenizer):
    problems, attempts_K_M = problems_and_attempts(k=1, m=4, solution_chars=200, explanation_chars=6000)
    teacher = teacher_role(long_tokenizer)
    text, ids = teacher.prompt_and_ids(problems, attempts_K_M, "")
    assert len(ids) + 64 < CONTEXT_LENGTH
    assert all(a.solution in text for a in attempts_K_M[0])  # short solutions kept whole
    assert metrics_of(teacher)["meta_learning/teacher_explanations_cut"] == 4.0


def test_problems_alone_over_the_budget_are_shortened_as_a_last_resort(tiny_checkpoint):
    tokenizer = load_tokenizer(str(tiny_checkpoint))  # one token a character, 256 positions
    template = TeacherPromptTemplate("T {problem} R {rubric} A {attempts_and_grades} P {previous_info}")
    teacher = TeacherRole(
        pool=None,
        template=template,
        renderer=PromptRenderer(tokenizer, False),
        temperature=1.0,
        max_new_tokens=16,
        context_length=256,
    )
    problem = Problem(uid="0", prompt="q" * 600, label="1", rubric="r" * 300)
    attempt = GradedAttempt(problem=problem, solution="s" * 400, grade=Grade(0.0, "e" * 100))
    text, ids = teacher.prompt_and_ids([problem], [[attempt]], "i" * 16)
    assert len(ids) <= 240 and text.startswith("T Problem:\nqqq") and " P i" in text
    assert metrics_of(teacher)["meta_learning/teacher_problems_elided"] == 1.0


def test_token_counter_keeps_both_ends(long_tokenizer):
    counter = TokenCounter(long_tokenizer)
    text = "HEAD " + pseudo_text(random.Random(0), pseudo_words(0), 4000) + " TAIL"
    cut, was_cut = counter.elide_middle(text, 100)
    assert was_cut and cut.startswith("HEAD") and cut.endswith("TAIL") and counter.count(cut) <= 104
    assert counter.elide_middle("short", 100) == ("short", False)


# ---------------------------------------------------------------------------- start-time checks


def run_main(args: list[str]) -> int:
    try:
        return train.main(args)
    except SystemExit as exit:
        return exit.code


SHORT_TEACHER = "T:{problem}{attempts_and_grades}{previous_info}"


def base_args(checkpoint, data, run_dir, *extra):
    return [
        "--use-meta-learning",
        "--hf-checkpoint",
        str(checkpoint),
        "--prompt-data",
        str(data),
        "--run-dir",
        str(run_dir),
        "--rollout-batch-size",
        "2",
        "--heldout-ipb",
        "1",
        "--n-samples-per-prompt",
        "2",
        "--grader",
        "verifier",
        *extra,
    ]


@pytest.mark.parametrize(
    "extra, flag",
    [
        ((), "--teacher-template"),  # the default template alone is longer than the demo model's 256 positions
        (("--teacher-template", SHORT_TEACHER), "--teacher-max-tokens"),
        (("--teacher-template", SHORT_TEACHER, "--teacher-max-tokens", "16"), "--rollout-max-response-len"),
    ],
)
def test_flags_that_can_never_fit_exit_2_naming_the_flag(extra, flag, tmp_path, tiny_checkpoint, capsys):
    data = write_jsonl(tmp_path / "d.jsonl", [{"prompt": f"{i} + 1 = ?", "label": str(i + 1)} for i in range(8)])
    code = run_main(base_args(tiny_checkpoint, data, tmp_path / "run", *extra))
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.startswith("error: ") and "\n" not in err, err
    assert err.startswith(f"error: {flag} ") and "256-token context" in err, err
    assert not (tmp_path / "run").exists()
    fit = re.search(rf"use {flag} (\d+)", err)
    if fit:  # the value the message suggests passes that check
        # (the student's flag kept small where the teacher's is checked: the next check would refuse 256)
        student = ("--rollout-max-response-len", "8") if flag == "--teacher-max-tokens" else ()
        fixed = (*extra, flag, fit.group(1), *student)
        cfg = parse_config(base_args(tiny_checkpoint, data, tmp_path / "run", *fixed))
        check_context_fits(cfg)


def test_rows_too_long_are_reported_and_skipped_and_all_too_long_exits_2(tmp_path, tiny_checkpoint, capsys):
    rows = [{"prompt": f"{i} + 1 = ?", "label": str(i + 1)} for i in range(6)]
    rows.insert(2, {"prompt": "x" * 400, "label": "1"})  # line 3: over the 256 positions by itself
    data = write_jsonl(tmp_path / "d.jsonl", rows)
    flags = (
        "--teacher-template",
        SHORT_TEACHER,
        "--teacher-max-tokens",
        "8",
        "--rollout-max-response-len",
        "8",
        "--generator-template",
        "Q: {problem}",
    )
    cfg = parse_config(base_args(tiny_checkpoint, data, tmp_path / "run", *flags))
    loaded = load_data(cfg)
    err = capsys.readouterr().err
    assert [p.prompt for p in loaded.sampler.problems] == [r["prompt"] for r in rows if len(r["prompt"]) < 400]
    assert f"{data}: line 3:" in err and "skipped 1 of 7 rows" in err, err

    all_long = write_jsonl(tmp_path / "long.jsonl", [{"prompt": "y" * 300, "label": "1"}] * 6)
    code = run_main(base_args(tiny_checkpoint, all_long, tmp_path / "run", *flags))
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert code == 2 and last.startswith(f"error: {all_long}: every row is too long") and "line 1" in last, last


def test_the_demo_flags_pass_the_checks(tmp_path, tiny_checkpoint):
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    script = (root / "scripts/run_synthetic.sh").read_text()
    assert "--teacher-max-tokens 4" in script and "--rollout-max-response-len 10" in script
    cfg = parse_config(
        [
            "--use-meta-learning",
            "--hf-checkpoint",
            str(tiny_checkpoint),
            "--prompt-data",
            str(root / "data/synthetic_suffix.jsonl"),
            "--group-key",
            "family",
            "--rollout-batch-size",
            "28",
            "--n-samples-per-prompt",
            "8",
            "--n-problems-per-prompt",
            "3",
            "--heldout-ipb",
            "16",
            "--num-inner-iterations",
            "2",
            "--n-samples-per-inner-prompt",
            "2",
            "--generator-template",
            "slime_meta.data.tasks.synthetic.SyntheticGeneratorTemplate",
            "--teacher-template",
            "slime_meta.data.tasks.synthetic.SyntheticTeacherTemplate",
            "--teacher-max-tokens",
            "4",
            "--rollout-max-response-len",
            "10",
            "--run-dir",
            str(tmp_path / "run"),
        ]
    )
    check_context_fits(cfg)
    assert len(load_data(cfg).sampler.problems) == 64 * 12  # no row skipped
