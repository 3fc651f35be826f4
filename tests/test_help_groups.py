"""--help shows first the flags most runs set, then the other flags slime (and Megatron under slime)
define too under slime's own group names, titled as used by both backends; with slime's source at
hand (SLIME_SRC), those groups are the ones slime declares them in."""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from slime_meta.config.arguments import (
    COMMON_FLAGS,
    COMMON_GROUP_TITLE,
    SLIME_HELP_GROUPS,
    add_meta_learning_arguments,
    slime_group_title,
)

ROOT = Path(__file__).resolve().parents[1]
MEGATRON_GROUP = "train (Megatron)"  # Megatron's own parser, not slime's arguments.py


def our_groups() -> dict[str, list[str]]:
    parser = add_meta_learning_arguments(argparse.ArgumentParser())
    return {group.title: [a.option_strings[0] for a in group._group_actions] for group in parser._action_groups}


def test_each_flag_slime_shares_sits_in_slimes_group_and_ours_stay_in_ours():
    """Apart from the flags most runs set, which --help shows first whoever defines them."""
    groups = our_groups()
    for group, flags in SLIME_HELP_GROUPS.items():
        shown = groups[slime_group_title(group)]
        assert len(shown) == len(set(shown)) and set(shown) == set(flags) - set(COMMON_FLAGS)
    assert groups[COMMON_GROUP_TITLE] == list(COMMON_FLAGS)
    assert "--num-inner-iterations" in groups["meta-learning"] and "--teacher-port" in groups["pools and resources"]
    titles = list(groups)
    assert titles.index(COMMON_GROUP_TITLE) < titles.index("meta-learning") < titles.index(slime_group_title("cluster"))
    assert titles.index(slime_group_title("cluster")) < titles.index("grader")


def test_on_slimes_parser_there_is_no_first_group_of_our_few():
    parser = argparse.ArgumentParser()
    parser.add_argument("--prompt-data")  # slime's parser holds slime's flags already
    titles = [group.title for group in add_meta_learning_arguments(parser)._action_groups]
    assert COMMON_GROUP_TITLE not in titles and "--group-key" in parser._option_string_actions


def test_help_prints_the_slime_groups_with_the_defaults():
    out = subprocess.run([sys.executable, "train.py", "--help"], cwd=ROOT, capture_output=True, text=True, check=True)
    text = out.stdout
    for group in SLIME_HELP_GROUPS:
        assert f"\n{slime_group_title(group)}:\n" in text
    # Flags both backends read are not shown as slime's alone.
    assert "\nslime:" not in text and "both backends" in slime_group_title("data")
    algo = text.split(f"\n{slime_group_title('algo')}:\n", 1)[1].split("\n\n", 1)[0]
    assert "--kl-loss-type" in algo and "(default: k3)" in algo and "--teacher-tau" not in algo


def slime_declarations(source: str) -> dict[str, str]:
    """flag -> the add_<group>_arguments function of slime's arguments.py that declares it (a flag
    as the first argument of add_argument / reset_arg, on the call's line or first on the next)."""
    group, found, open_call = None, {}, False
    call = re.compile(r'(?:add_argument|reset_arg)\(\s*(?:parser,\s*)?"(--[a-z0-9-]+)"')
    first = re.compile(r'^\s*"(--[a-z0-9-]+)"')
    for line in source.splitlines():
        match = re.match(r"\s+def add_(\w+)_arguments\(parser\)", line)
        if match:
            group = match.group(1)
            continue
        flag = call.search(line) or (first.match(line) if open_call else None)
        if group and flag:
            found.setdefault(flag.group(1), group)
        open_call = bool(re.search(r"(?:add_argument|reset_arg)\(\s*(?:parser,\s*)?$", line))
    return found


@pytest.mark.skipif(
    not os.environ.get("SLIME_SRC"), reason="needs slime's source: set SLIME_SRC to a THUDM/slime checkout"
)
def test_the_groups_are_the_ones_slime_declares_the_flags_in():
    source = (Path(os.environ["SLIME_SRC"]) / "slime/utils/arguments.py").read_text()
    declared = slime_declarations(source)
    ours = {flag for flags in our_groups().values() for flag in flags}
    shared = {flag: declared[flag] for flag in ours if flag in declared and flag != "--sglang-router-port"}
    table = {flag: group for group, flags in SLIME_HELP_GROUPS.items() if group != MEGATRON_GROUP for flag in flags}
    assert table == shared
