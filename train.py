"""Train a teacher LLM to write additional_info, rewarded by a student's holdout grades.

    python train.py --use-meta-learning --prompt-data data/math_word_problems.jsonl \
        --hf-checkpoint /path/to/model ...            # `python train.py --help` lists every flag

Local backend (one machine, embedded workers behind the real sglang-router) by default;
`--backend slime` runs on a cluster through slime (Ray + Megatron + SGLang).
"""

from __future__ import annotations

import faulthandler
import logging
import signal
import sys
import time
from pathlib import Path

from slime_meta.artifacts.resume import program_words, resume_note
from slime_meta.backends import get_backend
from slime_meta.backends.local.workers.processes import LaunchError
from slime_meta.backends.slime.cli import requested_backend
from slime_meta.config.arguments import MetaConfig, parse_config
from slime_meta.errors import EXIT_USER_ERROR, NonFiniteTrainingError, UserInputError
from slime_meta.rollout.pools import PoolUnavailable
from slime_meta_engine import memory_snapshots

RUNTIME_FAULTS = (LaunchError, PoolUnavailable, NonFiniteTrainingError)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if requested_backend(argv) == "slime":
        # Megatron's, SGLang's and Ray's flags are slime's: slime's own parser reads this command line.
        from slime_meta.backends.slime.cli import main as slime_main

        return slime_main(argv)
    quiet_library_progress_bars()
    take_sigint()
    started_at, config = time.time(), None
    try:
        config = parse_config(argv, default_run_dir=time.strftime("runs/%Y%m%d-%H%M%S"))
        backend = get_backend(config.backend)
        run_dir = backend(config)
    except UserInputError as error:
        print(f"error: {error}", file=sys.stderr)
        return EXIT_USER_ERROR
    except RUNTIME_FAULTS as fault:
        # Not the user's input, but still one readable line: the message names the log to read.
        print(f"error: {fault}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted: workers and routers stopped", file=sys.stderr)
        print_resume_note(config, argv, started_at)
        return 130
    except SystemExit as stop:
        # The worker launcher turns SIGTERM (a scheduler's time limit, `timeout`) into SystemExit(143).
        if stop.code != 128 + signal.SIGTERM or config is None:
            raise
        print("stopped by SIGTERM: workers and routers stopped", file=sys.stderr)
        print_resume_note(config, argv, started_at)
        return stop.code
    print(f"run directory: {run_dir}")
    return 0


def print_resume_note(config: MetaConfig | None, argv: list[str], started_at: float) -> None:
    """The stopped run's latest checkpoint and the command that resumes from it (or when the first is due).

    The note is the last thing the run prints: SIGTERM's SystemExit may have ended an asyncio task
    (an HTTP request in flight) whose "exception was never retrieved" asyncio would log at shutdown,
    a traceback under the note for a stop that went as planned.
    """
    logging.getLogger("asyncio").setLevel(logging.CRITICAL)
    if config is None:  # stopped while the flags were read: nothing started
        return
    note = resume_note(config, argv, program=program_words(Path(__file__)), started_at=started_at)
    print(note, file=sys.stderr, flush=True)


def take_sigint() -> None:
    """End the run on SIGINT even where it was started with SIGINT ignored (`train.py &` in a script).

    Its routers and workers end on SIGINT whatever they inherit (sglang-router handles it
    itself), so a trainer that kept ignoring it would only find its pools gone, fail on them and
    report a pool error; ending as interrupted (exit code 130) says what happened.
    """
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def quiet_library_progress_bars() -> None:
    """Weight saves every step would each draw a transformers progress bar; ours is enough."""
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()


if __name__ == "__main__":
    # `kill -USR1 <pid>` prints every thread's stack to stderr and the run goes on: where a hung run waits.
    # Here, not in main(): main() also runs in-process (tests, notebooks), where stderr may have no file.
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    # With SLIME_META_TRACEMALLOC=DIR, `kill -USR2 <pid>` writes a snapshot of the Python heap there
    # (slime_meta_engine/memory_snapshots.py; benchmarks/soak.py --tracemalloc compares them).
    memory_snapshots.install("trainer")
    sys.exit(main())
