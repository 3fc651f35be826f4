"""`--eval-baseline`: the student's grade with and without the reference context, before training
(R_oracle and the no-info control of the step line and the plot). Both backends use it."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from slime_meta.artifacts.tracking import format_duration
from slime_meta.config.arguments import MetaConfig
from slime_meta.config.objectives import read_context
from slime_meta.rollout.meta_rollout import MetaLearningRollout


async def baseline_eval(cfg: MetaConfig, rollout: MetaLearningRollout, problems, limit: int = 32) -> dict[str, float]:
    """`--eval-baseline`: the student with and without the distillation context, before training.

    Needs a context that exists before training (--teacher-context or --context-key); the
    meta-teacher's own info (--distill-context additional_info) does not exist yet, so nothing is
    measured for it.
    """
    o = cfg.objectives
    if not o.eval_baseline or not (o.teacher_context or o.context_key):
        return {}
    fixed = read_context(o.teacher_context)
    chosen = list(problems)[:limit]
    progress = BaselineProgress(answers=2 * len(chosen))
    print(
        f"baseline (--eval-baseline): the student answers {len(chosen)} training problems without and with the "
        f"reference context before step 1 ({progress.answers} answers, each graded)",
        flush=True,
    )

    async def graded(problem, context: str) -> float:
        _, completion = await rollout.student.solve(problem, context)
        score = (await rollout.grader.grade(problem, completion.text)).score
        progress.one_graded()
        return score

    def context_of(problem) -> str:
        return fixed if fixed is not None else str(problem.metadata.get(o.context_key, "") or "")

    plain = await asyncio.gather(*[graded(p, "") for p in chosen])
    with_context = await asyncio.gather(*[graded(p, context_of(p)) for p in chosen])
    name = Path(cfg.data.prompt_data).stem
    student, teacher = sum(plain) / len(plain), sum(with_context) / len(with_context)
    print(
        f"baseline: no info {student:.3f}, with the reference context {teacher:.3f} (R_oracle), "
        f"in {format_duration(progress.elapsed_s())}",
        flush=True,
    )
    return {
        f"eval/{name}/baseline_student/avg": student,
        f"eval/{name}/baseline_teacher/avg": teacher,
        f"eval/{name}/baseline_diff": teacher - student,
    }


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
