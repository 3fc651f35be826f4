"""Solver samples: the policy answering train problems itself, for the solver-role channels.

Context distillation, hint self-distillation (SDPO) and trace replay train the policy as a
solver. With a shared pool the student *is* the policy, so the first inner round's no-info
attempts are already the policy's own samples (same weights, their tokens and log-probs kept).
With a separate, frozen student those attempts come from another model: training on them as if
they were the policy's would be wrong without importance correction, so the policy then answers
the same problems itself through its own pool.

For each attempt this module adds the prompt with the context (distillation) or the hint (SDPO)
injected, and the log-probs of the attempt's tokens under the context prompt, from the pool's
scoring call (max_new_tokens=0, logprob_start_len=0), aligned to the response tokens.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from statistics import fmean
from typing import Sequence

import torch

from slime_meta.losses.advantages import grpo_advantages
from slime_meta.rollout.roles import Grader, StudentRole
from slime_meta.types import Chain, GradedAttempt, Problem, SolverSample


@dataclass(frozen=True)
class SolverSettings:
    attempts_per_problem: int
    reuse_chain_attempts: bool  # shared pool: the chain's first-round attempts are the policy's
    distill_context: str  # "none" | "fixed" | "column" | "additional_info"
    fixed_context: str | None
    context_key: str | None
    distill: bool
    sdpo: bool
    sdpo_hint: str | None
    sdpo_grade_threshold: float
    sdpo_on: str  # "errors" | "all"
    skip_verification: bool
    std_normalize: bool
    sdpo_shaping: bool = False  # score the answers of error sites under the hint prompt
    # SDPO's JSD form where the trainer cannot run the hinted forward itself (slime): the hint-conditioned
    # top-k at each answer token of the error sites, from the pool's scoring call
    sdpo_topk_scoring: int | None = None


def distillation_prompt_ids(policy: StudentRole, problem: Problem, context: str) -> tuple[int, ...]:
    """Where the distillation context goes, for both backends: into the solver's own prompt, in the
    slot where the student reads an info (generator template, chat template, --additional-info-position),
    so the context-conditioned teacher is the same model reading the same prompt plus the context.
    What is scored under it: the solver's response tokens only (the teacher's infos are never distilled)."""
    return tuple(policy.prompt_ids(problem, context))


class SolverSampleBuilder:
    def __init__(self, policy: StudentRole, grader: Grader, settings: SolverSettings):
        self.policy = policy  # the student role over the *policy's* pool
        self.grader = grader
        self.settings = settings
        self.skipped_for_length = 0  # attempts left out this step: a scoring call would not fit the context

    def context_for(self, chain: Chain, problem: Problem) -> str:
        s = self.settings
        if s.distill_context == "fixed":
            return s.fixed_context or ""
        if s.distill_context == "column":
            return str(problem.metadata.get(s.context_key or "", "") or "")
        return chain.final_info

    async def _own_attempts(self, problems: Sequence[Problem]) -> list[list[GradedAttempt]]:
        async def attempt(problem: Problem) -> GradedAttempt:
            _, completion = await self.policy.solve(problem, "", with_tokens=True)
            grade = await self.grader.grade(problem, completion.text)
            return GradedAttempt(problem=problem, solution=completion.text, grade=grade, completion=completion)

        m = self.settings.attempts_per_problem
        return await asyncio.gather(*[asyncio.gather(*[attempt(p) for _ in range(m)]) for p in problems])

    async def _chain_samples(self, chain: Chain) -> list[SolverSample]:
        s = self.settings
        if s.reuse_chain_attempts and chain.solver_attempts_K_M:
            attempts_K_M = chain.solver_attempts_K_M
        else:
            attempts_K_M = await self._own_attempts(chain.problems)
        samples: list[SolverSample] = []
        for problem, attempts_M in zip(chain.problems, attempts_K_M):
            grades_M = torch.tensor([a.grade.score for a in attempts_M], dtype=torch.float64)
            if s.skip_verification:
                advantages_M = [0.0] * len(attempts_M)
            else:  # GRPO over the m attempts at this problem
                advantages_M = grpo_advantages(grades_M, len(attempts_M), std_normalize=s.std_normalize).tolist()
            prompt_ids = tuple(self.policy.prompt_ids(problem, ""))
            context_ids = (
                distillation_prompt_ids(self.policy, problem, self.context_for(chain, problem)) if s.distill else None
            )
            hint = s.sdpo_hint if s.sdpo_hint is not None else chain.final_info
            hint_ids = tuple(self.policy.prompt_ids(problem, hint)) if s.sdpo else None
            for attempt, advantage in zip(attempts_M, advantages_M):
                completion = attempt.completion
                if completion is None or not completion.output_ids:
                    continue
                error = attempt.grade.score < s.sdpo_grade_threshold or s.sdpo_on == "all"
                # The answer was sized for the plain prompt; with the context or hint in front it
                # may not fit the model: such a sample is left out (counted), never a refused request.
                scored_under = [x for x in (context_ids, hint_ids if error else None) if x is not None]
                if not all(self.policy.fits_scoring(x, completion.output_ids) for x in scored_under):
                    self.skipped_for_length += 1
                    continue
                teacher_logprobs = None
                if context_ids is not None:
                    teacher_logprobs = tuple(await self.policy.score(context_ids, completion.output_ids))
                hint_logprobs = None
                if s.sdpo_shaping and error and hint_ids is not None:
                    hint_logprobs = tuple(await self.policy.score(hint_ids, completion.output_ids))
                hint_topk_ids = hint_topk_logprobs = None
                if s.sdpo_topk_scoring is not None and error and hint_ids is not None:
                    hint_topk_ids, hint_topk_logprobs = await self.policy.score_topk(
                        hint_ids, completion.output_ids, s.sdpo_topk_scoring
                    )
                samples.append(
                    SolverSample(
                        problem_uid=problem.uid,
                        prompt_ids=prompt_ids,
                        response_ids=completion.output_ids,
                        rollout_logprobs=completion.output_logprobs,
                        temperature=self.policy.temperature,
                        grade=attempt.grade.score,
                        task_advantage=float(advantage),
                        prompt_text=self.policy.prompt(problem, ""),
                        solution_text=completion.text,
                        context_prompt_ids=context_ids,
                        teacher_logprobs=teacher_logprobs,
                        hint_prompt_ids=hint_ids,
                        is_error_site=error,
                        hint_logprobs=hint_logprobs,
                        hint_topk_ids=hint_topk_ids,
                        hint_topk_logprobs=hint_topk_logprobs,
                    )
                )
        return samples

    async def build_per_chain(self, chains: Sequence[Chain]) -> tuple[list[list[SolverSample]], dict[str, float]]:
        """The solver samples of each chain, in chain order (slime attaches them to the chain's rollout)."""
        self.skipped_for_length = 0
        per_chain = list(await asyncio.gather(*[self._chain_samples(c) for c in chains]))
        metrics = self._metrics([x for chain_samples in per_chain for x in chain_samples])
        metrics["solver/skipped_for_length"] = float(self.skipped_for_length)
        return per_chain, metrics

    async def build(self, chains: Sequence[Chain]) -> tuple[list[SolverSample], dict[str, float]]:
        per_chain, metrics = await self.build_per_chain(chains)
        return [x for chain_samples in per_chain for x in chain_samples], metrics

    @staticmethod
    def _metrics(samples: Sequence[SolverSample]) -> dict[str, float]:
        metrics = {"solver/num_samples": float(len(samples))}
        if samples:
            metrics["solver/avg_grade"] = fmean(x.grade for x in samples)
            metrics["solver/error_sites"] = float(sum(x.is_error_site for x in samples))
        with_teacher = [x for x in samples if x.teacher_logprobs]
        if with_teacher:
            # The reward view of distillation: how much likelier the context makes the student's tokens.
            metrics["distill/teacher_minus_student_logp"] = fmean(
                sum(t - s for t, s in zip(x.teacher_logprobs, x.rollout_logprobs)) / len(x.response_ids)
                for x in with_teacher
            )
        return metrics
