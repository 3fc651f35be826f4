"""The two schedules benchmarks/inner_loop.py compares the project's rollout with, over the same
roles and pools: the published stage-synchronous one (a barrier after every stage) and one
request at a time.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from inner_loop_recording import RecordingGrader

from slime_meta.rollout.meta_rollout import InnerLoopSettings
from slime_meta.rollout.roles import StudentRole, TeacherRole
from slime_meta.types import Episode, GradedAttempt, Problem


async def _solve(student: StudentRole, problem: Problem, info: str) -> str:
    """The solution text (`solve` returns (prompt, text) or (prompt, Completion))."""
    _, solution = await student.solve(problem, info)
    return solution if isinstance(solution, str) else solution.text


@dataclass
class Roles:
    student: StudentRole
    teacher: TeacherRole
    grader: RecordingGrader
    settings: InnerLoopSettings


async def stage_synchronous(roles: Roles, episode: Episode) -> None:
    """All generations, barrier, all grades, barrier, all teacher calls, barrier; K times; holdout."""
    s = roles.settings
    chains = [(chunk, g) for chunk in episode.train_chunks_P for g in range(s.n_samples_per_prompt)]
    infos = [""] * len(chains)
    for _ in range(s.num_inner_iterations):
        jobs = [
            (c, p) for c, (chunk, _) in enumerate(chains) for p in chunk for _ in range(s.n_samples_per_inner_prompt)
        ]
        solutions = await asyncio.gather(*[_solve(roles.student, p, infos[c]) for c, p in jobs])
        grades = await asyncio.gather(*[roles.grader.grade(p, sol) for (c, p), sol in zip(jobs, solutions)])
        attempts: list[dict[str, list[GradedAttempt]]] = [{} for _ in chains]
        for (c, p), sol, grade in zip(jobs, solutions, grades):
            attempts[c].setdefault(p.uid, []).append(GradedAttempt(problem=p, solution=sol, grade=grade))
        replies = await asyncio.gather(
            *[
                roles.teacher.write_info(chunk, [attempts[c][p.uid] for p in chunk], infos[c])
                for c, (chunk, _) in enumerate(chains)
            ]
        )
        infos = [info for info, _, _ in replies]
    holdout_jobs = [(info, h) for info in infos for h in episode.holdout] + [("", h) for h in episode.holdout]
    solutions = await asyncio.gather(*[_solve(roles.student, h, info) for info, h in holdout_jobs])
    await asyncio.gather(*[roles.grader.grade(h, sol) for (_, h), sol in zip(holdout_jobs, solutions)])


async def sequential(roles: Roles, episode: Episode, max_chains: int | None) -> int:
    """One request at a time; returns how many chains it ran."""
    s = roles.settings
    chains = [(chunk, g) for chunk in episode.train_chunks_P for g in range(s.n_samples_per_prompt)]
    chains = chains[:max_chains] if max_chains else chains
    for chunk, _ in chains:
        info = ""
        for _ in range(s.num_inner_iterations):
            attempts = []
            for p in chunk:
                row = []
                for _ in range(s.n_samples_per_inner_prompt):
                    sol = await _solve(roles.student, p, info)
                    row.append(GradedAttempt(problem=p, solution=sol, grade=await roles.grader.grade(p, sol)))
                attempts.append(row)
            info, _, _ = await roles.teacher.write_info(chunk, attempts, info)
        for h in episode.holdout:
            await roles.grader.grade(h, await _solve(roles.student, h, info))
    if not max_chains or max_chains >= len(chains):
        for h in episode.holdout:  # the control, when the whole step ran
            await roles.grader.grade(h, await _solve(roles.student, h, ""))
    return len(chains)
