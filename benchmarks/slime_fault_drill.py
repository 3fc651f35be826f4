"""Faults a cluster user meets, on a live two-GPU launch (benchmarks/run_slime_2gpu.sh, started in a
session of its own): what the run says and whether anything is left behind.

  kill-server  wait until Megatron has logged step --after-step, then kill the SGLang server in the
               middle of the next rollout (its main process, its schedulers and its detokenizer, with
               SIGKILL: a crashed or OOM-killed server), and watch the console: the error lines the
               run prints, whether the launch ends by itself within --wait-s (nothing hung), and what
               is left afterwards (processes, GPU memory).
  sigterm      wait until Megatron has logged step --after-step, then SIGTERM the launch's process
               group (a scheduler's time limit, `kill`; Ctrl-C reaches the launch script the same way)
               and report the same.

  python benchmarks/slime_fault_drill.py kill-server --console runs/console_slime.log --after-step 51 \\
      --out benchmarks/results/slime_fault_kill_server.json
  python benchmarks/slime_fault_drill.py sigterm --console runs/console_check.log --after-step 4 \\
      --out benchmarks/results/slime_fault_sigterm.json

Linux only (reads /proc); nvidia-smi for the GPU memory. It starts nothing and installs nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

ERROR_LINE = re.compile(r"Error|Traceback|failed|refused|unavailable|exited|stopped", re.IGNORECASE)
LAUNCH_MARKER = "SLIME_META_LAUNCH="


def processes() -> list[dict]:
    """Every process: pid, parent, title (SGLang retitles its own, `sglang::scheduler`), launch marker."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
            ppid = int((entry / "stat").read_text().rsplit(") ", 1)[1].split()[1])
            environ = (entry / "environ").read_bytes().split(b"\0")
        except (OSError, IndexError, ValueError):
            continue
        marker = next((e.decode(errors="replace") for e in environ if e.startswith(LAUNCH_MARKER.encode())), "")
        found.append({"pid": int(entry.name), "ppid": ppid, "cmdline": cmdline[:200], "launch": marker})
    return found


def gpu_memory_mib() -> list[int]:
    out = subprocess.run(
        ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
        capture_output=True,
        text=True,
        check=False,
    ).stdout
    return [int(x) for x in out.split()] if out.strip() else []


def wait_for_step(console: Path, step: int, timeout_s: float) -> float:
    """Seconds waited until the console shows Megatron's `step N:` line."""
    pattern = re.compile(rf"model\.py:\d+ - step {step}:")
    start = time.monotonic()
    while time.monotonic() - start < timeout_s:
        if console.exists() and pattern.search(console.read_text(errors="replace")):
            return time.monotonic() - start
        time.sleep(2)
    raise SystemExit(f"error: {console}: no 'step {step}:' line within {timeout_s:.0f} s")


def launch_processes() -> list[dict]:
    return [p for p in processes() if p["launch"] and p["pid"] != os.getpid()]


def sglang_server_pids(everything: list[dict]) -> list[int]:
    """The launch's SGLang server processes: its schedulers and detokenizer (titled `sglang::...`), and the
    process that started them. Only processes that carry the launch's marker count, and never a router
    (sglang_router titles itself `sglang::router` too): a local run on the same host has its own router,
    whose parent is that run's train.py."""
    ours = [p for p in everything if p["launch"]]
    workers = [p for p in ours if p["cmdline"].startswith("sglang::") and not p["cmdline"].startswith("sglang::router")]
    parents = {p["ppid"] for p in workers}
    return sorted({p["pid"] for p in workers} | {p["pid"] for p in ours if p["pid"] in parents})


def launch_script_group(console: Path) -> int:
    """The process group of the launch (started with setsid: its leader's pid). The drill must run outside
    it: it signals the whole group and then waits for the group to empty."""
    for p in processes():
        if "run_slime_2gpu.sh" in p["cmdline"] or "launch_1node_2gpu.sh" in p["cmdline"]:
            group = os.getpgid(p["pid"])
            if group == os.getpgid(0):
                raise SystemExit(
                    f"error: the drill runs in the launch's own process group ({group}): start the launch "
                    "or the drill with setsid, so that each has a group of its own"
                )
            return group
    raise SystemExit(f"error: no launch script running (console {console})")


def watch(console: Path, offset: int, wait_s: float, group: int) -> dict:
    """Console lines after `offset` that look like errors, and when the launch's group emptied."""
    start = time.monotonic()
    ended_after = None
    while time.monotonic() - start < wait_s:
        alive = [p for p in processes() if p["pid"] != os.getpid() and _group(p["pid"]) == group]
        if not alive:
            ended_after = time.monotonic() - start
            break
        time.sleep(1)
    text = console.read_text(errors="replace")[offset:]
    lines = [line.strip()[:400] for line in text.splitlines() if ERROR_LINE.search(line)]
    return {"ended_after_s": ended_after, "error_lines": lines[:40], "console_tail": text.splitlines()[-30:]}


def _group(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except ProcessLookupError:
        return None


def leftovers(settle_s: float) -> dict:
    time.sleep(settle_s)
    left = launch_processes()
    return {
        "processes_left": [{"pid": p["pid"], "cmdline": p["cmdline"]} for p in left],
        "sglang_processes_left": sglang_server_pids(processes()),
        "gpu_memory_used_mib": gpu_memory_mib(),
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("drill", choices=["kill-server", "sigterm"])
    parser.add_argument("--console", type=Path, required=True, help="the launch's console log")
    parser.add_argument("--after-step", type=int, required=True, help="Megatron's step (0-based) to wait for")
    parser.add_argument("--wait-s", type=float, default=240.0, help="how long the run may take to end by itself")
    parser.add_argument("--step-timeout-s", type=float, default=900.0)
    parser.add_argument("--out", type=Path, required=True)
    ns = parser.parse_args(argv)

    waited = wait_for_step(ns.console, ns.after_step, ns.step_timeout_s)
    group = launch_script_group(ns.console)
    offset = len(ns.console.read_text(errors="replace"))
    result = {
        "drill": ns.drill,
        "after_step": ns.after_step,
        "waited_for_step_s": round(waited, 1),
        "gpu_memory_before_mib": gpu_memory_mib(),
        "launch_processes_before": len(launch_processes()),
    }
    if ns.drill == "kill-server":
        time.sleep(3)  # into the next step's rollout (the run is one step ahead: it is already sampling)
        everything = processes()
        victims = sglang_server_pids(everything)
        result["killed"] = [p for p in everything if p["pid"] in victims]
        for pid in victims:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    else:
        result["signalled_group"] = group
        os.killpg(group, signal.SIGTERM)
    t0 = time.monotonic()
    result.update(watch(ns.console, offset, ns.wait_s, group))
    result["hung"] = result["ended_after_s"] is None
    if result["hung"]:  # end it the way a user would, and say so
        os.killpg(group, signal.SIGTERM)
        result["ended_by_sigterm_after_s"] = round(time.monotonic() - t0, 1)
        time.sleep(20)
    result.update(leftovers(settle_s=5.0))
    ns.out.parent.mkdir(parents=True, exist_ok=True)
    ns.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k not in ("console_tail", "killed")}, indent=2)[:4000])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
