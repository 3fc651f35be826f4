"""Checkpoints that survive a kill: written under a temporary name, fsynced, then renamed.

Layout of `--save DIR` (slime's convention for the pointer file):
    DIR/iter_0000003/model/          HF weights + tokenizer (a normal HF checkpoint)
    DIR/iter_0000003/trainer.pt      optimizer, RNG states
    DIR/iter_0000003/state.json      next rollout id, data cursor
    DIR/latest_checkpointed_iteration.txt
A kill during a save leaves a `.tmp-*` directory and the previous pointer intact.

`trainer.pt` holds only tensors and plain values (the RNG states of Python and NumPy as int64
tensors), so `--load` reads it with `torch.load(weights_only=True)`: a file planted in the
directory cannot run code. Checkpoints written before that stored NumPy's state as an ndarray;
they load with exactly the NumPy globals that such a state needs allowed, nothing more.
"""

from __future__ import annotations

import json
import os
import pickle
import random
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from slime_meta.artifacts.checkpoint_pointer import POINTER, latest_checkpoint_dir  # noqa: F401 (re-exported)


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


RNG_FORMAT = 2  # 1 (no "format" key): Python's state as its tuple, NumPy's with an ndarray


def rng_state() -> dict[str, Any]:
    """The Python, NumPy and torch RNG states as tensors and plain values (loadable with weights_only)."""
    python_version, python_internal, gauss_next = random.getstate()
    algorithm, keys, position, has_gauss, cached_gaussian = np.random.get_state()
    return {
        "format": RNG_FORMAT,
        "python": {
            "version": python_version,
            "internal": torch.tensor(python_internal, dtype=torch.int64),
            "gauss_next": gauss_next,
        },
        "numpy": {
            "algorithm": str(algorithm),
            "keys": torch.from_numpy(keys.astype(np.int64)),
            "pos": int(position),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached_gaussian),
        },
        "torch": torch.get_rng_state(),
    }


def set_rng_state(state: dict[str, Any]) -> None:
    if state.get("format") is None:  # written before RNG_FORMAT 2
        random.setstate(state["python"])
        np.random.set_state(state["numpy"])
    else:
        python, numpy_state = state["python"], state["numpy"]
        random.setstate((python["version"], tuple(python["internal"].tolist()), python["gauss_next"]))
        np.random.set_state(
            (
                numpy_state["algorithm"],
                numpy_state["keys"].numpy().astype(np.uint32),
                numpy_state["pos"],
                numpy_state["has_gauss"],
                numpy_state["cached_gaussian"],
            )
        )
    torch.set_rng_state(state["torch"])


def _legacy_numpy_globals() -> list[Any]:
    """What pickling one NumPy array needs: its reconstructor, the array type, the dtype."""
    multiarray = np._core.multiarray if hasattr(np, "_core") else np.core.multiarray
    return [multiarray._reconstruct, np.ndarray, np.dtype, type(np.dtype(np.uint32))]


def _load_trainer_state(path: Path, load_dir: Path) -> dict[str, Any]:
    from slime_meta.errors import UserInputError

    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError:
        pass
    try:  # a checkpoint of the previous format: NumPy's RNG state as an ndarray
        with torch.serialization.safe_globals(_legacy_numpy_globals()):
            return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError:
        try:
            foreign = ", ".join(torch.serialization.get_unsafe_globals_in_checkpoint(path)) or "unknown objects"
        except Exception:  # too damaged to list
            foreign = "data torch cannot read"
        raise UserInputError(
            f"--load {load_dir}: {path.parent.name}/trainer.pt holds {foreign}, not only tensors and plain values; "
            "it was not written by slime-meta, so it is not loaded (it could run code); give a --save directory of an "
            "earlier run"
        ) from None


@dataclass(frozen=True)
class LoadedCheckpoint:
    iteration: int
    model_dir: Path
    trainer_state: dict[str, Any]
    state: dict[str, Any]


def save_checkpoint(
    save_dir: Path,
    iteration: int,
    *,
    trainer,
    tokenizer,
    state: dict[str, Any],
    retain_interval: int | None = None,
) -> Path:
    """Write checkpoint `iteration` whole, then move the pointer to it.

    With `retain_interval` N (--save-retain-interval), the earlier checkpoints of steps that are not
    multiples of N are deleted once the pointer has moved, so a 400-step run keeps a few, not 40.
    """
    save_dir.mkdir(parents=True, exist_ok=True)
    final = save_dir / f"iter_{iteration:07d}"
    tmp = save_dir / f".tmp-iter_{iteration:07d}"
    # What earlier saves that died left behind (one run writes a save dir): each is a whole model and
    # optimizer that nothing would ever load or delete.
    for leftover in save_dir.glob(".tmp-iter_*"):
        shutil.rmtree(leftover, ignore_errors=True)
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
    if retain_interval:
        _delete_unretained(save_dir, iteration, retain_interval)
    return final


def _delete_unretained(save_dir: Path, latest: int, retain_interval: int) -> None:
    """Delete the checkpoints before `latest` whose step is not a multiple of `retain_interval`.

    Only earlier ones: a directory of a later step (an earlier run that went further) stays. A link
    is left alone (it points at something kept elsewhere), and a failed delete is not fatal: the
    pointer already names the new checkpoint.
    """
    for path in save_dir.glob("iter_*"):
        try:
            step = int(path.name.removeprefix("iter_"))
        except ValueError:
            continue
        if step < latest and step % retain_interval and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)


def load_checkpoint(load_dir: Path) -> LoadedCheckpoint:
    pointer = load_dir / POINTER
    if not pointer.exists():
        from slime_meta.errors import UserInputError

        raise UserInputError(f"--load {load_dir}: no {POINTER} in it; give a --save directory of an earlier run")
    from slime_meta.errors import UserInputError

    try:
        iteration = int(pointer.read_text(encoding="utf-8", errors="replace").strip())
    except ValueError:
        raise UserInputError(
            f"--load {load_dir}: {POINTER} does not hold an iteration number; give a --save directory of an earlier run"
        )
    root = load_dir / f"iter_{iteration:07d}"
    missing = [name for name in ("trainer.pt", "state.json", "model/config.json") if not (root / name).is_file()]
    if missing:
        raise UserInputError(
            f"--load {load_dir}: checkpoint {root.name} lacks {', '.join(missing)}; point {POINTER} at a complete "
            "iter_* directory"
        )
    trainer_state = _load_trainer_state(root / "trainer.pt", load_dir)
    state = json.loads((root / "state.json").read_text(encoding="utf-8"))
    return LoadedCheckpoint(iteration=iteration, model_dir=root / "model", trainer_state=trainer_state, state=state)
