"""Files a stop can interrupt are either whole or their previous whole version.

A run's plot and config are rewritten in place (`replace_atomically`: a temporary sibling, then a
rename, which POSIX makes atomic); its metrics and traces grow by whole lines, and a line cut by a
kill (SIGKILL, a power cut: nothing in the process runs) is dropped when the run dir is next
opened for appending (`drop_torn_tail`). Checkpoints have their own protocol (train_state.py).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable


def replace_atomically(path: Path, write: Callable[[Path], object]) -> Path:
    """`write(tmp)` writes the new content to a temporary sibling of `path`, which then replaces it."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.partial")
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)  # a write that failed or was interrupted leaves nothing behind
    return path


def drop_torn_tail(path: Path) -> bool:
    """Cut a JSON-lines file back to its last complete line; True if a torn last line was dropped."""
    path = Path(path)
    if not path.is_file():
        return False
    with path.open("rb+") as f:
        size = f.seek(0, os.SEEK_END)
        if size == 0:
            return False
        f.seek(size - 1)
        if f.read(1) == b"\n":
            return False
        # Walk back to the last newline (records are small: a few KB, traces a few tens).
        position, chunk = size, 1 << 16
        while position > 0:
            start = max(0, position - chunk)
            f.seek(start)
            block = f.read(position - start)
            newline = block.rfind(b"\n")
            if newline >= 0:
                f.truncate(start + newline + 1)
                return True
            position = start
        f.truncate(0)
        return True
