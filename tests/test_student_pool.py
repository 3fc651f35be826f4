"""The student pool flags as the design document defines them, on the local backend.

- `--student-num-gpus` alone asks for a separate, frozen student pool; its checkpoint defaults to
  the teacher's starting one and its engine size to `--rollout-num-gpus-per-engine`.
- `--teacher-port` and `--student-router-port` are the ports of the routers this run starts.
- `--external-student-url` attaches to a student server that is already running.

The end-to-end cases run `train.py` with real workers behind the real sglang-router.
"""

from __future__ import annotations

import json
import socket
import urllib.request
from pathlib import Path

import pytest
import test_train_e2e as e2e

from slime_meta.backends.local.workers.launcher import LocalProcessGroup, visible_device
from slime_meta.backends.local.workers.pools import check_gpus_exist, describe_layout, worker_layouts
from slime_meta.config.arguments import parse_config
from slime_meta.errors import UserInputError

BASE = ["--use-meta-learning", "--prompt-data", "data/math_word_problems.jsonl", "--hf-checkpoint", "/ckpt/teacher"]
# One outer step of the synthetic task: 2 prompts x G=3 x (K=2 x k=2 + 2 holdout) problems + 2 x 2 controls,
# one request each: the m=2 attempts at a train problem are one request with n=2 (was 2 requests).
STUDENT_REQUESTS = 2 * 3 * (2 * 2 + 2) + 2 * 2
TEACHER_REQUESTS = 2 * 3 * 2


def free_ports(count: int) -> list[int]:
    sockets = [socket.socket() for _ in range(count)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def started_command(log: Path) -> str:
    """The command line a pool child was started with (the launcher writes it first in its log)."""
    return next(line for line in log.read_text().splitlines() if " starting: " in line)


def test_student_num_gpus_alone_means_a_frozen_copy_of_the_teacher():
    shared = parse_config(BASE)
    assert not shared.separate_student and shared.pools.student_checkpoint is None
    cfg = parse_config([*BASE, "--student-num-gpus", "2", "--rollout-num-gpus-per-engine", "2"])
    assert cfg.separate_student
    assert (cfg.pools.student_checkpoint, cfg.pools.student_num_gpus_per_engine) == ("/ckpt/teacher", 2)
    own = parse_config(
        [*BASE, "--student-num-gpus", "2", "--student-checkpoint", "/ckpt/small", "--student-num-gpus-per-engine", "1"]
    )
    assert (own.pools.student_checkpoint, own.pools.student_num_gpus_per_engine) == ("/ckpt/small", 1)


def test_student_workers_follow_the_teachers_gpus_with_the_teachers_engine_size():
    flags = [*BASE, "--rollout-num-gpus", "2", "--rollout-num-gpus-per-engine", "2", "--student-num-gpus", "4"]
    # slime's placement: inference on GPUs of its own after the trainer's GPU 0 ...
    teacher, student = worker_layouts(parse_config(flags))
    assert (teacher.num_workers, teacher.gpu_ids) == (1, (1,))
    assert (student.num_workers, student.gpu_ids) == (2, (3, 5))
    # ... or, with --colocate, from the trainer's GPU 0 on.
    teacher, student = worker_layouts(parse_config([*flags, "--colocate"]))
    assert (teacher.num_workers, teacher.gpu_ids) == (1, (0,))
    assert (student.num_workers, student.gpu_ids) == (2, (2, 4))


def test_a_student_pool_beside_workers_sharing_the_trainers_gpu_gets_the_next_gpu():
    teacher, student = worker_layouts(parse_config([*BASE, "--student-num-gpus", "1"]))
    assert (teacher.gpu_ids, student.gpu_ids) == (None, (1,))
    teacher, student = worker_layouts(parse_config([*BASE, "--student-num-gpus", "1", "--colocate"]))
    assert (teacher.gpu_ids, student.gpu_ids) == (None, (0,))


def test_a_layout_past_the_machines_gpus_is_refused_with_the_way_out():
    layouts = [(1, (1,)), (1, (2,))]
    check_gpus_exist(layouts, device_count=3)
    with pytest.raises(UserInputError, match="need GPU 2, and this machine has 2.*--colocate"):
        check_gpus_exist(layouts, device_count=2)
    assert describe_layout([(1, (1,)), (2, None)], ["teacher", "grader"]) == (
        "trainer GPU 0; teacher pool 1 worker(s) on GPU 1; grader pool 2 worker(s) on the trainer's device"
    )


def test_frozen_student_from_student_num_gpus_with_routers_on_the_given_ports(tiny_checkpoint, tmp_path):
    run_dir = tmp_path / "frozen-copy"
    teacher_port, student_port = free_ports(2)
    result = e2e.run_train(
        e2e.synthetic_args(
            tiny_checkpoint,
            run_dir,
            "--num-rollout",
            "1",
            "--student-num-gpus",
            "1",
            "--teacher-port",
            str(teacher_port),
            "--student-router-port",
            str(student_port),
        )
    )
    assert result.returncode == 0, result.stderr[-3000:]
    (record,) = e2e.read_jsonl(run_dir / "metrics.jsonl")
    assert record["pool/teacher_requests"] == TEACHER_REQUESTS  # the student's attempts went elsewhere
    assert record["pool/student_requests"] == STUDENT_REQUESTS
    logs = run_dir / "logs"
    assert f"--port {teacher_port} " in started_command(logs / "teacher-router.log")
    assert f"--port {student_port} " in started_command(logs / "student-router.log")
    assert f"--port {teacher_port} " not in started_command(
        logs / "teacher-worker-0.log"
    )  # the router's port, not a worker's
    student_worker = started_command(logs / "student-worker-0.log")
    assert f"--model-path {tiny_checkpoint} " in student_worker  # the teacher's starting weights
    assert "student-frozen-no-weight-updates" in student_worker  # a pool that refuses weight updates
    pools = json.loads((run_dir / "config.json").read_text())["pools"]
    assert pools["student_checkpoint"] == str(tiny_checkpoint) and pools["student_num_gpus_per_engine"] == 1
    assert e2e.processes_mentioning(str(run_dir)) == []


def test_external_student_server_is_used_and_nothing_is_started_for_it(tiny_checkpoint, tmp_path):
    with LocalProcessGroup(startup_timeout_s=120) as running:
        server = running.start_pool(
            "elsewhere", str(tiny_checkpoint), 1, device="cpu", weights_root=None, log_dir=str(tmp_path / "server-logs")
        )
        run_dir = tmp_path / "external"
        result = e2e.run_train(
            e2e.synthetic_args(
                tiny_checkpoint,
                run_dir,
                "--num-rollout",
                "1",
                "--external-student-url",
                server.router_url,
            )
        )
        assert result.returncode == 0, result.stderr[-3000:]
        with urllib.request.urlopen(f"{server.worker_urls[0]}/get_server_info", timeout=10) as response:
            served = json.loads(response.read())["num_generate_requests"]
    (record,) = e2e.read_jsonl(run_dir / "metrics.jsonl")
    assert served == record["pool/student_requests"] == STUDENT_REQUESTS
    assert record["pool/teacher_requests"] == TEACHER_REQUESTS
    assert not list((run_dir / "logs").glob("student-*"))


@pytest.mark.parametrize(
    "flags, needle",
    [
        (["--student-router-port", "30000"], "--student-router-port 30000: no student router is started"),
        (
            ["--student-router-ip", "10.0.0.2", "--student-num-gpus", "1"],
            "--student-router-ip 10.0.0.2: the local backend",
        ),
        (["--external-student-url", "10.0.0.2:30000"], "give the server as http://HOST:PORT"),
        (["--student-num-gpus", "0"], "--student-num-gpus"),
    ],
)
def test_student_pool_flags_that_cannot_work_are_refused(flags, needle, capsys):
    import train

    try:
        code = train.main([*BASE, *flags])
    except SystemExit as exit:  # argparse's refusal
        code = exit.code
    err = capsys.readouterr().err.strip()
    assert code == 2 and "\n" not in err and needle in err, err


def test_teacher_port_that_is_taken_exits_2_naming_the_flag(tiny_checkpoint, tmp_path, capsys):
    import train

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        code = train.main(e2e.synthetic_args(tiny_checkpoint, tmp_path / "run", "--teacher-port", str(port)))
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.startswith(f"error: --teacher-port {port}: cannot listen there"), err


def test_pool_gpus_count_within_the_runs_own_visible_devices():
    """A run shown GPUs 2,3 (CUDA_VISIBLE_DEVICES) numbers them 0 and 1: its pool on GPU 1 is physical GPU 3."""
    assert visible_device(1, {"CUDA_VISIBLE_DEVICES": "2,3"}) == "3"
    assert visible_device(1, {}) == "1"
    with pytest.raises(UserInputError, match="the pools need GPU 2, and CUDA_VISIBLE_DEVICES=2,3 shows 2"):
        visible_device(2, {"CUDA_VISIBLE_DEVICES": "2,3"})
