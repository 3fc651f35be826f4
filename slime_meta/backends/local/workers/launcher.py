"""Start and stop pools of embedded workers behind the real sglang-router, as child processes.

A pool is N `slime_meta_engine` processes on free loopback ports plus one
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
  3. given the pool's current weights (its `ServedWeights`, weight_sync.py: the last push), so it
     never serves the starting checkpoint next to trained workers;
  4. registered with the router again (`POST /workers`): a fresh entry, so the circuit breaker the
     dead worker opened (60 s by default) does not keep the healthy new process idle;
  5. counted: `restarts(pool_name)`.
A worker that died by SIGINT/SIGTERM/SIGHUP is restarted only after a 2 s grace period: those
signals usually reach the whole process group (Ctrl-C, a job scheduler), and this process then
stops the group itself (workers end by the signal they got, so their exit says so). While a group
runs, SIGINT to this process first stops all restarts, then runs the handler it had before. A
worker that dies more than `max_restarts` times within `restart_window_s` is left down (an error
is logged; the router keeps using the others). Routers are not restarted. `stop()` first tells
the supervisor to stop, waits for it (a restart in progress is abandoned, its process terminated
with the rest), so nothing is restarted during or after `stop()`.

Thread safety: `start_pool`, `restart_worker`, `stop` belong to one thread (normally the main
one); `update_weights`, `served_weights`, `restarts`, `router_retries`, `pool`, `child_pids` may
be called from any thread (the run loop pushes weights from its trainer thread).
"""

from __future__ import annotations

import atexit
import logging
import re
import signal
import sys
import threading
import time
import urllib.error
from collections.abc import Mapping, Sequence
from pathlib import Path

from slime_meta.backends.local.workers.local_http import LOOPBACK_OPENER, ROUTER_CALL_TIMEOUT_S
from slime_meta.backends.local.workers.processes import (
    LaunchError,
    PoolEndpoints,
    _Child,
    _ChildProcesses,
    _die_with_parent_hook,
    _Pool,
    _Stopping,
    remove_orphaned_buffers,
    weight_buffer_prefix,
)
from slime_meta.backends.local.workers.supervisor import _Supervision
from slime_meta.backends.local.workers.weight_sync import ServedWeights, WeightUpdate, disk_update
from slime_meta.errors import UserInputError
from slime_meta_engine.weights import remove_buffers

logger = logging.getLogger(__name__)

# Prometheus counters of the router's own retries: `smg_worker_retries_total` (sglang-router
# 0.3.x), `sgl_router_retries_total` (older releases).
_RETRIES_METRIC = re.compile(r"^(?P<name>[a-zA-Z_:][\w:]*retries_total)(?:\{[^}]*\})?\s+(?P<value>[0-9.eE+-]+)\s*$")


class PortInUse(LaunchError):
    """The port asked for a pool's router cannot be bound (taken, or not an address of this host)."""

    def __init__(self, port: int, message: str):
        super().__init__(message)
        self.port = port


def router_command(
    host: str, port: int, metrics_port: int, worker_urls: Sequence[str], policy: str = "round_robin"
) -> list[str]:
    """The command of one sglang-router in front of `worker_urls`: its metrics on `metrics_port`,
    warnings only in its log, each worker's health checked every second."""
    return [
        sys.executable,
        "-m",
        "sglang_router.launch_router",
        "--host",
        host,
        "--port",
        str(port),
        "--worker-urls",
        *worker_urls,
        "--policy",
        policy,
        "--prometheus-host",
        host,
        "--prometheus-port",
        str(metrics_port),
        "--log-level",
        "warn",
        "--health-check-interval-secs",
        "1",
    ]


def visible_device(gpu: int, env: Mapping[str, str]) -> str:
    """The CUDA_VISIBLE_DEVICES entry for GPU `gpu` as this process numbers it: an index into the
    run's own CUDA_VISIBLE_DEVICES when that is set (a run given GPUs 2,3 counts them 0 and 1)."""
    visible = [entry.strip() for entry in env.get("CUDA_VISIBLE_DEVICES", "").split(",") if entry.strip()]
    if not visible:
        return str(gpu)
    if gpu >= len(visible):
        raise UserInputError(
            f"the pools need GPU {gpu}, and CUDA_VISIBLE_DEVICES={','.join(visible)} shows {len(visible)}; "
            "give fewer GPUs to the pools, or show the run more"
        )
    return visible[gpu]


class LocalProcessGroup(_Supervision, _ChildProcesses):
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
        self._previous_sigint_handler: object = None
        self._child_setup = _die_with_parent_hook()
        # Same-host weight buffers (/dev/shm) of this group are named with this prefix; its workers
        # accept no other, and stop() removes every file that has it.
        self.weight_buffer_prefix = weight_buffer_prefix()
        remove_orphaned_buffers()
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
        router_port: int | None = None,
        gpu_ids: Sequence[int] | None = None,
        worker_args: Sequence[str] = (),
        router_args: Sequence[str] = (),
    ) -> PoolEndpoints:
        """Start `num_workers` workers and a router; return once the router reports ready.

        Ports: `base_port + i` for worker i, then the router and its metrics port; without
        `base_port`, free loopback ports. `router_port` instead: the router there (a user-facing
        address such as `--teacher-port`), workers and metrics on free ports; PortInUse when it
        cannot be bound. `gpu_ids`: worker i sees only GPU `gpu_ids[i % len(gpu_ids)]` (several
        workers may share one GPU).
        `weights_root`: the only directory `/update_weights_from_disk` may load from (the run's
        weight directory); None makes a frozen pool that refuses every weight update (its root
        is an empty directory of its own under `log_dir`).
        """
        if name in self._pools:
            raise ValueError(f"a pool named {name!r} is already running")
        if num_workers < 1:
            raise ValueError("num_workers must be >= 1")
        self._warn_if_not_main_thread()
        self._stopping.clear()  # a group may be used again after stop()
        self._install_sigterm_handler()
        self._install_sigint_hook()
        log_directory = Path(log_dir)
        log_directory.mkdir(parents=True, exist_ok=True)
        frozen_root = str(log_directory / f".{name}-frozen-no-weight-updates")
        if weights_root is None:
            Path(frozen_root).mkdir(exist_ok=True)
        if router_port is not None:
            if base_port is not None:
                raise ValueError("give base_port or router_port, not both")
            try:
                router_port = self._choose_ports(1, router_port)[0]
            except LaunchError as error:
                raise PortInUse(router_port, f"pool {name!r} router: {error}") from None
            ports = self._choose_ports(num_workers + 1, None)
            ports.insert(num_workers, router_port)
        else:
            ports = self._choose_ports(num_workers + 2, base_port)
        worker_ports, router_port, metrics_port = ports[:num_workers], ports[num_workers], ports[num_workers + 1]

        workers = []
        for index, port in enumerate(worker_ports):
            command = [
                sys.executable,
                "-m",
                "slime_meta_engine",
                "--model-path",
                model_path,
                "--host",
                self._host,
                "--port",
                str(port),
                "--device",
                device,
            ]
            command += ["--weights-root", weights_root if weights_root is not None else frozen_root]
            if weights_root is not None:
                command += ["--weight-buffer-prefix", self.weight_buffer_prefix]
            env = self._child_env()
            if gpu_ids and device != "cpu":  # on the CPU a GPU layout names nothing
                env["CUDA_VISIBLE_DEVICES"] = visible_device(gpu_ids[index % len(gpu_ids)], env)
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
            command=[*router_command(self._host, router_port, metrics_port, worker_urls), *router_args],
            env=self._child_env(),
            log_path=log_directory / f"{name}-router.log",
            url=f"http://{self._host}:{router_port}",
            ready_path="/readiness",
        )
        pool = _Pool(
            PoolEndpoints(name, router.url, worker_urls),
            workers,
            router,
            metrics_url=f"http://{self._host}:{metrics_port}/metrics",
            served=ServedWeights(workers, self._lock),
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
            name,
            router.url,
            ", ".join(worker_urls),
            workers_ready_s,
            time.monotonic() - started_at - workers_ready_s,
        )
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

    def update_weights(self, pool_name: str, weights: str | WeightUpdate, weight_version: str | int) -> list[str]:
        """Load new weights into every live worker of the pool; returns the URLs updated now.

        `weights`: a `save_pretrained` directory (`/update_weights_from_disk`) or a `WeightUpdate`;
        the pool's `ServedWeights` (weight_sync.py) remember it and reach the workers, so a worker
        that is down or restarting gets it when it is back. Raises RuntimeError when a live worker
        refuses the update.
        """
        update = weights if isinstance(weights, WeightUpdate) else disk_update(str(weights))
        return self._pools[pool_name].served.push(update, weight_version)

    def served_weights(self, pool_name: str) -> ServedWeights:
        """The weights the pool's workers serve (what a push updates and a restarted worker loads)."""
        return self._pools[pool_name].served

    def restarts(self, pool_name: str) -> int:
        """Worker restarts of this pool so far (automatic and `restart_worker`)."""
        return self._pools[pool_name].restarts

    def router_retries(self, pool_name: str) -> int:
        """Requests the pool's router re-sent to another worker so far (its Prometheus counter); 0 if unknown."""
        pool = self._pools[pool_name]
        try:
            with LOOPBACK_OPENER.open(pool.metrics_url, timeout=5) as response:
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
            supervisor.join(timeout=self._stop_timeout_s + ROUTER_CALL_TIMEOUT_S)
        # The lock is only ever held for a spawn or a weight load; never wait on it for long.
        locked = self._lock.acquire(timeout=self._stop_timeout_s + ROUTER_CALL_TIMEOUT_S)
        try:
            pools, self._pools = list(self._pools.values()), {}
            self._terminate([pool.router for pool in pools] + [worker for pool in pools for worker in pool.workers])
        finally:
            if locked:
                self._lock.release()
            remove_buffers(self.weight_buffer_prefix)
        self._restore_sigterm_handler()

    # ----- internals -------------------------------------------------------------------------------

    def _children(self) -> list[_Child]:
        with self._lock:
            return [child for pool in self._pools.values() for child in (pool.router, *pool.workers)]

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
            self._stopping.set()  # the workers got it too, most likely: restart none of them
            raise SystemExit(128 + signal_number)  # unwinds through __exit__ / finally / atexit

        self._previous_sigterm_handler = signal.signal(signal.SIGTERM, exit_on_sigterm)

    def _install_sigint_hook(self) -> None:
        """Ctrl-C reaches the workers and this process together: stop restarting before anything else.

        The program's own handler (Python's KeyboardInterrupt, asyncio's task cancellation) still
        runs after; an ignored SIGINT stays ignored.
        """
        previous = signal.getsignal(signal.SIGINT)
        if self._previous_sigint_handler is not None or not callable(previous):
            return
        if threading.current_thread() is not threading.main_thread():
            return

        def stop_restarts_then_interrupt(signal_number: int, frame: object) -> None:
            self._stopping.set()
            previous(signal_number, frame)

        signal.signal(signal.SIGINT, stop_restarts_then_interrupt)
        self._previous_sigint_handler = previous

    def _restore_sigterm_handler(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        if self._previous_sigterm_handler is not None:
            signal.signal(signal.SIGTERM, self._previous_sigterm_handler)
            self._previous_sigterm_handler = None
        if self._previous_sigint_handler is not None:
            signal.signal(signal.SIGINT, self._previous_sigint_handler)
            self._previous_sigint_handler = None
