"""Python heap snapshots on demand: what a long-running process keeps, by the line that allocated it.

Off unless `SLIME_META_TRACEMALLOC` names a directory. Then a process that calls `install(name)` (the
trainer, train.py; each worker, slime_meta_engine.server) answers SIGUSR2: the first starts `tracemalloc`
(`SLIME_META_TRACEMALLOC_FRAMES` frames per allocation, default 12), each later one writes a snapshot
of its Python heap to DIR/<name>-<pid>-<k>.tracemalloc (k = 0, 1, ...). Tracing starts late on purpose:
a process traced from its start pays for every import (torch's take minutes), and what matters is
what it keeps from one snapshot to the next. `compare` reads two snapshots of one process and gives the
allocation sites that grew most between them. `python benchmarks/soak.py --tracemalloc DIR` does all
of it for a run: it sets the variable, signals the trainer and the workers after warm-up (start), two
steps later (first snapshot) and two steps before the end (last), and reports the sites.

tracemalloc sees what Python's allocator hands out (objects, and buffers that numpy, torch's CPU
tensors and others take through it); memory that C/C++ code takes with malloc is not traced, so a
process whose RSS grows while its traced heap does not keeps it outside Python.
"""

from __future__ import annotations

import itertools
import os
import signal
import tracemalloc
from pathlib import Path

ENV_DIR = "SLIME_META_TRACEMALLOC"
ENV_FRAMES = "SLIME_META_TRACEMALLOC_FRAMES"
SNAPSHOT_SIGNAL = signal.SIGUSR2
SUFFIX = ".tracemalloc"


def install(name: str) -> Path | None:
    """Answer SIGUSR2 (the first starts tracing, each later one writes a snapshot), if
    SLIME_META_TRACEMALLOC is set; else nothing. Call it from the main thread (Python runs signal
    handlers there)."""
    directory = os.environ.get(ENV_DIR)
    if not directory:
        return None
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    frames = int(os.environ.get(ENV_FRAMES) or 12)
    numbers = itertools.count()

    def write_snapshot(signal_number, frame) -> None:
        if not tracemalloc.is_tracing():
            tracemalloc.start(frames)
            return
        path = out / f"{name}-{os.getpid()}-{next(numbers)}{SUFFIX}"
        partial = path.with_name(path.name + ".partial")
        tracemalloc.take_snapshot().dump(str(partial))
        os.replace(partial, path)  # a reader never sees half a snapshot under the final name

    signal.signal(SNAPSHOT_SIGNAL, write_snapshot)
    return out


def snapshots_by_process(directory: Path) -> dict[str, list[Path]]:
    """The snapshots in `directory` per '<name>-<pid>', in the order they were taken."""
    found: dict[str, list[tuple[int, Path]]] = {}
    for path in Path(directory).glob(f"*{SUFFIX}"):
        stem, _, number = path.name[: -len(SUFFIX)].rpartition("-")
        if number.isdigit():
            found.setdefault(stem, []).append((int(number), path))
    return {stem: [path for _, path in sorted(paths)] for stem, paths in sorted(found.items())}


def compare(before: Path, after: Path, top: int = 10, frames: int = 4) -> dict:
    """The traced heap's growth from `before` to `after` (snapshots of one process): its total, and the
    `top` allocation sites (whole tracebacks) that grew most, each with its innermost `frames` frames."""
    old, new = tracemalloc.Snapshot.load(str(before)), tracemalloc.Snapshot.load(str(after))
    # Allocations made by tracemalloc's own bookkeeping and the import machinery are not the program's.
    noise = (
        tracemalloc.Filter(False, tracemalloc.__file__),
        tracemalloc.Filter(False, "<frozen importlib._bootstrap>"),
    )
    old, new = old.filter_traces(noise), new.filter_traces(noise)
    differences = new.compare_to(old, "traceback")
    total_before = sum(stat.size for stat in old.statistics("filename"))
    total_after = sum(stat.size for stat in new.statistics("filename"))
    sites = [
        {
            "size_diff_kib": round(stat.size_diff / 1024, 1),
            "count_diff": stat.count_diff,
            "size_kib": round(stat.size / 1024, 1),
            "traceback": [f"{frame.filename}:{frame.lineno}" for frame in list(stat.traceback)[-frames:]],
        }
        for stat in sorted(differences, key=lambda stat: stat.size_diff, reverse=True)[:top]
    ]
    return {
        "traced_mib_before": round(total_before / 2**20, 2),
        "traced_mib_after": round(total_after / 2**20, 2),
        "traced_growth_kib": round((total_after - total_before) / 1024, 1),
        "sites": sites,
    }
