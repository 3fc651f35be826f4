"""Pools of real worker processes behind the real sglang-router, and that none outlive their owner."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
import urllib.request
from pathlib import Path

import pytest

from slime_meta.backends.local.workers.launcher import LocalProcessGroup
from slime_meta.backends.local.workers.processes import LaunchError

REPO_ROOT = Path(__file__).resolve().parents[1]


def generate(url: str, text: str) -> dict:
    body = json.dumps({"text": text, "sampling_params": {"max_new_tokens": 3, "temperature": 0}}).encode()
    request = urllib.request.Request(f"{url}/generate", data=body, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        return json.loads(response.read())


def served_count(worker_url: str) -> int:
    with urllib.request.urlopen(f"{worker_url}/get_server_info", timeout=10) as response:
        return json.loads(response.read())["num_generate_requests"]


def is_gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    # Still in the process table: only acceptable as an unreaped zombie of someone else.
    return Path(f"/proc/{pid}/stat").read_text().split(") ")[-1].startswith("Z")


def processes_mentioning(marker: str) -> list[int]:
    """Live processes whose command line contains `marker` (a unique port or path)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if marker in (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace"):
                    found.append(int(entry.name))
            except OSError:
                continue
    return [pid for pid in found if pid != os.getpid() and not is_gone(pid)]


def wait_until(condition, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.1)
    return condition()


def test_pool_behind_router_spreads_requests_restarts_and_stops_clean(tiny_checkpoint: Path, tmp_path: Path) -> None:
    with LocalProcessGroup(startup_timeout_s=120) as group:
        endpoints = group.start_pool(
            "teacher", str(tiny_checkpoint), 2, device="cpu", weights_root=str(tmp_path), log_dir=str(tmp_path / "logs")
        )
        assert endpoints.name == "teacher" and len(endpoints.worker_urls) == 2
        assert endpoints.router_url.startswith("http://127.0.0.1:")
        pids = group.child_pids()
        assert len(pids) == 3

        outputs = [generate(endpoints.router_url, "same prompt")["output_ids"] for _ in range(8)]
        assert all(output == outputs[0] for output in outputs)  # same weights on both workers
        counts = [served_count(url) for url in endpoints.worker_urls]
        assert sum(counts) == 8 and min(counts) >= 1, counts  # round robin reached both

        group.restart_worker("teacher", 0)
        restarted_pids = group.child_pids()
        assert len(restarted_pids) == 3 and set(restarted_pids) != set(pids)
        assert served_count(endpoints.worker_urls[0]) == 0  # a fresh process
        assert generate(endpoints.router_url, "after restart")["output_ids"]
        all_pids = set(pids) | set(restarted_pids)
        router_port = endpoints.router_url.rsplit(":", 1)[1]

    assert all(is_gone(pid) for pid in all_pids)
    assert processes_mentioning(f"--port {router_port}") == []
    for name in ("teacher-worker-0.log", "teacher-worker-1.log", "teacher-router.log"):
        assert (tmp_path / "logs" / name).is_file()


def test_worker_that_cannot_start_is_reported_with_its_log(tmp_path: Path) -> None:
    empty_model_dir = tmp_path / "not-a-model"
    empty_model_dir.mkdir()
    with LocalProcessGroup(startup_timeout_s=120) as group:
        with pytest.raises(LaunchError, match="broken-worker-0.log"):
            group.start_pool("broken", str(empty_model_dir), 1, device="cpu", weights_root=None, log_dir=str(tmp_path))
        assert group.child_pids() == []


PARENT_SCRIPT = textwrap.dedent(
    """
    import signal, sys, time
    from slime_meta.backends.local.workers.launcher import LocalProcessGroup
    # A shell starts background jobs (CI, nohup, `cmd &`) with SIGINT ignored, and Python then
    # keeps it ignored; a program in a terminal gets Ctrl-C. Model the terminal.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    group = LocalProcessGroup(startup_timeout_s=120)
    with group:
        group.start_pool("p", sys.argv[1], 1, device="cpu", weights_root=None, log_dir=sys.argv[2])
        print(" ".join(map(str, group.child_pids())), flush=True)
        time.sleep(120)
    """
)


# signal sent to the parent -> the parent's expected exit code
PARENT_ENDINGS = {
    signal.SIGTERM: 143,  # turned into SystemExit(143): the cleanup runs through __exit__
    signal.SIGINT: -signal.SIGINT,  # KeyboardInterrupt: the cleanup runs, then Python re-raises SIGINT
    signal.SIGKILL: -signal.SIGKILL,  # no cleanup possible: PR_SET_PDEATHSIG takes the children down
}


def test_children_die_with_their_parent(tiny_checkpoint: Path, tmp_path: Path) -> None:
    # One parent per signal, all started at once to share the start-up time.
    parents = {
        parent_signal: subprocess.Popen(
            [sys.executable, "-c", PARENT_SCRIPT, str(tiny_checkpoint), str(tmp_path / parent_signal.name)],
            stdout=subprocess.PIPE,
            env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
        )
        for parent_signal in PARENT_ENDINGS
    }
    try:
        child_pids = {}
        for parent_signal, parent in parents.items():
            child_pids[parent_signal] = [int(pid) for pid in parent.stdout.readline().split()]
            assert len(child_pids[parent_signal]) == 2, f"the {parent_signal.name} parent did not start its pool"
        for parent_signal, parent in parents.items():
            parent.send_signal(parent_signal)
            assert parent.wait(30) == PARENT_ENDINGS[parent_signal], parent_signal.name
            # With a cleanup the children were reaped before the parent exited; without one, the
            # kernel's SIGTERM still needs a moment to land.
            patience_s = 10 if parent_signal == signal.SIGKILL else 0
            pids = child_pids[parent_signal]
            assert wait_until(lambda pids=pids: all(is_gone(pid) for pid in pids), patience_s), (
                parent_signal.name,
                pids,
            )
    finally:
        for parent in parents.values():
            if parent.poll() is None:
                parent.kill()
                parent.wait()


def ctrl_c_run_args(checkpoint: Path, run_dir: Path) -> list[str]:
    """A run long enough to be interrupted in its second step (the tiny model, the built-in verifier)."""
    return [
        "--use-meta-learning",
        "--hf-checkpoint",
        str(checkpoint),
        "--prompt-data",
        str(REPO_ROOT / "data/synthetic_suffix.jsonl"),
        "--group-key",
        "family",
        "--rollout-batch-size",
        "8",
        "--n-samples-per-prompt",
        "4",
        "--n-problems-per-prompt",
        "2",
        "--heldout-ipb",
        "4",
        "--num-inner-iterations",
        "2",
        "--n-samples-per-inner-prompt",
        "2",
        "--generator-template",
        "slime_meta.data.tasks.synthetic.SyntheticGeneratorTemplate",
        "--teacher-template",
        "slime_meta.data.tasks.synthetic.SyntheticTeacherTemplate",
        "--teacher-max-tokens",
        "4",
        "--rollout-max-response-len",
        "8",
        "--grader",
        "verifier",
        "--num-rollout",
        "200",
        "--run-dir",
        str(run_dir),
    ]


# How the trainer starts with SIGINT: from a terminal (Python turns it into KeyboardInterrupt), or
# as a background job of a script (`train.py &`: inherited as ignored; the workers and the router
# end on it all the same).
SIGINT_AT_START = {"terminal": signal.SIG_DFL, "background_job": signal.SIG_IGN}


def test_ctrl_c_mid_step_ends_the_run_as_interrupted_and_restarts_nothing(
    tiny_checkpoint: Path, tmp_path: Path
) -> None:
    runs, stderr_paths = {}, {}
    for name, disposition in SIGINT_AT_START.items():
        stderr_paths[name] = tmp_path / f"{name}.stderr"
        with open(stderr_paths[name], "w") as stderr_file:  # a file: progress bars never fill a pipe
            runs[name] = subprocess.Popen(
                [sys.executable, str(REPO_ROOT / "train.py"), *ctrl_c_run_args(tiny_checkpoint, tmp_path / name)],
                cwd=REPO_ROOT,
                stdout=subprocess.PIPE,
                stderr=stderr_file,
                text=True,
                env={**os.environ, "PYTHONPATH": str(REPO_ROOT), "PYTHONUNBUFFERED": "1"},
                # A process group of its own, as a terminal's foreground job has: the signal goes to all of it.
                start_new_session=True,
                preexec_fn=lambda disposition=disposition: signal.signal(signal.SIGINT, disposition),
            )
    try:
        for name, run in runs.items():
            for line in run.stdout:  # the first step is done ("step 1/N ..."): the second one is under way
                if line.startswith("step 1/"):
                    break
            else:
                pytest.fail(f"{name}: the run ended before its first step:\n{stderr_paths[name].read_text()[-3000:]}")
        for run in runs.values():
            time.sleep(0.3)
            os.killpg(run.pid, signal.SIGINT)
        for name, run in runs.items():
            run.communicate(timeout=60)
            stderr = stderr_paths[name].read_text()
            assert run.returncode == 130, (name, stderr[-3000:])
            assert "interrupted: workers and routers stopped" in stderr, (name, stderr[-3000:])
            assert "restarting" not in stderr, (name, stderr[-3000:])
            assert "error:" not in stderr, (name, stderr[-3000:])
            assert wait_until(lambda name=name: processes_mentioning(str(tmp_path / name)) == [], 10), name
    finally:
        for run in runs.values():
            if run.poll() is None:
                os.killpg(run.pid, signal.SIGKILL)
                run.wait()


def test_router_port_that_is_taken_is_refused_before_anything_starts(tiny_checkpoint: Path, tmp_path: Path) -> None:
    import socket

    from slime_meta.backends.local.workers.launcher import PortInUse

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with LocalProcessGroup() as group:
            with pytest.raises(PortInUse) as error:
                group.start_pool(
                    "teacher",
                    str(tiny_checkpoint),
                    1,
                    device="cpu",
                    weights_root=None,
                    log_dir=str(tmp_path),
                    router_port=port,
                )
            assert error.value.port == port and group.child_pids() == [] and group.pool_names() == []
