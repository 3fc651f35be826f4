"""The values that travel through the meta-learning loop.

Nested lists carry shape suffixes where they are built: `infos_P_G` is one list per teacher
prompt P holding G infos. A group (the G teacher samples of one prompt) travels together.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence


@dataclass(frozen=True)
class Problem:
    """One row of the dataset.

    `label` is what the row holds (a string, or a dict such as {"answer": "x = 2"});
    `ground_truth` is its text form, shown to the grader.
    """

    uid: str
    prompt: str
    label: Any
    rubric: str = ""
    group: str | None = None
    metadata: Mapping[str, Any] = field(default_factory=dict)
    source: str = field(default="", compare=False)  # "file: line 7", for messages about this row

    @property
    def ground_truth(self) -> str:
        return label_text(self.label)


def label_text(label: Any) -> str:
    """The text of a label: a string as is, {"answer": x} as x, anything else as JSON."""
    if isinstance(label, str):
        return label
    if isinstance(label, Mapping):
        for key in ("answer", "ground_truth", "solution", "label"):
            if key in label:
                return label_text(label[key])
        return json.dumps(dict(label), ensure_ascii=False, sort_keys=True)
    if label is None:
        return ""
    return str(label)


@dataclass(frozen=True)
class Grade:
    """A grader's verdict on one solution. `score` is clamped to [0, 1]."""

    score: float
    explanation: str = ""
    parsed: bool = True  # False: the grader's reply could not be parsed (scored 0, counted)
    raw: str = ""


@dataclass(frozen=True)
class GradedAttempt:
    """One student solution of one problem, with its grade (and the engine's tokens when kept)."""

    problem: Problem
    solution: str
    grade: Grade
    completion: "Completion | None" = None
    iteration: int = 0  # the inner iteration it was made in: a long teacher prompt drops the oldest first


@dataclass(frozen=True)
class Completion:
    """One generation from an inference pool, as the engine sampled it.

    `prompt_ids` and `output_ids` are exactly the token ids the engine used and sampled; the
    trainer trains on them and never re-tokenises `text`. `output_logprobs` are the behaviour
    log-probs (the distribution the tokens were sampled from).
    """

    text: str
    prompt_ids: tuple[int, ...] = ()
    output_ids: tuple[int, ...] = ()
    output_logprobs: tuple[float, ...] = ()
    finish_reason: str = "stop"
    weight_version: str | None = None


@dataclass(frozen=True)
class InfoStep:
    """The teacher's output at one inner iteration of one chain."""

    iteration: int
    info: str
    completion: Completion
    avg_grade_before: float  # mean grade of the attempts the teacher read


@dataclass
class Chain:
    """One inner-loop chain: a teacher prompt's train problems and one teacher sample g."""

    prompt_index: int
    sample_index: int
    problems: Sequence[Problem]
    steps: list[InfoStep] = field(default_factory=list)
    grades_per_iteration: list[float] = field(default_factory=list)
    holdout_scores: list[float] = field(default_factory=list)
    reward: float = 0.0
    traced: bool = False
    trace: list[dict] = field(default_factory=list)
    solver_attempts_K_M: list[list[GradedAttempt]] = field(default_factory=list)

    @property
    def final_info(self) -> str:
        return self.steps[-1].info if self.steps else ""


@dataclass(frozen=True)
class TeacherSample:
    """One trainable teacher generation: prompt ids + sampled ids, with its advantage."""

    prompt_ids: tuple[int, ...]
    response_ids: tuple[int, ...]
    rollout_logprobs: tuple[float, ...]
    reward: float
    advantage: float
    group_index: int
    sample_index: int
    inner_iteration: int
    weight_version: str | None = None
    metadata: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Episode:
    """The problems of one step that are judged together: train chunks and their holdout set.

    `train_chunks_P` holds P teacher prompts of k problems each (`--n-problems-per-prompt`);
    every final info of every chunk is evaluated on every problem of `holdout`.
    """

    train_chunks_P: tuple[tuple[Problem, ...], ...]
    holdout: tuple[Problem, ...]


@dataclass(frozen=True)
class SolverSample:
    """The policy answering a problem itself (solver role): trained by distillation, SDPO, replay.

    `context_prompt_ids` is the same problem's prompt with the distillation context injected,
    `hint_prompt_ids` with the SDPO hint; `teacher_logprobs` are log p(response | context prompt)
    from the pool's scoring call, aligned to `response_ids`.
    """

    problem_uid: str
    prompt_ids: tuple[int, ...]
    response_ids: tuple[int, ...]
    rollout_logprobs: tuple[float, ...]
    temperature: float
    grade: float
    task_advantage: float
    prompt_text: str
    solution_text: str
    context_prompt_ids: tuple[int, ...] | None = None
    teacher_logprobs: tuple[float, ...] | None = None
    hint_prompt_ids: tuple[int, ...] | None = None
    is_error_site: bool = False
    hint_logprobs: tuple[float, ...] | None = None  # log p(response | hint prompt): SDPO's shaping form
    # SDPO's JSD form on slime: the hint-conditioned distribution at each response token as its top-k,
    # `[R, K]` ids (int32) and log-probs (float32) from the pool's scoring call (`StudentRole.score_topk`).
    hint_topk_ids: Any = field(default=None, compare=False)
    hint_topk_logprobs: Any = field(default=None, compare=False)


@dataclass(frozen=True)
class PreferencePair:
    """A DPO pair over one solver prompt: chosen and rejected response ids.

    The reference log-probs (summed over each response, under the run's start weights) are
    computed once when the pair is made and travel with it; None until then.
    """

    prompt_ids: tuple[int, ...]
    chosen_ids: tuple[int, ...]
    rejected_ids: tuple[int, ...]
    reference_chosen_logp: float | None = None
    reference_rejected_logp: float | None = None
