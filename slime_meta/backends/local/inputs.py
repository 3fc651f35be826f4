"""The local run's input checks, all before anything starts or is written: the model directories,
the servers named by flags, and the run directory (refused when it holds an earlier run)."""

from __future__ import annotations

from pathlib import Path

from slime_meta.backends.local.data import check_context_fits
from slime_meta.backends.local.workers.grader import grader_checkpoint, local_grader_line
from slime_meta.config.arguments import MetaConfig
from slime_meta.errors import UserInputError
from slime_meta.rollout.pools import check_reachable


def check_model_dir(path: str | None, flag: str) -> str:
    if not path:
        raise UserInputError(
            f"{flag} is required: a local HF checkpoint directory or a .gguf file (build the small demo model "
            "with: python -m slime_meta.models.tiny; get the real one with: python -m slime_meta.models.real)"
        )
    if not (Path(path) / "config.json").is_file():
        raise UserInputError(
            f"{flag} {path}: not an HF checkpoint directory (no config.json in it); give one, or a .gguf file"
        )
    return path


def check_models(cfg: MetaConfig) -> str:
    """The teacher's checkpoint (returned) and a separate student's, checked to be HF checkpoint directories."""
    teacher_model = check_model_dir(cfg.pools.hf_checkpoint, "--hf-checkpoint")
    if cfg.pools.student_checkpoint:
        check_model_dir(cfg.pools.student_checkpoint, "--student-checkpoint")
    return teacher_model


def check_servers(cfg: MetaConfig) -> None:
    """--grader local: its checkpoint (and one line on it); --external-student-url: that it answers.
    An unreachable student server is bad input: refused before the run directory exists."""
    if cfg.grader.grader == "local":
        check_model_dir(grader_checkpoint(cfg), "--grader-checkpoint")
        print(local_grader_line(cfg), flush=True)
    if cfg.pools.external_student_url:
        check_reachable(cfg.pools.external_student_url, "--external-student-url")


def prepare_run_dir(cfg: MetaConfig) -> Path:
    run_dir = Path(cfg.tracking.run_dir)
    if (run_dir / "metrics.jsonl").exists() and not cfg.checkpoint.load:
        raise UserInputError(
            f"--run-dir {run_dir}: holds an earlier run's metrics.jsonl; give a new --run-dir, or --load its "
            "checkpoints to resume"
        )
    check_context_fits(cfg)  # the last check before anything is written
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    (run_dir / "weights").mkdir(exist_ok=True)
    cfg.save(run_dir / "config.json")
    return run_dir
