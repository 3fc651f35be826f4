"""Reliability of the inference pools, with real processes: one teacher pool of two embedded
workers behind the real sglang-router, shared by the tests of this module (in file order).

- a worker SIGKILLed in the middle of an outer step's rollout: the step completes with every
  group whole, the retries are counted, the supervisor restarts the worker on its port with the
  pool's current weights and registers it with the router again, which then uses it;
- every worker and router listens on 127.0.0.1 only;
- `/update_weights_from_disk` refuses a path outside the run's weight directory (HTTP 400);
- 10,000 requests in flight through `SGLangPool`: bounded connections and memory, nothing leaks;
- `stop()` during a restart: nothing is restarted, nothing is left behind.
"""

from __future__ import annotations

import asyncio
import gc
import json
import os
import shutil
import signal
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from slime_meta.assembly import build_role_pieces, build_rollout, load_tokenizer, make_pool
from slime_meta.backends.local.data import load_data
from slime_meta.backends.local.workers.launcher import LocalProcessGroup
from slime_meta.config.arguments import parse_config
from slime_meta.rollout.pools import SGLangPool

ROOT = Path(__file__).resolve().parent.parent
POOL = "teacher"
NUM_WORKERS = 2


def get_json(url: str, timeout: float = 10.0) -> dict:
    with urllib.request.urlopen(url, timeout=timeout) as response:
        return json.loads(response.read())


def post_json(url: str, body: dict, timeout: float = 60.0) -> tuple[int, dict]:
    request = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}, method="POST"
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read() or b"{}")


def served(worker_url: str) -> int:
    return get_json(worker_url + "/get_server_info")["num_generate_requests"]


def wait_until(condition, timeout_s: float, interval_s: float = 0.1) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(interval_s)
    return condition()


def rss_kib(pid: int | str = "self") -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


def open_fds(pid: int | str = "self") -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


@pytest.fixture(scope="module")
def group_and_pool(tiny_checkpoint, tmp_path_factory):
    root = tmp_path_factory.mktemp("reliability-pool")
    weights_root = root / "weights"
    weights_root.mkdir()
    with LocalProcessGroup(startup_timeout_s=180) as group:
        endpoints = group.start_pool(
            POOL,
            str(tiny_checkpoint),
            NUM_WORKERS,
            device="cpu",
            weights_root=str(weights_root),
            log_dir=str(root / "logs"),
        )
        yield group, endpoints, root


def synthetic_config(checkpoint: Path, run_dir: Path):
    """A synthetic-task config sized so that one rollout takes a few seconds on two cores."""
    return parse_config(
        [
            "--use-meta-learning",
            "--hf-checkpoint",
            str(checkpoint),
            "--prompt-data",
            str(ROOT / "data/synthetic_suffix.jsonl"),
            "--group-key",
            "family",
            "--rollout-shuffle",
            "--rollout-batch-size",
            "16",
            "--n-samples-per-prompt",
            "4",
            "--n-problems-per-prompt",
            "2",
            "--heldout-ipb",
            "8",
            "--num-inner-iterations",
            "3",
            "--n-samples-per-inner-prompt",
            "2",
            "--generator-template",
            "slime_meta.data.tasks.synthetic.SyntheticGeneratorTemplate",
            "--teacher-template",
            "slime_meta.data.tasks.synthetic.SyntheticTeacherTemplate",
            "--teacher-temperature",
            "1.0",
            "--teacher-max-tokens",
            "12",
            "--rollout-max-response-len",
            "12",
            "--grader",
            "verifier",
            "--verifier-metric",
            "char",
            "--trace-sample-rate",
            "0",
            "--seed",
            "5",
            "--run-dir",
            str(run_dir),
        ]
    )


def test_sigkill_of_a_worker_mid_step_loses_no_sample_and_the_worker_comes_back(group_and_pool, tiny_checkpoint):
    group, endpoints, root = group_and_pool
    # The pool serves trained weights (version 1) before the kill: the restarted worker must too.
    weights_v1 = root / "weights" / "v0000001"
    shutil.copytree(tiny_checkpoint, weights_v1)
    assert len(group.update_weights(POOL, str(weights_v1), 1)) == NUM_WORKERS

    cfg = synthetic_config(tiny_checkpoint, root / "run")
    tokenizer = load_tokenizer(str(tiny_checkpoint))
    data = load_data(cfg)
    episodes = data.sampler.next_episodes(**data.draw_sizes)
    pid_before = group.child_pids()
    router_retries_before = group.router_retries(POOL)
    killed = {}

    async def step_with_a_kill():
        teacher_pool = make_pool(cfg, "teacher", endpoints.router_url, cfg.sampling.teacher_concurrency)
        student_pool = make_pool(cfg, "student", endpoints.router_url, cfg.sampling.student_concurrency)
        try:
            rollout = build_rollout(cfg, build_role_pieces(cfg), teacher_pool, student_pool, tokenizer)
            step = asyncio.create_task(rollout.run(episodes, rollout_id=0, seed=cfg.seed))
            while teacher_pool.stats.requests + student_pool.stats.requests < 60:  # well into the step
                assert not step.done(), "the rollout ended before the kill: make it longer"
                await asyncio.sleep(0.01)
            killed["requests_before"] = teacher_pool.stats.requests + student_pool.stats.requests
            await asyncio.to_thread(group.kill_worker, POOL, 0, signal.SIGKILL)
            killed["step_was_running"] = not step.done()
            result = await step
            return result, {
                "teacher": teacher_pool.stats.snapshot_and_reset(),
                "student": student_pool.stats.snapshot_and_reset(),
            }
        finally:
            await teacher_pool.close()
            await student_pool.close()

    result, stats = asyncio.run(step_with_a_kill())
    assert killed["step_was_running"]

    # The step completed and lost nothing: every group has G samples, every chain K infos and
    # every holdout grade.
    G, K = cfg.meta.n_samples_per_prompt, cfg.meta.num_inner_iterations
    groups = {}
    for sample in result.samples:
        groups.setdefault(sample.group_index, []).append(sample.sample_index)
    assert sorted(groups) == list(range(data.plan.groups))
    assert all(sorted(indices) == list(range(G)) for indices in groups.values())
    assert all(len(c.steps) == K and len(c.holdout_scores) == data.num_holdout for c in result.chains)
    assert all(
        sample.response_ids and len(sample.rollout_logprobs) == len(sample.response_ids) for sample in result.samples
    )
    total_requests = stats["teacher"]["requests"] + stats["student"]["requests"]
    chains = data.plan.groups * G
    k = cfg.meta.n_problems_per_prompt  # a problem's m attempts are one student request (n = m)
    assert total_requests == chains * (K * (k + 1) + data.num_holdout) + data.plan.groups * data.num_holdout
    assert stats["teacher"]["failures"] == stats["student"]["failures"] == 0

    # The retries are counted: the router re-sent the requests of the dead worker (its
    # Prometheus counter), and anything that still failed through it was retried by our client.
    router_retries = group.router_retries(POOL) - router_retries_before
    client_retries = stats["teacher"]["retries"] + stats["student"]["retries"]
    assert router_retries + client_retries > 0, (router_retries, client_retries)

    # The supervisor restarted the worker on its port, with the pool's weights, and the router uses it.
    assert wait_until(lambda: group.restarts(POOL) == 1, timeout_s=90), group.restarts(POOL)
    worker_url = endpoints.worker_urls[0]
    with urllib.request.urlopen(worker_url + "/health", timeout=10) as response:
        assert response.status == 200
    assert set(group.child_pids()) != set(pid_before) and len(group.child_pids()) == NUM_WORKERS + 1
    assert str(get_json(worker_url + "/get_model_info")["weight_version"]) == "1"
    served_before = served(worker_url)
    for index in range(6):
        status, reply = post_json(
            endpoints.router_url + "/generate", {"text": f"after {index}", "sampling_params": {"max_new_tokens": 2}}
        )
        assert status == 200 and reply["output_ids"], reply
    assert served(worker_url) > served_before  # round robin reaches the restarted worker again
    print(
        f"\nworker death: killed after {killed['requests_before']} of {total_requests} requests; "
        f"router retries {router_retries}, client retries {client_retries}, restarts {group.restarts(POOL)}"
    )


def _listening_inodes_to_addresses() -> dict[str, str]:
    """Inode -> 'ip:port' of every listening TCP socket of this network namespace."""
    listening = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            local, state, inode = fields[1], fields[3], fields[9]
            if state == "0A":  # TCP_LISTEN
                address_hex, port_hex = local.split(":")
                if len(address_hex) == 8:
                    address = ".".join(str(int(address_hex[i : i + 2], 16)) for i in (6, 4, 2, 0))
                else:
                    address = "::1" if address_hex == "0" * 24 + "01000000" else address_hex
                listening[inode] = f"{address}:{int(port_hex, 16)}"
    return listening


def test_workers_and_router_listen_on_loopback_only(group_and_pool):
    group, _, _ = group_and_pool
    listening = _listening_inodes_to_addresses()
    found = {}
    for pid in group.child_pids():
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith("socket:[") and target[8:-1] in listening:
                found.setdefault(pid, []).append(listening[target[8:-1]])
    # Each worker listens on its port, the router on its port and its metrics port.
    assert sum(len(addresses) for addresses in found.values()) >= NUM_WORKERS + 2, found
    for pid, addresses in found.items():
        for address in addresses:
            assert address.startswith("127.0.0.1:"), (pid, address)


def test_weight_updates_from_outside_the_run_weight_dir_are_refused(group_and_pool, tiny_checkpoint):
    group, endpoints, root = group_and_pool
    (root / "weights" / "escape").symlink_to(tiny_checkpoint, target_is_directory=True)
    for outside in (tiny_checkpoint, root / "weights" / "escape", root / "weights" / ".." / "logs"):
        for worker_url in endpoints.worker_urls:
            status, reply = post_json(worker_url + "/update_weights_from_disk", {"model_path": str(outside)})
            assert status == 400 and reply["success"] is False, (outside, reply)
    with pytest.raises(RuntimeError, match="outside the weights root"):
        group.update_weights(POOL, str(tiny_checkpoint), 99)
    # A refused update is not remembered: a restarted worker would not get it either.
    for worker_url in endpoints.worker_urls:
        assert str(get_json(worker_url + "/get_model_info")["weight_version"]) != "99"


def test_ten_thousand_requests_in_flight_with_bounded_memory_and_fds(group_and_pool):
    group, endpoints, _ = group_and_pool
    concurrency = 256

    async def flood(count: int) -> dict:
        pool = SGLangPool("load", endpoints.router_url, concurrency=concurrency, max_retries=3)
        peak = {"fds": 0, "rss": 0}

        async def monitor():
            while True:
                peak["fds"] = max(peak["fds"], open_fds())
                peak["rss"] = max(peak["rss"], rss_kib())
                await asyncio.sleep(0.05)

        watcher = asyncio.create_task(monitor())
        requests = [
            pool.generate(text=f"q{i % 97}", sampling_params={"max_new_tokens": 1, "temperature": 0})
            for i in range(count)
        ]
        completions = await asyncio.gather(*requests)
        watcher.cancel()
        stats = pool.stats.snapshot_and_reset()
        await pool.close()
        await asyncio.sleep(0.25)  # aiohttp closes its transports on the next loop iterations
        assert len(completions) == count and all(len(c.output_ids) == 1 for c in completions)
        return {**peak, **stats}

    gc.collect()
    fds_before, rss_before = open_fds(), rss_kib()
    warm = asyncio.run(flood(1000))  # warm-up: imports, connection pool, allocator arenas
    del warm
    gc.collect()
    rss_warm, fds_warm = rss_kib(), open_fds()
    started = time.monotonic()
    load = asyncio.run(flood(10_000))
    elapsed = time.monotonic() - started
    gc.collect()
    rss_after, fds_after = rss_kib(), open_fds()
    assert load["requests"] == 10_000 and load["failures"] == 0
    # Connections are bounded by the pool's connector, not by the requests in flight.
    assert load["fds"] - fds_before <= concurrency + 16, (fds_before, load["fds"])
    assert fds_after <= fds_warm + 2 and fds_after <= fds_before + 2, (fds_before, fds_warm, fds_after)
    # 10,000 pending requests cost little memory (< 12 KiB each at the peak), and it is returned.
    in_flight_kib = load["rss"] - rss_warm
    assert in_flight_kib < 10_000 * 12, in_flight_kib
    assert rss_after <= rss_warm * 1.10 + 16 * 1024, (rss_warm, rss_after)
    children_fds = {pid: open_fds(pid) for pid in group.child_pids()}
    assert all(count < 1024 for count in children_fds.values()), children_fds
    print(
        f"\nload: 10,000 requests in {elapsed:.1f}s; fds {fds_before} -> peak {load['fds']} -> {fds_after}; "
        f"RSS {rss_before} KiB -> warm {rss_warm} -> peak {load['rss']} -> {rss_after} KiB; "
        f"router/worker fds after: {sorted(children_fds.values())}"
    )


def test_when_every_worker_dies_the_client_waits_for_the_restarts(group_and_pool):
    """No worker left: the router answers 503 at once, and only our client's retries with
    backoff carry the requests over the restart (what a one-worker pool always meets)."""
    group, endpoints, _ = group_and_pool
    restarts_before = group.restarts(POOL)

    async def requests_over_a_total_outage():
        # Retries for about a minute: a restart (a process start and a model load) takes longer on a loaded machine.
        pool = SGLangPool(
            "outage", endpoints.router_url, concurrency=32, max_retries=18, initial_backoff_s=0.5, max_backoff_s=4.0
        )
        requests = [
            asyncio.create_task(pool.generate(text=f"o{i}", sampling_params={"max_new_tokens": 4, "temperature": 0}))
            for i in range(200)
        ]
        try:
            while pool.stats.requests < 20:
                await asyncio.sleep(0.01)
            for index in range(NUM_WORKERS):
                await asyncio.to_thread(group.kill_worker, POOL, index, signal.SIGKILL)
            completions = await asyncio.gather(*requests)
            return completions, pool.stats.snapshot_and_reset()
        finally:
            await pool.close()

    started = time.monotonic()
    completions, stats = asyncio.run(requests_over_a_total_outage())
    assert len(completions) == 200 and all(c.output_ids for c in completions)
    assert stats["failures"] == 0 and stats["retries"] > 0, stats
    assert wait_until(lambda: group.restarts(POOL) == restarts_before + NUM_WORKERS, timeout_s=60)
    for worker_url in endpoints.worker_urls:  # both came back with the pool's weights
        assert str(get_json(worker_url + "/get_model_info")["weight_version"]) == "1"
    print(f"\ntotal outage: 200 requests done in {time.monotonic() - started:.1f}s, client retries {stats['retries']}")


def test_stop_during_a_restart_restarts_nothing_and_leaves_nothing(group_and_pool):
    """Last in the module: it stops the shared group."""
    group, endpoints, root = group_and_pool
    log = root / "logs" / f"{POOL}-worker-1.log"
    starts_before = log.read_text().count("=== ")
    group.kill_worker(POOL, 1, signal.SIGKILL)
    assert wait_until(lambda: log.read_text().count("=== ") == starts_before + 1, timeout_s=10), "no restart began"
    pids = group.child_pids()
    started = time.monotonic()
    group.stop()
    assert time.monotonic() - started < 15
    assert group.child_pids() == []
    for pid in pids:
        assert wait_until(lambda pid=pid: not Path(f"/proc/{pid}").exists() or _is_zombie(pid), timeout_s=5), pid
    time.sleep(1.5)  # three supervisor periods: a restart after stop() would show in the log
    assert log.read_text().count("=== ") == starts_before + 1
    port = endpoints.worker_urls[1].rsplit(":", 1)[1]
    assert f":{port}" not in " ".join(_listening_inodes_to_addresses().values())


def _is_zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[-1].startswith("Z")
    except OSError:
        return True
