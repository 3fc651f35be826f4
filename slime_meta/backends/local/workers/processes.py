"""The child processes of a `LocalProcessGroup`: what one is, and how it is started, waited for and stopped.

Module-level helpers (parent-death hook, loopback HTTP, log tails, exit descriptions) and
`_ChildProcesses`, the mixin of `LocalProcessGroup` that spawns, waits for and terminates children
and picks their ports. See `slime_meta.backends.local.workers.launcher` for why children are set up as they are.
"""

from __future__ import annotations

import ctypes
import logging
import os
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from slime_meta.backends.local.workers.local_http import http_ok

if TYPE_CHECKING:
    from slime_meta.backends.local.workers.weight_sync import ServedWeights

# The launcher's logger: records keep the name they had before this module was split out of it.
logger = logging.getLogger("slime_meta.backends.local.workers.launcher")

_PR_SET_PDEATHSIG = 1
_POLL_INTERVAL_S = 0.2
_LOG_TAIL_LINES = 25
# The repository root, so children can import slime_meta even when it is not installed.
_PACKAGE_PARENT = str(Path(__file__).resolve().parents[4])


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

    def serving(self) -> bool:
        """Up and not restarting (a weight push reaches it now)."""
        return not self.restarting and not self.exited()

    def exited(self) -> bool:
        """Not started, or its process has ended."""
        return self.process is None or self.process.poll() is not None


@dataclass
class _Pool:
    endpoints: PoolEndpoints
    workers: list[_Child]
    router: _Child
    metrics_url: str
    served: ServedWeights  # the weights its workers serve (a restarted worker loads them first)
    restarts: int = 0
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


WEIGHT_BUFFER_NAME_START = "slime-meta-weights-"  # then the launcher's pid, its pid namespace, a random tag


def weight_buffer_prefix() -> str:
    """The name every same-host weight buffer of a new launcher starts with; its workers accept no other."""
    return f"{WEIGHT_BUFFER_NAME_START}{os.getpid()}-{_pid_namespace()}-{secrets.token_hex(4)}"


def _pid_namespace() -> str:
    """This process's pid namespace (containers that share /dev/shm may each have their own)."""
    try:
        return f"ns{os.stat('/proc/self/ns/pid').st_ino:x}"
    except OSError:  # no /proc (macOS): one namespace
        return "ns0"


def remove_orphaned_buffers(directory: str = "/dev/shm") -> list[str]:
    """Remove the weight buffers of launchers that are no longer running; returns their names.

    A launcher and its workers killed together (the OOM killer, `kill -9` to the process group)
    leave their buffer in /dev/shm, where it holds the model's size in memory until reboot. The
    next launcher on the host removes it. Kept: a buffer whose launcher is alive, one of another
    pid namespace (a container sharing /dev/shm: its pids mean nothing here), one of another user,
    one not named by `weight_buffer_prefix`. `directory` is slime_meta_engine.weights.SHARED_MEMORY_DIR,
    not imported from there: train.py imports this module, and that one loads torch.
    """
    removed, namespace = [], _pid_namespace()
    for path in Path(directory).glob(WEIGHT_BUFFER_NAME_START + "*"):
        pid_text, _, rest = path.name[len(WEIGHT_BUFFER_NAME_START) :].partition("-")
        if not pid_text.isdigit() or not rest.startswith(namespace + "-") or _process_exists(int(pid_text)):
            continue
        try:
            path.unlink()
            removed.append(path.name)
        except OSError:  # another user's, or removed meanwhile
            pass
    if removed:
        logger.info("removed %d weight buffer(s) of launchers no longer running: %s", len(removed), ", ".join(removed))
    return removed


def _process_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        return True
    return True


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


class _ChildProcesses:
    """Spawning, waiting for and terminating children, and picking their ports.

    A mixin of `LocalProcessGroup`; uses its `_host`, `_startup_timeout_s`, `_stop_timeout_s`,
    `_reserved_ports` and `_child_setup`.
    """

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
                if http_ok(child.url + child.ready_path):
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
