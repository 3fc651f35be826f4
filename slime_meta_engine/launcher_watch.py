"""A worker started with --weight-buffer-prefix outlives no launcher, and leaves no buffer of it.

The launcher (slime_meta/backends/local/workers/launcher.py) removes its /dev/shm weight buffers
when it stops. Killed with SIGKILL it cannot, so its workers do it for it:
- on the way out: the parent-death signal (PR_SET_PDEATHSIG, set by the launcher) stops the
  worker, and once the server is down it removes the buffers if the launcher is gone
  (`launcher_died`);
- from a watch thread: the signal is tied to the thread that forked the worker and is sent once,
  and a shutdown can stall behind a request that never ends. The thread checks the launcher every
  second; once it has gone, it removes the buffers at once (each can be gigabytes of shared
  memory) and stops the worker with SIGTERM, as the parent-death signal would.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Callable

from slime_meta_engine.weights import remove_buffers

logger = logging.getLogger("slime_meta.worker")

WATCH_INTERVAL_S = 1.0


def launcher_died(parent_pid: int) -> bool:
    """The process that started this worker is gone or going (not merely one of its threads).

    The parent-death signal comes when the *thread* that started this worker exits; under SIGKILL
    that can be the main thread while the others still run, so the parent id has not changed yet:
    a main thread that has exited shows as a zombie.
    """
    if os.getppid() != parent_pid:
        return True
    try:
        with open(f"/proc/{parent_pid}/stat") as stat:
            state = stat.read().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:  # no such process, where /proc lists processes (macOS has no /proc)
        return os.path.isdir("/proc/self")
    except (OSError, IndexError):
        return False  # unreadable: the parent id, checked above, is what counts
    return state in ("Z", "X")


def stop_this_worker() -> None:
    os.kill(os.getpid(), signal.SIGTERM)


def watch_launcher(
    parent_pid: int,
    buffer_prefix: str,
    on_gone: Callable[[], None] = stop_this_worker,
    interval_s: float = WATCH_INTERVAL_S,
) -> threading.Thread:
    """Start the daemon thread that removes the buffers and calls `on_gone` once the launcher has gone."""

    def watch() -> None:
        while not launcher_died(parent_pid):
            time.sleep(interval_s)
        removed = remove_buffers(buffer_prefix)
        logger.warning(
            "the process that started this worker (pid %d) is gone: removed %d weight buffer(s), stopping",
            parent_pid,
            len(removed),
        )
        on_gone()

    thread = threading.Thread(target=watch, name="launcher-watch", daemon=True)
    thread.start()
    return thread
