"""What a local run draws its problems from: the training set, the fixed eval sets, the batch plan,
and the rows and flags checked against the models' contexts before anything starts."""

from __future__ import annotations

from dataclasses import dataclass

from slime_meta.assembly import batch_plan, load_tokenizer
from slime_meta.config.arguments import MetaConfig
from slime_meta.data.batch_split import BatchPlan
from slime_meta.data.problems import ProblemSampler, load_problems, without_eval_problems
from slime_meta.errors import UserInputError
from slime_meta.prompt_templates import GeneratorPromptTemplate, TeacherPromptTemplate, load_template
from slime_meta.rollout.context_budget import ContextLimits, check_flags_fit, context_length_of, split_rows_by_fit
from slime_meta.rollout.roles import PromptRenderer, chat_setting


@dataclass
class Data:
    sampler: ProblemSampler
    num_holdout: int  # holdout problems per episode (per teacher prompt's family with --group-key)
    draw_sizes: dict  # keyword arguments of sampler.next_episodes for one step
    plan: BatchPlan
    eval_sets: dict[str, list]  # NAME -> its fixed episodes (--eval-prompt-data)


def load_data(cfg: MetaConfig) -> Data:
    def load(path: str):
        return load_problems(
            path,
            input_key=cfg.data.input_key,
            label_key=cfg.data.label_key,
            rubric_key=cfg.data.rubric_key,
            group_key=cfg.data.group_key,
        )

    problems = load(cfg.data.prompt_data)
    meta = cfg.meta
    plan = batch_plan(cfg)
    fit = ContextFit.of(cfg)
    eval_paths = dict(zip(meta.eval_prompt_data[0::2], meta.eval_prompt_data[1::2]))
    eval_problems = {name: fit.rows_that_fit(load(path), path) for name, path in eval_paths.items()}
    # An eval problem is never drawn for training: the same text (case, spacing and Unicode forms
    # aside, whatever its label's form) leaves the training pool.
    kept = without_eval_problems(problems, [p for found in eval_problems.values() for p in found])
    if len(kept) < len(problems):
        print(
            f"{len(problems) - len(kept)} problems of {cfg.data.prompt_data} are also in --eval-prompt-data: "
            "they are left out of training",
            flush=True,
        )
    if not kept:
        raise UserInputError(
            f"--prompt-data {cfg.data.prompt_data}: every problem is also in --eval-prompt-data; "
            "give an eval set of other problems"
        )
    kept = fit.rows_that_fit(kept, cfg.data.prompt_data)
    group_key_used = cfg.data.group_key is not None
    sampler = ProblemSampler(kept, seed=cfg.seed, shuffle=cfg.data.rollout_shuffle, group_key_used=group_key_used)
    sampler.validate(meta.n_problems_per_prompt, plan.holdout_per_episode, plan.groups)
    context_key = cfg.objectives.context_key
    if context_key and context_key not in problems[0].metadata:
        raise UserInputError(
            f"--context-key {context_key}: no such column in {cfg.data.prompt_data} "
            f"(columns besides problem and label: {', '.join(sorted(problems[0].metadata)) or 'none'})"
        )
    eval_sets = {}
    for name, found in eval_problems.items():
        # A fresh sampler with the run's seed: every evaluation sees the same problems, split the same way.
        eval_sampler = ProblemSampler(found, seed=cfg.seed, shuffle=True, group_key_used=group_key_used)
        try:
            eval_sampler.validate(meta.n_problems_per_prompt, plan.holdout_per_episode, plan.groups)
        except UserInputError as error:
            raise UserInputError(f"--eval-prompt-data {name}: {error}") from None
        eval_sets[name] = [
            e for _ in range(meta.eval_num_batches) for e in eval_sampler.next_episodes(**plan.draw_sizes)
        ]
    return Data(
        sampler=sampler,
        num_holdout=plan.holdout_per_episode,
        draw_sizes=plan.draw_sizes,
        plan=plan,
        eval_sets=eval_sets,
    )


def describe_plan(cfg: MetaConfig, data: Data) -> str:
    """The resolved batch plan, and the eval sets: printed once at start."""
    m = cfg.meta
    lines = [
        data.plan.describe(
            samples_per_prompt=m.n_samples_per_prompt,
            inner_iterations=m.num_inner_iterations,
            inner_samples=m.n_samples_per_inner_prompt,
            holdout_samples=m.n_holdout_samples,
        )
    ]
    o = cfg.objectives
    if not cfg.separate_student:
        lines.append(
            f"student: shares the teacher's weights; solver-role GRPO --adv-tau {o.solver_adv_tau:g} and "
            f"{o.kl_loss_type} KL to the start weights --kl-loss-coef {o.kl_loss_coef:g} "
            "(shared-student defaults 1 and 0.1 keep the student role from drifting)"
        )
    for name, episodes in data.eval_sets.items():
        count = sum(len(e.holdout) + sum(len(c) for c in e.train_chunks_P) for e in episodes)
        when = f"every {m.eval_interval} steps" if m.eval_interval else "before the first and after the last step"
        lines.append(f"eval {name}: {count} fixed problems ({m.eval_num_batches} batch(es) of the plan above), {when}")
    return "\n".join(lines)


@dataclass(frozen=True)
class ContextFit:
    """The role templates and the models' contexts a request must fit in, read once per run."""

    limits: ContextLimits
    generator: GeneratorPromptTemplate
    teacher: TeacherPromptTemplate
    info_position: str

    @classmethod
    def of(cls, cfg: MetaConfig) -> ContextFit:
        generator = load_template("generator", cfg.meta.generator_template, "--generator-template")
        teacher = load_template("teacher", cfg.meta.teacher_template, "--teacher-template")
        limits = context_limits(cfg, chat_setting(cfg.data.apply_chat_template, generator, teacher))
        return cls(limits, generator, teacher, cfg.meta.additional_info_position)

    def rows_that_fit(self, problems: list, path: str) -> list:
        """The rows whose problem fits the contexts; the others reported (file, row, length) and skipped."""
        return split_rows_by_fit(problems, self.limits, self.generator, self.teacher, self.info_position, path)


def context_limits(cfg: MetaConfig, chat: bool | None) -> ContextLimits:
    """Each role's model context (from its checkpoint's config) and its tokenizer's prompt ids.

    The student's model is the separate --student-checkpoint when given; an external student
    router (--student-router-ip) is taken to serve a model like the teacher's.
    """
    tokenizer = load_tokenizer(cfg.pools.hf_checkpoint)
    teacher_renderer = PromptRenderer(tokenizer, chat)
    student_dir = cfg.pools.student_checkpoint or cfg.pools.hf_checkpoint
    student_renderer = teacher_renderer
    if cfg.pools.student_checkpoint:
        student_renderer = PromptRenderer(load_tokenizer(student_dir), chat)
    student_flag = "--student-checkpoint" if cfg.pools.student_checkpoint else "--hf-checkpoint"
    return ContextLimits(
        teacher_context=context_length_of(cfg.pools.hf_checkpoint),
        student_context=context_length_of(student_dir),
        teacher_source=f"--hf-checkpoint {cfg.pools.hf_checkpoint}",
        student_source=f"{student_flag} {student_dir}",
        teacher_max_tokens=cfg.sampling.teacher_max_tokens,
        student_max_tokens=cfg.sampling.rollout_max_response_len,
        teacher_ids=teacher_renderer.ids,
        student_ids=student_renderer.ids,
    )


def check_context_fits(cfg: MetaConfig) -> None:
    """Refuse flags with which a request can never fit its model's context (exit 2, naming the flag)."""
    fit = ContextFit.of(cfg)
    check_flags_fit(fit.limits, fit.generator, fit.teacher, fit.info_position)
