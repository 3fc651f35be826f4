"""The teacher reads every round so far: past attempts, past feedback and its own past infos.

The design has the teacher take "problem, rubric, past attempts, past feedback"; each round's
prompt therefore holds the attempts of all earlier rounds, each under the info the student had
then (`--teacher-history all`, the default), and the context budget drops the oldest round first.
`--teacher-history last` keeps the current round only. Whatever the prompt holds, the trained
sample is the ids the engine was sent, and the trace shows that text.

Real parts: the embedded worker (a subprocess) serving the random 4k-context BPE model of
`helpers_context` for teacher and student, the built-in verifier, the real rollout.
"""

from __future__ import annotations

import asyncio
import random
import re

import pytest
from helpers_context import CONTEXT_LENGTH, make_long_context_checkpoint, pseudo_text, pseudo_words
from helpers_worker import embedded_worker

from slime_meta.assembly import load_tokenizer
from slime_meta.grading.graders import VerifierGrader
from slime_meta.prompt_templates import ATTEMPTS_LEFT_OUT, GeneratorPromptTemplate, TeacherPromptTemplate
from slime_meta.rollout.context_budget import metrics_of
from slime_meta.rollout.meta_rollout import InnerLoopSettings, MetaLearningRollout
from slime_meta.rollout.pools import SGLangPool
from slime_meta.rollout.roles import PromptRenderer, StudentRole, TeacherRole
from slime_meta.types import Episode, Grade, GradedAttempt, Problem

ROUNDS, ATTEMPTS = 3, 2


@pytest.fixture(scope="module")
def long_checkpoint(tmp_path_factory):
    return make_long_context_checkpoint(tmp_path_factory.mktemp("teacher-history"))


@pytest.fixture(scope="module")
def renderer(long_checkpoint):
    return PromptRenderer(load_tokenizer(str(long_checkpoint)), False)


@pytest.fixture(scope="module")
def worker_url(long_checkpoint, tmp_path_factory):
    log_path = tmp_path_factory.mktemp("worker-log") / "worker.log"
    with embedded_worker(long_checkpoint, log_path, "--static-cache-len", "1024") as url:
        yield url


def run_rollout(worker_url: str, renderer: PromptRenderer, history: str):
    template = TeacherPromptTemplate()  # the default teacher prompt

    async def run():
        pool = SGLangPool(name="policy", base_url=worker_url, max_retries=0)
        student = StudentRole(
            pool=pool,
            template=GeneratorPromptTemplate(),
            renderer=renderer,
            info_position="prefix",
            temperature=1.0,
            max_new_tokens=12,
            context_length=CONTEXT_LENGTH,
        )
        teacher = TeacherRole(
            pool=pool,
            template=template,
            renderer=renderer,
            temperature=1.0,
            max_new_tokens=12,
            context_length=CONTEXT_LENGTH,
        )
        settings = InnerLoopSettings(
            num_inner_iterations=ROUNDS,
            n_samples_per_inner_prompt=ATTEMPTS,
            n_samples_per_prompt=2,
            train_all_inner_steps=True,
            holdout_advantage="mean-then-normalize",
            std_normalize=True,
            trace_sample_rate=1.0,
            show_progress=False,
            teacher_history=history,
        )
        episode = Episode(
            train_chunks_P=((Problem(uid="t", prompt="What is 12 + 30?", label="42"),),),
            holdout=(Problem(uid="h", prompt="What is 2 + 5?", label="7"),),
        )
        try:
            return await MetaLearningRollout(student, VerifierGrader(), teacher, settings).run([episode], rollout_id=0)
        finally:
            await pool.close()

    return asyncio.run(run()), template


def test_each_round_the_teacher_reads_every_earlier_round_and_its_own_infos(worker_url, renderer):
    result, template = run_rollout(worker_url, renderer, "all")
    assert len(result.traces) == 2 and len(result.samples) == 2 * ROUNDS
    for trace in result.traces:
        steps = trace["steps"][:ROUNDS]
        for current, step in enumerate(steps):
            prompt = step["teacher_prompt"]
            if current == 0:  # one round: the single-round format, as before
                assert "Round 1" not in prompt
                continue
            # Every round so far, oldest first, under the info it was made with; the last under
            # "your previous additional information", which the prompt also shows as such.
            headers = [
                template.format_round_header(r, steps[r]["info_in"], is_last=r == current) for r in range(current + 1)
            ]
            positions = [prompt.index(header) for header in headers]
            assert positions == sorted(positions), prompt
            assert steps[current]["info_in"] == steps[current - 1]["info_out"]
            for r in range(current + 1):
                block = prompt[positions[r] : positions[r + 1] if r < current else len(prompt)]
                assert block.count("Attempt ") == ATTEMPTS, block
                for attempt in steps[r]["attempts"]:
                    assert f"GRADE: {attempt['grade']:.2f}\nFEEDBACK: {attempt['explanation']}" in block
    # The trained sample of each round is exactly the ids the engine was sent: those of the traced text.
    by_chain = {(t["prompt_index"], t["sample_index"]): t for t in result.traces}
    for sample in result.samples:
        traced = by_chain[(0, sample.sample_index)]["steps"][sample.inner_iteration]["teacher_prompt"]
        assert list(sample.prompt_ids) == renderer.ids_of_text(traced)
    assert {s.inner_iteration for s in result.samples} == set(range(ROUNDS))


def test_teacher_history_last_keeps_the_current_round_only(worker_url, renderer):
    result, _ = run_rollout(worker_url, renderer, "last")
    for trace in result.traces:
        for step in trace["steps"][:ROUNDS]:
            assert "Round " not in step["teacher_prompt"]
            assert step["teacher_prompt"].count("Attempt ") == ATTEMPTS


def test_over_the_budget_the_oldest_round_goes_first_with_its_info(long_checkpoint, renderer):
    rng, words = random.Random(5), pseudo_words(0)
    problem = Problem(uid="0", prompt="What is 12 + 30?", label="42")
    round_infos = ["", *(f"<info of round {r}> " + pseudo_text(rng, words, 200) for r in (1, 2))]
    attempts = [
        GradedAttempt(
            problem=problem,
            iteration=r,
            grade=Grade(0.0, "Incorrect."),
            solution=f"<start {r}.{j}> " + pseudo_text(rng, words, 3000) + f" <end {r}.{j}>",
        )
        for r in range(3)
        for j in range(4)
    ]
    # 1,200 tokens: room for about one round's attempts at their shortest (64 tokens each) beside the template.
    teacher = TeacherRole(
        pool=None,
        template=TeacherPromptTemplate(),
        renderer=renderer,
        temperature=1.0,
        max_new_tokens=64,
        context_length=1200,
    )
    text, ids = teacher.prompt_and_ids([problem], [attempts], round_infos[-1], round_infos)
    assert len(ids) + 64 < 1200 and ids == renderer.ids_of_text(text)
    shown = {int(r) for r in re.findall(r"<start (\d)\.\d>", text)}
    assert 2 in shown and 0 not in shown  # the newest round kept, the oldest dropped
    assert "Round 1" not in text and ATTEMPTS_LEFT_OUT not in text  # a round left out goes whole
    assert metrics_of(teacher)["meta_learning/teacher_attempts_dropped"] >= 4


def test_a_template_made_for_one_round_gets_the_current_round_only(renderer):
    class OneRoundTemplate(TeacherPromptTemplate):
        def build(self, problems, attempts_K_M, previous_info):  # the signature of subclasses written before history
            return super().build(problems, attempts_K_M, previous_info)

    problem = Problem(uid="0", prompt="What is 12 + 30?", label="42")
    attempts = [
        GradedAttempt(problem=problem, iteration=r, solution=f"answer of round {r}", grade=Grade(0.0, ""))
        for r in range(3)
    ]
    teacher = TeacherRole(pool=None, template=OneRoundTemplate(), renderer=renderer, temperature=1.0, max_new_tokens=8)
    text, _ = teacher.prompt_and_ids([problem], [attempts], "info 2", ["", "info 1", "info 2"])
    assert "answer of round 2" in text and "answer of round 1" not in text and "Round" not in text
