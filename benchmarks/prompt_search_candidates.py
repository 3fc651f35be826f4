"""Prompt search: a teacher template's instruction, the candidates it is searched over, the budget of
student answers, and how a candidate is scored (the RL run's reward, through the run's own rollout).

benchmarks/prompt_search.py describes the search.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from statistics import fmean
from typing import Any, Callable, Sequence

from slime_meta.config.arguments import MetaConfig
from slime_meta.prompt_templates import TeacherPromptTemplate
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
