"""What the slime-backend tests share: a base command line and reading a flag's value back."""

from __future__ import annotations

from pathlib import Path

from slime_meta.backends.slime.plan import translate

REPO = Path(__file__).resolve().parents[1]
BASE = [
    "--use-meta-learning",
    "--prompt-data",
    "data/math_word_problems.jsonl",
    "--hf-checkpoint",
    "/ckpt/teacher",
    "--ref-load",
    "/ckpt/teacher_torch_dist",
]


def value(argv, flag):
    """The last value given to `flag` in `argv` (what argparse keeps)."""
    values = [argv[i + 1] for i, token in enumerate(argv[:-1]) if token == flag]
    return values[-1] if values else None


def plan_of(*extra, run_dir=None, **kwargs):
    return translate([*BASE, *extra, "--run-dir", str(run_dir or "/tmp/slime-meta-test-run")], **kwargs)
