"""How a stopped local run is resumed: its latest checkpoint and the exact command that resumes from it.

A run stopped by Ctrl-C, SIGTERM (a scheduler's time limit, `timeout 2h python train.py ...`) or a
pool fault ends with, for instance,

    latest checkpoint: runs/mine/checkpoints/iter_0000010 (after step 10 of 40)
    resume with: .venv/bin/python train.py ... --load runs/mine/checkpoints

or, where this run has no checkpoint yet, when its first one is due. The command is the run's own
command line with `--load` set to its `--save` directory, and with `--run-dir` added where the run
took the default one (a new time-stamped name at each start): the resumed steps then continue the
same metrics.jsonl, traces.jsonl and plot.
"""

from __future__ import annotations

import shlex
import sys
from pathlib import Path
from typing import Sequence

from slime_meta.artifacts.checkpoint_pointer import POINTER, latest_checkpoint_dir
from slime_meta.config.arguments import MetaConfig
from slime_meta.config.command_line import rewrite_flag_values


def program_words(train_py: Path) -> list[str]:
    """This interpreter and train.py as a shell in the current directory reaches them: the .venv's
    python by its path (not resolved: the link is what makes it the .venv's), so the command runs
    without activating the .venv first."""
    return [_from_here(Path(sys.executable)), _from_here(train_py)]


def _from_here(path: Path) -> str:
    try:
        return str(path.absolute().relative_to(Path.cwd()))
    except ValueError:  # not below the current directory
        return str(path)


def _gives(argv: Sequence[str], flag: str) -> bool:
    return any(token == flag or token.startswith(f"{flag}=") for token in argv)


def resume_command(argv: Sequence[str], program: Sequence[str], *, load: str, run_dir: str) -> str:
    """`program` and `argv` with `--load load` (replacing a --load the run was given) and, when the
    run was not given one, `--run-dir run_dir`, quoted for a POSIX shell."""
    args = list(argv)
    if _gives(args, "--load"):
        args = rewrite_flag_values(args, {"--load"}, lambda flag, value: load)
    else:
        args += ["--load", load]
    if not _gives(args, "--run-dir"):
        args += ["--run-dir", run_dir]
    return shlex.join([*program, *args])


def _step_of(checkpoint: Path) -> int:
    return int(checkpoint.name.removeprefix("iter_"))


def _first_due(cfg: MetaConfig, start_step: int) -> str:
    interval, total = cfg.checkpoint.save_interval, cfg.meta.num_rollout
    if interval:
        due = min((start_step // interval + 1) * interval, total)
        return f"the first is due after step {due} of {total} (--save-interval {interval})"
    return (
        f"without --save-interval the only one is due after the last step, {total}; add --save-interval N "
        "to save every N steps"
    )


def resume_note(cfg: MetaConfig, argv: Sequence[str], *, program: Sequence[str], started_at: float) -> str:
    """What to print when the run stops before its end: the checkpoint it can resume from and the command
    that does, or that there is none yet and when the first is due.

    A checkpoint counts as this run's when its pointer was written after `started_at` (time.time()
    at the start), or when the run was loaded from its own --save directory: an earlier run's
    checkpoints in the same directory are not offered.
    """
    checkpoint, total = cfg.checkpoint, cfg.meta.num_rollout
    if not checkpoint.save:
        return (
            "no checkpoint: the run was given no --save DIR, so the same command starts it again from step 1 "
            "(add --save DIR --save-interval N to be able to resume)"
        )
    save_dir = Path(checkpoint.save)
    latest = latest_checkpoint_dir(save_dir)
    loaded_from_save_dir = bool(checkpoint.load) and Path(checkpoint.load).resolve() == save_dir.resolve()
    if latest and (loaded_from_save_dir or (save_dir / POINTER).stat().st_mtime >= started_at):
        step = _step_of(latest)
        if step >= total:
            return f"latest checkpoint: {latest} (after the last step, {total}): nothing is left to train"
        command = resume_command(argv, program, load=checkpoint.save, run_dir=cfg.tracking.run_dir)
        return f"latest checkpoint: {latest} (after step {step} of {total})\nresume with: {command}"
    if checkpoint.load:
        loaded = latest_checkpoint_dir(Path(checkpoint.load))
        start_step = _step_of(loaded) if loaded else 0
        command = resume_command(argv, program, load=checkpoint.load, run_dir=cfg.tracking.run_dir)
        return (
            f"no checkpoint of this run yet in {save_dir} ({_first_due(cfg, start_step)}); the checkpoint it "
            f"started from resumes it again\nresume with: {command}"
        )
    return f"no checkpoint yet in {save_dir}: {_first_due(cfg, 0)}; the same command starts the run again from step 1"
