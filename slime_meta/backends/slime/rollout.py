"""slime plugins of the rollout: `--rollout-function-path` and `--custom-reward-post-process-path`.

    generate_rollout(args, rollout_id, data_source, evaluation=False)
        -> RolloutFnTrainOutput | RolloutFnEvalOutput

Training: draws our --rollout-batch-size problems from slime's data source (carried as
--meta-rollout-batch-size), splits them into train and holdout, and runs our inner loop against
slime's routers and returns one group of n_samples_per_prompt samples per teacher prompt (train /
k groups: slime's own --rollout-batch-size, as its trainer expects): each the teacher's final
info, its reward the mean holdout grade. With --train-all-inner-steps each member of a group is
the list of that chain's K infos, one rollout (they share `Sample.rollout_id`, so slime counts it
once).

With --group-key the problems come from our per-family sampler instead of the data source's
order (`_family_episodes`). Solver samples (distillation, SDPO shaping) and replay pairs join
the rollout of the chain they came from (samples.py).

Evaluation (`evaluation=True`): `evaluation.py`. The pieces kept between calls, keyed by the
`args` object they were built from: `runtime.py`.
"""

from __future__ import annotations

import asyncio
import copy
import time
from argparse import Namespace
from dataclasses import replace
from typing import Any, Sequence

from slime_meta.artifacts.tracking import RunProgress, format_step_line, oracle_grade
from slime_meta.assembly import batch_plan
from slime_meta.backends.slime.data import converted_problems
from slime_meta.backends.slime.evaluation import evaluate
from slime_meta.backends.slime.replay_samples import ReplaySample, pairs_by_chain, replay_samples
from slime_meta.backends.slime.runtime import Runtime, build_runtime
from slime_meta.backends.slime.samples import (
    advantage_of,
    apply_fields,
    pack_topk,
    problem_from_sample,
    replay_sample_fields,
    solver_sample_fields,
    teacher_sample_fields,
)
from slime_meta.config.arguments import MetaConfig
from slime_meta.data.problems import ProblemSampler
from slime_meta.rollout.baseline import baseline_eval
from slime_meta.rollout.clients import counter_metrics
from slime_meta.rollout.meta_rollout import RolloutResult, describe_batch
from slime_meta.rollout.pools import SGLangPool
from slime_meta.types import Episode, Problem, SolverSample, TeacherSample

_runtimes: dict[int, Runtime] = {}


def runtime(args: Namespace) -> Runtime:
    found = _runtimes.get(id(args))
    if found is None or found.args is not args:
        found = _runtimes[id(args)] = build_runtime(args)
    return found


def close_runtimes() -> None:
    """Close every pool client and loop (tests; the rollout manager just exits)."""
    while _runtimes:
        _, rt = _runtimes.popitem()
        rt.close()


# ----------------------------------------------------------------------------- the plugins


def generate_rollout(args: Namespace, rollout_id: int, data_source: Any, evaluation: bool = False):
    """slime's --rollout-function-path: our meta-learning rollout over slime's pools."""
    rt = runtime(args)
    if evaluation:
        return rt.loop.run(evaluate(rt, rollout_id))
    plan = batch_plan(rt.cfg)
    if getattr(args, "rollout_batch_size", plan.groups) != plan.groups:
        raise ValueError(
            f"slime's --rollout-batch-size is {args.rollout_batch_size}, the plan has {plan.groups} teacher "
            "prompts: launch through train.py --backend slime, which sets both"
        )
    groups = data_source.get_samples(plan.problems)
    return rt.loop.run(_train_rollout(rt, rollout_id, groups, plan.train, _family_episodes(rt, rollout_id, plan)))


def _family_episodes(rt: Runtime, rollout_id: int, plan) -> list[Episode] | None:
    """--group-key: slime's data source hands out rows in its own order, not per task family, so
    the problems come from our own seeded per-family sampler over --prompt-data (the one the local
    backend uses; a resumed run replays the draws before its step). The data source still hands
    out the Sample objects slime counts and trains; their metadata becomes the drawn problem's."""
    cfg = rt.cfg
    if cfg.data.group_key is None:
        return None
    if rt.family_sampler is None:
        problems = [
            replace(p, group=str(p.metadata.get(cfg.data.group_key, "") or "") or None)
            for p in converted_problems(cfg, cfg.data.prompt_data)
        ]
        rt.family_sampler = ProblemSampler(
            problems, seed=cfg.seed, shuffle=cfg.data.rollout_shuffle, group_key_used=True
        )
    while rt.family_draws < rollout_id:
        rt.family_sampler.next_episodes(**plan.draw_sizes)
        rt.family_draws += 1
    rt.family_draws += 1
    return rt.family_sampler.next_episodes(**plan.draw_sizes)


def post_process_rewards(args: Namespace, samples: Sequence[Any]) -> tuple[list[float], list[float]]:
    """slime's --custom-reward-post-process-path: (raw rewards, the rollout's GRPO advantages).

    The advantages were computed over each group's holdout rewards by the inner loop (either
    --holdout-advantage mode); slime's own group normalisation would redo (and for
    normalize-then-mean, change) them.
    """
    raw = [float(s.reward) for s in samples]
    advantages = [advantage_of(s) for s in samples]
    return raw, [r if a is None else a for r, a in zip(raw, advantages)]


# ----------------------------------------------------------------------------- training step


def _episode(problems: Sequence[Problem], num_prompts: int, k: int, num_train: int) -> Episode:
    return Episode(
        train_chunks_P=tuple(tuple(problems[p * k : (p + 1) * k]) for p in range(num_prompts)),
        holdout=tuple(problems[num_train:]),
    )


def _traces_by_chain(result: RolloutResult) -> dict[tuple[int, int], dict]:
    return {(t["prompt_index"], t["sample_index"]): t for t in result.traces}


def _chain_output(
    rt: Runtime,
    base: Any,
    steps: list[TeacherSample],
    trace: dict | None,
    solver: Sequence[tuple[str, SolverSample, tuple[float, ...]]],
    counts: dict[str, int],
    replay: Sequence[ReplaySample] = (),
):
    """One group member: the chain's final info, or (--train-all-inner-steps) its K infos as one
    rollout; with solver channels on, the chain's solver samples join that rollout."""
    compact = rt.cfg.meta.train_all_inner_steps
    with_solver = rt.solver_builder is not None
    members = []
    for sample in steps:
        fields = teacher_sample_fields(
            sample,
            prompt=rt.tokenizer.decode(sample.prompt_ids),
            response=rt.tokenizer.decode(sample.response_ids),
            base_metadata=base.metadata,
            # slime forwards teacher_log_probs only when every sample has them; an info's are unused.
            teacher_log_probs=sample.rollout_logprobs if with_solver else None,
            rollout_id=base.index if (compact or with_solver) else None,  # siblings share it: one rollout
            trace=trace if sample is steps[-1] else None,
        )
        members.append(apply_fields(base if len(steps) == 1 and not with_solver else copy.deepcopy(base), fields))
    for kind, x, scores in solver:
        fields = solver_sample_fields(
            x,
            prompt=rt.tokenizer.decode(x.prompt_ids),
            response=rt.tokenizer.decode(x.response_ids),
            teacher_log_probs=scores,
            index=counts.get(kind, 0),
            rollout_id=base.index,
            base_metadata=base.metadata,
            kind=kind,
        )
        counts[kind] = counts.get(kind, 0) + 1
        members.append(apply_fields(copy.deepcopy(base), fields))
    for x in replay:
        fields = replay_sample_fields(
            x, index=counts.get("replay", 0), rollout_id=base.index, base_metadata=base.metadata
        )
        counts["replay"] = counts.get("replay", 0) + 1
        members.append(apply_fields(copy.deepcopy(base), fields))
    infos, solvers = members[: len(steps)], members[len(steps) :]
    if compact:
        return infos + solvers
    # slime flattens by its first member's type: with solver channels on, every member is a list.
    return [infos[-1], *solvers] if with_solver else infos[-1]


def trained_solver_samples(cfg: MetaConfig, samples: Sequence[SolverSample]) -> list[tuple[str, SolverSample, Any]]:
    """(kind, sample, its teacher_log_probs) of each solver sample the trainer uses, picked as the
    local trainer picks them: distillation trains every answer with context scores, SDPO's
    shaping form the error sites' answers with hint scores, its JSD form the same answers with the
    hint's top-k (`samples.pack_topk`; an answer trained by several is one sample per kind)."""
    o, out = cfg.objectives, []
    sdpo_jsd = bool(getattr(o, "sdpo_alpha", 0.0)) and getattr(o, "sdpo_form", "shaping") == "jsd"
    # --adv-tau alone: the solver's own GRPO term, no context scored (its "teacher" log-probs are the
    # rollout's, so the distillation terms, weighted 0, vanish), as the local solver pass trains it.
    solver_grpo_alone = getattr(o, "solver_grpo_on", False) and not o.distillation_on
    for x in samples:
        if not x.response_ids:
            continue
        if o.distillation_on and x.teacher_logprobs is not None:
            out.append(("distill", x, tuple(x.teacher_logprobs)))
        elif solver_grpo_alone:
            out.append(("distill", x, tuple(x.rollout_logprobs)))
        if o.sdpo_shaping and x.is_error_site and x.hint_logprobs is not None:
            out.append(("sdpo", x, tuple(x.hint_logprobs)))
        if sdpo_jsd and x.is_error_site and x.hint_topk_ids is not None:
            out.append(("sdpo_jsd", x, pack_topk(x.hint_topk_ids, x.hint_topk_logprobs)))
    return out


async def _score(pool: SGLangPool, prompt_ids: Sequence[int], response_ids: Sequence[int]) -> list[float]:
    """log p(response | prompt) per response token at temperature 1, by SGLang's scoring call."""
    reply = await pool.post(
        "/generate",
        {
            "input_ids": [*prompt_ids, *response_ids],
            "return_logprob": True,
            "logprob_start_len": 0,
            "sampling_params": {"max_new_tokens": 0},
        },
    )
    entries = reply["meta_info"]["input_token_logprobs"]
    return [float(entry[0]) for entry in entries[len(entries) - len(response_ids) :]]


async def _replay_by_chain(rt: Runtime, chains, per_chain) -> tuple[dict, dict[str, float]]:
    """Channel 3: each chain's pairs as replay samples (reference: the frozen pool of the start weights)."""
    o = rt.cfg.objectives
    pairs_C = await pairs_by_chain(
        rt.replayer,
        chains,
        per_chain,
        rt.tokenizer,
        reference=lambda p, r: _score(rt.student_pool, p, r),
        reference_id=f"start-weights:{rt.cfg.pools.hf_checkpoint}",
        loop_run=rt.loop.run,
    )
    out, first = {}, 0
    for chain, pairs in zip(chains, pairs_C):
        policy = await asyncio.gather(
            *[
                asyncio.gather(
                    _score(rt.teacher_pool, p.prompt_ids, p.chosen_ids),
                    _score(rt.teacher_pool, p.prompt_ids, p.rejected_ids),
                )
                for p in pairs
            ]
        )
        out[(chain.prompt_index, chain.sample_index)] = replay_samples(
            pairs, policy, o.replay_beta, o.replay_dpo_beta, first
        )
        first += len(pairs)
    metrics = {f"replay/{k}": float(v) for k, v in rt.replayer.stats.as_dict().items()}
    metrics["replay/pairs"] = float(first)
    return out, metrics


async def _train_rollout(
    rt: Runtime, rollout_id: int, groups: list[list[Any]], num_train: int, family_episodes: list[Episode] | None = None
):
    from slime.rollout.base_types import RolloutFnTrainOutput

    cfg, started = rt.cfg, time.perf_counter()
    k = cfg.meta.n_problems_per_prompt
    num_prompts = num_train // k
    problems = [
        problem_from_sample(g[0], rubric_key=cfg.data.rubric_key, fallback_uid=f"row-{g[0].group_index}")
        for g in groups
    ]
    episodes = [_episode(problems, num_prompts, k, num_train)]
    if family_episodes is not None:  # --group-key: each prompt's train and holdout problems of one family
        episodes = family_episodes
        problems = [q for e in episodes for chunk in e.train_chunks_P for q in chunk] + [
            q for e in episodes for q in e.holdout
        ]
        for p, episode in enumerate(episodes):
            first = episode.train_chunks_P[0][0]
            for base in groups[p * k]:
                base.metadata = {**first.metadata, "uid": first.uid}
    baseline: dict[str, float] = {}
    if cfg.objectives.eval_baseline and not rt.baseline_done and rollout_id == 0:  # not after a resume, as locally
        # The student with and without the distillation context, before any training: on slime the
        # first step's problems (the data source hands out rows one step at a time).
        baseline = await baseline_eval(cfg, rt.rollout, problems)
    rt.baseline_done = True
    result = await rt.rollout.run(episodes, rollout_id, seed=cfg.seed)
    solver_metrics: dict[str, float] = {}
    solver_by_chain: dict[tuple[int, int], list[tuple[str, SolverSample, tuple[float, ...]]]] = {}
    replay_by_chain: dict[tuple[int, int], list[ReplaySample]] = {}
    if rt.solver_builder is not None:
        per_chain, solver_metrics = await rt.solver_builder.build_per_chain(result.chains)
        for chain, samples in zip(result.chains, per_chain):
            solver_by_chain[(chain.prompt_index, chain.sample_index)] = trained_solver_samples(cfg, samples)
        if rt.replayer is not None:
            replay_by_chain, replay_metrics = await _replay_by_chain(rt, result.chains, per_chain)
            solver_metrics.update(replay_metrics)
    traces = _traces_by_chain(result)

    # One output group per teacher prompt p, built on the data source's n copies of its first problem.
    steps_P_G: list[list[list[TeacherSample]]] = [
        [[] for _ in range(cfg.meta.n_samples_per_prompt)] for _ in range(num_prompts)
    ]
    for sample in result.samples:
        steps_P_G[sample.group_index][sample.sample_index].append(sample)
    counts: dict[str, int] = {}  # solver samples so far, per kind: their indices
    output = [
        [
            _chain_output(
                rt,
                groups[p * k][g],
                steps,
                traces.get((p, g)),
                solver_by_chain.get((p, g), []),
                counts,
                replay_by_chain.get((p, g), []),
            )
            for g, steps in enumerate(steps_G)
        ]
        for p, steps_G in enumerate(steps_P_G)
    ]

    metrics = {
        **result.metrics,
        **solver_metrics,
        **baseline,
        **counter_metrics(rt.teacher_pool, rt.student_pool, rt.rollout.grader),
    }
    metrics["perf/meta_rollout_time"] = time.perf_counter() - started
    rt.tracker.log(rollout_id, metrics)
    rt.tracker.write_traces([describe_batch(episodes, rollout_id), *result.traces])
    if rt.progress is None:  # the first step of this process (a resumed run counts from here)
        rt.progress = RunProgress(rollout_id, rt.cfg.meta.num_rollout)
        rt.oracle = oracle_grade(baseline, rt.run_dir)
    # The rollout's part of the step line (slime's trainer logs loss and grad norm itself).
    line = format_step_line(
        rollout_id,
        metrics,
        total=rt.cfg.meta.num_rollout,
        elapsed_s=rt.progress.elapsed_s(),
        eta_s=rt.progress.eta_s(rollout_id),
        oracle=rt.oracle,
    )
    print(line, flush=True)
    if rt.plot is not None:
        rt.plot.after_step()
    return RolloutFnTrainOutput(samples=output, metrics=metrics)
