"""Flags and config of checkpoints and tracking."""

from __future__ import annotations

from dataclasses import dataclass

from slime_meta.config.flag_types import AddFlag, positive_int


@dataclass(frozen=True)
class CheckpointConfig:
    save: str | None
    load: str | None
    save_interval: int | None
    save_retain_interval: int | None


@dataclass(frozen=True)
class TrackingConfig:
    run_dir: str
    use_wandb: bool
    wandb_project: str
    wandb_group: str | None
    wandb_mode: str


def add_checkpoint_and_tracking_flags(add: AddFlag) -> None:
    """Checkpoint directories and intervals, the run directory, wandb."""
    add("--save", default=None, help="Checkpoint directory; default: no checkpoints.")
    add(
        "--load",
        default=None,
        help="Resume from this checkpoint directory (a --save directory; a stopped run prints the command that "
        "resumes it); default: start from --hf-checkpoint.",
    )
    add(
        "--save-interval",
        type=positive_int,
        default=None,
        help="Save every N outer steps (and at the end); default: at the end only.",
    )
    add(
        "--save-retain-interval",
        type=positive_int,
        default=None,
        help="Keep the checkpoints of steps that are multiples of N and the latest; delete each other one once a "
        "newer one is saved (Megatron's flag; a multiple of --save-interval); default: keep every checkpoint.",
    )
    add("--run-dir", default=None, help="Where metrics, traces, config and plot go (default runs/<time>).")
    add("--use-wandb", action="store_true", help="Also log to wandb (pip install -e '.[wandb]').")
    add("--wandb-project", default="slime-meta", help="wandb project.")
    add("--wandb-group", default=None, help="wandb group of the run; default: none.")
    add(
        "--wandb-mode",
        choices=("offline", "online", "disabled"),
        default="offline",
        help="online needs WANDB_API_KEY in the environment.",
    )
