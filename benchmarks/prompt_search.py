"""The untrained teacher with the best teacher prompt a search finds: the no-weights baseline of RL.

    python benchmarks/prompt_search.py TRAIN_FLAGS...                     # reflective search (GEPA-style)
    python benchmarks/prompt_search.py TRAIN_FLAGS... --method candidates # hand-written instructions, best kept
    python benchmarks/prompt_search.py --help                             # train.py's flags, then this one's

TRAIN_FLAGS are train.py's own (`--hf-checkpoint`, `--prompt-data`, `--eval-prompt-data`, `--grader`,
`--device`, the step's shape, `--teacher-template`, ...), read by train.py's parser: give the RL run's
command line and the search runs on the same models, data, grader and step shape. The teacher's
weights stay as they are (nothing is trained); only its prompt changes.

What is searched: the teacher template's *instruction*, the text before the blank line that precedes
its first `{slot}` (the default template's first paragraph). The rest of the template (the slots
and the lines around them) is kept as it is, so every candidate has the template's required slots
(`TeacherPromptTemplate.check_required`). The search starts from the run's teacher template
(`--teacher-template`, the project's default when not given).

How a candidate is scored: exactly as the RL run's reward. The candidate's template goes into the
run's own `MetaLearningRollout` (the local backend's workers behind sglang-router, the run's grader)
and runs on episodes drawn as a training step draws them: the teacher writes G infos per teacher
prompt over K inner rounds, the student answers the holdout problems of the same family with each
final info, the grader grades; the score is the mean holdout grade. Per teacher prompt (an
"instance") the score is the mean over its G infos.

`--method reflect` (default), after GEPA (Agrawal et al. 2025, "GEPA: Reflective Prompt Evolution
Can Outperform Reinforcement Learning"): a fixed Pareto set of `--pareto-batches` step draws scores
every candidate kept. Each round picks a parent from the Pareto front (candidates best on at least
one teacher prompt, drawn in proportion to how many), scores it on a fresh minibatch of
`--minibatch-batches` step draws with every chain traced, and asks a model (the teacher model
itself through its pool, or `--reflection-base-url`) to rewrite the instruction from the graded
attempts: the problems, the rubric, the infos the teacher wrote, the student's answers with them,
their grades and the grader's feedback, best and worst first. The child is scored on the same
minibatch; when it beats its parent there, it is scored on the Pareto set and kept. The best
candidate is the one with the highest mean on the Pareto set.

`--method candidates`: the run's instruction and a fixed list of hand-written ones (or `--candidates
FILE`), each scored on the same problems; the budget decides how many step draws each gets.

The budget (`--student-attempts`): every answer the student writes in the search counts, in the
inner rounds as well as on the holdout problems (one request of n attempts counts n). The default
is what the RL run of the same flags spends in `--num-rollout` steps:
    steps x [infos per step x (K x k x m + H x S) + holdout problems per step x S]
with infos per step = teacher prompts x G (`--n-samples-per-prompt`), K inner rounds, k train
problems per teacher prompt, m attempts each, H holdout problems per info, S = `--n-holdout-samples`;
the last term is the no-info control the RL run grades each step. Its holdout term, steps x infos per
step x H x S, is the RL run's reward attempts. A round (or a candidate) starts only when what it
can spend fits in what is left: the search never spends more than the budget. Scoring leaves the
no-info control out (it does not depend on the prompt); the final evaluation is not counted (nor
is the RL run's).

Then the best template (and, with `--eval-seed`, the starting one) is evaluated on each
`--eval-prompt-data` set exactly as a learning run evaluates its teacher
(`slime_meta.backends.local.evaluation.evaluate`: the same fixed episodes, the teacher's infos
against the no-info control); the eval lift's standard error is benchmarks/eval_lift.py's (binomial
over the eval set's holdout problems, the two errors combined). `--compare-with` an efficacy results
JSON puts the trained teacher's last eval beside it.

Writes to `--out` (default $OUT or runs/benchmarks, a directory per run): `prompt_search.json`
(date, command, machine, model, budget and spending, every candidate's text and scores, the
rounds, the best prompt, its eval lift) and `best_teacher_template.txt`, a file `--teacher-template`
accepts.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import os
import random
import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from statistics import fmean
from typing import Any, Awaitable, Callable, Sequence

from _common import REPO_ROOT, report_header, write_json
from eval_lift import lift_in_se, lift_se

from slime_meta.config.arguments import MetaConfig, _OneLineErrorParser, add_meta_learning_arguments, build_config
from slime_meta.errors import EXIT_USER_ERROR, UserInputError
from slime_meta.prompt_templates import TeacherPromptTemplate, TemplateSlotError, read_template_file
from slime_meta.rollout.clients import close_clients
from slime_meta.rollout.meta_rollout import InnerLoopSettings, MetaLearningRollout
from slime_meta.rollout.roles import StudentRole
from slime_meta.types import Chain, Episode

# ----------------------------------------------------------------------------- the instruction of a template

_SLOT = re.compile(r"\{\{|\}\}|\{([A-Za-z_][A-Za-z0-9_]*)\}")  # prompt_templates' own: {{ and }} are literal braces


def split_template(text: str) -> tuple[str, str]:
    """(instruction, scaffold): the text before the blank line that precedes the first `{slot}`, and the rest.

    A template whose first slot has no blank line before it (a one-line completion format) has an
    empty instruction: a new one goes in front of it as a paragraph of its own.
    """
    first = next((m for m in _SLOT.finditer(text) if m.group(1)), None)
    if first is None:
        return text.strip(), ""
    cut = text.rfind("\n\n", 0, first.start())
    if cut < 0:
        return "", text
    return text[:cut].strip(), text[cut + 2 :]


def join_template(instruction: str, scaffold: str) -> str:
    return f"{instruction}\n\n{scaffold}" if instruction and scaffold else instruction or scaffold


def literal_braces(text: str) -> str:
    """A model's text as template text that renders as written: braces doubled (no slot is made)."""
    return text.replace("{", "{{").replace("}", "}}")


def written_braces(instruction: str) -> str:
    """The instruction as the teacher reads it (literal braces undoubled)."""
    return instruction.replace("{{", "{").replace("}}", "}")


def make_template(seed: TeacherPromptTemplate, text: str, source: str) -> TeacherPromptTemplate:
    """A template of the seed's class (its formatting and parsing) with `text`; checked for its slots."""
    try:
        template = type(seed)(text, source=source)
    except TypeError:  # a subclass whose constructor takes no text: the base class with the text
        template = TeacherPromptTemplate(text, source=source)
    template.check_required()
    return template


# ----------------------------------------------------------------------------- candidates and the budget


@dataclass
class Candidate:
    id: int
    origin: str  # "seed", "hand-written", "reflection"
    instruction: str  # as template text (literal braces doubled)
    template: TeacherPromptTemplate
    parent: int | None = None
    pareto_scores: list[float] | None = None  # per teacher prompt of the Pareto (selection) set
    minibatch_scores: list[dict] = field(default_factory=list)

    @property
    def score(self) -> float | None:
        return fmean(self.pareto_scores) if self.pareto_scores else None

    def record(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "origin": self.origin,
            "parent": self.parent,
            "instruction": written_braces(self.instruction),
            "template_text": self.template.text,
            "score": self.score,
            "pareto_scores": self.pareto_scores,
            "minibatch_scores": self.minibatch_scores,
        }


def attempts_of(episodes: Sequence[Episode], settings: InnerLoopSettings) -> int:
    """The student answers `MetaLearningRollout.run` asks for on `episodes` (inner rounds, holdout, control)."""
    total = 0
    for episode in episodes:
        for chunk in episode.train_chunks_P:
            per_chain = settings.num_inner_iterations * len(chunk) * settings.n_samples_per_inner_prompt
            per_chain += len(episode.holdout) * settings.holdout_samples_per_problem
            total += settings.n_samples_per_prompt * per_chain
        total += len(episode.holdout) * settings.control_samples_per_problem
    return total


def rl_run_attempts(cfg: MetaConfig, plan) -> dict[str, Any]:
    """What the RL run of these flags spends on student answers in --num-rollout steps (the default budget)."""
    m = cfg.meta
    infos = plan.groups * m.n_samples_per_prompt
    inner = infos * m.num_inner_iterations * plan.problems_per_prompt * m.n_samples_per_inner_prompt
    holdout = infos * plan.holdout_per_episode * m.n_holdout_samples
    control = plan.holdout * m.n_holdout_samples
    per_step = inner + holdout + control
    return {
        "steps": m.num_rollout,
        "infos_per_step": infos,
        "per_step": {"inner_rounds": inner, "holdout": holdout, "no_info_control": control, "all": per_step},
        "holdout_attempts": m.num_rollout * holdout,
        "student_attempts": m.num_rollout * per_step,
        "formula": (
            "steps x [infos per step x (K x k x m + H x S) + holdout problems per step x S] = "
            f"{m.num_rollout} x [{infos} x ({m.num_inner_iterations} x {plan.problems_per_prompt} x "
            f"{m.n_samples_per_inner_prompt} + {plan.holdout_per_episode} x {m.n_holdout_samples}) + "
            f"{plan.holdout} x {m.n_holdout_samples}] = {m.num_rollout * per_step}"
        ),
    }


@dataclass
class CountedStudent(StudentRole):
    """The run's student role, counting every answer it asks its pool for (a request of n counts n)."""

    answers: int = 0

    @classmethod
    def of(cls, student: StudentRole) -> CountedStudent:
        return cls(**{f.name: getattr(student, f.name) for f in dataclasses.fields(student)})

    async def solve_n(self, problem, info: str, n: int, *, with_tokens: bool = False):
        self.answers += n
        return await super().solve_n(problem, info, n, with_tokens=with_tokens)


class Budget:
    """Student answers allowed and spent; spending is read from the student's own count."""

    def __init__(self, total: int, counter: Callable[[], int]):
        self.total, self._counter, self._start = total, counter, counter()

    @property
    def spent(self) -> int:
        return self._counter() - self._start

    @property
    def left(self) -> int:
        return self.total - self.spent

    def affords(self, cost: int) -> bool:
        return cost <= self.left


# ----------------------------------------------------------------------------- scoring a candidate


@dataclass
class Evaluation:
    score: float  # mean holdout grade over all its chains (the RL reward's mean)
    per_prompt: list[float]  # per teacher prompt: the mean over its G infos
    chains: list[Chain]
    attempts: int
    problems: dict[str, str] = field(default_factory=dict)  # uid -> problem text, train and holdout


def search_settings(settings: InnerLoopSettings) -> InnerLoopSettings:
    """The run's inner loop as the search scores with it: every chain traced (the reflection reads
    them), no no-info control (it does not depend on the prompt), no solver tokens kept, no bars."""
    return dataclasses.replace(
        settings, trace_sample_rate=1.0, control_samples_per_problem=0, keep_solver_attempts=False, show_progress=False
    )


def with_template(rollout: MetaLearningRollout, template: TeacherPromptTemplate, settings=None) -> MetaLearningRollout:
    """The run's rollout (its pools, student, grader) with another teacher template."""
    teacher = dataclasses.replace(rollout.teacher, template=template)
    return MetaLearningRollout(rollout.student, rollout.grader, teacher, settings or rollout.settings)


async def score(
    rollout: MetaLearningRollout,
    template: TeacherPromptTemplate,
    episodes: Sequence[Episode],
    rollout_id: int,
    seed: int,
) -> Evaluation:
    """The candidate's reward on `episodes`, the way the RL run's reward is computed (its rollout)."""
    settings = search_settings(rollout.settings)
    before = rollout.student.answers
    result = await with_template(rollout, template, settings).run(episodes, rollout_id, seed=seed)
    by_prompt: dict[int, list[float]] = {}
    for chain in result.chains:
        by_prompt.setdefault(chain.prompt_index, []).append(fmean(chain.holdout_scores))
    return Evaluation(
        score=result.metrics["meta_learning/avg_holdout_grade"],
        per_prompt=[fmean(by_prompt[p]) for p in sorted(by_prompt)],
        chains=result.chains,
        attempts=rollout.student.answers - before,
        problems={p.uid: p.prompt for e in episodes for p in (*e.holdout, *(q for c in e.train_chunks_P for q in c))},
    )


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


# ----------------------------------------------------------------------------- the two methods


def pareto_front(candidates: Sequence[Candidate]) -> dict[int, int]:
    """Candidate id -> on how many teacher prompts of the Pareto set it is best (ties count for each),
    dominated candidates left out (GEPA's candidate selection)."""
    scored = [c for c in candidates if c.pareto_scores]
    wins: dict[int, int] = {}
    for i in range(len(scored[0].pareto_scores)):
        best = max(c.pareto_scores[i] for c in scored)
        for c in scored:
            if c.pareto_scores[i] >= best - 1e-12:
                wins[c.id] = wins.get(c.id, 0) + 1
    by_id = {c.id: c for c in scored}

    def dominated(a: Candidate) -> bool:
        return any(
            b.id != a.id
            and all(x >= y for x, y in zip(b.pareto_scores, a.pareto_scores))
            and any(x > y for x, y in zip(b.pareto_scores, a.pareto_scores))
            for b in (by_id[i] for i in wins)
        )

    return {i: n for i, n in wins.items() if not dominated(by_id[i])}


class Search:
    """Both methods over one run's rollout, data and budget; every score printed and recorded."""

    def __init__(self, cfg, rollout, seed_template, budget: Budget, pareto, feedback, draw_sizes, opts, reflect, fits):
        self.cfg, self.rollout, self.seed_template, self.budget = cfg, rollout, seed_template, budget
        self.pareto, self.feedback, self.draw_sizes, self.opts = pareto, feedback, draw_sizes, opts
        self.reflect, self.fits = reflect, fits
        self.instruction, self.scaffold = split_template(seed_template.text)
        seed = Candidate(0, "seed", self.instruction, seed_template)
        self.candidates: list[Candidate] = [seed]
        self.rounds: list[dict] = []
        self.refused: list[dict] = []  # hand-written instructions that cannot be used (too long for the context)
        self.evaluations = 0
        self.rng = random.Random(cfg.seed)
        self.started = time.monotonic()

    def cost(self, episodes) -> int:
        return attempts_of(episodes, search_settings(self.rollout.settings))

    def log(self, text: str) -> None:
        elapsed = time.monotonic() - self.started
        print(
            f"[prompt search {elapsed:6.0f} s, {self.budget.spent:,}/{self.budget.total:,} student answers] {text}",
            flush=True,
        )

    async def evaluate(self, candidate: Candidate, episodes) -> Evaluation:
        self.evaluations += 1
        return await score(self.rollout, candidate.template, episodes, self.evaluations, self.cfg.seed)

    async def on_pareto(self, candidate: Candidate) -> None:
        evaluation = await self.evaluate(candidate, self.pareto)
        candidate.pareto_scores = evaluation.per_prompt
        self.log(f"candidate {candidate.id} ({candidate.origin}): {candidate.score:.3f} on the Pareto set")

    def minibatch(self) -> list[Episode]:
        return [e for _ in range(self.opts.minibatch_batches) for e in self.feedback.next_episodes(**self.draw_sizes)]

    async def reflect_rounds(self) -> None:
        await self.on_pareto(self.candidates[0])
        failures = 0
        for number in range(1, self.opts.max_rounds + 1):
            batch = self.minibatch()
            if not self.budget.affords(2 * self.cost(batch) + self.cost(self.pareto)):
                self.log(f"stop: round {number} could spend more than the {self.budget.left:,} answers left")
                break
            front = pareto_front(self.candidates)
            parent_id = self.rng.choices(list(front), weights=list(front.values()))[0]
            parent = next(c for c in self.candidates if c.id == parent_id)
            before = await self.evaluate(parent, batch)
            parent.minibatch_scores.append({"round": number, "score": before.score})
            proposal = await propose(
                parent,
                before,
                self.reflect,
                new_id=len(self.candidates),
                scaffold=self.scaffold,
                seed=self.seed_template,
                fits=self.fits,
                examples=self.opts.reflection_examples,
                answers=self.opts.reflection_answers,
                chars=self.opts.reflection_chars,
            )
            record = {"round": number, "parent": parent.id, "parent_minibatch": before.score, "reply": proposal.reply}
            self.rounds.append(record)
            if proposal.candidate is None:
                record["refused"] = proposal.refused
                self.log(f"round {number}: parent {parent.id} {before.score:.3f}; no candidate ({proposal.refused})")
                failures += 1
                if failures >= self.opts.max_failed_proposals:
                    self.log(f"stop: {failures} proposals in a row gave no candidate")
                    break
                continue
            failures = 0
            child = proposal.candidate
            after = await self.evaluate(child, batch)
            child.minibatch_scores.append({"round": number, "score": after.score})
            accepted = after.score > before.score
            record.update(child=child.id, child_minibatch=after.score, accepted=accepted)
            self.log(
                f"round {number}: parent {parent.id} {before.score:.3f}, child {after.score:.3f} on the minibatch: "
                + ("kept" if accepted else "dropped")
            )
            if accepted:
                self.candidates.append(child)
                await self.on_pareto(child)
            else:
                record["dropped"] = child.record()

    async def hand_written(self, instructions: Sequence[str]) -> None:
        """The seed and each hand-written instruction, scored on the same step draws: the Pareto set,
        and as many more draws of its size as the budget pays for with every candidate scored on
        them (candidates past the budget are not scored)."""
        for text in instructions:
            text = text.strip()
            if "{attempts_and_grades}" in text:  # a whole template: its own instruction and slots
                instruction, scaffold = split_template(text)
            else:  # an instruction, its braces literal
                instruction, scaffold = literal_braces(text), self.scaffold
            if any(c.instruction == instruction and c.template.text.endswith(scaffold) for c in self.candidates):
                continue
            number = len(self.candidates)
            template = make_template(self.seed_template, join_template(instruction, scaffold), f"candidate {number}")
            refused = self.fits(template)
            if refused:
                self.refused.append({"instruction": written_braces(instruction), "refused": refused})
                self.log(f"a hand-written instruction is left out: {refused}")
                continue
            self.candidates.append(Candidate(number, "hand-written", instruction, template))
        repeats = max(1, self.budget.left // (self.cost(self.pareto) * len(self.candidates)))
        for _ in range(repeats - 1):
            self.pareto += [
                e for _ in range(self.opts.pareto_batches) for e in self.feedback.next_episodes(**self.draw_sizes)
            ]
        for candidate in self.candidates:
            if not self.budget.affords(self.cost(self.pareto)):
                self.log(f"stop: candidate {candidate.id} could spend more than the {self.budget.left:,} answers left")
                break
            await self.on_pareto(candidate)

    def best(self) -> Candidate:
        scored = [c for c in self.candidates if c.score is not None]
        return max(scored, key=lambda c: (c.score, -c.id))


HAND_WRITTEN = (
    # The project's other hand-written prompt (prompt_templates/teacher_rules.txt) is added from its file.
    "You are a teacher. The student will see only each problem and the additional information you write: not the "
    "rubric, not the grades, not these instructions. Copy into your information every rule, fact, price or answer "
    "format the rubric states and the problems do not, plainly. Then add one sentence on the method. Do not give the "
    "answer to any specific problem.",
    "You are a teacher. Write additional information for a student who will solve problems like the ones below "
    "without seeing the rubric. State the rule or fact the rubric relies on, show one short worked example on a "
    "problem of your own, and say how the final answer must be written. Do not solve the problems shown.",
    "You are a teacher. Read the graded attempts: name the mistakes that lost credit and the right approach, and "
    "state any fact from the rubric the student lacked. At most three short sentences, addressed to the student; "
    "no answers to the problems shown.",
    "You are a teacher. The student is graded against the rubric below, which it cannot see. Tell the student in two "
    "or three sentences exactly what the rubric requires: the facts it gives, the method, and the form of the final "
    "answer (for example one last line 'Answer: <number>'). Do not give answers to specific problems.",
)


def hand_written_instructions(path: str | None) -> list[str]:
    """`--candidates FILE` (instructions, or whole templates, separated by lines of `---`), else the built-in list."""
    if path:
        parts = [p.strip() for p in re.split(r"^---\s*$", Path(path).read_text(encoding="utf-8"), flags=re.M)]
        return [p for p in parts if p]
    rules, _ = split_template(read_template_file(str(REPO_ROOT / "prompt_templates/teacher_rules.txt")))
    return [written_braces(rules), *HAND_WRITTEN]


# ----------------------------------------------------------------------------- the eval sets


def lift_record(with_info: float, without: float, units: int) -> dict[str, Any]:
    """The eval lift as benchmarks/eval_lift.py gives it: the difference, its binomial SE over `units`
    eval problems (the two errors combined), the difference in SEs, and a 95% interval."""
    se = lift_se(with_info, without, units)
    lift = with_info - without
    return {
        "with_info": with_info,
        "no_info": without,
        "lift": lift,
        "units": units,
        "se": se,
        "lift_in_se": lift_in_se(with_info, without, units) if se > 0 else None,  # no spread: no figure
        "interval_95": [lift - 1.96 * se, lift + 1.96 * se],
    }


async def eval_lifts(cfg, rollout, template, eval_sets: dict) -> dict[str, dict]:
    """Each eval set's lift with `template`, through the learning run's own evaluation."""
    from slime_meta.backends.local.evaluation import evaluate

    metrics = await evaluate(cfg, with_template(rollout, template), eval_sets, 0)
    return {
        name: lift_record(
            metrics[f"eval/{name}/holdout_grade"],
            metrics[f"eval/{name}/holdout_grade_no_info"],
            sum(len(e.holdout) for e in episodes),
        )
        for name, episodes in eval_sets.items()
    }


def trained_teacher(path: str, units_by_set: dict[str, int]) -> dict[str, Any]:
    """The trained teacher's last eval in an efficacy results JSON, as eval_lift.py reads it."""
    result = json.loads(Path(path).read_text())
    curve = result.get("eval_curve") or []
    if not curve:
        return {"file": path, "note": "no eval in this file"}
    point = curve[-1]
    units = next(iter(units_by_set.values()), 32)
    return {"file": path, "step": point["step"], **lift_record(point["holdout"], point["no_info"], units)}


# ----------------------------------------------------------------------------- flags


def add_search_flags(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument_group("prompt search (benchmarks/prompt_search.py)").add_argument
    add(
        "--method",
        choices=("reflect", "candidates"),
        default="reflect",
        help="GEPA-style reflective search, or the hand-written candidates each scored",
    )
    add(
        "--student-attempts",
        type=int,
        default=None,
        help="The budget of student answers (inner rounds and "
        "holdout). Default: what the RL run of these flags spends in --num-rollout steps (see the top of this file).",
    )
    add("--pareto-batches", type=int, default=2, help="Step draws in the Pareto (selection) set.")
    add("--minibatch-batches", type=int, default=1, help="Step draws a round's parent and child are scored on.")
    add("--max-rounds", type=int, default=1000, help="At most this many reflection rounds.")
    add(
        "--max-failed-proposals", type=int, default=5, help="Stop after this many proposals in a row give no candidate."
    )
    add(
        "--candidates",
        default=None,
        help="--method candidates: a file of instructions separated by lines of --- (an entry with "
        "{attempts_and_grades} is a whole template); default: a built-in list and "
        "prompt_templates/teacher_rules.txt's.",
    )
    add(
        "--reflection-base-url",
        default=None,
        help="An OpenAI-compatible endpoint that reflects (default: the teacher model through its pool).",
    )
    add("--reflection-model", default=None, help="The model name at --reflection-base-url.")
    add("--reflection-api-key-env", default="OPENAI_API_KEY", help="Its key's environment variable.")
    add("--reflection-temperature", type=float, default=1.0)
    add("--reflection-max-tokens", type=int, default=384, help="Tokens of a new instruction, at most.")
    add("--reflection-examples", type=int, default=4, help="Chains shown to the reflection, best and worst first.")
    add("--reflection-answers", type=int, default=3, help="Student answers shown per chain.")
    add("--reflection-chars", type=int, default=400, help="Characters of a problem, answer or feedback shown.")
    add(
        "--eval-seed",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="Also evaluate the starting template on --eval-prompt-data.",
    )
    add("--compare-with", default=None, help="An efficacy results JSON: the trained teacher's last eval beside ours.")
    add(
        "--out",
        default=None,
        help="Directory for prompt_search.json, the best template and the logs "
        "(default: $OUT or runs/benchmarks, then prompt_search-<time>).",
    )


class _SearchParser(_OneLineErrorParser):
    def error(self, message: str):
        self.exit(EXIT_USER_ERROR, f"error: {message} (see python benchmarks/prompt_search.py --help)\n")


def parse(argv: Sequence[str]) -> tuple[MetaConfig, argparse.Namespace]:
    parser = _SearchParser(
        prog="prompt_search.py",
        usage="%(prog)s --hf-checkpoint MODEL --prompt-data FILE [train.py flags] [search flags]",
        allow_abbrev=False,
        description=__doc__.splitlines()[0],
    )
    add_meta_learning_arguments(parser)
    add_search_flags(parser)
    ns = parser.parse_args(argv)
    checks = (
        (ns.student_attempts is not None and ns.student_attempts < 1, "--student-attempts", "give a number >= 1"),
        (ns.pareto_batches < 1, "--pareto-batches", "give 1 or more"),
        (ns.minibatch_batches < 1, "--minibatch-batches", "give 1 or more"),
        (ns.max_rounds < 1, "--max-rounds", "give 1 or more"),
        (ns.max_failed_proposals < 1, "--max-failed-proposals", "give 1 or more"),
        (ns.reflection_max_tokens < 1, "--reflection-max-tokens", "give 1 or more"),
        (ns.reflection_examples < 1, "--reflection-examples", "give 1 or more"),
        (ns.reflection_answers < 0, "--reflection-answers", "give 0 or more"),
        (ns.reflection_chars < 20, "--reflection-chars", "give 20 or more"),
        (ns.reflection_temperature < 0, "--reflection-temperature", "give a temperature >= 0"),
        (
            bool(ns.reflection_base_url) != bool(ns.reflection_model),
            "--reflection-base-url",
            "give it together with --reflection-model (the model name there), or neither",
        ),
        (ns.candidates is not None and not Path(ns.candidates).is_file(), "--candidates", "no such file"),
        (ns.candidates is not None and ns.method != "candidates", "--candidates", "it needs --method candidates"),
        (
            ns.compare_with is not None and not Path(ns.compare_with).is_file(),
            "--compare-with",
            "no such file; give an efficacy results JSON (benchmarks/results/efficacy_*.json)",
        ),
        (ns.backend != "local", "--backend", "the search runs on the local backend; leave --backend out"),
    )
    for bad, flag, fix in checks:
        if bad:
            value = getattr(ns, flag[2:].replace("-", "_"))
            raise UserInputError(f"{flag} {value}: {fix}")
    if ns.candidates:
        for text in hand_written_instructions(ns.candidates):
            if "{attempts_and_grades}" in text:  # a whole template: the teacher's slots, the required one
                try:
                    TeacherPromptTemplate(text, source=ns.candidates).check_required()
                except TemplateSlotError as error:
                    raise UserInputError(f"--candidates {ns.candidates}: {error.detail}") from None
    if not ns.out:
        base = Path(os.environ["OUT"]) if os.environ.get("OUT") else REPO_ROOT / "runs" / "benchmarks"
        ns.out = str(base / f"prompt_search-{time.strftime('%Y%m%d-%H%M%S')}")
    cfg = build_config(ns, default_run_dir=ns.out)
    budget_of(cfg, ns)  # a budget that cannot pay for one scoring is refused before anything starts
    return cfg, ns


def budget_of(cfg: MetaConfig, opts: argparse.Namespace) -> tuple[int, dict[str, Any]]:
    """The budget (--student-attempts, else the RL run's answers) and the RL run's figures; refused
    (UserInputError) when it cannot pay for one scoring of the seed on the Pareto set."""
    from slime_meta.assembly import batch_plan

    plan = batch_plan(cfg)
    rl = rl_run_attempts(cfg, plan)
    total = opts.student_attempts or rl["student_attempts"]
    first = opts.pareto_batches * (rl["per_step"]["inner_rounds"] + rl["per_step"]["holdout"])
    if first > total:
        raise UserInputError(
            f"--student-attempts {total}: less than one scoring of the starting template on the Pareto set "
            f"({first} answers); give at least {first}, or fewer --pareto-batches"
        )
    return total, rl


# ----------------------------------------------------------------------------- the run


@dataclass
class OpenRun:
    """A search's running pieces: the run's data, roles and rollout over started pools."""

    cfg: MetaConfig
    data: Any  # slime_meta.backends.local.data.Data
    pieces: Any  # slime_meta.assembly.RolePieces
    rollout: MetaLearningRollout  # its student a CountedStudent
    too_long: Callable[[TeacherPromptTemplate], str | None]  # why a template cannot fit the models' context


@contextlib.asynccontextmanager
async def open_run(cfg: MetaConfig, out: Path):
    """The run's inputs checked and its pools started, as train.py's local backend does, for `cfg`;
    the processes stopped when the block ends. Logs go to `out`/logs."""
    from slime_meta.artifacts.model_files import with_converted_checkpoints
    from slime_meta.assembly import build_role_pieces, build_rollout, load_tokenizer, make_pool
    from slime_meta.backends.local.data import context_limits, load_data
    from slime_meta.backends.local.inputs import check_context_fits, check_models, check_servers
    from slime_meta.backends.local.workers.launcher import LocalProcessGroup
    from slime_meta.backends.local.workers.pools import start_pools, with_local_grader
    from slime_meta.rollout.clients import close_clients
    from slime_meta.rollout.context_budget import check_flags_fit

    cfg = with_converted_checkpoints(cfg)
    teacher_model = check_models(cfg)
    data = load_data(cfg)
    tokenizer = load_tokenizer(teacher_model)
    pieces = build_role_pieces(cfg)
    check_servers(cfg)
    check_context_fits(cfg)
    limits = context_limits(cfg, pieces.chat)

    def too_long(template: TeacherPromptTemplate) -> str | None:
        try:
            check_flags_fit(limits, pieces.generator_template, template, cfg.meta.additional_info_position)
        except UserInputError as error:
            return f"it does not fit the context ({error})"
        return None

    (out / "logs").mkdir(parents=True, exist_ok=True)
    (out / "weights").mkdir(exist_ok=True)
    with LocalProcessGroup(host=cfg.pools.host) as processes:
        pools = start_pools(cfg, processes, teacher_model, out)
        pieces = with_local_grader(cfg, pieces, pools.grader_url)
        teacher_pool = make_pool(cfg, "teacher", pools.teacher.router_url, cfg.sampling.teacher_concurrency)
        student_pool = make_pool(cfg, "student", pools.student_url, cfg.sampling.student_concurrency)
        rollout = build_rollout(cfg, pieces, teacher_pool, student_pool, tokenizer)
        rollout.settings = dataclasses.replace(rollout.settings, keep_solver_attempts=False, show_progress=False)
        rollout.student = CountedStudent.of(rollout.student)
        try:
            yield OpenRun(cfg, data, pieces, rollout, too_long)
        finally:
            await close_clients(teacher_pool, student_pool, pieces.grader)


def split_draws(cfg: MetaConfig, data, batches: int):
    """GEPA's two sets: `batches` step draws for the Pareto set, and a sampler of the other training
    problems for the minibatches (of all of them where too few are left for a step)."""
    from slime_meta.data.problems import ProblemSampler

    pareto = [e for _ in range(batches) for e in data.sampler.next_episodes(**data.draw_sizes)]
    used = {p.uid for e in pareto for p in (*e.holdout, *(q for c in e.train_chunks_P for q in c))}
    grouped = cfg.data.group_key is not None
    rest = [p for p in data.sampler.problems if p.uid not in used]
    feedback = ProblemSampler(rest, seed=cfg.seed + 1, shuffle=True, group_key_used=grouped)
    try:
        feedback.validate(cfg.meta.n_problems_per_prompt, data.plan.holdout_per_episode, data.plan.groups)
    except UserInputError:
        feedback = ProblemSampler(data.sampler.problems, seed=cfg.seed + 1, shuffle=True, group_key_used=grouped)
    return pareto, feedback


def make_reflector(opts: argparse.Namespace, run: OpenRun):
    if opts.reflection_base_url:
        return APIReflector(
            opts.reflection_base_url,
            opts.reflection_model,
            opts.reflection_api_key_env,
            opts.reflection_temperature,
            opts.reflection_max_tokens,
            run.cfg.grader.grader_timeout,
        )
    return PoolReflector(run.rollout.teacher, opts.reflection_temperature, opts.reflection_max_tokens)


async def search_on(run: OpenRun, opts: argparse.Namespace, out: Path) -> dict[str, Any]:
    """The search over an open run, the best template's evaluation, and the report's figures."""
    cfg, data, pieces, rollout = run.cfg, run.data, run.pieces, run.rollout
    started = time.perf_counter()
    pareto, feedback = split_draws(cfg, data, opts.pareto_batches)
    total, rl = budget_of(cfg, opts)
    reflect = make_reflector(opts, run)
    budget = Budget(total, lambda: rollout.student.answers)
    search = Search(
        cfg, rollout, pieces.teacher_template, budget, pareto, feedback, data.draw_sizes, opts, reflect, run.too_long
    )
    first = search.cost(pareto)
    print(
        f"prompt search ({opts.method}): budget {total:,} student answers"
        + (f" (the RL run's: {rl['formula']})" if not opts.student_attempts else "")
        + f"; a scoring on the Pareto set costs {first:,}"
        + (f"; reflection by {reflect.name}" if opts.method == "reflect" else ""),
        flush=True,
    )
    try:
        if opts.method == "reflect":
            await search.reflect_rounds()
        else:
            await search.hand_written(hand_written_instructions(opts.candidates))
    finally:
        await close_clients(reflect)
    search_s, spent, best = time.perf_counter() - started, budget.spent, search.best()
    print(f"best: candidate {best.id} ({best.origin}), {best.score:.3f} on the Pareto set", flush=True)
    evals: dict[str, dict] = {}
    if data.eval_sets:
        evals["best"] = await eval_lifts(cfg, rollout, best.template, data.eval_sets)
        if opts.eval_seed:
            same = best.id == 0
            evals["seed"] = (
                evals["best"] if same else await eval_lifts(cfg, rollout, search.seed_template, data.eval_sets)
            )
    out.mkdir(parents=True, exist_ok=True)
    template_file = out / "best_teacher_template.txt"
    template_file.write_text(best.template.text + "\n", encoding="utf-8")
    units = {name: lift["units"] for name, lift in evals.get("best", {}).items()}
    seed = pieces.teacher_template
    return {
        "method": opts.method,
        "model": {
            "teacher": cfg.pools.hf_checkpoint,
            "student": cfg.pools.student_checkpoint or "the teacher's weights",
        },
        "seed_template": seed.source,
        "seed_template_class": f"{type(seed).__module__}.{type(seed).__name__}",
        "reflection": reflect.name if opts.method == "reflect" else None,
        "budget": {
            "student_attempts": total,
            "spent": spent,
            "counted": "every student answer: inner rounds and holdout (one request of n attempts counts n)",
            "rl_run": rl,
            "pareto_set": {"episodes": len(search.pareto), "answers_per_scoring": search.cost(search.pareto)},
        },
        "evaluations": search.evaluations,
        "search_s": round(search_s, 1),
        "candidates": [c.record() for c in search.candidates],
        "rounds": search.rounds,
        "hand_written_refused": search.refused,
        "best": {
            "id": best.id,
            "origin": best.origin,
            "score": best.score,
            "instruction": written_braces(best.instruction),
            "template_file": str(template_file),
        },
        "eval": evals,
        "trained_teacher": trained_teacher(opts.compare_with, units) if opts.compare_with else None,
    }


async def run_search(cfg: MetaConfig, opts: argparse.Namespace, out: Path) -> dict[str, Any]:
    async with open_run(cfg, out) as run:
        return await search_on(run, opts, out)


def in_se(lift: dict) -> str:
    return "-" if lift["lift_in_se"] is None else f"{lift['lift_in_se']:.2f}"


def print_summary(report: dict) -> None:
    budget = report["budget"]
    print(f"spent {budget['spent']:,} of {budget['student_attempts']:,} student answers", flush=True)
    for c in report["candidates"]:
        shown = c["instruction"].replace("\n", " ")[:90]
        shown_score = "-" if c["score"] is None else f"{c['score']:.3f}"
        print(f"  candidate {c['id']:>2} {c['origin']:<12} {shown_score:>6}  {shown}")
    for which, lifts in report["eval"].items():
        for name, lift in lifts.items():
            print(
                f"eval {name}, {which} template: with info {lift['with_info']:.3f}, no info {lift['no_info']:.3f}, "
                f"lift {lift['lift']:.3f} (SE {lift['se']:.3f}, {in_se(lift)} SE; {lift['units']} problems)"
            )
    trained = report.get("trained_teacher")
    if trained and "lift" in trained:
        print(
            f"trained teacher ({trained['file']}, step {trained['step']}): with info {trained['with_info']:.3f}, no "
            f"info {trained['no_info']:.3f}, lift {trained['lift']:.3f} ({in_se(trained)} SE)"
        )
    print(f"best template: {report['best']['template_file']}", flush=True)


def write_report(fields: dict[str, Any], opts: argparse.Namespace, argv: Sequence[str]) -> Path:
    """prompt_search.json in --out: the date, the command, the machine and every flag, then the figures."""
    report = report_header("prompt_search", dict(vars(opts)))
    report["command"] = " ".join(["python", "benchmarks/prompt_search.py", *argv])
    report.update(fields)
    return write_json(report, Path(opts.out) / "prompt_search.json")


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        cfg, opts = parse(argv)
        fields = asyncio.run(run_search(cfg, opts, Path(opts.out)))
    except UserInputError as error:
        print(f"error: {error}", file=sys.stderr)
        return EXIT_USER_ERROR
    path = write_report(fields, opts, argv)
    print_summary(json.loads(path.read_text()))
    print(path, flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
