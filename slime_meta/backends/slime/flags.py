"""Our flags on slime's parser, and the typed config rebuilt from slime's namespace.

slime's `parse_args(add_custom_arguments=fn)` calls `fn` *before* it adds its own flags (only
Megatron's are on the parser then) and its parser refuses a flag defined twice. So the flags we
share with slime (`--rollout-batch-size`, `--prompt-data`, `--eps-clip`, ...) must be skipped
even though they are not on the parser yet: `arguments_for_slime` asks slime which flags it
will add and hides them from `add_meta_learning_arguments`, which skips flags the parser has.

Four flags mean different things to the inner loop and to slime's trainer, so the translation
in `plan.py` moves our meaning to a flag of this backend:
  --rollout-temperature   ours: the student's sampling temperature; slime: the temperature the
                          trained model sampled at, which its log-prob recomputation divides by.
                          On slime it becomes the teacher's temperature; ours goes to --student-temperature.
  --rollout-batch-size    ours: the problems drawn per step (train + holdout); slime: the prompts
                          per step, each a group of --n-samples-per-prompt samples. On slime it
                          becomes the number of teacher prompts (GRPO groups); ours goes to
                          --meta-rollout-batch-size.
  --apply-chat-template   ours: the roles render their messages with the chat template; slime:
                          its data source renders the dataset prompt. Ours goes to
                          --meta-apply-chat-template (our templates need the raw problem text).
"""

from __future__ import annotations

import argparse
import collections
from typing import Any, Callable, Iterable

from slime_meta.config.arguments import MetaConfig, add_meta_learning_arguments, build_config


def add_slime_backend_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The flags of this backend (none of them is slime's)."""
    existing = parser._option_string_actions  # argparse has no public lookup for this
    group = parser.add_argument_group("slime backend")

    def add(flag: str, **kwargs) -> None:
        if flag not in existing:
            group.add_argument(flag, **kwargs)

    add(
        "--dry-run",
        action="store_true",
        help=(
            "--backend slime: print the slime arguments, the generated --sglang-config and the GPUs per role; "
            "start nothing."
        ),
    )
    add(
        "--student-temperature",
        type=float,
        default=None,
        help="Set by --backend slime from --rollout-temperature (the student's temperature); slime's own "
        "--rollout-temperature then holds the teacher's.",
    )
    add(
        "--meta-rollout-batch-size",
        type=int,
        default=None,
        help="Set by --backend slime from --rollout-batch-size (problems drawn per step); slime's own "
        "--rollout-batch-size then holds the teacher prompts (GRPO groups) per step.",
    )
    add(
        "--meta-apply-chat-template",
        choices=("auto", "on", "off"),
        nargs="?",
        const="on",
        default="auto",
        help="Set by --backend slime from --apply-chat-template / --no-apply-chat-template: whether our roles "
        "render with their models' chat templates (auto: when the tokenizer has one); slime's data source "
        "keeps the raw problem text.",
    )
    return parser


class _ParserWithReservedFlags:
    """The parser as `add_meta_learning_arguments` sees it: flags slime adds later count as present."""

    def __init__(self, parser: argparse.ArgumentParser, reserved: Iterable[str]):
        self._parser = parser
        self._option_string_actions = collections.ChainMap(parser._option_string_actions, dict.fromkeys(reserved))

    def add_argument_group(self, *args: Any, **kwargs: Any):
        return self._parser.add_argument_group(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._parser, name)


def meta_arguments_skipping(reserved: Iterable[str]) -> Callable[[argparse.ArgumentParser], argparse.ArgumentParser]:
    """An `add_custom_arguments` that adds our flags except `reserved` ones (and those already there)."""
    reserved = frozenset(reserved)

    def add(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        add_meta_learning_arguments(_ParserWithReservedFlags(parser, reserved))  # type: ignore[arg-type]
        add_slime_backend_arguments(parser)
        return parser

    return add


def slime_flags() -> frozenset[str]:
    """Every flag slime's own argument groups add (needs slime importable)."""
    from slime.utils.arguments import get_slime_extra_args_provider

    scratch = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    get_slime_extra_args_provider(None)(scratch)
    return frozenset(scratch._option_string_actions)


def arguments_for_slime(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """What `slime.utils.arguments.parse_args(add_custom_arguments=...)` takes."""
    return meta_arguments_skipping(slime_flags())(parser)


# ----------------------------------------------------------------------------- config


def our_defaults() -> dict[str, Any]:
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    add_slime_backend_arguments(add_meta_learning_arguments(parser))
    return vars(parser.parse_args([]))


def config_from_slime_args(args: argparse.Namespace, *, default_run_dir: str = "runs/slime") -> MetaConfig:
    """The frozen config from slime's namespace (in the rollout manager, where the plugin runs).

    slime's value wins where slime has one; our default fills what slime leaves None (Megatron's
    `--lr` without a value, for instance). Checkpoints are slime's business on this backend.
    """
    values = {}
    for name, default in our_defaults().items():
        value = getattr(args, name, None)
        values[name] = default if value is None else value
    if getattr(args, "grpo_std_normalization", True) is False:  # slime's --disable-grpo-std-normalization
        values["std_normalize"] = False  # our rollout computes the advantages: the flag means Dr.GRPO there too
    if values["student_temperature"] is not None:
        values["rollout_temperature"] = values["student_temperature"]
    values["apply_chat_template"] = {"auto": None, "on": True, "off": False}[
        values["meta_apply_chat_template"] or "auto"
    ]
    if values["meta_rollout_batch_size"] is not None:
        values["rollout_batch_size"] = values["meta_rollout_batch_size"]
    # slime does checkpoints and wandb here (its --wandb-key, its run); ours would be a second copy.
    values.update(
        backend="slime",
        load=None,
        save=None,
        save_interval=None,
        save_retain_interval=None,
        use_wandb=False,
        use_meta_learning=True,
    )
    values["replay_teachers"] = list(values.get("replay_teachers") or [])
    return build_config(argparse.Namespace(**values), default_run_dir=default_run_dir)
