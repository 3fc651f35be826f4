"""The cluster launch scripts end every process they started: on Ctrl-C, on SIGTERM, when the run fails
and when it ends.

scripts/_launch.sh's `start_head` and `submit_run` run here as the launch scripts call them. Ray is not in
the test environment, so a stand-in `ray` command plays its part where it matters for the cleanup:
`ray start` leaves a detached daemon behind (as Ray's head does) with a child that ignores SIGTERM and
that `ray stop` does not reach (as an SGLang server outlives its killed engine actor); the driver
(`$PYTHON train.py`) is a stand-in that starts a child of its own and waits.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]

STAND_IN_RAY = r"""#!/usr/bin/env bash
# Stand-in for Ray's CLI (Ray is not installed in the test environment).
echo "ray $*" >> "$LOG_DIR/ray.log"
case "$1" in
  start)
    [ -n "${RAY_START_FAILS:-}" ] && { echo "ray start: a Ray instance is already running" >&2; exit 1; }
    # The head: a daemon in a session of its own, with a child that ignores SIGTERM (an SGLang server).
    setsid "$REAL_PYTHON" -c '
import os, signal, subprocess, sys, time
deaf = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"
child = subprocess.Popen([sys.executable, "-c", deaf])
open(os.environ["LOG_DIR"] + "/head.pid", "w").write(f"{os.getpid()} {child.pid}")
time.sleep(600)
' </dev/null >/dev/null 2>&1 &
    for _ in $(seq 100); do [ -f "$LOG_DIR/head.pid" ] && exit 0; sleep 0.1; done
    exit 1 ;;
  stop)
    # Ray's head goes; the server under it does not (it is not one of Ray's processes).
    read -r head _ < "$LOG_DIR/head.pid" && kill -9 "$head" 2>/dev/null
    exit 0 ;;
esac
"""

STAND_IN_PYTHON = r"""#!/usr/bin/env bash
# Stand-in for the driver: `$PYTHON .../train.py ...` starts a child and waits; anything else is real Python.
if [[ "${1:-}" == */train.py ]]; then
  exec "$REAL_PYTHON" -c '
import os, subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
open(os.environ["LOG_DIR"] + "/driver.pid", "w").write(f"{os.getpid()} {child.pid}")
code = int(os.environ.get("DRIVER_EXIT", "-1"))
if code >= 0:
    time.sleep(0.5)
    sys.exit(code)
time.sleep(600)
'
fi
exec "$REAL_PYTHON" "$@"
"""


def is_gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return Path(f"/proc/{pid}/stat").read_text().split(") ")[-1].startswith("Z")


def wait_for(path: Path, timeout_s: float = 30.0) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if path.exists() and path.read_text().strip():
            return path.read_text()
        time.sleep(0.1)
    raise AssertionError(f"{path} never appeared")


@pytest.fixture
def launch(tmp_path):
    """Start scripts/_launch.sh's head + driver with the stand-ins; returns (process, log dir)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("ray", STAND_IN_RAY), ("python", STAND_IN_PYTHON)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    script = tmp_path / "launch.sh"
    script.write_text(
        textwrap.dedent(
            f"""\
            set -euo pipefail
            REPO_DIR={REPO_ROOT}; cd "$REPO_DIR"
            PYTHON={bin_dir}/python DATA=data/price_lists.jsonl PROMPTS={tmp_path}/prompts.slime.jsonl
            MASTER_ADDR=127.0.0.1 MEGATRON_DIR=/nonexistent
            ARGS=(--use-meta-learning)
            source scripts/_launch.sh
            start_head 0
            submit_run
            """
        )
    )
    started = []

    def start(**env_extra):
        env = {
            **os.environ,
            "PATH": f"{bin_dir}:{os.environ['PATH']}",
            "LOG_DIR": str(tmp_path),
            "REAL_PYTHON": sys.executable,
            "STOP_GRACE_S": "2",
            **env_extra,
        }
        proc = subprocess.Popen(["bash", str(script)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        started.append(proc)
        return proc

    yield start, tmp_path
    for proc in started:
        if proc.poll() is None:
            proc.kill()
    for name in ("head.pid", "driver.pid"):  # never leave a stray process behind, whatever failed
        if (tmp_path / name).exists():
            for pid in (tmp_path / name).read_text().split():
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except (ProcessLookupError, ValueError):
                    pass


def launched_pids(log_dir: Path) -> list[int]:
    head = wait_for(log_dir / "head.pid").split()
    driver = wait_for(log_dir / "driver.pid").split()
    return [int(p) for p in head + driver]


@pytest.mark.parametrize(("sig", "code"), [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_a_signal_ends_the_driver_ray_and_the_server_ray_stop_misses(launch, sig, code):
    start, log_dir = launch
    proc = start()
    pids = launched_pids(log_dir)
    assert not any(is_gone(pid) for pid in pids)
    proc.send_signal(sig)
    output = proc.communicate(timeout=60)[0].decode()
    assert proc.returncode == code, output
    assert "no process of this launch is left" in output
    assert [pid for pid in pids if not is_gone(pid)] == []
    assert "ray stop --force" in (log_dir / "ray.log").read_text()


def test_a_failed_run_exits_with_its_status_and_leaves_nothing(launch):
    start, log_dir = launch
    proc = start(DRIVER_EXIT="3")
    pids = launched_pids(log_dir)
    output = proc.communicate(timeout=60)[0].decode()
    assert proc.returncode == 3, output
    assert [pid for pid in pids if not is_gone(pid)] == []


def test_a_finished_run_leaves_nothing(launch):
    start, log_dir = launch
    proc = start(DRIVER_EXIT="0")
    pids = launched_pids(log_dir)
    output = proc.communicate(timeout=60)[0].decode()
    assert proc.returncode == 0, output
    assert [pid for pid in pids if not is_gone(pid)] == []


def test_a_ray_already_running_is_left_alone(launch):
    start, log_dir = launch
    proc = start(RAY_START_FAILS="1")
    output = proc.communicate(timeout=60)[0].decode()
    assert proc.returncode != 0
    assert "already running" in output
    assert "ray stop" not in (log_dir / "ray.log").read_text()
    assert not (log_dir / "driver.pid").exists()
