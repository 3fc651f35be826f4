"""`--eval-baseline`: the student's grade with and without the reference context, before training
(R_oracle and the no-info control of the step line and the plot). Both backends use it."""

from __future__ import annotations

import asyncio
import math
import time
from pathlib import Path

from slime_meta.artifacts.tracking import format_duration
from slime_meta.config.arguments import MetaConfig
from slime_meta.config.objectives import read_context
from slime_meta.rollout.meta_rollout import MetaLearningRollout


async def baseline_eval(cfg: MetaConfig, rollout: MetaLearningRollout, problems) -> dict[str, float]:
    """`--eval-baseline`: the student with and without the distillation context, before training.

    --eval-baseline-problems training problems, --eval-baseline-attempts attempts at each (one
    request of n attempts). Each grade is the mean over the problems of a problem's mean score, and
    its standard error is taken over the problems (a problem's attempts are not independent draws
    of the grade). Needs a context that exists before training (--teacher-context or --context-key);
    the meta-teacher's own info (--distill-context additional_info) does not exist yet, so nothing
    is measured for it.
    """
    o = cfg.objectives
    if not o.eval_baseline or not (o.teacher_context or o.context_key):
        return {}
    fixed = read_context(o.teacher_context)
    chosen = list(problems)[: o.eval_baseline_problems]
    attempts = o.eval_baseline_attempts
    progress = BaselineProgress(answers=2 * len(chosen) * attempts)
    print(
        f"baseline (--eval-baseline): the student answers {len(chosen)} training problems {attempts} time(s) each "
        f"without and with the reference context before step 1 ({progress.answers} answers, each graded)",
        flush=True,
    )

    async def graded(problem, context: str) -> float:
        """The problem's mean score over its attempts."""
        _, completions = await rollout.student.solve_n(problem, context, attempts)
        scores = []
        for completion in completions:
            scores.append((await rollout.grader.grade(problem, completion.text)).score)
            progress.one_graded()
        return sum(scores) / len(scores)

    def context_of(problem) -> str:
        return fixed if fixed is not None else str(problem.metadata.get(o.context_key, "") or "")

    plain = await asyncio.gather(*[graded(p, "") for p in chosen])
    with_context = await asyncio.gather(*[graded(p, context_of(p)) for p in chosen])
    name = Path(cfg.data.prompt_data).stem
    student, student_se = mean_and_se(plain)
    teacher, teacher_se = mean_and_se(with_context)
    print(
        f"baseline: no info {student:.3f} ± {student_se:.3f}, with the reference context {teacher:.3f} ± "
        f"{teacher_se:.3f} (R_oracle; ± one standard error over the {len(chosen)} problems), "
        f"in {format_duration(progress.elapsed_s())}",
        flush=True,
    )
    return {
        f"eval/{name}/baseline_student/avg": student,
        f"eval/{name}/baseline_teacher/avg": teacher,
        f"eval/{name}/baseline_diff": teacher - student,
        f"eval/{name}/baseline_student/se": student_se,
        f"eval/{name}/baseline_teacher/se": teacher_se,
        f"eval/{name}/baseline_problems": float(len(chosen)),
        f"eval/{name}/baseline_attempts": float(attempts),
    }


def mean_and_se(values: list[float]) -> tuple[float, float]:
    """The mean and its standard error (NaN for fewer than two values)."""
    n = len(values)
    mean = sum(values) / n
    if n < 2:
        return mean, float("nan")
    variance = sum((v - mean) ** 2 for v in values) / (n - 1)
    return mean, math.sqrt(variance / n)


class BaselineProgress:
    """A line each time another quarter of the baseline's answers is graded: on a CPU with a real
    model the baseline takes minutes before the first step line, which would otherwise pass in silence."""

    def __init__(self, answers: int, parts: int = 4):
        self.answers, self.graded = answers, 0
        # The last quarter's line is the result line of `baseline_eval`.
        self._marks = {round(answers * part / parts) for part in range(1, parts)} - {0, answers}
        self._started = time.monotonic()

    def elapsed_s(self) -> float:
        return time.monotonic() - self._started

    def one_graded(self) -> None:
        self.graded += 1
        if self.graded in self._marks:
            elapsed = format_duration(self.elapsed_s())
            print(f"baseline: {self.graded}/{self.answers} answers graded ({elapsed} elapsed)", flush=True)
