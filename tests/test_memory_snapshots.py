"""Heap snapshots on demand (slime_meta_engine/memory_snapshots.py): a process started with
SLIME_META_TRACEMALLOC answers SIGUSR2 with a snapshot, and two snapshots name the line that kept memory.
Real processes throughout: a probe script, and a worker behind the real router."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers_tiny import make_random_tiny_checkpoint

from benchmarks.soak import ask_for_snapshots, compare_snapshots, descendants
from slime_meta.backends.local.workers.launcher import LocalProcessGroup
from slime_meta_engine import memory_snapshots, native_allocations

ROOT = Path(__file__).resolve().parents[1]

PROBE = """\
import os, signal
from slime_meta_engine import memory_snapshots, native_allocations
memory_snapshots.install("probe")
os.kill(os.getpid(), signal.SIGUSR2)  # starts tracing
before = [bytearray(1000) for _ in range(500)]  # traced, alive at both snapshots: no growth
os.kill(os.getpid(), signal.SIGUSR2)
kept = [[bytearray(1000)] for _ in range(3000)]  # about 3 MB kept between the two snapshots, in lists that gc sees
os.kill(os.getpid(), signal.SIGUSR2)
"""


NATIVE_PROBE = """\
import os, signal, sqlite3
from slime_meta_engine import memory_snapshots, native_allocations
memory_snapshots.install("probe")
os.kill(os.getpid(), signal.SIGUSR2)  # starts tracing
os.kill(os.getpid(), signal.SIGUSR2)  # the first snapshot; native recording starts
kept = []
for _ in range(40):  # SQLite allocates with malloc, where tracemalloc does not see it
    connection = sqlite3.connect(":memory:")
    connection.execute("create table t (x blob)")
    connection.executemany("insert into t values (?)", [(b"x" * 1000,)] * 200)
    kept.append(connection)
for _ in range(40):  # allocated and freed inside the window: not kept
    sqlite3.connect(":memory:").close()
os.kill(os.getpid(), signal.SIGUSR2)  # recording stops, the second snapshot
"""


def run_probe(
    tmp_path: Path, env_dir: Path | None, source: str = PROBE, **extra_env: str
) -> subprocess.CompletedProcess:
    script = tmp_path / "probe.py"
    script.write_text(source)
    env = {key: value for key, value in os.environ.items() if key != memory_snapshots.ENV_DIR}
    env.update(extra_env)
    if env_dir is not None:
        env[memory_snapshots.ENV_DIR] = str(env_dir)
    env["PYTHONPATH"] = str(ROOT)
    return subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=60)


def test_two_snapshots_name_the_line_that_kept_memory(tmp_path):
    out = tmp_path / "heap"
    result = run_probe(tmp_path, out)
    assert result.returncode == 0, result.stderr
    ((stem, paths),) = memory_snapshots.snapshots_by_process(out).items()
    assert stem.startswith("probe-") and [p.name.rsplit("-", 1)[1] for p in paths] == ["0.tracemalloc", "1.tracemalloc"]
    (heap,) = compare_snapshots(out).values()
    assert 2900 < heap["traced_growth_kib"] < 4000, heap
    top = heap["sites"][0]
    assert top["traceback"][-1].endswith("probe.py:7") and top["count_diff"] >= 3000, top
    assert not list(out.glob("*.partial"))
    # below Python, from the snapshots' sidecars: the objects by type, the process's pages, malloc's totals
    assert 3000 <= heap["objects_grown"]["list"] < 3100, heap["objects_grown"]  # gc sees containers, not bytearrays
    rss_before, rss_after = heap["resident"]["rss_kib"]
    assert rss_after - rss_before > 2000, heap["resident"]
    if heap.get("malloc"):  # glibc 2.33 or later: blocks of 1000 bytes come from malloc, not pymalloc
        in_use_before, in_use_after = heap["malloc"]["in_use_kib"]
        # the 3,000 blocks, and tracemalloc's own records of them (it keeps those with malloc too)
        assert 2900 < in_use_after - in_use_before < 6000, heap["malloc"]


def test_native_allocations_kept_between_the_snapshots_are_found_by_their_stack(tmp_path):
    pytest.importorskip("memray")  # optional: pip install memray
    out = tmp_path / "heap"
    result = run_probe(tmp_path, out, NATIVE_PROBE, **{native_allocations.ENV_NATIVE: "1"})
    assert result.returncode == 0, result.stderr
    (heap,) = compare_snapshots(out).values()
    # 40 databases of 200 rows of 1,000 bytes: about 8 MB that tracemalloc does not see
    assert heap["traced_growth_kib"] < 1000, heap["traced_growth_kib"]
    assert heap["native_live_kib"] > 7000, heap["native_live_kib"]
    sqlite_kib = sum(s["size_kib"] for s in heap["native_sites"] if "probe.py" in (s["python"] or ""))
    assert sqlite_kib > 7000, heap["native_sites"][:3]
    assert any("sqlite" in frame for s in heap["native_sites"][:3] for frame in s["frames"]), heap["native_sites"][:3]


def test_without_the_variable_nothing_is_traced_and_sigusr2_keeps_its_default(tmp_path):
    # SIGUSR2's default ends the process: the probe dies by it, so nothing was installed
    result = run_probe(tmp_path, None)
    assert result.returncode == -signal.SIGUSR2
    assert not list(tmp_path.glob("**/*.tracemalloc"))


def test_a_worker_behind_the_router_answers_sigusr2_with_a_snapshot(tmp_path, monkeypatch):
    out = tmp_path / "heap"
    monkeypatch.setenv(memory_snapshots.ENV_DIR, str(out))
    model = make_random_tiny_checkpoint(tmp_path / "tiny")
    with LocalProcessGroup() as group:
        pool = group.start_pool("teacher", str(model), 1, device="cpu", weights_root=None, log_dir=str(tmp_path))
        workers = {pid: name for pid, name in descendants(os.getpid()).items() if name.startswith("worker:")}
        assert len(workers) == 1, workers
        ask_for_snapshots(workers)  # starts tracing
        time.sleep(1.0)  # two signals close together may arrive as one
        for count in (1, 2):  # the handler stays installed after the first snapshot
            ask_for_snapshots(workers)
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline and len(list(out.glob(f"*{memory_snapshots.SUFFIX}"))) < count:
                time.sleep(0.2)
        assert pool.worker_urls
    ((stem, paths),) = memory_snapshots.snapshots_by_process(out).items()
    assert stem.startswith("worker_") and len(paths) == 2
    # tracing ran in the worker from the first signal: its later allocations are in both snapshots
    heap = compare_snapshots(out)[stem]
    assert heap["traced_mib_before"] > 0 and heap["traced_mib_after"] > 0, heap
