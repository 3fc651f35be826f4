"""Checkpoints that survive a kill: written under a temporary name, fsynced, then renamed.

Layout of `--save DIR` (slime's convention for the pointer file):
    DIR/iter_0000003/model/          HF weights + tokenizer (a normal HF checkpoint)
    DIR/iter_0000003/trainer.pt      optimizer, RNG states
    DIR/iter_0000003/state.json      next rollout id, data cursor
    DIR/latest_checkpointed_iteration.txt
A kill during a save leaves a `.tmp-*` directory and the previous pointer intact.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

POINTER = "latest_checkpointed_iteration.txt"


def _fsync_tree(root: Path) -> None:
    for path in sorted(root.rglob("*")):
        if path.is_file():
            with path.open("rb") as f:
                os.fsync(f.fileno())
    _fsync_dir(root)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".tmp-{path.name}")
    with tmp.open("w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def rng_state() -> dict[str, Any]:
    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])


@dataclass(frozen=True)
class LoadedCheckpoint:
    iteration: int
    model_dir: Path
    trainer_state: dict[str, Any]
    state: dict[str, Any]


def save_checkpoint(save_dir: Path, iteration: int, *, trainer, tokenizer, state: dict[str, Any]) -> Path:
    save_dir.mkdir(parents=True, exist_ok=True)
    final = save_dir / f"iter_{iteration:07d}"
    tmp = save_dir / f".tmp-iter_{iteration:07d}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    trainer.model.save_pretrained(tmp / "model", safe_serialization=True)
    tokenizer.save_pretrained(tmp / "model")
    torch.save({**trainer.state_dict(), "rng": rng_state()}, tmp / "trainer.pt")
    (tmp / "state.json").write_text(json.dumps(state, indent=2, sort_keys=True), encoding="utf-8")
    _fsync_tree(tmp)
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    _fsync_dir(save_dir)
    _write_atomic(save_dir / POINTER, f"{iteration}\n")
    return final


def load_checkpoint(load_dir: Path) -> LoadedCheckpoint:
    pointer = load_dir / POINTER
    if not pointer.exists():
        from slime_meta.errors import UserInputError

        raise UserInputError(f"--load {load_dir}: no {POINTER} in it; give a --save directory of an earlier run")
    from slime_meta.errors import UserInputError

    try:
        iteration = int(pointer.read_text(encoding="utf-8", errors="replace").strip())
    except ValueError:
        raise UserInputError(f"--load {load_dir}: {POINTER} does not hold an iteration number; give a --save directory of an earlier run")
    root = load_dir / f"iter_{iteration:07d}"
    missing = [name for name in ("trainer.pt", "state.json", "model/config.json") if not (root / name).is_file()]
    if missing:
        raise UserInputError(
            f"--load {load_dir}: checkpoint {root.name} lacks {', '.join(missing)}; point {POINTER} at a complete iter_* directory"
        )
    trainer_state = torch.load(root / "trainer.pt", map_location="cpu", weights_only=False)
    state = json.loads((root / "state.json").read_text(encoding="utf-8"))
    return LoadedCheckpoint(iteration=iteration, model_dir=root / "model", trainer_state=trainer_state, state=state)
