"""Prompt search, the reflective step: a model rewrites the teacher's instruction from graded attempts
(the problems, the infos, the student's answers, their grades), after GEPA (Agrawal et al. 2025).

benchmarks/prompt_search.py describes the search.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from statistics import fmean
from typing import Awaitable, Callable, Sequence

from prompt_search_candidates import Candidate, Evaluation, join_template, literal_braces, make_template, written_braces

from slime_meta.prompt_templates import TeacherPromptTemplate, TemplateSlotError
from slime_meta.types import Chain

# ----------------------------------------------------------------------------- reflection

REFLECTION_PROMPT = "\n".join(
    (
        "I gave a teacher model the instruction below. With it, the teacher reads a few problems of one kind, their "
        "rubric and a student's graded attempts, and writes additional information for the student. The student then "
        "answers other problems of the same kind with only that information: it never sees the rubric, the grades or "
        "the instruction. The teacher's score is the student's mean grade on those other problems.",
        "",
        "The current instruction:",
        "```",
        "{instruction}",
        "```",
        "",
        "What the teacher wrote with this instruction and how the student did with it, best and worst first:",
        "",
        "{examples}",
        "",
        "Write a new instruction for the teacher that makes its additional information raise the student's grades on "
        "problems it has not seen. Compare the information that scored high with the one that scored low; read the "
        "student's answers and the grader's feedback: what did the student lack, what did it get wrong, in what form "
        "must the final answer be? Put the lessons into the instruction as general rules for the teacher; it must "
        "work for every kind of problem the teacher may see, so name no answer of a specific problem. Reply with the "
        "new instruction only, inside ``` blocks.",
    )
)


def clip(text: str, limit: int) -> str:
    text = text.strip()
    return text if len(text) <= limit else text[: limit - 3].rstrip() + "..."


def describe_chain(number: int, chain: Chain, problems: dict[str, str], answers: int, chars: int) -> str:
    """One example of the reflection prompt: the problems and rubric the teacher saw, its info, and
    the student's answers with that info, their grades and feedback (from the chain's trace)."""
    seen = "\n".join(f"- {clip(p.prompt, chars)}" for p in chain.problems)
    rubrics = "\n".join(dict.fromkeys(p.rubric for p in chain.problems if p.rubric)) or "(none)"
    holdout = next((step["holdout"] for step in chain.trace if "holdout" in step), [])
    shown = []
    for record in holdout[:answers]:
        problem = problems.get(record["problem_uid"], "(not shown)")
        shown.append(
            f"Problem: {clip(problem, chars)}\nStudent's answer: {clip(record['solution'], chars)}\n"
            f"Grade: {record['grade']:.2f}. Feedback: {clip(record['explanation'] or '', chars)}"
        )
    return (
        f"Example {number}: score {fmean(chain.holdout_scores):.2f}\n"
        f"Problems the teacher saw:\n{seen}\nRubric:\n{clip(rubrics, 2 * chars)}\n"
        f"The teacher's additional information:\n{clip(chain.final_info, 2 * chars) or '(empty)'}\n"
        f"The student's answers to other problems of the same kind, with that information:\n"
        + ("\n\n".join(shown) or "(none)")
    )


def contrasting(chains: Sequence[Chain], count: int) -> list[Chain]:
    """Up to `count` chains, best and worst alternately (the reflection learns most from the contrast)."""
    ranked = sorted(chains, key=lambda c: fmean(c.holdout_scores), reverse=True)
    order, high, low = [], 0, len(ranked) - 1
    while high <= low:
        order.append(ranked[high])
        high += 1
        if high <= low:
            order.append(ranked[low])
            low -= 1
    return order[:count]


def reflection_prompt(instruction: str, evaluation: Evaluation, examples: int, answers: int, chars: int) -> str:
    chosen = contrasting(evaluation.chains, examples)
    blocks = [describe_chain(n + 1, c, evaluation.problems, answers, chars) for n, c in enumerate(chosen)]
    values = {"instruction": written_braces(instruction) or "(none)", "examples": "\n\n".join(blocks)}
    return re.sub(r"\{(instruction|examples)\}", lambda m: values[m.group(1)], REFLECTION_PROMPT)


def instruction_of_reply(reply: str) -> str:
    """The new instruction: the first ``` block's text (a language tag on its first line dropped), else the reply."""
    blocks = re.findall(r"```[^\n`]*\n?(.*?)```", reply, flags=re.S)
    text = next((b for b in blocks if b.strip()), None)
    if text is None:
        text = reply.split("```", 1)[-1] if reply.count("```") == 1 else reply
    return text.strip()


class PoolReflector:
    """The reflection asked of the teacher model through its own pool (its chat template, its context)."""

    def __init__(self, teacher, temperature: float, max_tokens: int):
        self.teacher, self.temperature, self.max_tokens = teacher, temperature, max_tokens
        self.name = "the teacher model, through its pool"

    def fits(self, ids: Sequence[int]) -> bool:
        limit = self.teacher.context_length
        return limit is None or len(ids) + self.max_tokens < limit

    def ids(self, prompts: Sequence[str]) -> list[int]:
        """The first of `prompts` (fewer examples each) that fits the context; else the last, cut in the middle."""
        renderer = self.teacher.renderer
        for prompt in prompts:
            ids = renderer.ids([{"role": "user", "content": prompt}])
            if self.fits(ids):
                return ids
        room = max(2, self.teacher.context_length - self.max_tokens - 1)
        return ids[: room // 2] + ids[len(ids) - (room - room // 2) :]

    async def __call__(self, prompts: Sequence[str]) -> str:
        completion = await self.teacher.pool.generate(
            input_ids=self.ids(prompts),
            sampling_params={"temperature": self.temperature, "max_new_tokens": self.max_tokens},
        )
        return completion.text


class APIReflector:
    """The reflection asked of a model behind an OpenAI-compatible chat-completions endpoint."""

    def __init__(self, base_url: str, model: str, api_key_env: str, temperature: float, max_tokens: int, timeout_s):
        from slime_meta.rollout.chat_api import ChatCompletionsClient

        self.client = ChatCompletionsClient(
            base_url=base_url, api_key_env=api_key_env, timeout_s=timeout_s, connection_limit=4
        )
        self.model, self.temperature, self.max_tokens = model, temperature, max_tokens
        self.name = f"{model} at {base_url}"

    async def __call__(self, prompts: Sequence[str]) -> str:
        messages = [{"role": "user", "content": prompts[0]}]
        payload = {"model": self.model, "messages": messages, "temperature": self.temperature}
        return await self.client.create({**payload, "max_tokens": self.max_tokens})

    async def aclose(self) -> None:
        await self.client.aclose()


@dataclass
class Proposal:
    candidate: Candidate | None
    reply: str
    refused: str | None = None  # why no candidate came of the reply


async def propose(
    parent: Candidate,
    evaluation: Evaluation,
    reflect: Callable[[Sequence[str]], Awaitable[str]],
    *,
    new_id: int,
    scaffold: str,
    seed: TeacherPromptTemplate,
    fits: Callable[[TeacherPromptTemplate], str | None],
    examples: int = 4,
    answers: int = 3,
    chars: int = 400,
) -> Proposal:
    """One reflective mutation: the parent's graded chains -> a model's new instruction -> a candidate.

    The new instruction replaces the parent's; the scaffold (slots and the lines around them) is
    kept, and the model's braces are made literal, so the candidate has exactly the seed's slots.
    """
    prompts = [reflection_prompt(parent.instruction, evaluation, n, answers, chars) for n in range(examples, 0, -1)]
    reply = await reflect(prompts)
    instruction = literal_braces(instruction_of_reply(reply))
    if not instruction:
        return Proposal(None, reply, "the reply holds no instruction")
    if instruction == parent.instruction:
        return Proposal(None, reply, "the instruction is the parent's")
    try:
        template = make_template(seed, join_template(instruction, scaffold), source=f"candidate {new_id}")
    except TemplateSlotError as error:  # cannot happen with the scaffold kept; a guard all the same
        return Proposal(None, reply, str(error))
    too_long = fits(template)
    if too_long:
        return Proposal(None, reply, too_long)
    return Proposal(Candidate(new_id, "reflection", instruction, template, parent=parent.id), reply)
