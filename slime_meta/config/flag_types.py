"""Value types of the command line's flags: each refuses a bad value with one line argparse
turns into `--flag: ...` and exit code 2."""

from __future__ import annotations

import argparse
from typing import Callable

# One argparse group's add_argument that skips a flag the parser already has (slime's).
AddFlag = Callable[..., object]


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def positive_seconds(text: str) -> float:
    value = float(text)
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a number of seconds > 0, got {text}")
    return value


def open_fraction(text: str) -> float:
    value = float(text)
    if not 0.0 < value < 1.0:
        raise argparse.ArgumentTypeError(f"must be between 0 and 1 (exclusive), got {value}")
    return value


def page_size(text: str) -> int:
    value = int(text)
    if value < 1 or value > 128 or value & (value - 1):
        raise argparse.ArgumentTypeError(f"must be a power of two up to 128 (e.g. 16), got {value}")
    return value


def prefill_chunk(text: str) -> int:
    value = int(text)
    if value < 1 and value != -1:
        raise argparse.ArgumentTypeError(f"must be >= 1 (tokens) or -1 (off), got {value}")
    return value
