"""Shared pieces of the benchmarks: where the repo is, what machine ran, tables, JSON, processes.

Every benchmark prints a plain-text table last and writes one JSON file holding the machine, the
command, the date, its settings and every measured figure, so `docs/performance.md` can quote a
file rather than a memory.
"""

from __future__ import annotations

import ctypes
import datetime as _dt
import json
import os
import platform
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Sequence

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:  # `python benchmarks/x.py` without the package installed
    sys.path.insert(0, str(REPO_ROOT))


def machine_info() -> dict[str, Any]:
    info: dict[str, Any] = {
        "hostname": socket.gethostname(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
        "cpu_model": _cpu_model(),
    }
    try:
        import torch

        info["torch"] = torch.__version__
        if torch.cuda.is_available():
            props = torch.cuda.get_device_properties(0)
            info["gpu"] = props.name
            info["gpu_memory_gib"] = round(props.total_memory / 2**30, 1)
            info["gpu_sms"] = props.multi_processor_count
    except ImportError:
        pass
    try:
        import transformers

        info["transformers"] = transformers.__version__
    except ImportError:
        pass
    return info


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def report_header(name: str, settings: dict[str, Any]) -> dict[str, Any]:
    return {
        "benchmark": name,
        "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC"),
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "machine": machine_info(),
        "settings": settings,
    }


def write_json(report: dict[str, Any], path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2, default=float) + "\n")
    return path


def default_out(name: str) -> Path:
    """Where a benchmark writes its JSON: $OUT when it is set, else runs/benchmarks/."""
    base = Path(os.environ["OUT"]) if os.environ.get("OUT") else REPO_ROOT / "runs" / "benchmarks"
    return base / f"{name}.json"


def table(rows: Sequence[Sequence[Any]], header: Sequence[str]) -> str:
    cells = [[_cell(v) for v in row] for row in [header, *rows]]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))) for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        if value != value:
            return "nan"
        if abs(value) >= 1000:
            return f"{value:,.0f}"
        if abs(value) >= 10:
            return f"{value:.1f}"
        return f"{value:.3g}"
    return str(value)


# ----------------------------------------------------------------------------- child processes


def free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    sockets, ports = [], []
    try:
        for _ in range(count):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind((host, 0))
            sockets.append(s)
            ports.append(s.getsockname()[1])
    finally:
        for s in sockets:
            s.close()
    return ports


def _die_with_parent() -> None:
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGTERM))  # PR_SET_PDEATHSIG


def status_mib(key: str) -> float:
    """A /proc/self/status figure in MiB (VmRSS: resident now; VmHWM: the peak since the start)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) / 1024
    raise KeyError(key)


def http_ok(url: str, timeout_s: float = 2.0) -> bool:
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(url, timeout=timeout_s) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False


def http_json(url: str, payload: dict | None = None, timeout_s: float = 10.0) -> Any:
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    data = None if payload is None else json.dumps(payload).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with opener.open(request, timeout=timeout_s) as response:
        return json.loads(response.read().decode())


class Children:
    """Processes this benchmark starts; all stopped (by their own pids) on exit."""

    def __init__(self, log_dir: Path):
        self.log_dir = log_dir
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.processes: list[tuple[str, subprocess.Popen]] = []

    def __enter__(self) -> Children:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self, name: str, command: list[str], env: dict[str, str] | None = None) -> subprocess.Popen:
        log = open(self.log_dir / f"{name}.log", "ab")
        full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        full_env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), full_env.get("PYTHONPATH")) if p)
        process = subprocess.Popen(
            command,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=full_env,
            preexec_fn=_die_with_parent,  # noqa: PLW1509
        )
        log.close()
        self.processes.append((name, process))
        return process

    def wait_ready(self, urls: Sequence[str], timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        pending = list(urls)
        while pending:
            for name, process in self.processes:
                if process.poll() is not None:
                    tail = (self.log_dir / f"{name}.log").read_text(errors="replace")[-2000:]
                    raise RuntimeError(f"{name} exited with {process.returncode} while starting:\n{tail}")
            pending = [u for u in pending if not http_ok(u)]
            if pending and time.monotonic() > deadline:
                raise RuntimeError(f"not ready after {timeout_s:.0f}s: {pending}")
            if pending:
                time.sleep(0.1)

    def cpu_seconds(self) -> dict[str, float]:
        """user+system CPU seconds of each running child, read from /proc (Linux)."""
        ticks = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
        out = {}
        for name, process in self.processes:
            try:
                fields = Path(f"/proc/{process.pid}/stat").read_text().rsplit(")", 1)[1].split()
                out[name] = (int(fields[11]) + int(fields[12])) / ticks
            except (OSError, IndexError, ValueError):
                out[name] = float("nan")
        return out

    def stop(self) -> None:
        for _, process in self.processes:
            if process.poll() is None:
                process.terminate()
        deadline = time.monotonic() + 5.0
        for _, process in self.processes:
            try:
                process.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        self.processes.clear()


def quiet_transformers() -> None:
    """No progress bars or info logs from transformers in the benchmark output."""
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()
    transformers_logging.set_verbosity_error()


def median_replay_ms(graph, reps: int, warmup: int = 3) -> float:
    """Median time of one replay of a captured CUDA graph, each timed with its own CUDA events."""
    import statistics

    import torch

    for _ in range(warmup):
        graph.replay()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for start, end in zip(starts, ends):
        start.record()
        graph.replay()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(start.elapsed_time(end) for start, end in zip(starts, ends))


def median_eager_ms(step, reps: int) -> float:
    """Median host-clock time of one call of `step` after one warm-up call (the CPU runs)."""
    import statistics

    step()
    times = []
    for _ in range(reps):
        started = time.perf_counter()
        step()
        times.append((time.perf_counter() - started) * 1e3)
    return statistics.median(times)
