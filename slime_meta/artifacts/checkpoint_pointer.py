"""Which checkpoint of a --save directory `--load` resumes from: the pointer file slime and Megatron
write, and the iteration directory it names. Apart from train_state.py (which needs torch) so that
the resume note and the slime backend's dry run read it without loading torch."""

from __future__ import annotations

from pathlib import Path

POINTER = "latest_checkpointed_iteration.txt"


def latest_checkpoint_dir(save_dir: Path) -> Path | None:
    """The checkpoint `--load save_dir` would resume from (the pointer's iter_* directory, whole), or None."""
    try:
        iteration = int((save_dir / POINTER).read_text(encoding="utf-8", errors="replace").strip())
    except (OSError, ValueError):
        return None
    root = save_dir / f"iter_{iteration:07d}"
    return root if (root / "state.json").is_file() else None
