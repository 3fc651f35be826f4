"""Start and stop pools of embedded workers behind the real sglang-router, as child processes.

A pool is N `slime_meta.backends.local.worker` processes on free loopback ports plus one
`sglang_router.launch_router` in front of them; callers talk to the router URL exactly as they
would to an SGLang deployment.

Not leaving processes behind is the main job here:
- `stop()` (also `__exit__` and an atexit hook) sends SIGTERM to routers and workers, waits up to
  `stop_timeout_s`, SIGKILLs what is left and reaps everything.
- SIGTERM to the parent: Python's default action kills it without running atexit hooks, so while
  a group is running (and only when the program had no SIGTERM handler of its own, and only from
  the main thread) SIGTERM is turned into `SystemExit(143)`, which unwinds through `__exit__`.
  The previous handler is restored by `stop()`.
- SIGKILL of the parent cannot be caught: on Linux each child asks the kernel for SIGTERM when
  its parent dies (PR_SET_PDEATHSIG, set in `preexec_fn`). The kernel ties this to the *thread*
  that forked the child, so call `start_pool`/`restart_worker` from the main thread or a thread
  that lives as long as the pool (a warning is logged otherwise). The supervisor thread (below)
  lives until `stop()`, so the workers it restarts are covered too.
- Children stay in the parent's process group and session (no `start_new_session`): Ctrl-C in a
  terminal, a hangup, or a job controller signalling the group (`timeout`, CI, schedulers) then
  reaches the whole tree at once, so nothing outlives the terminal or the job. The price is that
  on Ctrl-C the workers shut down in parallel with the parent's own cleanup; that is what Ctrl-C
  means here. `stop()` tolerates children that are already gone.

Keeping a pool whole while it runs (`supervise=True`, the default): a daemon thread polls the
workers every `supervise_interval_s` (0.5 s). A worker whose process has exited (SIGKILL by the
OOM killer, a crash, a GPU fault; several of a pool at once are restarted together) is
  1. removed from its router at once (`DELETE /workers/{id}`), so nothing is routed to it (the
     router's own retries already moved the requests that were in flight to another worker);
  2. started again with the same command on the same port, and waited for until `/health` is 200;
  3. given the pool's current weights (the last `update_weights` call), so it never serves the
     starting checkpoint next to trained workers;
  4. registered with the router again (`POST /workers`): a fresh entry, so the circuit breaker the
     dead worker opened (60 s by default) does not keep the healthy new process idle;
  5. counted: `restarts(pool_name)`.
A worker that died by SIGINT/SIGTERM/SIGHUP is restarted only after a 2 s grace period: those
signals usually reach the whole process group (Ctrl-C, a job scheduler), and this process then
stops the group itself. A worker that dies more than `max_restarts` times within
`restart_window_s` is left down (an error is logged; the router keeps using the others). Routers
are not restarted. `stop()` first tells the supervisor to stop, waits for it (a restart in
progress is abandoned, its process terminated with the rest), so nothing is restarted during or
after `stop()`.

Thread safety: `start_pool`, `restart_worker`, `stop` belong to one thread (normally the main
one); `update_weights`, `restarts`, `router_retries`, `pool`, `child_pids` may be called from
any thread (the run loop calls `update_weights` from a worker thread).
"""

from __future__ import annotations

import atexit
import ctypes
import json
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1
_POLL_INTERVAL_S = 0.2
_LOG_TAIL_LINES = 25
_POLITE_SIGNALS = {signal.SIGINT, signal.SIGTERM, signal.SIGHUP}
_POLITE_DEATH_GRACE_S = 2.0
_ROUTER_CALL_TIMEOUT_S = 10.0
_ROUTER_SYNC_TIMEOUT_S = 15.0
# Prometheus counters of the router's own retries: `smg_worker_retries_total` (sglang-router
# 0.3.x), `sgl_router_retries_total` (older releases).
_RETRIES_METRIC = re.compile(r"^(?P<name>[a-zA-Z_:][\w:]*retries_total)(?:\{[^}]*\})?\s+(?P<value>[0-9.eE+-]+)\s*$")
# The repository root, so children can import slime_meta even when it is not installed.
_PACKAGE_PARENT = str(Path(__file__).resolve().parents[3])


class LaunchError(RuntimeError):
    """A worker or router died or never became ready; the message names its log file."""


class _Stopping(Exception):
    """The group is stopping: a restart in progress gives up."""


@dataclass(frozen=True)
class PoolEndpoints:
    name: str
    router_url: str
    worker_urls: tuple[str, ...]


@dataclass
class _Child:
    """One managed process: enough to start it again on the same port."""

    role: str
    command: list[str]
    env: dict[str, str]
    log_path: Path
    url: str
    ready_path: str  # GET path that answers 200 once the process is usable
    process: subprocess.Popen | None = None
    restarting: bool = False  # a new process is starting; not yet back in its router
    seen_dead_at: float | None = None
    restart_times: list[float] = field(default_factory=list)
    given_up: bool = False


@dataclass
class _Pool:
    endpoints: PoolEndpoints
    workers: list[_Child]
    router: _Child
    metrics_url: str
    restarts: int = 0
    weights: tuple[str, str] | None = None  # (model_path, weight_version) of the last update
    router_dead_logged: bool = False


def _die_with_parent_hook() -> Callable[[], None] | None:
    """`preexec_fn` that makes the child receive SIGTERM when this process dies (Linux only)."""
    if not sys.platform.startswith("linux"):
        return None
    prctl = ctypes.CDLL(None, use_errno=True).prctl  # resolved now: nothing to load after fork
    parent_pid = os.getpid()

    def set_parent_death_signal() -> None:
        prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM))
        if os.getppid() != parent_pid:  # the parent died before the request took effect
            os._exit(1)

    return set_parent_death_signal


# No proxies: these are loopback addresses, and an http_proxy variable must not reroute them.
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def _http_ok(url: str, timeout_s: float = 2.0) -> bool:
    try:
        with _OPENER.open(url, timeout=timeout_s) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False


def _http_json(method: str, url: str, body: Any = None, timeout_s: float = _ROUTER_CALL_TIMEOUT_S) -> tuple[int, Any]:
    """(status, parsed JSON body or None) of one request; HTTP errors are returned, not raised."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    try:
        with _OPENER.open(request, timeout=timeout_s) as response:
            status, raw = response.status, response.read()
    except urllib.error.HTTPError as error:
        status, raw = error.code, error.read()
    try:
        return status, json.loads(raw) if raw else None
    except ValueError:
        return status, None


def _log_tail(path: Path) -> str:
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return "(log unreadable)"
    return "\n".join(lines[-_LOG_TAIL_LINES:])


def _describe_exit(returncode: int | None) -> str:
    if returncode is not None and returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"exited with code {returncode}"


class LocalProcessGroup:
    """Owns every worker and router it starts; use as a context manager."""

    def __init__(
        self,
        *,
        host: str = "127.0.0.1",
        startup_timeout_s: float = 300.0,
        stop_timeout_s: float = 5.0,
        handle_sigterm: bool = True,
        supervise: bool = True,
        supervise_interval_s: float = 0.5,
        max_restarts: int = 5,
        restart_window_s: float = 600.0,
    ):
        self._host = host
        self._startup_timeout_s = startup_timeout_s
        self._stop_timeout_s = stop_timeout_s
        self._handle_sigterm = handle_sigterm
        self._supervise = supervise
        self._supervise_interval_s = supervise_interval_s
        self._max_restarts = max_restarts
        self._restart_window_s = restart_window_s
        self._pools: dict[str, _Pool] = {}
        self._reserved_ports: set[int] = set()
        self._previous_sigterm_handler: object = None
        self._child_setup = _die_with_parent_hook()
        # Guards the pools' state between the caller's threads and the supervisor; held only for
        # a spawn, a termination or a weight load: never while a process starts or the router is called.
        self._lock = threading.RLock()
        self._stopping = threading.Event()
        self._supervisor: threading.Thread | None = None
        atexit.register(self.stop)

    def __enter__(self) -> LocalProcessGroup:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    # ----- public API ----------------------------------------------------------------------------

    def start_pool(
        self,
        name: str,
        model_path: str,
        num_workers: int,
        *,
        device: str,
        weights_root: str | None,
        log_dir: str,
        base_port: int | None = None,
        gpu_ids: Sequence[int] | None = None,
        worker_args: Sequence[str] = (),
        router_args: Sequence[str] = (),
    ) -> PoolEndpoints:
        """Start `num_workers` workers and a router; return once the router reports ready.

        Ports: `base_port + i` for worker i, then the router and its metrics port; without
        `base_port`, free loopback ports. `gpu_ids`: worker i sees only GPU
        `gpu_ids[i % len(gpu_ids)]` (several workers may share one GPU).
        `weights_root`: the only directory `/update_weights_from_disk` may load from (the run's
        weight directory); None makes a frozen pool that refuses every weight update (its root
        is an empty directory of its own under `log_dir`).
        """
        if name in self._pools:
            raise ValueError(f"a pool named {name!r} is already running")
        if num_workers < 1:
            raise ValueError("num_workers must be >= 1")
        self._warn_if_not_main_thread()
        self._install_sigterm_handler()
        self._stopping.clear()  # a group may be used again after stop()
        log_directory = Path(log_dir)
        log_directory.mkdir(parents=True, exist_ok=True)
        frozen_root = str(log_directory / f".{name}-frozen-no-weight-updates")
        if weights_root is None:
            Path(frozen_root).mkdir(exist_ok=True)
        ports = self._choose_ports(num_workers + 2, base_port)
        worker_ports, router_port, metrics_port = ports[:num_workers], ports[num_workers], ports[num_workers + 1]

        workers = []
        for index, port in enumerate(worker_ports):
            command = [
                sys.executable, "-m", "slime_meta.backends.local.worker",
                "--model-path", model_path, "--host", self._host, "--port", str(port), "--device", device,
            ]  # fmt: skip
            command += ["--weights-root", weights_root if weights_root is not None else frozen_root]
            env = self._child_env()
            if gpu_ids:
                env["CUDA_VISIBLE_DEVICES"] = str(gpu_ids[index % len(gpu_ids)])
            workers.append(
                _Child(
                    role=f"pool {name!r} worker {index}",
                    command=command + list(worker_args),
                    env=env,
                    log_path=log_directory / f"{name}-worker-{index}.log",
                    url=f"http://{self._host}:{port}",
                    ready_path="/health",
                )
            )
        worker_urls = tuple(worker.url for worker in workers)
        router = _Child(
            role=f"pool {name!r} router",
            command=[
                sys.executable,
                "-m",
                "sglang_router.launch_router",
                "--host",
                self._host,
                "--port",
                str(router_port),
                "--worker-urls",
                *worker_urls,
                "--policy",
                "round_robin",
                "--prometheus-host",
                self._host,
                "--prometheus-port",
                str(metrics_port),
                "--log-level",
                "warn",
                "--health-check-interval-secs",
                "1",
                *router_args,
            ],  # fmt: skip
            env=self._child_env(),
            log_path=log_directory / f"{name}-router.log",
            url=f"http://{self._host}:{router_port}",
            ready_path="/readiness",
        )
        pool = _Pool(
            PoolEndpoints(name, router.url, worker_urls), workers, router, metrics_url=f"http://{self._host}:{metrics_port}/metrics"
        )
        started_at = time.monotonic()
        try:
            with self._lock:
                self._pools[name] = pool
                for worker in workers:
                    self._spawn(worker)
            self._wait_until_ready(workers)
            workers_ready_s = time.monotonic() - started_at
            with self._lock:
                self._spawn(router)
            self._wait_until_ready([router])
        except BaseException:
            with self._lock:
                self._terminate([router, *workers])
                self._pools.pop(name, None)
            raise
        logger.info(
            "pool %s ready: router %s, workers %s (workers %.1fs, router %.1fs)",
            name, router.url, ", ".join(worker_urls), workers_ready_s, time.monotonic() - started_at - workers_ready_s,
        )  # fmt: skip
        self._start_supervisor()
        return pool.endpoints

    def restart_worker(self, pool_name: str, index: int) -> str:
        """Stop worker `index` if it runs, start it again on the same port, wait until healthy.

        Like an automatic restart: the worker is taken out of its router first, gets the pool's
        current weights, is registered again, and counts in `restarts(pool_name)`.
        """
        self._warn_if_not_main_thread()
        pool = self._pools[pool_name]
        worker = pool.workers[index]
        worker.restarting = True
        self._deregister(pool, worker)
        with self._lock:
            self._terminate([worker])
            self._spawn(worker)
        try:
            self._wait_until_ready([worker], abort=self._stopping)
            self._finish_restart(pool, worker)
        except _Stopping:
            raise LaunchError(f"{worker.role}: the group stopped during the restart") from None
        finally:
            worker.restarting = False
        return worker.url

    def kill_worker(self, pool_name: str, index: int, signal_number: int = signal.SIGKILL) -> None:
        """Send a signal to worker `index` and reap it (for failure tests; the supervisor restarts it)."""
        worker = self._pools[pool_name].workers[index]
        process = worker.process
        if process is not None and process.poll() is None:
            process.send_signal(signal_number)
            process.wait()

    def update_weights(self, pool_name: str, model_path: str, weight_version: str | int) -> list[str]:
        """Load `model_path` into every live worker of the pool (`/update_weights_from_disk`).

        The path is remembered first: a worker that is down or restarting is skipped and gets
        these weights when it is back, before the router sends it anything. Returns the URLs
        updated now. Raises RuntimeError when a live worker refuses the update.
        """
        with self._lock:
            pool = self._pools[pool_name]
            previous, pool.weights = pool.weights, (str(model_path), str(weight_version))
            updated = []
            try:
                for worker in pool.workers:
                    if worker.restarting or worker.process is None or worker.process.poll() is not None:
                        logger.warning("%s is down: it gets weights %s when it is back", worker.role, weight_version)
                        continue
                    try:
                        self._load_weights(worker, pool.weights)
                    except (urllib.error.URLError, OSError) as error:
                        if worker.process.poll() is None:
                            time.sleep(0.2)  # a worker dying right now: let its exit show
                        if worker.process.poll() is not None:
                            logger.warning("%s died during a weight update: it gets the weights when it is back", worker.role)
                            continue
                        raise RuntimeError(f"weight update of {worker.url} failed: {error}") from None
                    updated.append(worker.url)
            except RuntimeError:
                pool.weights = previous  # a refused update is not what restarted workers should load
                raise
            return updated

    def restarts(self, pool_name: str) -> int:
        """Worker restarts of this pool so far (automatic and `restart_worker`)."""
        return self._pools[pool_name].restarts

    def router_retries(self, pool_name: str) -> int:
        """Requests the pool's router re-sent to another worker so far (its Prometheus counter); 0 if unknown."""
        pool = self._pools[pool_name]
        try:
            with _OPENER.open(pool.metrics_url, timeout=5) as response:
                text = response.read().decode(errors="replace")
        except (urllib.error.URLError, OSError, ValueError):
            return 0
        total = 0.0
        for line in text.splitlines():
            match = _RETRIES_METRIC.match(line)
            if match:
                total += float(match.group("value"))
        return int(total)

    def pool_names(self) -> list[str]:
        return list(self._pools)

    def pool(self, name: str) -> PoolEndpoints:
        return self._pools[name].endpoints

    def child_pids(self) -> list[int]:
        """Process ids of every child started and not yet reaped."""
        return [
            child.process.pid
            for child in self._children()
            if child.process is not None and child.process.returncode is None
        ]

    def stop(self) -> None:
        """Terminate every router and worker (routers first) and reap them. Idempotent."""
        self._stopping.set()  # no restart from now on; a restart in progress gives up
        supervisor, self._supervisor = self._supervisor, None
        if supervisor is not None and supervisor is not threading.current_thread():
            supervisor.join(timeout=self._stop_timeout_s + _ROUTER_CALL_TIMEOUT_S)
        # The lock is only ever held for a spawn or a weight load; never wait on it for long.
        locked = self._lock.acquire(timeout=self._stop_timeout_s + _ROUTER_CALL_TIMEOUT_S)
        try:
            pools, self._pools = list(self._pools.values()), {}
            self._terminate([pool.router for pool in pools] + [worker for pool in pools for worker in pool.workers])
        finally:
            if locked:
                self._lock.release()
        self._restore_sigterm_handler()

    # ----- supervision ---------------------------------------------------------------------------

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
                        pool.router.role, _describe_exit(pool.router.process.returncode), pool.router.log_path,
                    )  # fmt: skip
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
        if process.returncode is not None and -process.returncode in _POLITE_SIGNALS:
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
                    worker.role, exit_text, len(worker.restart_times) + 1, self._restart_window_s, worker.log_path,
                )  # fmt: skip
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
        loaded = None
        while True:
            with self._lock:  # the same lock as update_weights: never a directory being replaced
                if self._stopping.is_set():
                    raise _Stopping
                if pool.weights is not None and pool.weights != loaded:
                    try:
                        self._load_weights(worker, pool.weights)
                    except (urllib.error.URLError, OSError, RuntimeError) as error:
                        raise LaunchError(f"{worker.role} came back but did not take weights {pool.weights[0]}: {error}")
                    loaded = pool.weights
            self._register(pool, worker)  # router calls: outside the lock
            with self._lock:
                if pool.weights is None or pool.weights == loaded:
                    worker.restarting = False  # from here on, update_weights reaches it directly
                    pool.restarts += 1
                    break
            # update_weights moved on while the worker was registered: load the newer weights too
        logger.warning("%s is back on %s (restart %d of pool %s)", worker.role, worker.url, pool.restarts, pool.endpoints.name)

    @staticmethod
    def _load_weights(worker: _Child, weights: tuple[str, str]) -> None:
        status, reply = _http_json(
            "POST", worker.url + "/update_weights_from_disk", {"model_path": weights[0], "weight_version": weights[1]},
            timeout_s=600.0,
        )  # fmt: skip
        if status != 200 or not (reply or {}).get("success"):
            raise RuntimeError(f"weight update of {worker.url} failed: {(reply or {}).get('message', status)}")

    # Router registration. sglang-router 0.3.x manages workers through `/workers` (list, POST to
    # add, DELETE /workers/{id} to remove; both are queued, so each call waits until the listing
    # shows the change). A router without that API (404) still takes a restarted worker back
    # through its health checks, once the circuit breaker of the dead worker closes again.

    def _router_worker_ids(self, pool: _Pool, url: str) -> list[str] | None:
        status, reply = _http_json("GET", pool.router.url + "/workers")
        if status != 200 or not isinstance(reply, dict):
            return None
        return [str(w.get("id")) for w in reply.get("workers", []) if w.get("url") == url]

    def _deregister(self, pool: _Pool, worker: _Child) -> None:
        try:
            ids = self._router_worker_ids(pool, worker.url)
            if not ids:
                return
            for worker_id in ids:
                _http_json("DELETE", f"{pool.router.url}/workers/{worker_id}")
            self._wait_for_router(pool, worker.url, present=False)
        except (urllib.error.URLError, OSError) as error:
            logger.warning("could not take %s out of its router: %s", worker.role, error)

    def _register(self, pool: _Pool, worker: _Child) -> None:
        try:
            if self._router_worker_ids(pool, worker.url) is None:
                logger.info("router of pool %s has no /workers API: its health checks take %s back", pool.endpoints.name, worker.url)
                return
            status, reply = _http_json("POST", pool.router.url + "/workers", {"url": worker.url})
            if status not in (200, 201, 202):
                raise LaunchError(f"router {pool.router.url} refused to add {worker.url}: HTTP {status} {reply}")
            self._wait_for_router(pool, worker.url, present=True)
        except (urllib.error.URLError, OSError) as error:
            raise LaunchError(f"could not register {worker.role} with router {pool.router.url}: {error}") from None

    def _wait_for_router(self, pool: _Pool, url: str, *, present: bool) -> None:
        deadline = time.monotonic() + _ROUTER_SYNC_TIMEOUT_S
        while time.monotonic() < deadline:
            status, reply = _http_json("GET", pool.router.url + "/workers")
            entries = [w for w in (reply or {}).get("workers", []) if w.get("url") == url] if status == 200 else []
            if (present and entries and all(w.get("is_healthy", True) for w in entries)) or (not present and not entries):
                return
            if self._stopping.is_set():
                raise _Stopping
            time.sleep(0.1)
        action = "add" if present else "remove"
        raise LaunchError(f"router {pool.router.url} did not {action} {url} within {_ROUTER_SYNC_TIMEOUT_S:.0f}s")

    # ----- internals -------------------------------------------------------------------------------

    def _children(self) -> list[_Child]:
        with self._lock:
            return [child for pool in self._pools.values() for child in (pool.router, *pool.workers)]

    @staticmethod
    def _child_env() -> dict[str, str]:
        env = dict(os.environ)
        env["PYTHONUNBUFFERED"] = "1"  # logs reach the file as they happen
        env["PYTHONPATH"] = os.pathsep.join(p for p in (_PACKAGE_PARENT, env.get("PYTHONPATH")) if p)
        return env

    def _choose_ports(self, count: int, base_port: int | None) -> list[int]:
        try:
            return self._reserve_ports(count, base_port)
        except (OSError, OverflowError) as error:  # a host that is no local address, a port out of range
            where = f"ports {base_port}-{base_port + count - 1}" if base_port is not None else "a free port"
            raise LaunchError(f"cannot bind {where} on host {self._host!r}: {error}") from None

    def _reserve_ports(self, count: int, base_port: int | None) -> list[int]:
        if base_port is not None:
            ports = list(range(base_port, base_port + count))
            for port in ports:
                if port in self._reserved_ports or not self._port_is_free(port):
                    raise LaunchError(f"port {port} (from base_port {base_port}) is already in use")
        else:
            ports = []
            while len(ports) < count:
                with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
                    probe.bind((self._host, 0))
                    port = probe.getsockname()[1]
                if port not in self._reserved_ports and port not in ports:
                    ports.append(port)
        self._reserved_ports.update(ports)
        return ports

    def _port_is_free(self, port: int) -> bool:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the servers will
            try:
                probe.bind((self._host, port))
            except OSError:
                return False
        return True

    def _spawn(self, child: _Child) -> None:
        with open(child.log_path, "ab") as log:
            log.write(f"\n=== {time.strftime('%Y-%m-%d %H:%M:%S')} starting: {' '.join(child.command)}\n".encode())
            log.flush()
            child.process = subprocess.Popen(
                child.command,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=child.env,
                preexec_fn=self._child_setup,  # noqa: PLW1509 - only a prctl call, see module docstring
            )

    def _wait_until_ready(self, children: list[_Child], abort: threading.Event | None = None) -> None:
        deadline = time.monotonic() + self._startup_timeout_s
        pending = list(children)
        while pending:
            if abort is not None and abort.is_set():
                raise _Stopping
            for child in list(pending):
                assert child.process is not None
                if child.process.poll() is not None:
                    raise LaunchError(
                        f"{child.role} exited with code {child.process.returncode} while starting; "
                        f"log {child.log_path}:\n{_log_tail(child.log_path)}"
                    )
                if _http_ok(child.url + child.ready_path):
                    pending.remove(child)
            if pending and time.monotonic() > deadline:
                names = ", ".join(f"{c.role} (log {c.log_path})" for c in pending)
                raise LaunchError(f"not ready after {self._startup_timeout_s:.0f}s: {names}")
            if pending:
                time.sleep(_POLL_INTERVAL_S)

    def _terminate(self, children: Sequence[_Child]) -> None:
        running = [c for c in children if c.process is not None and c.process.poll() is None]
        for child in running:
            try:
                child.process.terminate()
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + self._stop_timeout_s
        for child in running:
            try:
                child.process.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                logger.warning("%s ignored SIGTERM for %.0fs; killing it", child.role, self._stop_timeout_s)
                child.process.kill()
                child.process.wait()
        for child in children:
            if child.process is not None:
                child.process.poll()  # reap children that had already exited

    def _warn_if_not_main_thread(self) -> None:
        if self._child_setup is not None and threading.current_thread() is not threading.main_thread():
            logger.warning(
                "starting workers from thread %s: they get SIGTERM when that thread exits (PR_SET_PDEATHSIG)",
                threading.current_thread().name,
            )

    def _install_sigterm_handler(self) -> None:
        if (
            not self._handle_sigterm
            or self._previous_sigterm_handler is not None
            or threading.current_thread() is not threading.main_thread()
            or signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL
        ):
            return

        def exit_on_sigterm(signal_number: int, frame: object) -> None:
            raise SystemExit(128 + signal_number)  # unwinds through __exit__ / finally / atexit

        self._previous_sigterm_handler = signal.signal(signal.SIGTERM, exit_on_sigterm)

    def _restore_sigterm_handler(self) -> None:
        if self._previous_sigterm_handler is not None and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self._previous_sigterm_handler)
            self._previous_sigterm_handler = None
