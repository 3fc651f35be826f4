"""From our command line to slime's: the plugin flags, the pools as --sglang-config, GPU accounting.

`translate(argv)` needs no slime: it parses our flags (slime's pass through untouched), checks
them, works out how many GPUs each role gets and writes nothing. The result is what a real run
hands to slime's `parse_args` and what `--dry-run` prints.

GPU facts this follows (slime, `slime/ray/placement_group.py` and `slime/ray/rollout.py`):
  - training (Megatron) takes actor_num_nodes x actor_num_gpus_per_node GPUs;
  - slime's --rollout-num-gpus is the sum over every SGLang model of --sglang-config (it asserts
    that), so with a separate student it is teacher GPUs + student GPUs;
  - --colocate: one placement group of max(training, rollout) GPUs, inference on the training
    GPUs first (offloaded while training runs); otherwise training + rollout GPUs, rollout after;
  - the first model of --sglang-config gets the router at --sglang-router-port and receives the
    weight updates (`update_weights: true`); a frozen model gets its own router.
"""

from __future__ import annotations

import argparse
import math
import os
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import yaml

from slime_meta.artifacts.model_files import resolve_checkpoint_argv
from slime_meta.backends.slime.argv import absolute_paths, given, without, without_slime_defaults
from slime_meta.backends.slime.data import batch_plan, check_eval_sets_disjoint
from slime_meta.backends.slime.flags import add_slime_backend_arguments
from slime_meta.backends.slime.samples import DEFAULT_SDPO_TOPK
from slime_meta.config.arguments import MetaConfig, add_meta_learning_arguments, build_config
from slime_meta.errors import UserInputError
from slime_meta.grading.graders import default_grader_kind

PLUGINS = {
    "--rollout-function-path": "slime_meta.backends.slime.rollout.generate_rollout",
    "--custom-reward-post-process-path": "slime_meta.backends.slime.rollout.post_process_rewards",
    "--custom-loss-function-path": "slime_meta.backends.slime.loss.meta_loss",
    "--custom-advantage-function-path": "slime_meta.backends.slime.advantages.meta_advantages",
    "--custom-convert-samples-to-train-data-path": "slime_meta.backends.slime.train_data.convert_samples_to_train_data",
    "--rollout-data-postprocess-path": "slime_meta.backends.slime.loss.hold_sdpo_topk",
}
TEACHER_MODEL = "actor"  # slime's name for the trained model's pool in its own examples
STUDENT_MODEL = "student"
SGLANG_CONFIG_NAME = "sglang_config.yaml"
SLIME_DEFAULT_GPUS_PER_NODE = 8  # slime's default --actor-num-gpus-per-node and --num-gpus-per-node

# Our flags the translation rewrites: flag -> whether it takes a value.
_REWRITTEN = {
    "--backend": True,
    "--dry-run": False,
    "--run-dir": True,
    "--rollout-num-gpus": True,
    "--actor-num-nodes": True,
    "--actor-num-gpus-per-node": True,
    "--rollout-temperature": True,
    "--student-temperature": True,
    "--apply-chat-template": False,
    "--no-apply-chat-template": False,
    "--meta-apply-chat-template": False,
    "--input-key": True,
    "--label-key": True,
    "--rollout-batch-size": True,
    "--n-samples-per-prompt": True,
    "--num-rollout": True,
    "--meta-rollout-batch-size": True,
}


class _Parser(argparse.ArgumentParser):
    """Bad flags become one UserInputError line, like everywhere else."""

    def error(self, message: str):
        raise UserInputError(f"{message} (see python train.py --backend slime --help)")


def meta_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="train.py --backend slime",
        add_help=False,
        allow_abbrev=False,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    return add_slime_backend_arguments(add_meta_learning_arguments(parser))


def _slime_side_parser() -> argparse.ArgumentParser:
    """The few slime flags the translation reads or guards (slime parses them for real)."""
    parser = _Parser(add_help=False, allow_abbrev=False)
    parser.add_argument("--colocate", action="store_true")
    parser.add_argument("--num-gpus-per-node", type=int, default=SLIME_DEFAULT_GPUS_PER_NODE)
    parser.add_argument("--sglang-config", default=None)
    parser.add_argument("--sglang-router-port", type=int, default=None)
    parser.add_argument("--loss-type", default=None)
    for flag in PLUGINS:
        parser.add_argument(flag, default=None)
    parser.add_argument("--custom-tis-function-path", default=None)
    parser.add_argument("--calculate-per-token-loss", action="store_true")
    parser.add_argument("--advantage-estimator", default="grpo")
    parser.add_argument("--release-train", action="store_true")
    parser.add_argument("--disable-rollout-global-dataset", action="store_true")
    parser.add_argument("--global-batch-size", type=int, default=None)
    parser.add_argument("--num-steps-per-rollout", type=int, default=None)
    parser.add_argument("--num-epoch", type=int, default=None)
    parser.add_argument("--context-parallel-size", type=int, default=1)
    return parser


# ----------------------------------------------------------------------------- GPUs


@dataclass(frozen=True)
class InferencePool:
    model: str  # the model's name in --sglang-config (its router's key in args.sglang_model_routers)
    model_path: str | None
    num_gpus: int
    gpus_per_engine: int
    update_weights: bool

    @property
    def engines(self) -> int:
        return self.num_gpus // self.gpus_per_engine

    def as_sglang_model(self) -> dict:
        return {
            "name": self.model,
            "model_path": self.model_path,
            "update_weights": self.update_weights,
            "server_groups": [
                {"worker_type": "regular", "num_gpus": self.num_gpus, "num_gpus_per_engine": self.gpus_per_engine}
            ],
        }


@dataclass(frozen=True)
class GpuLayout:
    actor_num_nodes: int
    actor_num_gpus_per_node: int
    num_gpus_per_node: int
    colocate: bool
    teacher: InferencePool
    student: InferencePool | None  # a separate pool slime starts; None: shared or external
    user_sglang_config: str | None = None  # the user's own --sglang-config: not generated, not split by role

    @property
    def training_gpus(self) -> int:
        return self.actor_num_nodes * self.actor_num_gpus_per_node

    @property
    def rollout_gpus(self) -> int:
        return self.teacher.num_gpus + (self.student.num_gpus if self.student else 0)

    @property
    def total_gpus(self) -> int:
        if self.colocate:
            return max(self.training_gpus, self.rollout_gpus)
        return self.training_gpus + self.rollout_gpus

    @property
    def nodes(self) -> int:
        return math.ceil(self.total_gpus / self.num_gpus_per_node)

    def sglang_config(self) -> dict | None:
        """The --sglang-config we generate: only for a separate student pool (else slime's default)."""
        if self.student is None or self.user_sglang_config:
            return None
        return {"sglang": [self.teacher.as_sglang_model(), self.student.as_sglang_model()]}


def _positive(value: int | None, flag: str, what: str) -> int:
    if value is None or value < 1:
        raise UserInputError(f"{flag} {value}: {what} must be >= 1")
    return value


def _divisible(gpus: int, per_engine: int, gpus_flag: str, engine_flag: str) -> None:
    if gpus % per_engine:
        raise UserInputError(
            f"{gpus_flag} {gpus} is not a multiple of {engine_flag} {per_engine}: every engine needs all its GPUs"
        )


def plan_gpus(ns: argparse.Namespace, slime_ns: argparse.Namespace, argv: Sequence[str]) -> GpuLayout:
    nodes = _positive(ns.actor_num_nodes, "--actor-num-nodes", "training nodes")
    per_node = ns.actor_num_gpus_per_node if given(argv, "--actor-num-gpus-per-node") else SLIME_DEFAULT_GPUS_PER_NODE
    per_node = _positive(per_node, "--actor-num-gpus-per-node", "training GPUs per node")
    colocate = slime_ns.colocate
    if given(argv, "--rollout-num-gpus"):
        teacher_gpus = ns.rollout_num_gpus
    elif colocate:
        teacher_gpus = nodes * per_node  # slime's own default under --colocate
    else:
        raise UserInputError(
            "--rollout-num-gpus is required without --colocate: the teacher's inference GPUs "
            "(training and inference then use separate GPUs)"
        )
    teacher_gpus = _positive(teacher_gpus, "--rollout-num-gpus", "the teacher's inference GPUs")
    _divisible(teacher_gpus, ns.rollout_num_gpus_per_engine, "--rollout-num-gpus", "--rollout-num-gpus-per-engine")
    teacher = InferencePool(TEACHER_MODEL, ns.hf_checkpoint, teacher_gpus, ns.rollout_num_gpus_per_engine, True)

    student = None
    if ns.student_checkpoint or ns.student_num_gpus:
        # A separate, frozen student pool; its checkpoint defaults to the teacher's starting one.
        flag = "--student-checkpoint" if ns.student_checkpoint else "--student-num-gpus"
        if slime_ns.sglang_config:
            raise UserInputError(
                f"--sglang-config and {flag}: give one; the student pool is generated from "
                "--student-num-gpus (and --student-checkpoint), or name a 'student' model in your own --sglang-config"
            )
        student_gpus = _positive(ns.student_num_gpus, "--student-num-gpus", "the separate student pool's GPUs")
        per_engine = ns.student_num_gpus_per_engine or ns.rollout_num_gpus_per_engine
        _divisible(student_gpus, per_engine, "--student-num-gpus", "--student-num-gpus-per-engine")
        checkpoint = ns.student_checkpoint or ns.hf_checkpoint
        student = InferencePool(STUDENT_MODEL, checkpoint, student_gpus, per_engine, False)
    return GpuLayout(
        actor_num_nodes=nodes,
        actor_num_gpus_per_node=per_node,
        num_gpus_per_node=slime_ns.num_gpus_per_node,
        colocate=colocate,
        teacher=teacher,
        student=student,
        user_sglang_config=slime_ns.sglang_config,
    )


# ----------------------------------------------------------------------------- the plan


@dataclass(frozen=True)
class LaunchPlan:
    slime_argv: tuple[str, ...]
    config: MetaConfig
    layout: GpuLayout
    run_dir: Path
    dry_run: bool

    @property
    def sglang_config_path(self) -> Path | None:
        return self.run_dir / SGLANG_CONFIG_NAME if self.layout.sglang_config() else None

    def sglang_config_yaml(self) -> str | None:
        config = self.layout.sglang_config()
        return yaml.safe_dump(config, sort_keys=False) if config else None

    def write_sglang_config(self) -> Path | None:
        text, path = self.sglang_config_yaml(), self.sglang_config_path
        if text is None or path is None:
            return None
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
        return path


def _unsupported(ns: argparse.Namespace, slime_ns: argparse.Namespace) -> None:
    """What this backend cannot do (yet), each refused in one line that says why and what instead."""

    def fail(message: str) -> None:
        raise UserInputError(message)

    for flag, value in ((f, getattr(slime_ns, f[2:].replace("-", "_"))) for f in PLUGINS):
        if value is not None:
            fail(f"{flag} is set by --backend slime (to {PLUGINS[flag]}); leave it out")
    if slime_ns.loss_type not in (None, "custom_loss"):
        fail(f"--loss-type {slime_ns.loss_type}: --backend slime trains with its own loss (custom_loss); leave it out")
    if slime_ns.calculate_per_token_loss:
        fail(
            "--calculate-per-token-loss: the conversion plugin gives each channel its own token mean (as on one "
            "machine); slime's per-token mode would pool them into one; leave it out"
        )
    if slime_ns.custom_tis_function_path:
        fail("--custom-tis-function-path: not supported with --backend slime (use --use-tis / --aipo-delta)")
    if slime_ns.advantage_estimator != "grpo":
        fail(
            f"--advantage-estimator {slime_ns.advantage_estimator}: --backend slime computes GRPO advantages over "
            "holdout rewards in the rollout; leave it at grpo"
        )
    if slime_ns.release_train:
        fail("--release-train: not supported by the slime-meta loop; leave it out")
    if ns.grader == "local":
        fail(
            "--grader local: the embedded grader pool runs with the local backend; on a cluster serve the grader "
            "with SGLang (python -m sglang.launch_server --model-path PATH) and give --grader-base-url http://HOST:PORT/v1"
        )
    if slime_ns.disable_rollout_global_dataset:
        fail("--disable-rollout-global-dataset: the rollout draws its problems from slime's data source; leave it out")
    sdpo_jsd = ns.sdpo_alpha != 0.0 and ns.sdpo_form == "jsd"
    if sdpo_jsd and not ns.sdpo_topk_tail:
        fail(
            "--no-sdpo-topk-tail: on slime the loss keeps the hint's mass outside its top-k as a tail bucket; "
            "leave it out, or run the renormalised top-k on the local backend"
        )
    if sdpo_jsd and ns.sdpo_temperature != 1.0:
        fail(
            f"--sdpo-temperature {ns.sdpo_temperature} with --sdpo-form jsd: on slime the hint's top-k log-probs come "
            "from the scoring call at temperature 1; give --sdpo-temperature 1, or run it on the local backend"
        )
    if sdpo_jsd and slime_ns.context_parallel_size > 1:
        fail(
            f"--context-parallel-size {slime_ns.context_parallel_size} with --sdpo-alpha (JSD form): the loss reads "
            "each answer's logit rows whole, and context parallelism splits them over ranks; give "
            "--context-parallel-size 1, or --sdpo-form shaping"
        )
    if ns.replay_beta != 0.0 and (ns.student_num_gpus is None or ns.student_checkpoint or ns.external_student_url):
        fail(
            "--replay-beta on slime: DPO's reference log-probs are scored on a frozen pool of the start weights; "
            "give --student-num-gpus N without --student-checkpoint (a frozen student pool of --hf-checkpoint), "
            "or run channel 3 on the local backend"
        )
    if ns.replay_beta != 0.0 and ns.teacher_temperature != 1.0:
        fail(
            f"--replay-beta with --teacher-temperature {ns.teacher_temperature}: DPO's log-probs are at temperature "
            "1 and slime's trainer scores at --teacher-temperature; give --teacher-temperature 1 --rollout-temperature 1"
        )
    if ns.adv_tau not in (None, 0.0) and ns.teacher_tau == 0.0 and ns.student_tau == 0.0:
        fail(
            f"--adv-tau {ns.adv_tau} without --teacher-tau/--student-tau: the solver-role GRPO term on its own runs on "
            "the local backend only (on slime --adv-tau weighs the task advantage inside context distillation); "
            "add --teacher-tau/--student-tau, or leave --adv-tau out"
        )
    solver_on = ns.teacher_tau != 0.0 or ns.student_tau != 0.0 or ns.sdpo_alpha != 0.0 or ns.replay_beta != 0.0
    student_temperature = ns.rollout_temperature if ns.student_temperature is None else ns.student_temperature
    if solver_on and student_temperature != ns.teacher_temperature:
        fail(
            f"--rollout-temperature {student_temperature} with solver samples (distillation, SDPO): slime's trainer scores every "
            f"sample at one temperature, and the solver samples are drawn at the student's; give --rollout-temperature "
            f"{ns.teacher_temperature} (= --teacher-temperature), or train on the local backend"
        )
    if ns.max_async_level > 1:
        fail(
            f"--max-async-level {ns.max_async_level}: slime's pattern for rollouts ahead of training runs one step "
            "ahead; give --max-async-level 1 (or 0), or run deeper levels on the local backend"
        )
    if ns.max_async_level and slime_ns.colocate:
        fail(
            "--max-async-level 1 with --colocate: the next rollout runs while the trainer trains, so they need "
            "GPUs of their own; leave out --colocate (a split topology) or give --max-async-level 0"
        )
    if ns.teacher_temperature <= 0:
        fail(
            f"--teacher-temperature {ns.teacher_temperature}: must be > 0 on slime (the trained policy samples with it)"
        )
    for flag in ("--student-router-ip", "--student-router-port"):
        if getattr(ns, flag[2:].replace("-", "_")) is not None:
            fail(
                f"{flag}: slime starts the student router (with --student-num-gpus) at an address it picks itself; "
                "leave it out, or give --external-student-url for a student server you run"
            )


def translate(argv: Sequence[str], *, default_run_dir: str = "runs/slime") -> LaunchPlan:
    """Our argv -> slime's argv (no slime needed). Raises UserInputError naming the flag."""
    # slime's SGLang and Megatron read --hf-checkpoint too: a .gguf becomes its converted HF directory here, once.
    argv = resolve_checkpoint_argv(absolute_paths(argv))
    ns, rest = meta_parser().parse_known_args(argv)
    slime_ns, _ = _slime_side_parser().parse_known_args(rest)
    ns.backend = "slime"
    _unsupported(ns, slime_ns)
    layout = plan_gpus(ns, slime_ns, argv)
    run_dir = Path(ns.run_dir or default_run_dir).resolve()  # the rollout manager's cwd is not ours

    # Validated with our own rules; --load/--save are Megatron's checkpoints here (slime checks them).
    checked = argparse.Namespace(
        **{**vars(ns), "load": None, "save": None, "save_interval": None, "run_dir": str(run_dir)}
    )
    config = build_config(checked)
    batch = batch_plan(config)
    groups_samples = batch.groups * ns.n_samples_per_prompt
    if slime_ns.global_batch_size is not None and groups_samples % slime_ns.global_batch_size:
        raise UserInputError(
            f"--global-batch-size {slime_ns.global_batch_size} does not divide the {groups_samples} samples of a step "
            f"({batch.groups} teacher prompts x --n-samples-per-prompt {ns.n_samples_per_prompt}); "
            f"leave it out for one optimizer step per rollout (global batch {groups_samples})"
        )
    check_eval_sets_disjoint(config)

    out = without_slime_defaults(without(argv, _REWRITTEN))
    out += [
        "--actor-num-nodes",
        str(layout.actor_num_nodes),
        "--actor-num-gpus-per-node",
        str(layout.actor_num_gpus_per_node),
    ]
    out += ["--rollout-num-gpus", str(layout.rollout_gpus)]
    plan = LaunchPlan((), config, layout, run_dir, ns.dry_run)
    if plan.sglang_config_path is not None:
        out += ["--sglang-config", str(plan.sglang_config_path)]
    if ns.teacher_port is not None and slime_ns.sglang_router_port is None:
        out += ["--sglang-router-port", str(ns.teacher_port)]
    out += ["--input-key", ns.input_key, "--label-key", ns.label_key]
    # slime's rollout batch is prompts (groups of n samples); ours is problems: the teacher prompts go to slime.
    out += ["--rollout-batch-size", str(batch.groups), "--n-samples-per-prompt", str(ns.n_samples_per_prompt)]
    out += ["--meta-rollout-batch-size", str(ns.rollout_batch_size)]
    if given(argv, "--num-rollout") or slime_ns.num_epoch is None:
        out += ["--num-rollout", str(ns.num_rollout)]
    # The trained model is the teacher: slime's temperature is the teacher's (its log-probs divide by it).
    out += [
        "--rollout-temperature",
        repr(float(ns.teacher_temperature)),
        "--student-temperature",
        repr(float(ns.rollout_temperature)),
    ]
    chat_template = {True: "on", False: "off"}.get(ns.apply_chat_template, ns.meta_apply_chat_template or "auto")
    if chat_template != "auto":  # auto (each role's model's template when it has one) is the default there too
        out += [f"--meta-apply-chat-template={chat_template}"]
    if slime_ns.global_batch_size is None and slime_ns.num_steps_per_rollout is None:
        # One optimizer step per outer step, as on one machine: global batch = train problems / k x G.
        out += ["--num-steps-per-rollout", "1", "--global-batch-size", str(groups_samples)]
    out += ["--run-dir", str(run_dir)]
    out += ["--rollout-function-path", PLUGINS["--rollout-function-path"]]
    out += ["--custom-reward-post-process-path", PLUGINS["--custom-reward-post-process-path"]]
    out += ["--loss-type", "custom_loss", "--custom-loss-function-path", PLUGINS["--custom-loss-function-path"]]
    # Always: our denominators make slime's step loss the local one (infos' token mean, + solver samples').
    out += ["--custom-convert-samples-to-train-data-path", PLUGINS["--custom-convert-samples-to-train-data-path"]]
    o = config.objectives
    if o.sdpo_on_any and o.sdpo_form == "jsd":
        # The hint's top-k per answer token, scored at rollout time; held away from slime's rollout logging.
        if o.sdpo_topk is None:
            out += ["--sdpo-topk", str(DEFAULT_SDPO_TOPK)]
        out += ["--rollout-data-postprocess-path", PLUGINS["--rollout-data-postprocess-path"]]
    if o.distillation_on or o.sdpo_on_any or o.replay_on:  # solver and replay samples: advantages per kind
        out += ["--custom-advantage-function-path", PLUGINS["--custom-advantage-function-path"]]
    return LaunchPlan(tuple(out), config, layout, run_dir, ns.dry_run)


# ----------------------------------------------------------------------------- the dry run


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
        f"  {'teacher training':<20}{lay.training_gpus:>5}  Megatron, {lay.actor_num_nodes} node(s) x {lay.actor_num_gpus_per_node}"
    )
    if lay.user_sglang_config:
        lines.append(f"  {'inference':<20}{lay.rollout_gpus:>5}  as your --sglang-config {lay.user_sglang_config} says")
    else:
        lines.append(
            f"  {'teacher inference':<20}{t.num_gpus:>5}  SGLang model '{t.model}': {t.engines} engine(s) x {t.gpus_per_engine} GPU, weights follow training"
        )
    if s is not None:
        lines.append(
            f"  {'student inference':<20}{s.num_gpus:>5}  SGLang model '{s.model}': {s.engines} engine(s) x {s.gpus_per_engine} GPU, frozen {s.model_path}"
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
