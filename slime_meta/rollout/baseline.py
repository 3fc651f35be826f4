"""`--eval-baseline`: the student's grade with and without the reference context, before training
(R_oracle and the no-info control of the step line and the plot). Both backends use it."""

from __future__ import annotations

import asyncio
from pathlib import Path

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

    async def graded(problem, context: str) -> float:
        _, completion = await rollout.student.solve(problem, context)
        return (await rollout.grader.grade(problem, completion.text)).score

    def context_of(problem) -> str:
        return fixed if fixed is not None else str(problem.metadata.get(o.context_key, "") or "")

    plain = await asyncio.gather(*[graded(p, "") for p in chosen])
    with_context = await asyncio.gather(*[graded(p, context_of(p)) for p in chosen])
    name = Path(cfg.data.prompt_data).stem
    student, teacher = sum(plain) / len(plain), sum(with_context) / len(with_context)
    return {
        f"eval/{name}/baseline_student/avg": student,
        f"eval/{name}/baseline_teacher/avg": teacher,
        f"eval/{name}/baseline_diff": teacher - student,
    }
