"""benchmarks/soak.py's Python heap snapshots (--tracemalloc): when the run's processes are signalled,
the signal, the wait for the last snapshots, and their comparison (slime_meta_engine/memory_snapshots.py
does the tracing inside each process)."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from slime_meta_engine import memory_snapshots, native_allocations  # noqa: E402

if TYPE_CHECKING:
    from soak import SoakRun


def traced(processes: dict[int, str]) -> dict[int, str]:
    """The processes that trace their heaps (memory_snapshots.install): the trainer and the workers."""
    return {pid: name for pid, name in processes.items() if name == "trainer" or name.startswith("worker:")}


def wait_for_snapshots(directory: Path, processes: dict[int, str], count: int, timeout_s: float = 120.0) -> None:
    """Until each traced process (trainer, workers) has written `count` snapshots to `directory`, or
    `timeout_s` passes (a process answers SIGUSR2 when its main thread is next in Python)."""
    # A worker named worker:PORT here installs itself as worker_PORT (slime_meta_engine/server.py).
    stems = [f"{name.replace(':', '_')}-{pid}" for pid, name in traced(processes).items()]
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        written = memory_snapshots.snapshots_by_process(directory)
        if all(len(written.get(stem, [])) >= count for stem in stems):
            return
        time.sleep(0.5)


def heap_snapshot_due(run: SoakRun, step: int, warmup: int, steps: int) -> bool:
    """Whether the processes get SIGUSR2 after `step`: the first step past warm-up and past the first
    plot (tracing starts), two steps later and two steps before the end (the snapshots)."""
    if not run.snapshot_steps:
        return step >= warmup and bool(run.plot_steps) and step > run.plot_steps[0]
    return step in (run.snapshot_steps[0] + 2, steps - 2) and step not in run.snapshot_steps


def ask_for_snapshots(processes: dict[int, str]) -> None:
    """SIGUSR2 to the trainer and each worker: the first starts tracing, each later one writes a heap
    snapshot (memory_snapshots.install)."""
    for pid in traced(processes):
        try:
            os.kill(pid, memory_snapshots.SNAPSHOT_SIGNAL)
        except ProcessLookupError:
            pass


def compare_snapshots(directory: Path) -> dict[str, dict]:
    """Per process that wrote two snapshots or more: the first against the last (memory_snapshots.compare),
    and with --memray what it allocated natively between them and still held (native_allocations)."""
    out = {}
    for stem, paths in memory_snapshots.snapshots_by_process(directory).items():
        if len(paths) < 2:
            continue
        out[stem] = memory_snapshots.compare(paths[0], paths[-1])
        native = Path(directory) / f"{stem}{native_allocations.SUFFIX}"
        if native.is_file():
            out[stem].update(native_allocations.live_sites(native))
    return out


def print_heap_growth(heaps: dict) -> None:
    if len(heaps["after_steps"]) < 2:
        print(f"tracemalloc: snapshots after steps {heaps['after_steps']}, two are needed: give more --steps")
        return
    first, last = heaps["after_steps"][0], heaps["after_steps"][-1]
    for stem, heap in heaps["processes"].items():
        print(
            f"{stem}: traced Python heap {heap['traced_mib_before']} -> {heap['traced_mib_after']} MiB from step "
            f"{first} to {last} ({heap['traced_growth_kib']:+.1f} KiB); grew most:"
        )
        for site in heap["sites"][:5]:
            where = " < ".join(site["traceback"][::-1])  # innermost frame first
            print(f"  {site['size_diff_kib']:+9.1f} KiB {site['count_diff']:+7d} blocks  {where}")
        for part in ("resident", "malloc"):  # below Python: the process's pages, and glibc's heap
            if part in heap:
                moved = ", ".join(f"{key} {a:,} -> {b:,}" for key, (a, b) in heap[part].items())
                print(f"  {part} (KiB): {moved}")
        if "native_sites" in heap:
            print(
                f"  native allocations kept from step {first} to {last}: {heap['native_live_kib']:,.1f} KiB; largest:"
            )
            for site in heap["native_sites"][:5]:
                print(f"    {site['size_kib']:+9.1f} KiB {site['count']:7d} blocks  {' < '.join(site['frames'])}")
                print(f"      from {site['python']}")
        if "objects_grown" in heap:
            grown = ", ".join(f"{kind} {count:+d}" for kind, count in list(heap["objects_grown"].items())[:5])
            print(f"  objects: {heap['objects_before']:,} -> {heap['objects_after']:,}; grew most: {grown}")
