"""`python train.py --backend slime ...` (or `python -m slime_meta.backends.slime ...`).

The command line goes through slime's own parser (Megatron's and SGLang's flags are slime's to
read), after `plan.translate` has checked ours and added the plugin flags. `--dry-run` stops
after printing the plan, so it needs neither GPUs nor slime.
"""

from __future__ import annotations

import importlib
import sys
import time
from pathlib import Path
from typing import Sequence

from slime_meta.backends.slime.dry_run import describe
from slime_meta.backends.slime.plan import LaunchPlan, meta_parser, translate
from slime_meta.errors import EXIT_USER_ERROR, UserInputError

INSTALL_HINT = (
    "install it one of two ways: run inside slime's docker image (docker pull slimerl/slime:latest; "
    "slime is in /root/slime) and `pip install -e .` this repository there, or install slime from source "
    "(git clone https://github.com/THUDM/slime && pip install -e ./slime --no-deps, plus Megatron-LM and SGLang "
    "as slime's docs say); the PyPI package named `slime` is unrelated; see docs/cluster.md"
)


def requested_backend(argv: Sequence[str]) -> str | None:
    """The value of --backend in `argv`, read before any parser (slime's flags are not ours)."""
    for index, token in enumerate(argv):
        if token == "--backend" and index + 1 < len(argv):
            return argv[index + 1]
        if token.startswith("--backend="):
            return token.split("=", 1)[1]
    return None


def missing_slime() -> str | None:
    """None when THUDM's slime and the stack it runs on import; else the one line that says what to do."""
    try:
        importlib.import_module("slime")
    except ImportError:
        return f"--backend slime needs slime (THUDM/slime), which is not importable here: {INSTALL_HINT}"
    for module in (
        "slime.rollout.base_types",
        "slime.ray.placement_group",
        "slime.utils.arguments",
        "slime.backends.megatron_utils.arguments",
    ):
        try:
            importlib.import_module(module)
        except ModuleNotFoundError as exc:
            if exc.name and (exc.name == "slime" or exc.name.startswith("slime.")):
                return (
                    f"--backend slime: the importable `slime` is not THUDM/slime (it has no {exc.name}); {INSTALL_HINT}"
                )
            return (
                f"--backend slime: slime is there but {exc.name} is missing (slime runs on Ray, Megatron-LM "
                f"and SGLang); {INSTALL_HINT}"
            )
    return None


def flag_values(argv: Sequence[str], flag: str) -> list[str]:
    """The values given to `flag` in `argv` (`--flag v` or `--flag=v`; for nargs flags, up to the next flag)."""
    values: list[str] = []
    for index, token in enumerate(argv):
        if token.startswith(flag + "="):
            values.append(token.split("=", 1)[1])
        elif token == flag:
            for value in argv[index + 1 :]:
                if value.startswith("--"):
                    break
                values.append(value)
    return values


def missing_path(slime_argv: Sequence[str]) -> str | None:
    """The first input path of the launch that is not there, in one line naming its flag; else None.

    Checked before Ray, SGLang and Megatron start (minutes of start-up), which would each fail on it
    later and in their own words."""
    checkpoint = flag_values(slime_argv, "--hf-checkpoint")
    for path in checkpoint:
        if not (Path(path) / "config.json").is_file():
            return (
                f"--hf-checkpoint {path}: no HF checkpoint there (no config.json); give the model's directory "
                "(SGLang serves it and Megatron's shape is checked against its config.json)"
            )
    for flag in ("--ref-load", "--load"):
        for path in flag_values(slime_argv, flag):
            if flag == "--load" and path in flag_values(slime_argv, "--save"):
                continue  # slime's resume pattern: --load $SAVE starts from --ref-load while nothing is saved
            if not Path(path).exists():
                return f"{flag} {path}: no such directory; give Megatron's weights (an HF or torch_dist directory)"
    for flag in ("--prompt-data", "--eval-prompt-data"):
        for value in flag_values(slime_argv, flag):
            looks_like_path = "/" in value or value.endswith((".jsonl", ".json", ".parquet"))
            if looks_like_path and not Path(value).is_file():
                return f"{flag} {value}: no such file; check the path"
    return None


def parse_slime_args(slime_argv: Sequence[str]):
    """slime's parse_args over `slime_argv` with our flag groups (slime and Megatron read sys.argv)."""
    from slime.utils.arguments import parse_args

    from slime_meta.backends.slime.flags import arguments_for_slime

    saved = sys.argv
    sys.argv = [saved[0] if saved else "train.py", *slime_argv]
    try:
        return parse_args(add_custom_arguments=arguments_for_slime)
    finally:
        sys.argv = saved


def run(plan: LaunchPlan) -> None:
    plan.run_dir.mkdir(parents=True, exist_ok=True)
    plan.write_sglang_config()
    plan.config.save(plan.run_dir / "config.json")
    args = parse_slime_args(plan.slime_argv)

    from slime_meta.artifacts.plot import write_plot
    from slime_meta.backends.slime.loop import train

    try:
        train(args)
    finally:  # the rollout manager redraws it every minute; once more however the run ends
        write_plot(plan.run_dir)


def print_help() -> None:
    print(meta_parser().format_help())
    print(
        "Every other flag is slime's (Megatron's, SGLang's, Ray placement): see `python train.py --help` "
        "in your slime checkout. `--dry-run` prints what would run without GPUs or slime."
    )


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "-h" in argv or "--help" in argv:
        print_help()
        return 0
    try:
        plan = translate(argv, default_run_dir=time.strftime("runs/%Y%m%d-%H%M%S"))
        if plan.dry_run:
            print(describe(plan))
            return 0
        problem = missing_slime() or missing_path(plan.slime_argv)
        if problem:
            raise UserInputError(problem)
        run(plan)
    except UserInputError as error:
        print(f"error: {error}", file=sys.stderr)
        return EXIT_USER_ERROR
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    print(f"run directory: {plan.run_dir}")
    return 0
