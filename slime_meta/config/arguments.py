"""The one typed, frozen config and the parser that builds it from every flag.

`add_meta_learning_arguments(parser)` is what slime's `parse_args(add_custom_arguments=...)`
takes: it adds our groups and skips any flag the parser already has, so the flags slime also
defines (`--prompt-data`, `--rollout-batch-size`, `--hf-checkpoint`, `--lr`, `--save`, ...) keep
slime's definition on a cluster and get ours when run on one machine. Names and meanings follow
slime's where both exist. Each concern's flags and config section live in their own module:
`rollout` (loop sizes, data, sampling), `grading`, `pools`, `training`, `objectives`,
`tracking` (checkpoints and tracking).

After parsing, `build_config(namespace)` makes a `MetaConfig` once; nothing mutates it.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import json
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Sequence

from slime_meta.artifacts.atomic_files import replace_atomically
from slime_meta.config.grading import GraderConfig, add_grader_flags
from slime_meta.config.objectives import ObjectivesConfig, add_objective_arguments, shared_student_objective_defaults
from slime_meta.config.pools import PoolConfig, add_pool_flags
from slime_meta.config.rollout import (
    DataConfig,
    MetaLearningConfig,
    SamplingConfig,
    add_data_flags,
    add_meta_learning_flags,
    add_sampling_flags,
)
from slime_meta.config.tracking import CheckpointConfig, TrackingConfig, add_checkpoint_and_tracking_flags
from slime_meta.config.training import TrainConfig, add_train_flags
from slime_meta.config.validation import student_pool_defaults, validate_flags

# ----------------------------------------------------------------------------- config


@dataclass(frozen=True)
class MetaConfig:
    backend: str
    seed: int
    data: DataConfig
    meta: MetaLearningConfig
    sampling: SamplingConfig
    grader: GraderConfig
    pools: PoolConfig
    train: TrainConfig
    objectives: ObjectivesConfig
    checkpoint: CheckpointConfig
    tracking: TrackingConfig

    @property
    def separate_student(self) -> bool:
        """The student is not the evolving teacher: a frozen pool we start, or an external server.

        A frozen pool is asked for by --student-checkpoint or --student-num-gpus (its checkpoint
        then defaults to the teacher's starting weights); an external one by --external-student-url.
        """
        p = self.pools
        return bool(p.student_checkpoint or p.student_num_gpus or p.external_student_url)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def save(self, path: Path) -> None:
        # Secrets never live in the config: API keys are read from the environment by name.
        text = json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n"
        replace_atomically(Path(path), lambda tmp: tmp.write_text(text, encoding="utf-8"))


def settings_from(cls, *sections: Any, **given: Any):
    """A component's settings (dataclass `cls`) from the run's config: each field from `given`, else from
    the first config section with a field of that name (one name per setting), else its default.
    Derived values (a section's properties) are never picked up by name: pass them in `given`."""
    values = dict(given)
    for section in sections:
        names = {field.name for field in fields(section)}
        for field in fields(cls):
            if field.name in names and field.name not in values:
                values[field.name] = getattr(section, field.name)
    return cls(**values)


# ----------------------------------------------------------------------------- flags


# Flags slime (or Megatron, under slime) defines too, under the group slime declares them in
# (slime/utils/arguments.py's add_<group>_arguments, where slime also resets some of Megatron's:
# --lr, --seed, --save ... in algo; the rest of Megatron's as "train (Megatron)"): --help
# shows them there, so a slime user finds each where slime keeps it. On slime's own parser they
# are slime's and these groups stay empty.
SLIME_HELP_GROUPS = {
    "cluster": (
        "--rollout-num-gpus",
        "--colocate",
        "--rollout-num-gpus-per-engine",
        "--actor-num-nodes",
        "--actor-num-gpus-per-node",
    ),
    "rollout": ("--hf-checkpoint", "--rollout-shuffle", "--rollout-temperature", "--rollout-max-response-len"),
    "data": (
        "--prompt-data",
        "--input-key",
        "--label-key",
        "--rollout-batch-size",
        "--n-samples-per-prompt",
        "--num-rollout",
        "--apply-chat-template",
        "--use-dynamic-batch-size",
        "--max-tokens-per-gpu",
        "--micro-batch-size",
    ),
    "eval": ("--eval-prompt-data", "--eval-interval"),
    "algo": (
        "--lr",
        "--clip-grad",
        "--eps-clip",
        "--eps-clip-high",
        "--eps-clip-c",
        "--disable-grpo-std-normalization",
        "--use-tis",
        "--tis-clip",
        "--tis-clip-low",
        "--kl-loss-coef",
        "--use-kl-loss",
        "--kl-loss-type",
        "--entropy-coef",
        "--save",
        "--load",
        "--save-interval",
        "--seed",
    ),
    "train (Megatron)": (
        "--weight-decay",
        "--adam-beta1",
        "--adam-beta2",
        "--recompute-granularity",
        "--save-retain-interval",
    ),
    "wandb": ("--use-wandb", "--wandb-project", "--wandb-group", "--wandb-mode"),
}
_SLIME_GROUP_OF = {flag: group for group, flags in SLIME_HELP_GROUPS.items() for flag in flags}

# What --help shows first, in this order: the flags most runs set (model, data and its columns, the
# draw per step, steps, where outputs go, checkpoints), wherever their concern's module adds them.
COMMON_FLAGS = (
    "--hf-checkpoint",
    "--prompt-data",
    "--input-key",
    "--label-key",
    "--rubric-key",
    "--group-key",
    "--rollout-batch-size",
    "--heldout-ipb",
    "--num-rollout",
    "--run-dir",
    "--save",
    "--save-interval",
    "--load",
)
COMMON_GROUP_TITLE = "the flags most runs set"


def slime_group_title(group: str) -> str:
    """The title of a group of flags slime defines too: both backends use them (a flag that only one
    backend reads says so in its help); the name is the group slime's --help lists them under."""
    return f"{group}, both backends (grouped as in slime)"


class _Groups:
    """Adds flags to argparse groups, skipping those the parser already defines (slime's). The flags
    most runs set go to the first group (COMMON_FLAGS); another flag slime defines too goes to the
    group named after slime's (SLIME_HELP_GROUPS).

    On slime's own parser (it holds slime's flags already, or has them reserved) there is no first
    group: it would show only the few of those flags that are ours alone."""

    def __init__(self, parser: argparse.ArgumentParser):
        self.parser = parser
        self.slime_groups: dict[str, argparse._ArgumentGroup] = {}
        on_slimes_parser = "--prompt-data" in parser._option_string_actions
        self.common = None if on_slimes_parser else parser.add_argument_group(COMMON_GROUP_TITLE)

    def slime_group(self, group: str) -> argparse._ArgumentGroup:
        if group not in self.slime_groups:
            self.slime_groups[group] = self.parser.add_argument_group(slime_group_title(group))
        return self.slime_groups[group]

    def add_slime_groups(self) -> None:
        """The slime-named groups, in slime's order (argparse prints a group only when it holds flags)."""
        for group in SLIME_HELP_GROUPS:
            self.slime_group(group)

    def group(self, title: str):
        group = self.parser.add_argument_group(title)
        existing = self.parser._option_string_actions  # argparse has no public lookup for this

        def add(*flags: str, **kwargs):
            if any(flag in existing for flag in flags):
                return None
            if self.common is not None and flags[0] in COMMON_FLAGS:
                return self.common.add_argument(*flags, **kwargs)
            slime_group = _SLIME_GROUP_OF.get(flags[0])
            return (self.slime_group(slime_group) if slime_group else group).add_argument(*flags, **kwargs)

        return add

    def order_common_flags(self) -> None:
        """The first group in COMMON_FLAGS' order, not the order the concerns' modules add them in."""
        if self.common is not None:  # argparse has no public way to reorder a group
            self.common._group_actions.sort(key=lambda action: COMMON_FLAGS.index(action.option_strings[0]))


def add_meta_learning_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    groups = _Groups(parser)
    meta_learning = groups.group("meta-learning")
    groups.add_slime_groups()  # after the meta-learning flags, before the rest of ours
    add_meta_learning_flags(meta_learning)
    add_data_flags(groups.group("data"))
    add_sampling_flags(groups.group("teacher sampling"))
    add_grader_flags(groups.group("grader"))
    pools_and_resources = groups.group("pools and resources")
    add_pool_flags(pools_and_resources)
    add_train_flags(pools_and_resources)
    add_objective_arguments(groups.group)
    add_checkpoint_and_tracking_flags(groups.group("checkpoints and tracking"))

    add = groups.group("program")
    add(
        "--backend",
        choices=("local", "slime"),
        default="local",
        help="local: one machine, embedded workers behind sglang-router and a torch trainer; slime: a GPU "
        "cluster through slime (Ray + Megatron + SGLang), docs/cluster.md.",
    )
    add(
        "--seed",
        type=int,
        default=1234,
        help="Seed of the problem draws, their train/holdout split and the choice of traced chains.",
    )
    groups.order_common_flags()
    return parser


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows each flag's default, except a None default: such a flag's help says what not giving
    it means (computed from other flags, off, or required)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        if action.default is None:
            return action.help or ""
        return super()._get_help_string(action)


class _OneLineErrorParser(argparse.ArgumentParser):
    """Bad flags end in one line and exit code 2, not a usage dump; a mistyped flag gets the closest
    real one suggested."""

    def error(self, message: str):
        self.exit(2, f"error: {message}{self._suggestion(message)} (see python train.py --help)\n")

    def _suggestion(self, message: str) -> str:
        if not message.startswith("unrecognized arguments:"):
            return ""
        known = [flag for flag in self._option_string_actions if flag.startswith("--")]
        hints = []
        for token in message.split(":", 1)[1].split():
            flag = token.split("=", 1)[0]
            if flag.startswith("--") and (close := difflib.get_close_matches(flag, known, n=1, cutoff=0.75)):
                hints.append(f"{flag}: did you mean {close[0]}?")
        return f"; {'; '.join(hints)}" if hints else ""


def build_parser() -> argparse.ArgumentParser:
    parser = _OneLineErrorParser(
        prog="train.py",
        # Not argparse's list of all ~130 flags, which would fill the first screens of --help.
        usage="%(prog)s --hf-checkpoint MODEL --prompt-data FILE [FLAG VALUE ...]   (the flags below)",
        allow_abbrev=False,  # as on slime: `--lr` never silently means a longer flag
        description="Train a teacher LLM to write additional_info, rewarded by a student's holdout grades.",
        formatter_class=_HelpFormatter,
    )
    return add_meta_learning_arguments(parser)


# ----------------------------------------------------------------------------- config


def _pick(cls, namespace: argparse.Namespace, **overrides):
    values = {f.name: getattr(namespace, f.name) for f in fields(cls) if f.name not in overrides}
    return cls(**values, **overrides)


def build_config(namespace: argparse.Namespace, *, default_run_dir: str | None = None) -> MetaConfig:
    """The frozen config from parsed flags, validated; raises UserInputError naming the flag.

    Checkpoint paths stay as given: a .gguf file is converted where the backend starts
    (`artifacts.model_files`), not here: building a config converts nothing.
    """
    validate_flags(namespace)
    run_dir = namespace.run_dir or default_run_dir or "runs/meta"
    return MetaConfig(
        backend=namespace.backend,
        seed=namespace.seed,
        data=_pick(DataConfig, namespace),
        meta=_pick(MetaLearningConfig, namespace, eval_prompt_data=tuple(namespace.eval_prompt_data or ())),
        sampling=_pick(SamplingConfig, namespace),
        grader=_pick(GraderConfig, namespace),
        pools=_pick(PoolConfig, namespace, **student_pool_defaults(namespace)),
        train=_pick(TrainConfig, namespace),
        objectives=_pick(
            ObjectivesConfig,
            namespace,
            replay_teachers=tuple(namespace.replay_teachers),
            **shared_student_objective_defaults(namespace),
        ),
        checkpoint=_pick(CheckpointConfig, namespace),
        tracking=_pick(TrackingConfig, namespace, run_dir=run_dir),
    )


def parse_config(argv: Sequence[str] | None = None, *, default_run_dir: str | None = None) -> MetaConfig:
    parser = build_parser()
    return build_config(parser.parse_args(argv), default_run_dir=default_run_dir)
