"""What `--dry-run` prints: GPUs per role, where each pool is, the batch plan, the generated
--sglang-config and slime's arguments, one per line."""

from __future__ import annotations

import os
import shlex

from slime_meta.backends.slime.gpus import STUDENT_MODEL
from slime_meta.backends.slime.plan import LaunchPlan
from slime_meta.config.arguments import MetaConfig
from slime_meta.data.batch_split import batch_plan
from slime_meta.grading.graders import default_grader_kind


def _grader_line(cfg: MetaConfig) -> str:
    g = cfg.grader
    kind = g.grader if g.grader != "auto" else default_grader_kind(g.grader_api_key_env, g.grader_base_url)
    if kind == "verifier":
        return f"built-in verifier against the label ({g.verifier_metric})"
    where = f"self-hosted OpenAI-compatible server {g.grader_base_url}" if g.grader_base_url else "the OpenAI API"
    key = "set" if os.environ.get(g.grader_api_key_env) else "NOT set"
    return f"{g.grader_model or 'gpt-4'} on {where} (key from ${g.grader_api_key_env}: {key} here)"


def describe(plan: LaunchPlan) -> str:
    """What --dry-run prints: GPUs per role, where each pool is, the sglang-config, slime's flags."""
    lay, cfg = plan.layout, plan.config
    t, s = lay.teacher, lay.student
    lines = [f"slime-meta --backend slime: dry run, nothing started (run dir {plan.run_dir})", ""]
    lines.append(f"GPUs: {lay.total_gpus} in the Ray placement group, {lay.nodes} node(s) of {lay.num_gpus_per_node}")
    lines.append(f"  {'role':<20}{'GPUs':>5}  layout")
    lines.append(
        f"  {'teacher training':<20}{lay.training_gpus:>5}  Megatron, "
        f"{lay.actor_num_nodes} node(s) x {lay.actor_num_gpus_per_node}"
    )
    if lay.user_sglang_config:
        lines.append(f"  {'inference':<20}{lay.rollout_gpus:>5}  as your --sglang-config {lay.user_sglang_config} says")
    else:
        lines.append(
            f"  {'teacher inference':<20}{t.num_gpus:>5}  SGLang model '{t.model}': "
            f"{t.engines} engine(s) x {t.gpus_per_engine} GPU, weights follow training"
        )
    if s is not None:
        lines.append(
            f"  {'student inference':<20}{s.num_gpus:>5}  SGLang model '{s.model}': "
            f"{s.engines} engine(s) x {s.gpus_per_engine} GPU, frozen {s.model_path}"
        )
    placement = (
        "colocated: inference shares the training GPUs (offloaded while training runs)"
        if lay.colocate
        else "separate: training GPUs first, inference GPUs after them"
    )
    lines += [f"  placement: {placement}", ""]

    lines.append("pools")
    first = "the first model's router (args.sglang_router_ip/port)"
    lines.append(f"  teacher  {first}" + (f", port {cfg.pools.teacher_port}" if cfg.pools.teacher_port else ""))
    if cfg.pools.external_student_url:
        lines.append(f"  student  external server {cfg.pools.external_student_url}")
    elif s is not None or lay.user_sglang_config:
        lines.append(f"  student  router of model '{STUDENT_MODEL}' (args.sglang_model_routers['{STUDENT_MODEL}'])")
    else:
        lines.append("  student  the teacher's router (shared pool: the same, evolving model)")
    lines += [f"  grader   {_grader_line(cfg)}", ""]
    o = cfg.objectives
    kl = f"KL to --ref-load {o.kl_loss_coef:g} ({o.kl_loss_type}, --use-kl-loss)" if o.kl_loss_coef else "no KL term"
    lines.append(f"regularisers: {kl}")
    if s is None and not cfg.pools.external_student_url and o.adv_tau is None:
        # Where slime differs from one machine, said once: there --adv-tau 1 is a shared-student default too.
        lines.append(
            "  shared student: no solver-role GRPO term (--adv-tau 1 is the local backend's default; on slime give "
            "--adv-tau 1 with --rollout-temperature = --teacher-temperature); the KL term holds the student role alone"
        )
    lines.append("")
    m = cfg.meta
    lines.append(
        batch_plan(cfg).describe(
            samples_per_prompt=m.n_samples_per_prompt,
            inner_iterations=m.num_inner_iterations,
            inner_samples=m.n_samples_per_inner_prompt,
            holdout_samples=m.n_holdout_samples,
        )
    )
    lines.append("")

    text = plan.sglang_config_yaml()
    if text:
        lines.append(f"--sglang-config {plan.sglang_config_path} (written when the run starts)")
        lines += ["  " + line for line in text.rstrip().splitlines()] + [""]
    else:
        lines += [
            "--sglang-config: none generated ("
            + ("yours" if lay.user_sglang_config else "one shared pool: slime's default")
            + ")",
            "",
        ]

    lines.append("slime arguments")
    argv = list(plan.slime_argv)
    groups, current = [], []
    for token in argv:
        if token.startswith("--") and current:
            groups.append(current)
            current = []
        current.append(token)
    if current:
        groups.append(current)
    lines += [
        "  " + " ".join(shlex.quote(x) for x in group) + (" \\" if i < len(groups) - 1 else "")
        for i, group in enumerate(groups)
    ]
    return "\n".join(lines)
