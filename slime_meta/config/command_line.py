"""Rewriting the values of some flags in a command line that another parser will read."""

from __future__ import annotations

from typing import Callable, Collection, Sequence


def rewrite_flag_values(argv: Sequence[str], flags: Collection[str], rewrite: Callable[[str, str], str]) -> list[str]:
    """`argv` with each value of `flags` replaced by `rewrite(flag, value)`, in both the `--flag value`
    and the `--flag=value` form; every other token as it was."""
    out, pending = [], None
    for token in argv:
        if pending:  # this token is the value of the flag before it, whatever it looks like
            out.append(rewrite(pending, token))
            pending = None
            continue
        name, eq, value = token.partition("=")
        if eq and name in flags:
            out.append(f"{name}={rewrite(name, value)}")
        else:
            out.append(token)
            pending = token if not eq and token in flags else None
    return out
