"""Requests stay strictly inside the context: SGLang refuses a prompt + max_new_tokens that fills it.

SGLang's tokenizer manager answers HTTP 400 when the prompt plus `max_new_tokens` reaches the
context length (equal included), and its scheduler aborts a prompt within 6 tokens of it. The
embedded worker refuses the same, so a budget that lets a request fill the context exactly (what
the client did before: prompt + max_new_tokens == context) fails here as it would on a cluster.

Real parts: the embedded worker as a subprocess on the character-level tiny model (256 positions,
one token a character), the real roles and templates, the real request parser.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from helpers_worker import embedded_worker, post

from slime_meta.prompt_templates import GeneratorPromptTemplate, TeacherPromptTemplate
from slime_meta.rollout.context_budget import SGLANG_INPUT_MARGIN, longest_prompt, metrics_of, student_new_tokens
from slime_meta.rollout.pools import PoolUnavailable, SGLangPool
from slime_meta.rollout.roles import PromptRenderer, StudentRole, TeacherRole
from slime_meta.types import Grade, GradedAttempt, Problem
from slime_meta_engine import protocol

CONTEXT = 256  # the tiny model's max_position_embeddings


@pytest.fixture(scope="module")
def worker_url(tiny_checkpoint: Path, tmp_path_factory):
    with embedded_worker(tiny_checkpoint, tmp_path_factory.mktemp("worker-log") / "worker.log") as url:
        yield url


def test_client_budget_and_worker_agree_with_sglangs_rule_at_every_boundary():
    for context in (64, CONTEXT, 4096):
        for new in (0, 1, SGLANG_INPUT_MARGIN - 1, SGLANG_INPUT_MARGIN, SGLANG_INPUT_MARGIN + 1, 40):
            for prompt in range(context - new - 12, context - new + 3):
                sglang_serves = prompt + new < context and prompt < context - SGLANG_INPUT_MARGIN
                served = protocol.context_length_error(prompt, new, context) is None
                assert served == sglang_serves, (context, new, prompt)
                assert (prompt <= longest_prompt(context, new)) == sglang_serves, (context, new, prompt)
    assert protocol.SGLANG_INPUT_MARGIN == SGLANG_INPUT_MARGIN


def test_the_worker_refuses_a_request_that_fills_the_context(worker_url: str):
    prompt = [5] * 200
    status, reply = post(f"{worker_url}/generate", {"input_ids": prompt, "sampling_params": {"max_new_tokens": 56}})
    assert status == 400 and "reaches the model's context length (256)" in reply["error"]["message"], reply
    status, reply = post(f"{worker_url}/generate", {"input_ids": prompt, "sampling_params": {"max_new_tokens": 55}})
    assert status == 200, reply
    # A scoring request (no new token) whose prompt is within SGLang's scheduler margin of the context.
    score = {"sampling_params": {"max_new_tokens": 0}, "return_logprob": True, "logprob_start_len": 0}
    assert post(f"{worker_url}/generate", {"input_ids": [5] * (CONTEXT - SGLANG_INPUT_MARGIN), **score})[0] == 400
    assert post(f"{worker_url}/generate", {"input_ids": [5] * (CONTEXT - SGLANG_INPUT_MARGIN - 1), **score})[0] == 200
    # The OpenAI route passes the same check (SGLang's does).
    status, reply = post(f"{worker_url}/v1/completions", {"prompt": prompt, "max_tokens": 56})
    assert status == 400 and "reaches" in reply["error"]["message"], reply


def test_student_requests_are_clamped_strictly_inside(tiny_checkpoint, worker_url: str):
    from transformers import AutoTokenizer

    renderer = PromptRenderer(AutoTokenizer.from_pretrained(tiny_checkpoint), False)
    count = lambda text: len(renderer.ids_of_text(text))  # noqa: E731
    for prompt_tokens in (200, CONTEXT - 40, CONTEXT - SGLANG_INPUT_MARGIN - 1):
        text = "q" * prompt_tokens
        new, counted = student_new_tokens(text, 64, CONTEXT, count)
        assert counted == count(text) and counted + new == CONTEXT - 1
    # A prompt SGLang's scheduler would abort is not sent at all (an empty answer instead).
    assert student_new_tokens("q" * (CONTEXT - SGLANG_INPUT_MARGIN), 64, CONTEXT, count)[0] == 0

    async def solve(problem: Problem):
        client = SGLangPool(name="student", base_url=worker_url, max_retries=0)
        student = StudentRole(
            pool=client,
            template=GeneratorPromptTemplate("{problem}"),
            renderer=renderer,
            info_position="prefix",
            temperature=1.0,
            max_new_tokens=64,
            context_length=CONTEXT,
        )
        try:
            return await student.solve_n(problem, "", 2, with_tokens=True), student
        finally:
            await client.close()

    # The prompt leaves 56 positions of the 64 tokens asked for: before, the request asked for all 56 (refused).
    (prompt, completions), student = asyncio.run(solve(Problem(uid="0", prompt="q" * 200, label="1")))
    prompt_ids = renderer.ids_of_text(prompt)
    assert len(prompt_ids) == 200 and all(len(c.prompt_ids) + len(c.output_ids) < CONTEXT for c in completions)
    assert metrics_of(student)["meta_learning/student_requests_clamped"] == 2.0


def test_the_teachers_prompt_leaves_the_last_position_free(tiny_checkpoint, worker_url: str):
    from transformers import AutoTokenizer

    renderer = PromptRenderer(AutoTokenizer.from_pretrained(tiny_checkpoint), False)
    template = TeacherPromptTemplate("{problem}{attempts_and_grades}{previous_info}")
    max_new_tokens = 16
    problem = Problem(uid="0", prompt="p", label="1")
    attempt = GradedAttempt(problem=problem, solution="", grade=Grade(1.0, ""))
    bare = len(renderer.ids(template.build([problem], [[attempt]], "")))
    # A previous info that makes the whole prompt exactly context - max_new_tokens: it used to be sent as it was.
    previous_info = "i" * (CONTEXT - max_new_tokens - bare)
    assert len(renderer.ids(template.build([problem], [[attempt]], previous_info))) == CONTEXT - max_new_tokens

    async def write():
        client = SGLangPool(name="teacher", base_url=worker_url, max_retries=0)
        teacher = TeacherRole(
            pool=client,
            template=template,
            renderer=renderer,
            temperature=1.0,
            max_new_tokens=max_new_tokens,
            context_length=CONTEXT,
        )
        try:
            return await teacher.write_info([problem], [[attempt]], previous_info)
        finally:
            await client.close()

    try:
        _, completion, prompt = asyncio.run(write())
    except PoolUnavailable as error:  # what a prompt that fills the context gets, from SGLang and from the worker
        pytest.fail(f"the teacher's request was refused: {error}")
    assert len(completion.prompt_ids) + max_new_tokens < CONTEXT
    assert list(completion.prompt_ids) == renderer.ids_of_text(prompt)  # trained on exactly what was sent
