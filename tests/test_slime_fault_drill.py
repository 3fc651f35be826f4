"""benchmarks/slime_fault_drill.py picks its victims among the launch's processes only.

On a host where a local run shares the machine with a slime launch, the local run's sglang-router
(which titles itself `sglang::router`, as SGLang's schedulers title themselves `sglang::scheduler`) and
its train.py must survive a kill-server drill aimed at the launch's SGLang server.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from slime_fault_drill import sglang_server_pids  # noqa: E402

MARK = "SLIME_META_LAUNCH=run-1"


def proc(pid: int, ppid: int, cmdline: str, launch: str = "") -> dict:
    return {"pid": pid, "ppid": ppid, "cmdline": cmdline, "launch": launch}


def test_kill_server_victims_are_the_launch_servers_processes_only():
    everything = [
        # the launch: a Ray actor that started the SGLang server, its scheduler and detokenizer, slime's router
        proc(100, 1, "ray::SGLangEngine", MARK),
        proc(101, 100, "python3 -m sglang.launch_server --port 15000", MARK),
        proc(102, 101, "sglang::scheduler", MARK),
        proc(103, 101, "sglang::detokenizer", MARK),
        proc(104, 1, "sglang::router", MARK),
        # a local run on the same host: its train.py, its router, its engine worker
        proc(200, 1, "python3 train.py --hf-checkpoint /models/qwen"),
        proc(201, 200, "sglang::router"),
        proc(202, 200, "python3 -m slime_meta_engine --port 31000"),
    ]
    assert sglang_server_pids(everything) == [101, 102, 103]


def test_no_launch_no_victims():
    everything = [proc(200, 1, "python3 train.py"), proc(201, 200, "sglang::router"), proc(202, 1, "sglang::scheduler")]
    assert sglang_server_pids(everything) == []
