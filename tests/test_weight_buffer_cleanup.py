"""Weight buffers in /dev/shm never outlive their launcher: the workers' watch thread removes them
when the launcher is gone, and a new launcher removes those of launchers killed with their workers."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

from slime_meta.backends.local.workers.launcher import LocalProcessGroup
from slime_meta.backends.local.workers.processes import (
    WEIGHT_BUFFER_NAME_START,
    remove_orphaned_buffers,
    weight_buffer_prefix,
)
from slime_meta_engine.launcher_watch import launcher_died, watch_launcher
from slime_meta_engine.weights import SHARED_MEMORY_DIR


def dead_pid() -> int:
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    return process.pid


def test_a_new_launcher_removes_the_buffers_of_launchers_no_longer_running(tmp_path):
    ours = weight_buffer_prefix()  # slime-meta-weights-PID-NAMESPACE-TAG
    pid, namespace = ours[len(WEIGHT_BUFFER_NAME_START) :].split("-")[:2]
    dead = dead_pid()
    shm = Path(SHARED_MEMORY_DIR)
    gone = shm / f"{WEIGHT_BUFFER_NAME_START}{dead}-{namespace}-0badc0de-weights"
    running = shm / f"{ours}-weights"
    other_container = shm / f"{WEIGHT_BUFFER_NAME_START}{dead}-ns1-0badc0de-weights"  # its pid means nothing here
    unparsable = shm / f"{WEIGHT_BUFFER_NAME_START}x{dead}-{namespace}-weights"
    kept = (running, other_container, unparsable)
    for path in (gone, *kept):
        path.write_bytes(b"\0" * 64)
    try:
        with LocalProcessGroup(handle_sigterm=False):
            pass
        assert not gone.exists()
        assert all(path.exists() for path in kept), [path.name for path in kept if not path.exists()]
        assert remove_orphaned_buffers() == []
        assert pid == str(os.getpid())
    finally:
        for path in (gone, *kept):
            path.unlink(missing_ok=True)


def test_the_watch_thread_removes_the_buffers_and_stops_the_worker_once_the_launcher_is_gone():
    prefix = weight_buffer_prefix()
    buffer = Path(SHARED_MEMORY_DIR) / f"{prefix}-weights"
    buffer.write_bytes(b"\0" * 64)
    stopped = threading.Event()
    try:
        # Our own parent is alive: nothing happens.
        watch_launcher(os.getppid(), prefix, on_gone=stopped.set, interval_s=0.05)
        time.sleep(0.3)
        assert buffer.exists() and not stopped.is_set()
        # A launcher that has gone (its pid is not our parent's any more): buffers removed, worker stopped.
        thread = watch_launcher(dead_pid(), prefix, on_gone=stopped.set, interval_s=0.05)
        thread.join(timeout=5)
        assert stopped.is_set() and not buffer.exists()
    finally:
        buffer.unlink(missing_ok=True)


def test_launcher_died_reads_a_parent_whose_main_thread_has_exited_as_gone():
    # The parent-death signal comes when the forking thread exits; a main thread that has ended while
    # another thread runs leaves the process alive with its leader a zombie (as SIGKILL can for a moment).
    child_code = (
        "import os, sys, time; sys.path.insert(0, sys.argv[1]); "
        "from slime_meta_engine.launcher_watch import launcher_died; "
        "ppid = os.getppid(); print(launcher_died(ppid), flush=True); time.sleep(1.5); "
        "print(launcher_died(ppid), flush=True)"
    )
    code = (
        "import ctypes, os, subprocess, sys, threading\n"
        f"child = subprocess.Popen([sys.executable, '-c', {child_code!r}, sys.argv[1]],\n"
        "                         stdout=subprocess.PIPE, text=True)\n"
        "print(child.stdout.readline().strip(), flush=True)\n"
        "threading.Thread(target=lambda: (print(child.stdout.read().strip(), flush=True), os._exit(0))).start()\n"
        "ctypes.CDLL(None).pthread_exit(None)\n"  # the main OS thread ends, the process lives on
    )
    root = str(Path(__file__).resolve().parents[1])
    result = subprocess.run([sys.executable, "-c", code, root], capture_output=True, text=True, timeout=60)
    assert result.stdout.split() == ["False", "True"], result.stdout + result.stderr


def test_without_proc_only_the_parent_id_counts(monkeypatch):
    # macOS has no /proc: a running launcher must not read as gone there (its workers would stop).
    gone, real_isdir = dead_pid(), os.path.isdir
    monkeypatch.setattr(os.path, "isdir", lambda path: False if path == "/proc/self" else real_isdir(path))
    monkeypatch.setattr("builtins.open", lambda *args, **kwargs: (_ for _ in ()).throw(FileNotFoundError(args[0])))
    assert launcher_died(os.getppid()) is False
    assert launcher_died(gone) is True  # not our parent's id
