"""What a process allocates below Python and keeps: memray's record of native allocations in a window.

tracemalloc (memory_snapshots.py) sees Python's allocator only; a process whose glibc heap grows while
its traced heap does not keeps memory that C/C++ code took with malloc (torch, the CUDA libraries and
driver, tokenizers). With `SLIME_META_MEMRAY=1` beside `SLIME_META_TRACEMALLOC`, memory_snapshots.py
also records every allocation with its native stack (memray, `pip install memray`; not a dependency
of the project) from the first heap snapshot to the second, into DIR/<name>-<pid>.memray. What the
window allocated and had not freed when it closed is what the process kept over it (plus what was in
flight at that moment); `live_sites` groups it by the frames that allocated it and the Python line
that led there.

The file is written in memray's aggregated form (a few MB, whatever the window's length), which keeps
what was live at the end and drops the allocations that were freed.
"""

from __future__ import annotations

from pathlib import Path

ENV_NATIVE = "SLIME_META_MEMRAY"
SUFFIX = ".memray"
# Frames of the allocator itself, not of who asked for the memory.
_ALLOCATOR_FRAMES = ("malloc", "calloc", "realloc", "memalign", "operator new", "memray", "PyMem_", "_PyObject_")

_tracker = None  # the one memray tracker a process may have running


def enabled(environ) -> bool:
    return environ.get(ENV_NATIVE, "") not in ("", "0")


def start(path: Path) -> None:
    """Record this process's allocations, with native stacks, into `path` until `stop`."""
    global _tracker
    import memray

    if _tracker is not None:
        return
    path.unlink(missing_ok=True)  # memray will not overwrite
    _tracker = memray.Tracker(str(path), native_traces=True, file_format=memray.FileFormat.AGGREGATED_ALLOCATIONS)
    _tracker.__enter__()


def stop() -> None:
    global _tracker
    if _tracker is not None:
        _tracker.__exit__(None, None, None)
        _tracker = None


def _where(record, frames: int) -> tuple[tuple[str, ...], str | None]:
    """The innermost `frames` frames of an allocation past the allocator's own, and the innermost
    Python frame (a .py file) on its stack."""
    try:
        stack = record.hybrid_stack_trace(64)
    except (NotImplementedError, RuntimeError):  # no native stack for this record
        stack = record.stack_trace(64)
    callers = [(name, path, line) for name, path, line in stack if not any(a in name for a in _ALLOCATOR_FRAMES)]
    # C++ and Rust names can run to hundreds of characters of template arguments: their start says enough.
    native = tuple(f"{name[:120]} ({path.rsplit('/', 1)[-1]}:{line})" for name, path, line in callers[:frames])
    python = next((f"{name} ({path}:{line})" for name, path, line in callers if path.endswith(".py")), None)
    return native, python


def live_sites(path: Path, top: int = 10, frames: int = 4) -> dict:
    """What the window recorded in `path` allocated and still held at its end: the total, and the
    `top` sites (innermost frames past the allocator, and the Python line below them) by size."""
    import memray

    sites: dict[tuple, list[int]] = {}
    total = 0
    for record in memray.FileReader(str(path)).get_leaked_allocation_records(merge_threads=True):
        total += record.size
        key = _where(record, frames)
        size_count = sites.setdefault(key, [0, 0])
        size_count[0] += record.size
        size_count[1] += record.n_allocations
    largest = sorted(sites.items(), key=lambda item: item[1][0], reverse=True)[:top]
    return {
        "native_live_kib": round(total / 1024, 1),
        "native_sites": [
            {"size_kib": round(size / 1024, 1), "count": count, "frames": list(native), "python": python}
            for (native, python), (size, count) in largest
        ],
    }
