"""`python train.py --help`: every flag explained, with its real default."""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

import pytest

from slime_meta.backends.slime.flags import add_slime_backend_arguments
from slime_meta.config.arguments import build_parser, parse_config
from slime_meta.errors import UserInputError

ROOT = Path(__file__).resolve().parent.parent


def _flag_actions(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    return [a for a in parser._actions if a.option_strings and a.help is not argparse.SUPPRESS]


def test_every_flag_has_help():
    parser = add_slime_backend_arguments(build_parser())
    missing = [a.option_strings[0] for a in _flag_actions(parser) if not (a.help or "").strip()]
    assert missing == []


def test_a_flag_without_a_fixed_default_says_what_not_giving_it_means():
    """`(default: None)` says nothing: such a flag's help says how its value is computed, that it is
    off or none, or that it is required."""
    vague = [
        a.option_strings[0]
        for a in _flag_actions(build_parser())
        if a.default is None and not re.search(r"default|not given|required", a.help or "", re.IGNORECASE)
    ]
    assert vague == []


def test_help_shows_real_defaults_and_never_default_none():
    text = subprocess.run(
        [sys.executable, str(ROOT / "train.py"), "--help"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout
    flat = " ".join(text.split())
    assert "(default: None)" not in flat
    assert "AdamW learning rate. (default: 1e-05)" in flat
    assert "(default: 1234)" in flat  # --seed


def test_the_required_flags_are_reported_together():
    with pytest.raises(UserInputError) as error:
        parse_config([])
    message = str(error.value)
    assert all(flag in message for flag in ("--prompt-data", "--hf-checkpoint"))
    assert "--use-meta-learning" not in message  # the default: the one mode this program runs


def test_help_opens_with_the_flags_most_runs_set():
    """A short usage line, then model, data and its columns, the draw per step, steps, run dir and
    checkpoints: not argparse's list of every flag, and not the meta-learning loop's own knobs."""
    text = subprocess.run(
        [sys.executable, str(ROOT / "train.py"), "--help"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout
    usage, rest = text.split("\n\n", 1)
    assert usage.count("\n") == 0 and "--hf-checkpoint MODEL --prompt-data FILE" in usage
    first_group = rest.split("\n\n")[2]  # after the description and "options:"
    assert first_group.startswith("the flags most runs set:\n  --hf-checkpoint")
    flags = re.findall(r"^  (--[a-z-]+)", first_group, re.MULTILINE)
    assert flags[:2] == ["--hf-checkpoint", "--prompt-data"]
    for flag in ("--group-key", "--rollout-batch-size", "--num-rollout", "--run-dir", "--save", "--load"):
        assert flag in flags
