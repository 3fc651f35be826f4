"""slime's evaluation (--eval-interval, --eval-prompt-data NAME PATH ...): the same loop on a fixed
draw of each set (--eval-num-batches batches of the step's split, the run's seed), no training,
reported per set as two data sets, NAME/holdout_grade (each final info's reward) and
NAME/holdout_grade_no_info (the control), which slime logs as eval/NAME/holdout_grade and
eval/NAME/holdout_grade_no_info, plus eval/NAME/gain.
"""

from __future__ import annotations

import asyncio
from dataclasses import replace

from slime_meta.assembly import batch_plan
from slime_meta.backends.slime.data import converted_problems
from slime_meta.backends.slime.runtime import Runtime
from slime_meta.backends.slime.samples import apply_fields, status_value, teacher_sample_fields
from slime_meta.data.problems import ProblemSampler
from slime_meta.types import Problem


def _eval_problems(rt: Runtime) -> dict[str, list[Problem]]:
    """NAME -> problems of each --eval-prompt-data pair (slime keeps them as a flat NAME PATH list)."""
    if rt.eval_problems is None:
        values = list(getattr(rt.args, "eval_prompt_data", None) or rt.cfg.meta.eval_prompt_data)
        rt.eval_problems = {name: converted_problems(rt.cfg, path) for name, path in zip(values[0::2], values[1::2])}
    return rt.eval_problems


async def evaluate(rt: Runtime, rollout_id: int):
    from slime.rollout.base_types import RolloutFnEvalOutput

    data, metrics = {}, {}
    for name, problems in _eval_problems(rt).items():
        set_data, set_metrics = await _evaluate_set(rt, rollout_id, name, problems)
        data.update(set_data)
        metrics.update(set_metrics)
    rt.tracker.log(rollout_id, metrics)  # our metrics.jsonl, for the plot
    return RolloutFnEvalOutput(data=data, metrics=metrics)


async def _evaluate_set(rt: Runtime, rollout_id: int, name: str, problems: list[Problem]):
    from slime.utils.types import Sample

    cfg, meta = rt.cfg, rt.cfg.meta
    plan = batch_plan(cfg)
    # A fresh sampler with the run's seed: every evaluation sees the same problems, split the same way.
    key = cfg.data.group_key  # per family with --group-key, as the training draws and the local backend
    if key is not None:
        problems = [replace(p, group=str(p.metadata.get(key, "") or "") or None) for p in problems]
    sampler = ProblemSampler(problems, seed=cfg.seed, shuffle=True, group_key_used=key is not None)
    episodes = [e for _ in range(meta.eval_num_batches) for e in sampler.next_episodes(**plan.draw_sizes)]
    result = await rt.rollout.run(episodes, rollout_id, seed=cfg.seed)
    finals = [s for s in result.samples if s.inner_iteration == meta.num_inner_iterations - 1]
    with_info = [
        apply_fields(
            Sample(group_index=s.group_index, index=i),
            teacher_sample_fields(
                s, prompt=rt.tokenizer.decode(s.prompt_ids), response=rt.tokenizer.decode(s.response_ids)
            ),
        )
        for i, s in enumerate(finals)
    ]

    async def no_info(problem: Problem, index: int):
        prompt, completion = await rt.rollout.student.solve(problem, "", with_tokens=True)
        grade = await rt.rollout.grader.grade(problem, completion.text)
        return Sample(
            index=index,
            prompt=prompt,
            tokens=[*map(int, completion.prompt_ids), *map(int, completion.output_ids)],
            response=completion.text,
            response_length=len(completion.output_ids),
            label=problem.ground_truth,
            reward=float(grade.score),
            status=Sample.Status(status_value(completion.finish_reason)),
            metadata={"problem_uid": problem.uid},
        )

    holdout = [h for e in episodes for h in e.holdout for _ in range(meta.n_holdout_samples)]
    without = list(await asyncio.gather(*[no_info(h, i) for i, h in enumerate(holdout)]))

    def dataset(samples):
        return {
            "rewards": [s.reward for s in samples],
            "truncated": [s.status == Sample.Status.TRUNCATED for s in samples],
            "samples": samples,
        }

    data = {f"{name}/holdout_grade": dataset(with_info), f"{name}/holdout_grade_no_info": dataset(without)}
    with_grade = sum(s.reward for s in with_info) / len(with_info)
    no_info_grade = sum(s.reward for s in without) / len(without)
    metrics = {
        f"eval/{name}/holdout_grade": with_grade,
        f"eval/{name}/holdout_grade_no_info": no_info_grade,
        f"eval/{name}/gain": with_grade - no_info_grade,
    }
    return data, metrics
