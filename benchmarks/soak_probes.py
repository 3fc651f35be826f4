"""What benchmarks/soak.py reads of a run's processes, from /proc and nvidia-smi: resident memory split
by kind, open descriptors, GPU memory per process and per GPU, and the run's process tree by role."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from slime_meta_engine.memory_snapshots import resident_kib  # noqa: E402


def memory_kib(pid: int) -> dict[str, int] | None:
    """Resident memory of a process, KiB: all of it (rss_kib) and by kind (anon_kib: what it allocated;
    file_kib: mapped files it touched, libraries' code among them; shmem_kib); None once it is gone."""
    memory = resident_kib(pid)
    return memory if "rss_kib" in memory else None


def _nvidia_smi(query: str, fields: str) -> list[list[int]]:
    """Rows of integers from `nvidia-smi --query-QUERY=FIELDS`; none without nvidia-smi or on an error."""
    if shutil.which("nvidia-smi") is None:
        return []
    try:
        out = subprocess.run(
            ["nvidia-smi", f"--query-{query}={fields}", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=30,
        ).stdout
        return [[int(v) for v in line.split(",")] for line in out.splitlines() if line.strip()]
    except (OSError, subprocess.SubprocessError, ValueError):
        return []


def gpu_memory_by_pid() -> dict[int, int]:
    """MiB of GPU memory per process (summed over GPUs), as the driver reports it."""
    out: dict[int, int] = {}
    for pid, mib in _nvidia_smi("compute-apps", "pid,used_memory"):
        out[pid] = out.get(pid, 0) + mib
    return out


def gpu_memory_used() -> list[int]:
    """MiB in use on each GPU; empty without GPUs."""
    return [row[0] for row in _nvidia_smi("gpu", "memory.used")]


def fd_count(pid: int) -> int | None:
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return None


def descendants(pid: int) -> dict[int, str]:
    """Child processes (recursively) of `pid`: pid -> a short name: router:PORT, worker:PORT (the pid
    where the command line has no --port: a router renames itself sglang::router), trainer, and
    other:PID for anything else (the verifier's math children)."""
    parents = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parents[int(entry.name)] = int((entry / "stat").read_text().rsplit(") ", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
    found, frontier = {}, [pid]
    while frontier:
        parent = frontier.pop()
        for child, child_parent in parents.items():
            if child_parent == parent and child not in found:
                try:
                    argv = Path(f"/proc/{child}/cmdline").read_bytes().split(b"\0")
                except OSError:
                    continue
                words = [a.decode(errors="replace") for a in argv]
                port = words[words.index("--port") + 1] if "--port" in words else str(child)  # else its pid
                if any("sglang" in w and "router" in w for w in words):  # it renames itself sglang::router
                    found[child] = f"router:{port}"
                elif any(w == "slime_meta_engine" for w in words):
                    found[child] = f"worker:{port}"
                elif any(w.endswith("train.py") for w in words):
                    found[child] = "trainer"
                else:
                    found[child] = f"other:{child}"
                frontier.append(child)
    return found


def allocator_mib(records: str) -> dict[str, float]:
    """The trainer's caching allocator after its last step, from metrics.jsonl's text (its last whole
    line): allocated and reserved MiB (`memory/gpu_*`, logged on a GPU); none off the GPU or before
    the first step."""
    whole = records[: records.rfind("\n") + 1].splitlines()  # not a line being written
    try:
        last = json.loads(whole[-1]) if whole else {}
    except json.JSONDecodeError:
        return {}
    names = {"allocated_mib": "memory/gpu_allocated_mib", "reserved_mib": "memory/gpu_reserved_mib"}
    return {key: last[name] for key, name in names.items() if isinstance(last.get(name), (int, float))}
