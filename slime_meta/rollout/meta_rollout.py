"""The meta-learning rollout: inner iterations on train problems, holdout rewards, GRPO groups.

For every teacher prompt p (k train problems) and every teacher sample g of its group, a chain:
    info = ""
    K times: the student solves each train problem m times with `info`; the grader scores each
             attempt; the teacher reads problems, the attempts and grades of every round so far
             (each under the info it was made with: its own earlier infos; `--teacher-history
             last`: this round's only) and `info`, and writes a new info.
    holdout: the student solves every holdout problem S times with the final info (S =
             --n-holdout-samples); graded.
    reward(p, g) = mean holdout grade over all H x S attempts.

All chains run at once and each goes on to its holdout the moment it ends (no barrier between
stages), so the critical path is K x (generate + grade + teach) + (generate + grade); the pools
bound concurrency. The control (holdout with an empty info, also S attempts per problem) runs
beside them. The m (or S) attempts at one problem are one student request with
`sampling_params.n = m`: the server prefills the prompt once for all of them, and the pool sees
m times fewer requests; each attempt is graded on its own.
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass, field
from statistics import fmean
from typing import Any, Sequence

from tqdm import tqdm

from slime_meta.rollout.context_budget import metrics_of as context_budget_metrics
from slime_meta.rollout.phase_timeline import PhaseTimeline
from slime_meta.rollout.rewards import group_rewards_and_advantages
from slime_meta.rollout.roles import Grader, StudentRole, TeacherRole
from slime_meta.types import Chain, Episode, GradedAttempt, InfoStep, Problem, TeacherSample


@dataclass(frozen=True)
class InnerLoopSettings:
    num_inner_iterations: int
    n_samples_per_inner_prompt: int
    n_samples_per_prompt: int
    train_all_inner_steps: bool
    holdout_advantage: str
    std_normalize: bool
    trace_sample_rate: float
    control_samples_per_problem: int = 1
    holdout_samples_per_problem: int = 1
    show_progress: bool = True
    keep_solver_attempts: bool = False
    # What the teacher reads each round: "all" rounds' attempts so far (each under the info it was
    # made with: its own earlier infos), or the "last" round's only.
    teacher_history: str = "all"


@dataclass
class RolloutResult:
    samples: list[TeacherSample]
    metrics: dict[str, float]
    chains: list[Chain]
    traces: list[dict[str, Any]] = field(default_factory=list)


def trace_at_least_one(chains: Sequence[Chain], rate: float, rng: random.Random) -> None:
    """Where the draw at `rate` (--trace-sample-rate) traced none of a step's chains, one chosen at
    random is traced: at the default 0.1 a step of 32 chains (the demo's) drew none 3% of the time,
    one of 8 (run_real.sh on a CPU) 43%, and that step's infos were then nowhere to read. A rate of
    0 traces nothing."""
    if rate > 0 and chains and not any(chain.traced for chain in chains):
        rng.choice(chains).traced = True


class MetaLearningRollout:
    """Runs one outer step's rollout over the pools. Stateless between steps."""

    def __init__(self, student: StudentRole, grader: Grader, teacher: TeacherRole, settings: InnerLoopSettings):
        self.student = student
        self.grader = grader
        self.teacher = teacher
        self.settings = settings

    async def run(self, episodes: Sequence[Episode], rollout_id: int, seed: int = 0) -> RolloutResult:
        s = self.settings
        started = time.perf_counter()
        tracing_rng = random.Random(f"{seed}:{rollout_id}")
        prompt_numbers = iter(range(10**9))  # teacher prompts are numbered across episodes
        chains_E_P_G = [
            [
                [
                    Chain(
                        prompt_index=p,
                        sample_index=g,
                        problems=chunk,
                        traced=tracing_rng.random() < s.trace_sample_rate,
                    )
                    for g in range(s.n_samples_per_prompt)
                ]
                for p, chunk in ((next(prompt_numbers), chunk) for chunk in episode.train_chunks_P)
            ]
            for episode in episodes
        ]
        chains = [c for chains_P_G in chains_E_P_G for chains_G in chains_P_G for c in chains_G]
        trace_at_least_one(chains, s.trace_sample_rate, tracing_rng)
        progress = tqdm(total=len(chains), desc=f"step {rollout_id} chains", disable=not s.show_progress, leave=False)
        timeline = PhaseTimeline()  # when each dependent phase ran (perf/rollout_phase_*)

        async def chain_then_holdout(chain: Chain, holdout: Sequence[Problem]) -> None:
            await self._run_chain(chain, timeline)
            with timeline.phase("holdout"):
                await self._run_holdout(chain, holdout)
            progress.update(1)

        async def control_grades(holdout: Sequence[Problem]) -> list[float]:
            with timeline.phase("control"):
                return await self._control_grades(holdout)

        control = [control_grades(e.holdout) for e in episodes]
        work = [chain_then_holdout(c, e.holdout) for e, P_G in zip(episodes, chains_E_P_G) for G in P_G for c in G]
        control_grades_E = (await asyncio.gather(asyncio.gather(*control), *work))[0]
        progress.close()

        samples: list[TeacherSample] = []
        group_index = 0
        for chains_P_G in chains_E_P_G:
            for chains_G in chains_P_G:
                rewards_G, advantages_G = group_rewards_and_advantages(
                    [c.holdout_scores for c in chains_G], mode=s.holdout_advantage, std_normalize=s.std_normalize
                )
                for chain, reward, advantage in zip(chains_G, rewards_G, advantages_G):
                    chain.reward = reward
                    steps = chain.steps if s.train_all_inner_steps else chain.steps[-1:]
                    samples += [self._sample(step, chain, reward, advantage, group_index) for step in steps]
                group_index += 1

        metrics = self._metrics(chains_E_P_G, control_grades_E, elapsed=time.perf_counter() - started)
        metrics["meta_learning/num_train_samples"] = float(len(samples))
        metrics.update(timeline.metrics())
        metrics.update(context_budget_metrics(self.student, self.teacher))  # what was shortened to fit the context
        traces = [self._trace_record(c, rollout_id) for c in chains if c.traced]
        return RolloutResult(samples=samples, metrics=metrics, chains=chains, traces=traces)

    # ------------------------------------------------------------------ one chain

    async def _attempts(
        self, problem: Problem, info: str, count: int, with_tokens: bool = False, iteration: int = 0
    ) -> list[tuple[str, GradedAttempt]]:
        """`count` attempts at `problem`: one student request with n = count (the prompt is
        prefilled once for all of them), then each attempt graded on its own."""
        if count < 1:
            return []
        prompt, completions = await self.student.solve_n(problem, info, count, with_tokens=with_tokens)
        grades = await asyncio.gather(*[self.grader.grade(problem, c.text) for c in completions])
        return [
            (prompt, GradedAttempt(problem=problem, solution=c.text, grade=grade, completion=c, iteration=iteration))
            for c, grade in zip(completions, grades)
        ]

    async def _run_chain(self, chain: Chain, timeline: PhaseTimeline | None = None) -> None:
        m = self.settings.n_samples_per_inner_prompt
        info = ""
        history_K_M: list[list[GradedAttempt]] = [[] for _ in chain.problems]  # every round's attempts so far
        round_infos: list[str] = []  # the info of each round so far
        timeline = timeline or PhaseTimeline()
        for iteration in range(self.settings.num_inner_iterations):
            # The first round's no-info attempts are the policy's own solver samples when it is the
            # student (shared pool): keep their tokens for the solver-role channels.
            keep_tokens = iteration == 0 and self.settings.keep_solver_attempts
            with timeline.phase(f"student_{iteration}"):  # the attempts and their grades
                results_K_M = await asyncio.gather(
                    *[self._attempts(p, info, m, keep_tokens, iteration) for p in chain.problems]
                )
            if keep_tokens:
                chain.solver_attempts_K_M = [[attempt for _, attempt in results_M] for results_M in results_K_M]
            attempts_K_M = [[attempt for _, attempt in results_M] for results_M in results_K_M]
            avg_grade = fmean(a.grade.score for attempts_M in attempts_K_M for a in attempts_M)
            chain.grades_per_iteration.append(avg_grade)
            round_infos.append(info)
            if self.settings.teacher_history == "all":  # past attempts, past feedback, its own past infos
                for history_M, attempts_M in zip(history_K_M, attempts_K_M):
                    history_M.extend(attempts_M)
                shown_K_M, shown_infos = [list(h) for h in history_K_M], list(round_infos)
            else:
                shown_K_M, shown_infos = attempts_K_M, []
            with timeline.phase(f"teacher_{iteration}"):
                new_info, completion, teacher_prompt = await self.teacher.write_info(
                    chain.problems, shown_K_M, info, round_infos=shown_infos
                )
            chain.steps.append(
                InfoStep(iteration=iteration, info=new_info, completion=completion, avg_grade_before=avg_grade)
            )
            if chain.traced:
                chain.trace.append(
                    {
                        "iteration": iteration,
                        "info_in": info,
                        "attempts": [
                            {
                                "problem_uid": a.problem.uid,
                                "prompt": prompt,
                                "solution": a.solution,
                                "grade": a.grade.score,
                                "explanation": a.grade.explanation,
                                "parsed": a.grade.parsed,
                            }
                            for results_M in results_K_M
                            for prompt, a in results_M
                        ],
                        "teacher_prompt": teacher_prompt,
                        "teacher_response": completion.text,
                        "teacher_finish_reason": completion.finish_reason,
                        "info_out": new_info,
                    }
                )
            info = new_info

    async def _run_holdout(self, chain: Chain, holdout: Sequence[Problem]) -> None:
        n = self.settings.holdout_samples_per_problem
        results_H_N = await asyncio.gather(*[self._attempts(h, chain.final_info, n) for h in holdout])
        results = [result for results_N in results_H_N for result in results_N]
        # One score per holdout problem, the mean of its n attempts: the reward (their mean) is the
        # mean over all attempts, and normalize-then-mean still lines problems up across the G infos.
        scores_H_N = [[a.grade.score for _, a in results[i * n : (i + 1) * n]] for i in range(len(holdout))]
        chain.holdout_scores = [fmean(scores_N) for scores_N in scores_H_N]
        if chain.traced:
            chain.trace.append(
                {
                    "holdout": [
                        {
                            "problem_uid": a.problem.uid,
                            "prompt": prompt,
                            "solution": a.solution,
                            "grade": a.grade.score,
                            "explanation": a.grade.explanation,
                        }
                        for prompt, a in results
                    ]
                }
            )

    async def _control_grades(self, holdout: Sequence[Problem]) -> list[float]:
        """The no-teacher control: the holdout problems solved with an empty info."""
        n = self.settings.control_samples_per_problem
        results_H_N = await asyncio.gather(*[self._attempts(h, "", n) for h in holdout])
        results = [result for results_N in results_H_N for result in results_N]
        return [a.grade.score for _, a in results]

    # ------------------------------------------------------------------ outputs

    @staticmethod
    def _sample(step: InfoStep, chain: Chain, reward: float, advantage: float, group_index: int) -> TeacherSample:
        c = step.completion
        return TeacherSample(
            prompt_ids=c.prompt_ids,
            response_ids=c.output_ids,
            rollout_logprobs=c.output_logprobs,
            reward=reward,
            advantage=advantage,
            group_index=group_index,
            sample_index=chain.sample_index,
            inner_iteration=step.iteration,
            weight_version=c.weight_version,
            metadata={"finish_reason": c.finish_reason, "info": step.info},
        )

    def _metrics(self, chains_E_P_G, control_grades_E, *, elapsed: float) -> dict[str, float]:
        chains = [c for P_G in chains_E_P_G for G in P_G for c in G]
        groups = [G for P_G in chains_E_P_G for G in P_G]
        holdout_scores = [x for c in chains for x in c.holdout_scores]
        control = [x for grades in control_grades_E for x in grades]
        avg_holdout = fmean(holdout_scores) if holdout_scores else 0.0
        avg_control = fmean(control) if control else 0.0
        metrics = {
            "meta_learning/inner_loop_time": elapsed,
            "meta_learning/avg_inner_grade": fmean(g for c in chains for g in c.grades_per_iteration),
            "meta_learning/avg_holdout_grade": avg_holdout,
            "meta_learning/num_train_problems": float(sum(len(G[0].problems) for G in groups)),
            "meta_learning/num_holdout_evals": float(len(holdout_scores) * self.settings.holdout_samples_per_problem),
            "meta_learning/holdout_grade_no_info": avg_control,
            "meta_learning/holdout_gain_over_no_info": avg_holdout - avg_control,
            "meta_learning/best_info_holdout_grade": fmean(max(c.reward for c in G) for G in groups),
            "meta_learning/groups_without_signal": fmean(
                float(max(c.reward for c in G) - min(c.reward for c in G) < 1e-9) for G in groups
            ),
            "meta_learning/info_tokens": fmean(len(c.steps[-1].completion.output_ids) for c in chains),
            "meta_learning/info_truncated": fmean(
                float(c.steps[-1].completion.finish_reason == "length") for c in chains
            ),
        }
        for iteration in range(self.settings.num_inner_iterations):
            metrics[f"meta_learning/inner_grade_iter_{iteration}"] = fmean(
                c.grades_per_iteration[iteration] for c in chains
            )
        return metrics

    @staticmethod
    def _trace_record(chain: Chain, rollout_id: int) -> dict[str, Any]:
        return {
            "type": "chain",
            "rollout_id": rollout_id,
            "prompt_index": chain.prompt_index,
            "sample_index": chain.sample_index,
            "problems": [{"uid": p.uid, "prompt": p.prompt, "ground_truth": p.ground_truth} for p in chain.problems],
            "steps": chain.trace,
            "final_info": chain.final_info,
            "reward": chain.reward,
        }


def describe_batch(episodes: Sequence[Episode], rollout_id: int) -> dict[str, Any]:
    """Which problems a step drew (a trace record: resumed runs can be checked against it)."""
    return {
        "type": "batch",
        "rollout_id": rollout_id,
        "episodes": [
            {"train": [[p.uid for p in chunk] for chunk in e.train_chunks_P], "holdout": [p.uid for p in e.holdout]}
            for e in episodes
        ],
    }
