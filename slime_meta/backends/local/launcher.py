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
  that lives as long as the pool (a warning is logged otherwise).
- Children stay in the parent's process group and session (no `start_new_session`): Ctrl-C in a
  terminal, a hangup, or a job controller signalling the group (`timeout`, CI, schedulers) then
  reaches the whole tree at once, so nothing outlives the terminal or the job. The price is that
  on Ctrl-C the workers shut down in parallel with the parent's own cleanup; that is what Ctrl-C
  means here. `stop()` tolerates children that are already gone.

Not thread-safe: use one group from one thread.
"""

from __future__ import annotations

import atexit
import ctypes
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1
_POLL_INTERVAL_S = 0.2
_LOG_TAIL_LINES = 25
# The repository root, so children can import slime_meta even when it is not installed.
_PACKAGE_PARENT = str(Path(__file__).resolve().parents[3])


class LaunchError(RuntimeError):
    """A worker or router died or never became ready; the message names its log file."""


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


@dataclass
class _Pool:
    endpoints: PoolEndpoints
    workers: list[_Child]
    router: _Child


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


def _http_ok(url: str, timeout_s: float = 2.0) -> bool:
    # No proxies: these are loopback addresses, and an http_proxy variable must not reroute them.
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(url, timeout=timeout_s) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False


def _log_tail(path: Path) -> str:
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return "(log unreadable)"
    return "\n".join(lines[-_LOG_TAIL_LINES:])


class LocalProcessGroup:
    """Owns every worker and router it starts; use as a context manager."""

    def __init__(
        self,
        *,
        host: str = "127.0.0.1",
        startup_timeout_s: float = 300.0,
        stop_timeout_s: float = 5.0,
        handle_sigterm: bool = True,
    ):
        self._host = host
        self._startup_timeout_s = startup_timeout_s
        self._stop_timeout_s = stop_timeout_s
        self._handle_sigterm = handle_sigterm
        self._pools: dict[str, _Pool] = {}
        self._reserved_ports: set[int] = set()
        self._previous_sigterm_handler: object = None
        self._child_setup = _die_with_parent_hook()
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
        """
        if name in self._pools:
            raise ValueError(f"a pool named {name!r} is already running")
        if num_workers < 1:
            raise ValueError("num_workers must be >= 1")
        self._warn_if_not_main_thread()
        self._install_sigterm_handler()
        log_directory = Path(log_dir)
        log_directory.mkdir(parents=True, exist_ok=True)
        ports = self._choose_ports(num_workers + 2, base_port)
        worker_ports, router_port, metrics_port = ports[:num_workers], ports[num_workers], ports[num_workers + 1]

        workers = []
        for index, port in enumerate(worker_ports):
            command = [
                sys.executable, "-m", "slime_meta.backends.local.worker",
                "--model-path", model_path, "--host", self._host, "--port", str(port), "--device", device,
            ]  # fmt: skip
            if weights_root is not None:
                command += ["--weights-root", weights_root]
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
        pool = _Pool(PoolEndpoints(name, router.url, worker_urls), workers, router)
        self._pools[name] = pool
        started_at = time.monotonic()
        try:
            for worker in workers:
                self._spawn(worker)
            self._wait_until_ready(workers)
            workers_ready_s = time.monotonic() - started_at
            self._spawn(router)
            self._wait_until_ready([router])
        except BaseException:
            self._terminate([router, *workers])
            del self._pools[name]
            raise
        logger.info(
            "pool %s ready: router %s, workers %s (workers %.1fs, router %.1fs)",
            name, router.url, ", ".join(worker_urls), workers_ready_s, time.monotonic() - started_at - workers_ready_s,
        )  # fmt: skip
        return pool.endpoints

    def restart_worker(self, pool_name: str, index: int) -> str:
        """Stop worker `index` if it runs, start it again on the same port, wait until healthy.

        The router notices the worker is back through its health checks (about 2 s).
        """
        self._warn_if_not_main_thread()
        worker = self._pools[pool_name].workers[index]
        self._terminate([worker])
        self._spawn(worker)
        self._wait_until_ready([worker])
        return worker.url

    def kill_worker(self, pool_name: str, index: int, signal_number: int = signal.SIGKILL) -> None:
        """Send a signal to worker `index` and reap it (for failure tests)."""
        worker = self._pools[pool_name].workers[index]
        if worker.process is not None and worker.process.poll() is None:
            worker.process.send_signal(signal_number)
            worker.process.wait()

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
        pools, self._pools = list(self._pools.values()), {}
        self._terminate([pool.router for pool in pools] + [worker for pool in pools for worker in pool.workers])
        self._restore_sigterm_handler()

    # ----- internals -------------------------------------------------------------------------------

    def _children(self) -> list[_Child]:
        return [child for pool in self._pools.values() for child in (pool.router, *pool.workers)]

    @staticmethod
    def _child_env() -> dict[str, str]:
        env = dict(os.environ)
        env["PYTHONUNBUFFERED"] = "1"  # logs reach the file as they happen
        env["PYTHONPATH"] = os.pathsep.join(p for p in (_PACKAGE_PARENT, env.get("PYTHONPATH")) if p)
        return env

    def _choose_ports(self, count: int, base_port: int | None) -> list[int]:
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

    def _wait_until_ready(self, children: list[_Child]) -> None:
        deadline = time.monotonic() + self._startup_timeout_s
        pending = list(children)
        while pending:
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
