"""From our command line to slime's: the plugin flags, what this backend refuses, the pools as
--sglang-config.

`translate(argv)` needs no slime: it parses our flags (slime's pass through untouched), checks
them, works out how many GPUs each role gets (`gpus.py`) and writes nothing. The result is what a
real run hands to slime's `parse_args` and what `--dry-run` prints (`dry_run.py`).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import yaml

from slime_meta.artifacts.model_files import resolve_checkpoint_argv
from slime_meta.backends.slime.argv import absolute_paths, given, without, without_slime_defaults
from slime_meta.backends.slime.data import check_eval_sets_disjoint
from slime_meta.backends.slime.flags import add_slime_backend_arguments
from slime_meta.backends.slime.gpus import SLIME_DEFAULT_GPUS_PER_NODE, GpuLayout, plan_gpus
from slime_meta.backends.slime.samples import DEFAULT_SDPO_TOPK
from slime_meta.config.arguments import MetaConfig, add_meta_learning_arguments, build_config
from slime_meta.data.batch_split import batch_plan
from slime_meta.errors import UserInputError

PLUGINS = {
    "--rollout-function-path": "slime_meta.backends.slime.rollout.generate_rollout",
    "--custom-reward-post-process-path": "slime_meta.backends.slime.rollout.post_process_rewards",
    "--custom-loss-function-path": "slime_meta.backends.slime.loss.meta_loss",
    "--custom-advantage-function-path": "slime_meta.backends.slime.advantages.meta_advantages",
    "--custom-convert-samples-to-train-data-path": "slime_meta.backends.slime.train_data.convert_samples_to_train_data",
    "--rollout-data-postprocess-path": "slime_meta.backends.slime.loss.hold_sdpo_topk",
}
SGLANG_CONFIG_NAME = "sglang_config.yaml"
# Megatron's local layers (no TransformerEngine) over slime's packed micro-batches.
LOCAL_TRANSFORMER_MODULE = "slime_meta.backends.slime.megatron_local"

# Our flags the translation rewrites: flag -> whether it takes a value.
_REWRITTEN = {
    "--backend": True,
    "--sglang-router-port": True,  # our --teacher-port's other name: given to slime once, below
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
    "--kl-loss-coef": True,
    "--kl-loss-type": True,
    "--use-kl-loss": False,
}


# Flags of the local backend alone (its workers, its trainer, its grader pool): on slime they would
# pass silently and change nothing, so they are refused with the way out.
LOCAL_ONLY_FLAGS = {
    "--local-num-workers": "slime's pools are --rollout-num-gpus / --rollout-num-gpus-per-engine",
    "--local-student-num-workers": "the student pool is --student-num-gpus / --student-num-gpus-per-engine",
    "--device": "slime's trainer and SGLang run on the cluster's GPUs",
    "--host": "slime's routers bind where Ray places them",
    "--local-kv-cache": "SGLang keeps its own cache (--sglang-page-size and the other --sglang-* flags)",
    "--compile-layers": "Megatron trains on slime",
    "--no-compile-layers": "Megatron trains on slime",
    "--share-prompt-forward": "Megatron trains on slime",
    "--no-share-prompt-forward": "Megatron trains on slime",
    "--max-skipped-steps": "Megatron trains on slime",
    "--weight-sync": "slime pushes the weights to SGLang itself",
    "--grader-checkpoint": "serve the grader with SGLang and give --grader-base-url",
    "--grader-num-workers": "serve the grader with SGLang and give --grader-base-url",
}
# Defaults this project trains with where slime's (or Megatron's) own differ: passed explicitly,
# so a flag not given means the same on both backends (docs/cluster.md, "Defaults on both backends").
OUR_DEFAULTS_FOR_SLIME = ("--lr", "--weight-decay", "--adam-beta1", "--adam-beta2", "--rollout-max-response-len")


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
    parser.add_argument("--num-gpus-per-node", type=int, default=SLIME_DEFAULT_GPUS_PER_NODE)
    parser.add_argument("--sglang-config", default=None)
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
    parser.add_argument("--transformer-impl", default="transformer_engine")
    return parser


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


def _unsupported(ns: argparse.Namespace, slime_ns: argparse.Namespace, argv: Sequence[str]) -> None:
    """What this backend cannot do (yet), each refused in one line that says why and what instead."""

    def fail(message: str) -> None:
        raise UserInputError(message)

    for flag, value in ((f, getattr(slime_ns, f[2:].replace("-", "_"))) for f in PLUGINS):
        if value is not None:
            fail(f"{flag} is set by --backend slime (to {PLUGINS[flag]}); leave it out")
    if getattr(ns, "num_rollout", 1) == 0:
        fail(
            "--num-rollout 0 (evaluation only) runs on the local backend; with --backend slime give a number of "
            "steps >= 1 (or leave out --backend slime to evaluate)"
        )
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
            "with SGLang (python -m sglang.launch_server --model-path PATH) "
            "and give --grader-base-url http://HOST:PORT/v1"
        )
    for flag, instead in LOCAL_ONLY_FLAGS.items():
        if given(argv, flag):
            fail(f"{flag}: a flag of the local backend, which --backend slime would ignore ({instead}); leave it out")
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
            "1 and slime's trainer scores at --teacher-temperature; give --teacher-temperature 1 "
            "--rollout-temperature 1"
        )
    solver_on = ns.adv_tau not in (None, 0.0) or ns.teacher_tau != 0.0 or ns.student_tau != 0.0 or ns.sdpo_alpha != 0.0
    solver_on = solver_on or ns.replay_beta != 0.0
    student_temperature = ns.rollout_temperature if ns.student_temperature is None else ns.student_temperature
    if solver_on and student_temperature != ns.teacher_temperature:
        fail(
            f"--rollout-temperature {student_temperature} with solver samples (--adv-tau, distillation, SDPO): "
            "slime's trainer scores every sample at one temperature, and the solver samples are drawn at the "
            "student's; give "
            f"--rollout-temperature {ns.teacher_temperature} (= --teacher-temperature), or train on the local backend"
        )
    if ns.max_async_level > 1:
        fail(
            f"--max-async-level {ns.max_async_level}: slime's pattern for rollouts ahead of training runs one step "
            "ahead; give --max-async-level 1 (or 0), or run deeper levels on the local backend"
        )
    if ns.max_async_level and ns.colocate:
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
    _unsupported(ns, slime_ns, argv)
    layout = plan_gpus(ns, slime_ns, argv)
    run_dir = Path(ns.run_dir or default_run_dir).resolve()  # the rollout manager's cwd is not ours

    # Validated with our own rules; --load/--save are Megatron's checkpoints here (slime checks them).
    megatron_owned = {"load": None, "save": None, "save_interval": None, "save_retain_interval": None}
    checked = argparse.Namespace(**{**vars(ns), **megatron_owned, "run_dir": str(run_dir)})
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
    if ns.teacher_port is not None:  # --teacher-port or --sglang-router-port, one port
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
    for flag in OUR_DEFAULTS_FOR_SLIME:
        if not given(argv, flag):
            out += [flag, repr(getattr(ns, flag[2:].replace("-", "_")))]
    out += ["--run-dir", str(run_dir)]
    out += ["--rollout-function-path", PLUGINS["--rollout-function-path"]]
    out += ["--custom-reward-post-process-path", PLUGINS["--custom-reward-post-process-path"]]
    out += ["--loss-type", "custom_loss", "--custom-loss-function-path", PLUGINS["--custom-loss-function-path"]]
    # Always: our denominators make slime's step loss the local one (infos' token mean, + solver samples').
    out += ["--custom-convert-samples-to-train-data-path", PLUGINS["--custom-convert-samples-to-train-data-path"]]
    o = config.objectives
    if o.kl_loss_coef != 0.0:
        # slime computes the KL term only with --use-kl-loss, and builds the reference model it needs only then
        # (from --ref-load); its estimator default is k1, ours k3: both said explicitly.
        if not given(argv, "--ref-load"):
            why = "" if given(argv, "--kl-loss-coef") else " (the default where the student shares the weights)"
            raise UserInputError(
                f"--kl-loss-coef {o.kl_loss_coef:g}{why}: on slime the KL term needs the reference model slime loads "
                "from --ref-load; give --ref-load DIR (Megatron's starting weights, as the launch scripts do), "
                "or --kl-loss-coef 0"
            )
        out += ["--use-kl-loss", "--kl-loss-coef", repr(o.kl_loss_coef), "--kl-loss-type", o.kl_loss_type]
    if o.sdpo_on_any and o.sdpo_form == "jsd":
        # The hint's top-k per answer token, scored at rollout time; held away from slime's rollout logging.
        if o.sdpo_topk is None:
            out += ["--sdpo-topk", str(DEFAULT_SDPO_TOPK)]
        out += ["--rollout-data-postprocess-path", PLUGINS["--rollout-data-postprocess-path"]]
    if o.needs_solver_samples:  # solver and replay samples: advantages per kind
        out += ["--custom-advantage-function-path", PLUGINS["--custom-advantage-function-path"]]
    out += local_transformer_hooks(argv, slime_ns)
    return LaunchPlan(tuple(out), config, layout, run_dir, ns.dry_run)


def local_transformer_hooks(argv: Sequence[str], slime_ns: argparse.Namespace) -> list[str]:
    """With `--transformer-impl local` (a host without TransformerEngine), the layer spec and the
    actor hook that let slime train that model and sync its weights (megatron_local.py), unless
    the command line names its own."""
    if slime_ns.transformer_impl != "local":
        return []
    hooks = []
    if not given(argv, "--spec"):
        hooks += ["--spec", LOCAL_TRANSFORMER_MODULE, "packed_local_layer_spec"]
    if not given(argv, "--custom-megatron-init-path"):
        hooks += ["--custom-megatron-init-path", f"{LOCAL_TRANSFORMER_MODULE}.actor_init"]
    return hooks
