"""Weights pushed through one /dev/shm buffer instead of the disk: same served weights, nothing left behind.

Real workers behind the real router (tiny model, CPU), real HTTP, the real trainer. A disk push
into a second pool is the reference: both pools must then give the same log-probs and greedy
generations. `train.py` runs check the flag end to end and that no buffer outlives a run, a
SIGTERMed run or a SIGKILLed one.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import torch
from test_train_e2e import run_train, synthetic_args
from test_weight_sync import score, weight_version
from transformers import AutoTokenizer

from slime_meta.backends.local.training.settings import TrainerSettings
from slime_meta.backends.local.training.trainer import LocalTrainer
from slime_meta.backends.local.workers.launcher import LocalProcessGroup
from slime_meta.backends.local.workers.weight_sync import WeightSync, choose_mode, make_weight_sync, push_weights
from slime_meta.errors import UserInputError
from slime_meta.rollout.pools import post_json_sync
from slime_meta_engine.weights import SHARED_MEMORY_DIR

ROOT = Path(__file__).resolve().parent.parent


def buffers_named(prefix: str) -> list[str]:
    return sorted(p.name for p in Path(SHARED_MEMORY_DIR).glob(prefix + "*"))


def greedy(url: str, ids: list[int]) -> list[int]:
    reply = post_json_sync(
        url + "/generate", {"input_ids": ids, "sampling_params": {"temperature": 0.0, "max_new_tokens": 12}}
    )
    return reply["output_ids"]


def post_raw(url: str, body: dict) -> tuple[int, dict]:
    request = urllib.request.Request(
        url, json.dumps(body).encode(), {"Content-Type": "application/json"}, method="POST"
    )
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def moved_trainer(checkpoint: Path) -> LocalTrainer:
    """A trainer whose weights differ clearly from the checkpoint the workers started with."""
    trainer = LocalTrainer(str(checkpoint), TrainerSettings(lr=5e-2, device="cpu"))
    generator = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for parameter in trainer.model.parameters():
            parameter.add_(0.05 * torch.randn(parameter.shape, generator=generator))
    return trainer


@pytest.fixture(scope="module")
def pools(tiny_checkpoint, tmp_path_factory):
    """Group `shm` pushes through shared memory, group `disk` through the disk; both start from the checkpoint."""
    root = tmp_path_factory.mktemp("sync")
    with LocalProcessGroup() as shm_group, LocalProcessGroup() as disk_group:
        shm = shm_group.start_pool(
            "teacher", str(tiny_checkpoint), 1, device="cpu", weights_root=str(root / "w1"), log_dir=str(root)
        )
        disk = disk_group.start_pool(
            "teacher", str(tiny_checkpoint), 1, device="cpu", weights_root=str(root / "w2"), log_dir=str(root)
        )
        yield shm_group, shm, disk_group, disk, root


def test_shared_memory_push_serves_what_a_disk_push_serves(pools, tiny_checkpoint):
    shm_group, shm, disk_group, disk, root = pools
    tokenizer = AutoTokenizer.from_pretrained(tiny_checkpoint)
    probe = tokenizer("T#abcd:abcdxy!abcdef;>", add_special_tokens=False)["input_ids"]
    before = score(shm.router_url, probe)
    trainer = moved_trainer(tiny_checkpoint)
    sync = make_weight_sync("auto", trainer, shm.worker_urls, root / "w1", shm_group.weight_buffer_prefix)
    assert sync.mode == "shared-memory"  # CPU trainer, workers of this group
    assert buffers_named(shm_group.weight_buffer_prefix) == [shm_group.weight_buffer_prefix + "-weights"]
    push_weights(trainer, list(shm.worker_urls), root / "w1", 1, shm_group, sync)
    push_weights(trainer, list(disk.worker_urls), root / "w2", 1, disk_group, WeightSync("disk", root / "w2"))

    after_shm, after_disk = score(shm.router_url, probe), score(disk.router_url, probe)
    assert max(abs(a - b) for a, b in zip(after_shm, before)) > 1e-3  # the new weights are served
    assert after_shm == after_disk  # float32 both ways: exactly the same weights
    assert greedy(shm.router_url, probe) == greedy(disk.router_url, probe)
    assert weight_version(shm.worker_urls[0]) == "1"
    assert not (root / "w1").exists() or not any((root / "w1").iterdir())  # nothing written to disk

    # A worker restarted after the push loads the current buffer before it serves again.
    restarts = shm_group.restarts("teacher")
    shm_group.kill_worker("teacher", 0)
    deadline = time.monotonic() + 120
    while shm_group.restarts("teacher") == restarts and time.monotonic() < deadline:
        time.sleep(0.5)
    assert shm_group.restarts("teacher") == restarts + 1
    assert score(shm.worker_urls[0], probe) == after_disk and weight_version(shm.worker_urls[0]) == "1"
    sync.close()
    assert buffers_named(shm_group.weight_buffer_prefix) == []


def test_buffers_outside_the_prefix_or_the_layout_are_refused(pools, tiny_checkpoint, tmp_path):
    shm_group, shm, _, _, root = pools
    url = shm.worker_urls[0] + "/update_weights_from_shared_memory"
    trainer = moved_trainer(tiny_checkpoint)
    sync = make_weight_sync("shared-memory", trainer, shm.worker_urls, root / "w1", shm_group.weight_buffer_prefix)
    update = sync.publish(trainer, 3)
    version = weight_version(shm.worker_urls[0])
    outsider = Path(SHARED_MEMORY_DIR) / f"not-ours-{os.getpid()}-weights"
    outsider.write_bytes((Path(SHARED_MEMORY_DIR) / update.body["buffer_name"]).read_bytes())
    disguised = Path(SHARED_MEMORY_DIR) / f"{shm_group.weight_buffer_prefix}-link"
    disguised.symlink_to(outsider)
    try:
        for name in (outsider.name, "../" + update.body["buffer_name"], disguised.name):
            status, reply = post_raw(url, {**update.body, "buffer_name": name})
            assert status == 400 and reply["success"] is False, (name, reply)
        too_far = [dict(entry, offset=entry["offset"] + 10**9) for entry in update.body["tensors"]]
        status, reply = post_raw(url, {**update.body, "tensors": too_far})
        assert status == 400 and "does not fit" in reply["message"]
        wrong_shape = [dict(entry, shape=[3, 3]) if i == 0 else entry for i, entry in enumerate(update.body["tensors"])]
        status, reply = post_raw(url, {**update.body, "tensors": wrong_shape})
        assert status == 400 and "shape mismatch" in reply["message"]
        assert weight_version(shm.worker_urls[0]) == version  # nothing was loaded
        status, reply = post_raw(url, {**update.body, "weight_version": "ok"})  # the same body, its own name: taken
        assert status == 200 and reply["success"] is True
    finally:
        outsider.unlink()
        disguised.unlink()
        sync.close()


def test_a_worker_without_a_prefix_refuses_and_auto_falls_back_to_disk(tiny_checkpoint, tmp_path):
    with LocalProcessGroup() as group:
        frozen = group.start_pool(
            "student", str(tiny_checkpoint), 1, device="cpu", weights_root=None, log_dir=str(tmp_path)
        )
        status, reply = post_raw(
            frozen.worker_urls[0] + "/update_weights_from_shared_memory", {"buffer_name": "x", "tensors": []}
        )
        assert status == 400 and "--weight-buffer-prefix" in reply["message"]
        trainer = moved_trainer(tiny_checkpoint)
        assert (
            make_weight_sync("auto", trainer, frozen.worker_urls, tmp_path, group.weight_buffer_prefix).mode == "disk"
        )
        with pytest.raises(UserInputError, match="--weight-sync shared-memory"):
            make_weight_sync("shared-memory", trainer, frozen.worker_urls, tmp_path, group.weight_buffer_prefix)


def test_auto_picks_by_where_trainer_and_workers_are():
    ours = {"device": "cpu", "dtype": "float32", "gpu_uuid": None, "buffer_prefix": "p"}
    assert choose_mode("auto", torch.device("cpu"), [ours, ours]) == "shared-memory"
    assert choose_mode("auto", torch.device("cpu"), [ours, None]) == "disk"
    assert choose_mode("disk", torch.device("cpu"), [ours]) == "disk"
    with pytest.raises(UserInputError, match="--weight-sync cuda-ipc needs the trainer and every teacher worker"):
        choose_mode("cuda-ipc", torch.device("cpu"), [ours])


def run_dir_args(tiny_checkpoint, run_dir: Path, *extra: str) -> list[str]:
    return synthetic_args(tiny_checkpoint, run_dir, "--num-rollout", "1", *extra)


@pytest.mark.parametrize("mode", ["shared-memory", "disk"])
def test_train_runs_with_each_mode_and_leave_no_buffer(mode, tiny_checkpoint, tmp_path):
    before = set(buffers_named("slime-meta-weights-"))
    # An entropy bonus always has a gradient: the step is never skipped for want of a training signal
    # (all grades of a group equal), so there is always a push to check.
    flags = ("--weight-sync", mode, "--entropy-coef", "0.001")
    result = run_train(run_dir_args(tiny_checkpoint, tmp_path / "run", *flags))
    assert result.returncode == 0, result.stderr[-3000:]
    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert not metrics[0].get("train/skipped_no_signal") and metrics[0]["perf/weight_push_time"] > 0
    assert f"through {mode} (--weight-sync {mode})" in result.stdout
    written = sorted(p.name for p in (tmp_path / "run" / "weights").iterdir())
    assert written == (["v0000001"] if mode == "disk" else [])
    assert set(buffers_named("slime-meta-weights-")) - before == set()  # a new run may remove orphans of earlier ones


@pytest.mark.parametrize("signal_number", [signal.SIGTERM, signal.SIGKILL])
def test_a_killed_run_leaves_no_buffer(signal_number, tiny_checkpoint, tmp_path):
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    args = run_dir_args(tiny_checkpoint, tmp_path / "run", "--weight-sync", "shared-memory")
    args[args.index("--num-rollout") + 1] = "50"
    stderr_path = tmp_path / "stderr.txt"
    with stderr_path.open("w") as stderr:
        process = subprocess.Popen(
            [sys.executable, str(ROOT / "train.py"), *args],
            cwd=ROOT,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=stderr,
        )
    prefix = f"slime-meta-weights-{process.pid}-"
    try:
        deadline = time.monotonic() + 180
        while not buffers_named(prefix) and time.monotonic() < deadline and process.poll() is None:
            time.sleep(0.2)
        assert buffers_named(prefix), "the run never made its buffer"
        process.send_signal(signal_number)
        try:
            process.wait(timeout=120)
        except subprocess.TimeoutExpired:  # name where it waits: every thread's stack (train.py's SIGUSR1)
            process.send_signal(signal.SIGUSR1)
            time.sleep(3)
            pytest.fail(f"still running 120 s after signal {signal_number}:\n{stderr_path.read_text()[-6000:]}")
        deadline = time.monotonic() + 30  # after SIGKILL the workers remove it on their way out
        while buffers_named(prefix) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert buffers_named(prefix) == []
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def test_benchmark_script_runs_on_a_toy_model(tmp_path):
    out = tmp_path / "weight_sync.json"
    result = subprocess.run(
        [
            sys.executable,
            "benchmarks/weight_sync.py",
            "--shape",
            "tiny",
            "--device",
            "cpu",
            "--steps",
            "2",
            "--out",
            str(out),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(out.read_text())
    assert "benchmarks/weight_sync.py --shape tiny" in report["command"] and report["machine"] and report["date"]
    for mode in ("disk", "shared-memory"):
        assert len(report["results"][mode]["push_s"]) == 2 and report["results"][mode]["changed_from_start"]
    assert report["results"]["shared-memory"]["same_logprobs_as_disk"] is True
