"""The dead-worker supervisor of a `LocalProcessGroup` and its router (de)registration.

`_Supervision` is a mixin of `LocalProcessGroup`: a daemon thread that polls the workers, restarts
dead ones on the same port, gives them the pool's current weights and registers them with the
router again. See `slime_meta.backends.local.workers.launcher` for the whole procedure.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
import urllib.error

from slime_meta.backends.local.workers.local_http import http_json
from slime_meta.backends.local.workers.processes import (
    LaunchError,
    _Child,
    _describe_exit,
    _Pool,
    _Stopping,
)

# The launcher's logger: records keep the name they had before this module was split out of it.
logger = logging.getLogger("slime_meta.backends.local.workers.launcher")

_POLITE_SIGNALS = {signal.SIGINT, signal.SIGTERM, signal.SIGHUP}
_POLITE_DEATH_GRACE_S = 2.0
_ROUTER_SYNC_TIMEOUT_S = 15.0


def _stopped_by_polite_signal(returncode: int | None) -> bool:
    """Killed by SIGINT/SIGTERM/SIGHUP (-N), or exited 128+N after handling one."""
    return returncode is not None and (-returncode in _POLITE_SIGNALS or returncode - 128 in _POLITE_SIGNALS)


class _Supervision:
    """Restarts dead workers and keeps the routers' worker lists in step.

    A mixin of `LocalProcessGroup`; uses its `_pools`, `_lock`, `_stopping`, `_supervisor`,
    `_supervise`, `_supervise_interval_s`, `_max_restarts`, `_restart_window_s` and the
    `_ChildProcesses` methods `_spawn`, `_wait_until_ready`, `_terminate`.
    """

    def _start_supervisor(self) -> None:
        if not self._supervise or (self._supervisor is not None and self._supervisor.is_alive()):
            return
        self._supervisor = threading.Thread(target=self._supervise_loop, name="worker-supervisor", daemon=True)
        self._supervisor.start()

    def _supervise_loop(self) -> None:
        while not self._stopping.wait(self._supervise_interval_s):
            try:
                self._check_pools()
            except _Stopping:
                return
            except Exception:  # the supervisor must outlive any one failure: its children die with it
                logger.exception("worker supervisor: unexpected error (continuing)")

    def _check_pools(self) -> None:
        with self._lock:
            pools = list(self._pools.values())
        for pool in pools:
            if self._stopping.is_set():
                raise _Stopping
            if pool.router.process is not None and pool.router.process.poll() is not None:
                if not pool.router_dead_logged:
                    pool.router_dead_logged = True
                    logger.error(
                        "%s %s; its workers are not restarted (log %s)",
                        pool.router.role,
                        _describe_exit(pool.router.process.returncode),
                        pool.router.log_path,
                    )
                continue
            dead = [worker for worker in pool.workers if self._needs_restart(worker)]
            if dead:
                self._restart_dead_workers(pool, dead)

    def _needs_restart(self, worker: _Child) -> bool:
        process = worker.process
        if worker.restarting or worker.given_up or process is None or process.poll() is None:
            worker.seen_dead_at = None
            return False
        now = time.monotonic()
        if worker.seen_dead_at is None:
            worker.seen_dead_at = now
        if _stopped_by_polite_signal(process.returncode):
            # Most likely the whole process group got it (Ctrl-C, a scheduler) and this process
            # is stopping too: its handler sets _stopping within the grace, and nothing restarts.
            return now - worker.seen_dead_at >= _POLITE_DEATH_GRACE_S
        return True

    def _restart_dead_workers(self, pool: _Pool, dead: list[_Child]) -> None:
        """Restart the dead workers of one pool together (a lost node takes several at once)."""
        now = time.monotonic()
        chosen = []
        for worker in dead:
            worker.restart_times = [t for t in worker.restart_times if now - t < self._restart_window_s]
            exit_text = _describe_exit(worker.process.returncode)
            if len(worker.restart_times) >= self._max_restarts:
                worker.given_up = True
                logger.error(
                    "%s %s; it died %d times within %.0fs, so it is left down (log %s)",
                    worker.role,
                    exit_text,
                    len(worker.restart_times) + 1,
                    self._restart_window_s,
                    worker.log_path,
                )
                self._deregister(pool, worker)
                continue
            worker.restart_times.append(now)
            logger.warning("%s %s; restarting it on %s (log %s)", worker.role, exit_text, worker.url, worker.log_path)
            chosen.append(worker)
        if not chosen:
            return
        for worker in chosen:
            worker.restarting = True
            self._deregister(pool, worker)
        with self._lock:
            if self._stopping.is_set():
                raise _Stopping
            for worker in chosen:
                self._spawn(worker)
        try:
            pending = list(chosen)
            while pending:
                worker = pending.pop(0)
                try:
                    self._wait_until_ready([worker], abort=self._stopping)
                    self._finish_restart(pool, worker)
                except LaunchError as error:  # it failed to come back: a later poll tries again
                    logger.error("restart of %s failed: %s", worker.role, error)
                    with self._lock:
                        self._terminate([worker])
                finally:
                    worker.restarting = False
                    worker.seen_dead_at = None
        finally:
            for worker in chosen:
                worker.restarting = False

    def _finish_restart(self, pool: _Pool, worker: _Child) -> None:
        """A restarted worker is up: current weights in, back into its router, counted."""
        served, loaded = pool.served, None
        while True:
            with self._lock:  # the same lock as a weight push: never a buffer being rewritten
                if self._stopping.is_set():
                    raise _Stopping
                if served.current is not None and served.current != loaded:
                    try:
                        served.load_current(worker)
                    except (urllib.error.URLError, OSError, RuntimeError) as error:
                        raise LaunchError(
                            f"{worker.role} came back but did not take weights {served.current[0]}: {error}"
                        )
                    loaded = served.current
            self._register(pool, worker)  # router calls: outside the lock
            with self._lock:
                if served.current is None or served.current == loaded:
                    worker.restarting = False  # from here on, a weight push reaches it directly
                    pool.restarts += 1
                    break
            # a push moved on while the worker was registered: load the newer weights too
        logger.warning(
            "%s is back on %s (restart %d of pool %s)", worker.role, worker.url, pool.restarts, pool.endpoints.name
        )

    # Router registration. sglang-router 0.3.x manages workers through `/workers` (list, POST to
    # add, DELETE /workers/{id} to remove; both are queued, so each call waits until the listing
    # shows the change). A router without that API (404) still takes a restarted worker back
    # through its health checks, once the circuit breaker of the dead worker closes again.

    def _router_worker_ids(self, pool: _Pool, url: str) -> list[str] | None:
        status, reply = http_json("GET", pool.router.url + "/workers")
        if status != 200 or not isinstance(reply, dict):
            return None
        return [str(w.get("id")) for w in reply.get("workers", []) if w.get("url") == url]

    def _deregister(self, pool: _Pool, worker: _Child) -> None:
        try:
            ids = self._router_worker_ids(pool, worker.url)
            if not ids:
                return
            for worker_id in ids:
                http_json("DELETE", f"{pool.router.url}/workers/{worker_id}")
            self._wait_for_router(pool, worker.url, present=False)
        except (urllib.error.URLError, OSError) as error:
            logger.warning("could not take %s out of its router: %s", worker.role, error)

    def _register(self, pool: _Pool, worker: _Child) -> None:
        try:
            if self._router_worker_ids(pool, worker.url) is None:
                logger.info(
                    "router of pool %s has no /workers API: its health checks take %s back",
                    pool.endpoints.name,
                    worker.url,
                )
                return
            status, reply = http_json("POST", pool.router.url + "/workers", {"url": worker.url})
            if status not in (200, 201, 202):
                raise LaunchError(f"router {pool.router.url} refused to add {worker.url}: HTTP {status} {reply}")
            self._wait_for_router(pool, worker.url, present=True)
        except (urllib.error.URLError, OSError) as error:
            raise LaunchError(f"could not register {worker.role} with router {pool.router.url}: {error}") from None

    def _wait_for_router(self, pool: _Pool, url: str, *, present: bool) -> None:
        deadline = time.monotonic() + _ROUTER_SYNC_TIMEOUT_S
        while time.monotonic() < deadline:
            status, reply = http_json("GET", pool.router.url + "/workers")
            entries = [w for w in (reply or {}).get("workers", []) if w.get("url") == url] if status == 200 else []
            if (present and entries and all(w.get("is_healthy", True) for w in entries)) or (
                not present and not entries
            ):
                return
            if self._stopping.is_set():
                raise _Stopping
            time.sleep(0.1)
        action = "add" if present else "remove"
        raise LaunchError(f"router {pool.router.url} did not {action} {url} within {_ROUTER_SYNC_TIMEOUT_S:.0f}s")
