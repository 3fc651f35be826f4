"""GPU memory of a benchmark run, sampled from `nvidia-smi` while it runs (benchmarks/step.py)."""

from __future__ import annotations

import os
import subprocess
import threading
import time
from pathlib import Path
from typing import Any


class GpuMemorySampler(threading.Thread):
    """Samples `nvidia-smi` (each GPU's total and each process's use) until stopped; keeps the peaks.

    Only the GPUs this run sees count (CUDA_VISIBLE_DEVICES by index, else all): on a machine of
    several GPUs other jobs may hold the rest. `peak_device_gib` is the run's first GPU (the
    trainer's), `peak_by_gpu_gib` every one of its GPUs."""

    def __init__(self, interval_s: float):
        super().__init__(daemon=True)
        self.interval_s, self.stopped = interval_s, threading.Event()
        self.peak_by_gpu_mib, self.peak_by_pid_mib, self.samples, self.available = {}, {}, 0, True
        self.gpu_of_pid: dict[str, str] = {}
        self.started, self.first_seen_s = time.perf_counter(), {}  # when each pid first held memory
        visible = os.environ.get("CUDA_VISIBLE_DEVICES", "")
        self.visible = [v.strip() for v in visible.split(",")] if visible.replace(",", "").isdigit() else None

    def _query(self, query: str) -> list[list[str]]:
        out = subprocess.run(
            ["nvidia-smi", query, "--format=csv,noheader,nounits"], capture_output=True, text=True, timeout=10
        ).stdout
        return [[field.strip() for field in line.split(",")] for line in out.splitlines() if line.strip()]

    def run(self) -> None:
        while not self.stopped.is_set():
            try:
                gpus = self._query("--query-gpu=index,uuid,memory.used")
                apps = self._query("--query-compute-apps=pid,gpu_uuid,used_memory")
            except (OSError, subprocess.TimeoutExpired):
                self.available = False
                return
            index_of_uuid = {uuid: index for index, uuid, _ in gpus}
            for index, _, used in gpus:
                if self.visible is None or index in self.visible:
                    self.peak_by_gpu_mib[index] = max(self.peak_by_gpu_mib.get(index, 0.0), float(used))
            for pid, uuid, used in apps:
                index = index_of_uuid.get(uuid, "?")
                if used.isdigit() and (self.visible is None or index in self.visible):
                    key = f"{pid}@{index}"  # a process may hold memory on several GPUs
                    self.peak_by_pid_mib[key] = max(self.peak_by_pid_mib.get(key, 0.0), float(used))
                    self.first_seen_s.setdefault(key, time.perf_counter() - self.started)
            self.samples += 1
            self.stopped.wait(self.interval_s)

    def report(self, trainer_pid: int) -> dict[str, Any]:
        if not self.available or not self.samples:
            return {"available": False}
        processes = {}
        for key, mib in self.peak_by_pid_mib.items():
            pid, _, gpu = key.partition("@")
            try:
                command = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                command = "(exited or outside this pid namespace)"
            role = "trainer (train.py)" if pid == str(trainer_pid) else ("worker" if "serving" in command else "other")
            # Outside this pid namespace (a container) the roles are unknown; the worker starts
            # before train.py builds its trainer, so the order of first appearance tells them apart.
            processes[key] = {
                "role": role,
                "gpu": gpu,
                "peak_gib": mib / 1024,
                "first_seen_s": round(self.first_seen_s[key], 1),
            }
        first_gpu = self.visible[0] if self.visible else min(self.peak_by_gpu_mib, key=int, default=None)
        return {
            "available": True,
            "samples": self.samples,
            "peak_device_gib": self.peak_by_gpu_mib.get(first_gpu, 0.0) / 1024,
            "peak_by_gpu_gib": {gpu: mib / 1024 for gpu, mib in sorted(self.peak_by_gpu_mib.items())},
            "processes": processes,
            "peak_sum_of_processes_gib": sum(p["peak_gib"] for p in processes.values()),
        }
