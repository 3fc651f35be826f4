"""Every command README.md and docs/*.md show (code blocks, indented blocks and inline code) that runs
`python train.py` or a script that ends in it is parsed by the real parser and checked by the real
validation, without training: a documented command whose flag no longer exists, or whose flags no
longer go together, fails here instead of on a reader's machine. A command shown with `...` for
the flags it leaves out is parsed only (it is not whole).

The scripts' own flags are part of the command: `scripts/run_synthetic.sh` (and `scripts/demo.sh`,
which hands its arguments to it; tests/test_demo_script.py shows that) and `scripts/run_real.sh` run
for real with a stand-in interpreter (`PYTHON`) that records the train.py command line and does
nothing else; run_real.sh both in its CPU and its GPU shape. `benchmarks/run_gpu_real.sh
price_lists|price_keys|house_rules` is run_real.sh's GPU shape with the flags it and benchmarks/efficacy.py add
(`--trace-sample-rate 0.05 --seed SEED` and TRAIN_FLAGS).

Left out: `--backend slime` command lines (slime's and Megatron's flags are slime's parser's; the
launch scripts' --dry-run tests cover them) and scripts that do not run train.py.
"""

from __future__ import annotations

import os
import re
import shlex
import stat
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from slime_meta.config.arguments import build_config, build_parser
from slime_meta.errors import UserInputError

ROOT = Path(__file__).resolve().parent.parent
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SCRIPTS = {"scripts/demo.sh": "scripts/run_synthetic.sh", "scripts/run_synthetic.sh": "scripts/run_synthetic.sh"}
SCRIPTS["scripts/run_real.sh"] = "scripts/run_real.sh"
GPU_BENCHMARK = "benchmarks/run_gpu_real.sh"
# Words the docs write for a value the reader picks: `SEED=S`, `RUN_DIR=DIR`, `--save-interval N`.
PLACEHOLDERS = {"S": "7", "N": "4", "DIR": "runs/documented", "PATH": "data/math_word_problems.jsonl"}
SHELL_OPERATORS = {"|", "||", "&&", ";", "&", ">", ">>", "2>", "2>&1", "<"}


@dataclass
class Command:
    where: str  # file:line
    environment: dict[str, str]
    program: str  # "train.py", a script's path, or the GPU benchmark's
    arguments: list[str] = field(default_factory=list)
    elided: bool = False  # shown with `...` for flags left out: its flags are checked, not that it is whole


def code_of(text: str) -> list[tuple[int, str]]:
    """(line number, code) of each fenced block line, indented block line and inline code span."""
    found, fenced, previous_blank = [], False, True
    for number, line in enumerate(text.splitlines(), start=1):
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        if fenced:
            found.append((number, line))
        elif line.startswith("    ") and (previous_blank or (found and found[-1][0] == number - 1)):
            found.append((number, line[4:]))
        else:
            found += [(number, span) for span in re.findall(r"`([^`]+)`", line)]
        previous_blank = not line.strip()
    return found


def joined(lines: list[tuple[int, str]]) -> list[tuple[int, str]]:
    """Lines ending in a backslash joined with the next, numbered by their first line."""
    out, pending = [], None
    for number, line in lines:
        if pending is not None:
            number, line = pending[0], pending[1] + " " + line.strip()
        if line.rstrip().endswith("\\"):
            pending = (number, line.rstrip()[:-1])
            continue
        pending = None
        out.append((number, line))
    return out


def parse_command(line: str, where: str) -> Command | None:
    try:
        tokens = shlex.split(line, comments=True)
    except ValueError:  # prose in backticks, not a command
        return None
    for index, token in enumerate(tokens):
        program = None
        if token == "train.py" and index and re.fullmatch(r"(\S*/)?python3?", tokens[index - 1]):
            program, head = "train.py", tokens[: index - 1]
        elif any(token.endswith(script) for script in (*SCRIPTS, GPU_BENCHMARK)):
            program = next(script for script in (*SCRIPTS, GPU_BENCHMARK) if token.endswith(script))
            head = tokens[:index]
        if program is None:
            continue
        environment = {}
        for word in head:
            name, equals, value = word.partition("=")
            if equals and re.fullmatch(r"[A-Z_][A-Z0-9_]*", name):
                environment[name] = PLACEHOLDERS.get(value, value)
        arguments, elided = [], False
        for word in tokens[index + 1 :]:
            if word in SHELL_OPERATORS or word.startswith((">", "2>")):
                break
            if word in ("...", "…"):
                elided = True
            else:
                arguments.append(PLACEHOLDERS.get(word, word))
        return Command(where, environment, program, arguments, elided)
    return None


def documented_commands() -> list[Command]:
    commands = []
    for document in DOCUMENTS:
        for number, line in joined(code_of(document.read_text(encoding="utf-8"))):
            command = parse_command(line, f"{document.relative_to(ROOT)}:{number}")
            if command is None or "slime" in _backend(command.arguments):
                continue
            if command.program == GPU_BENCHMARK and command.arguments[:1] not in (
                ["price_lists"],
                ["price_keys"],
                ["house_rules"],
            ):
                continue  # its other parts take no train.py flags
            commands.append(command)
    return commands


def _backend(arguments: list[str]) -> str:
    for index, word in enumerate(arguments):
        if word.startswith("--backend="):
            return word.split("=", 1)[1]
        if word == "--backend" and index + 1 < len(arguments):
            return arguments[index + 1]
    return "local"


def stand_in_python(tmp_path: Path) -> Path:
    """An interpreter for the scripts that records train.py's command line (NUL-separated) and runs nothing."""
    path = tmp_path / "python"
    path.write_text(
        "#!/usr/bin/env bash\n"
        'case "$1" in\n'
        "  -m) echo /placeholder/model ;;  # the model build or fetch: its directory is the last line\n"
        '  -c) exit "${STAND_IN_GPU:-1}" ;;  # run_real.sh asks whether torch sees a GPU (1: no)\n'
        '  train.py|benchmarks/prompt_search.py) shift; printf "%s\\0" "$@" > "$STAND_IN_ARGV" ;;\n'
        "esac\n"
    )
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return path


def train_argvs(command: Command, tmp_path: Path) -> dict[str, list[str]]:
    """The train.py command lines a documented command runs: one per shape of the script."""
    if command.program == "train.py":
        return {"": command.arguments}
    environment = dict(command.environment)
    arguments = command.arguments
    script = SCRIPTS.get(command.program, "scripts/run_real.sh")
    shapes = {"CPU": "1", "GPU": "0"} if script == "scripts/run_real.sh" else {"": "1"}
    if command.program == GPU_BENCHMARK:  # benchmarks/efficacy.py's run of run_real.sh, on a GPU
        task = arguments[0]
        environment.update(DATA=task, NUM_ROLLOUT="400")
        if not environment.get("SHARED"):
            environment["FROZEN_STUDENT"] = "1"
        train_flags = shlex.split(environment.get("TRAIN_FLAGS", ""))
        arguments = ["--trace-sample-rate", "0.05", "--seed", environment.get("SEED", "1"), *train_flags]
        shapes = {"GPU": "0"}
    environment.setdefault("MODEL_DIR", "/placeholder/model")  # no fetch, no model build
    environment.setdefault("RUN_DIR", str(tmp_path / "run"))
    found = {}
    for shape, gpu in shapes.items():
        record = tmp_path / f"argv-{shape or 'one'}"
        record.unlink(missing_ok=True)
        env = {
            **os.environ,
            **environment,
            "PYTHON": str(stand_in_python(tmp_path)),
            "STAND_IN_ARGV": str(record),
            "STAND_IN_GPU": gpu,
        }
        done = subprocess.run(
            ["bash", script, *arguments], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60
        )
        assert record.is_file(), f"{command.where}: {script} did not reach train.py ({done.returncode}): {done.stderr}"
        found[shape] = record.read_text().split("\0")[:-1]
    return found


COMMANDS = documented_commands()


def test_the_docs_show_commands_of_every_kind():
    programs = {command.program for command in COMMANDS}
    assert {"train.py", "scripts/demo.sh", "scripts/run_real.sh", GPU_BENCHMARK} <= programs, programs
    assert len(COMMANDS) >= 10


def prompt_search_parses(command: Command, tmp_path: Path) -> None:
    """run_real.sh with ENTRY=benchmarks/prompt_search.py: its command line, read by the search's own
    parser (train.py's flags and the search's), which also builds the run's config."""
    import prompt_search

    for shape, argv in train_argvs(command, tmp_path).items():
        try:
            prompt_search.parse(argv)
        except SystemExit as stop:
            pytest.fail(f"{command.where} {shape}: the search's parser refuses ({stop.code}) {shlex.join(argv)}")
        except UserInputError as error:
            pytest.fail(f"{command.where} {shape}: {error}\n  {shlex.join(argv)}")


@pytest.mark.parametrize("command", COMMANDS, ids=[command.where for command in COMMANDS])
def test_a_documented_command_parses_and_validates(command, tmp_path, monkeypatch):
    if command.environment.get("ENTRY") == "benchmarks/prompt_search.py":
        monkeypatch.chdir(ROOT)  # its --compare-with file is read from the repository root, as the docs run it
        monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
        prompt_search_parses(command, tmp_path)
        return
    for shape, argv in train_argvs(command, tmp_path).items():
        label = f"{command.where} {shape}".strip()
        try:
            namespace = build_parser().parse_args(argv)
        except SystemExit as stop:
            if stop.code == 0:  # --help
                continue
            pytest.fail(f"{label}: the parser refuses {shlex.join(argv)}")
        if command.elided:
            continue
        try:
            build_config(namespace)
        except UserInputError as error:
            # A --load of a run the reader has not made yet is the one thing a parse cannot stand in for.
            if not re.match(r"--load \S+: no such directory", str(error)):
                pytest.fail(f"{label}: {error}\n  {shlex.join(argv)}")
