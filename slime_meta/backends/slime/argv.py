"""Editing a command line on its way to slime: flags removed, spellings only our parser knows
dropped, relative paths made absolute (slime's actors do not run in our directory)."""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

from slime_meta.config.command_line import rewrite_flag_values


def without_slime_defaults(argv: Sequence[str]) -> list[str]:
    """`argv` without the spellings of slime's and Megatron's own defaults that only our parser knows:
    `--no-use-dynamic-batch-size` (slime's default is off) and `--recompute-granularity none`
    (Megatron keeps activations unless the flag is given); slime's parser would refuse both."""
    out, tokens = [], iter(argv)
    for token in tokens:
        if token == "--no-use-dynamic-batch-size" or token == "--recompute-granularity=none":
            continue
        if token == "--recompute-granularity":
            value = next(tokens, None)
            if value != "none":
                out += [token] + ([value] if value is not None else [])
            continue
        out.append(token)
    return out


def given(argv: Sequence[str], flag: str) -> bool:
    return any(token == flag or token.startswith(flag + "=") for token in argv)


def without(argv: Sequence[str], flags: dict[str, bool]) -> list[str]:
    """`argv` minus every occurrence of `flags` (flag -> takes a value), as `--f v` or `--f=v`."""
    out, skip = [], False
    for token in argv:
        if skip:
            skip = False
            continue
        name = token.split("=", 1)[0]
        if name in flags:
            skip = flags[name] and "=" not in token
            continue
        out.append(token)
    return out


# Flags whose relative paths are made absolute: slime's actors do not run in our directory.
_PATH_FLAGS = (
    "--prompt-data",
    "--hf-checkpoint",
    "--student-checkpoint",
    "--generator-template",
    "--grader-template",
    "--teacher-template",
    "--teacher-context",
)


def absolute_paths(argv: Sequence[str]) -> list[str]:
    """`argv` with the relative paths of `_PATH_FLAGS` that exist here made absolute."""

    def fix(flag: str, value: str) -> str:
        at, raw = ("@", value[1:]) if flag == "--teacher-context" else ("", value)
        if flag == "--teacher-context" and not value.startswith("@"):
            return value  # a context text, not a file
        path = Path(raw)
        return at + str(path.resolve()) if not path.is_absolute() and path.exists() else value

    return rewrite_flag_values(argv, _PATH_FLAGS, fix)
