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
process whose RSS grows while its traced heap does not keeps it outside Python. For that, each
snapshot has a sidecar, <name>-<pid>-<k>.process.json: the process's resident memory by kind
(/proc/self/status: anonymous, file-backed, shared), glibc's malloc figures (mallinfo2, all arenas:
bytes in use, free but held, in mmapped blocks) and the live objects that the garbage collector
tracks, counted by type. `compare` reports how each moved. With `SLIME_META_MEMRAY=1` as well, the
process also records its native allocations from the first snapshot to the second
(native_allocations.py).
"""

from __future__ import annotations

import collections
import ctypes
import gc
import itertools
import json
import os
import signal
import tracemalloc
from pathlib import Path

from slime_meta_engine import native_allocations

ENV_DIR = "SLIME_META_TRACEMALLOC"
ENV_FRAMES = "SLIME_META_TRACEMALLOC_FRAMES"
SNAPSHOT_SIGNAL = signal.SIGUSR2
SUFFIX = ".tracemalloc"
PROCESS_SUFFIX = ".process.json"
STATUS_FIELDS = {"VmRSS": "rss_kib", "RssAnon": "anon_kib", "RssFile": "file_kib", "RssShmem": "shmem_kib"}


class _MallInfo2(ctypes.Structure):
    """glibc's `struct mallinfo2` (2.33 and later): size_t fields, summed over all arenas."""

    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena",  # bytes taken from the system with brk/sbrk, all arenas
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",  # bytes in blocks mmapped on their own (large allocations)
            "usmblks",
            "fsmblks",
            "uordblks",  # bytes in use
            "fordblks",  # bytes free but held
            "keepcost",
        )
    ]


def malloc_figures() -> dict[str, int] | None:
    """glibc's malloc totals in KiB (in use, free but held, mmapped blocks), or None where the C
    library has no mallinfo2 (musl, macOS, glibc before 2.33)."""
    try:
        mallinfo2 = ctypes.CDLL(None).mallinfo2
    except (AttributeError, OSError):
        return None
    mallinfo2.restype = _MallInfo2
    info = mallinfo2()
    return {
        "in_use_kib": (info.uordblks + info.hblkhd) // 1024,
        "free_held_kib": info.fordblks // 1024,
        "mmapped_kib": info.hblkhd // 1024,
        "arena_kib": info.arena // 1024,
    }


def resident_kib(pid: int | str = "self") -> dict[str, int]:
    """A process's resident memory by kind (STATUS_FIELDS), KiB, this one's by default; empty where
    /proc is missing or the process is gone."""
    try:
        lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    except OSError:
        return {}
    out = {}
    for line in lines:
        key, _, value = line.partition(":")
        if key in STATUS_FIELDS:
            out[STATUS_FIELDS[key]] = int(value.split()[0])
    return out


def process_figures() -> dict:
    """What the sidecar of a snapshot holds: resident memory by kind, malloc's totals, and the live
    objects the garbage collector tracks by type name."""
    objects = collections.Counter(type(obj).__name__ for obj in gc.get_objects())
    return {"resident": resident_kib(), "malloc": malloc_figures(), "objects": dict(objects)}


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
    native = native_allocations.enabled(os.environ)
    if native:
        try:
            import memray  # noqa: F401
        except ImportError:
            raise SystemExit(f"{native_allocations.ENV_NATIVE}=1 needs memray here: pip install memray") from None

    def write_snapshot(signal_number, frame) -> None:
        if not tracemalloc.is_tracing():
            tracemalloc.start(frames)
            return
        number = next(numbers)
        if native and number == 1:
            native_allocations.stop()  # the window closes before the second snapshot's own allocations
        path = out / f"{name}-{os.getpid()}-{number}{SUFFIX}"
        figures = process_figures()  # before the snapshot, whose own memory is not the program's
        sidecar = path.with_name(path.name[: -len(SUFFIX)] + PROCESS_SUFFIX)
        sidecar.write_text(json.dumps(figures))
        partial = path.with_name(path.name + ".partial")
        tracemalloc.take_snapshot().dump(str(partial))
        os.replace(partial, path)  # a reader never sees half a snapshot under the final name; last, so
        # that the sidecar is there once it is
        if native and number == 0:
            native_allocations.start(out / f"{name}-{os.getpid()}{native_allocations.SUFFIX}")

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
    report = {
        "traced_mib_before": round(total_before / 2**20, 2),
        "traced_mib_after": round(total_after / 2**20, 2),
        "traced_growth_kib": round((total_after - total_before) / 1024, 1),
        "sites": sites,
    }
    report.update(compare_process_figures(before, after, top))
    return report


def compare_process_figures(before: Path, after: Path, top: int = 10) -> dict:
    """From the two snapshots' sidecars, where both exist: resident memory by kind and malloc's
    totals before -> after (KiB), and the `top` object types whose count grew most."""
    sidecars = [path.with_name(path.name[: -len(SUFFIX)] + PROCESS_SUFFIX) for path in (before, after)]
    if not all(path.is_file() for path in sidecars):
        return {}
    old, new = (json.loads(path.read_text()) for path in sidecars)
    out = {}
    for part in ("resident", "malloc"):
        if old.get(part) and new.get(part):
            out[part] = {key: [old[part][key], new[part][key]] for key in new[part] if key in old[part]}
    counts_before, counts_after = old["objects"], new["objects"]
    grown = {kind: count - counts_before.get(kind, 0) for kind, count in counts_after.items()}
    out["objects_grown"] = dict(sorted(grown.items(), key=lambda item: item[1], reverse=True)[:top])
    out["objects_before"], out["objects_after"] = sum(counts_before.values()), sum(counts_after.values())
    return out
