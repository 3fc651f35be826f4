"""Weights pushed through CUDA IPC reach the worker's CUDA-graph decode path (needs a GPU).

A trainer and two real workers on one GPU: one pool takes the trainer's weights through CUDA IPC,
the other through the disk. The graphs read the parameters in place, so they only see the new
weights if the copy went into the same memory: greedy generations on the graph path must change,
and equal those of the disk-updated pool, after each of two pushes (the second reuses the opened
buffer).
"""

from __future__ import annotations

import json
import time
import urllib.request
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from slime_meta.backends.local.training.settings import TrainerSettings
from slime_meta.backends.local.training.trainer import LocalTrainer
from slime_meta.backends.local.workers.launcher import LocalProcessGroup
from slime_meta.backends.local.workers.weight_sync import WeightSync, make_weight_sync, push_weights
from slime_meta.rollout.pools import post_json_sync
from slime_meta_engine.weights import SHARED_MEMORY_DIR

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def server_info(worker_url: str) -> dict:
    with urllib.request.urlopen(worker_url + "/get_server_info", timeout=30) as response:
        return json.loads(response.read())


def greedy(url: str, ids: list[int]) -> tuple[list[int], list[float]]:
    reply = post_json_sync(
        url + "/generate",
        {
            "input_ids": ids,
            "sampling_params": {"temperature": 0.0, "max_new_tokens": 24, "ignore_eos": True},
            "return_logprob": True,
        },
    )
    return reply["output_ids"], [entry[0] for entry in reply["meta_info"]["output_token_logprobs"]]


def nudge(trainer: LocalTrainer, seed: int) -> None:
    generator = torch.Generator(device=trainer.device).manual_seed(seed)
    with torch.no_grad():
        for parameter in trainer.model.parameters():
            parameter.add_(0.1 * torch.randn(parameter.shape, generator=generator, device=trainer.device))


def test_cuda_ipc_push_reaches_the_cuda_graph_decode_path(tiny_checkpoint, tmp_path):
    tokenizer = AutoTokenizer.from_pretrained(tiny_checkpoint)
    prompt = tokenizer("T#abcd:abcdxy!abcdef;>", add_special_tokens=False)["input_ids"]
    shm_before = set(Path(SHARED_MEMORY_DIR).iterdir())
    with LocalProcessGroup() as ipc_group, LocalProcessGroup() as disk_group:
        ipc = ipc_group.start_pool(
            "teacher", str(tiny_checkpoint), 1, device="cuda", weights_root=str(tmp_path / "w1"), log_dir=str(tmp_path)
        )
        disk = disk_group.start_pool(
            "teacher", str(tiny_checkpoint), 1, device="cuda", weights_root=str(tmp_path / "w2"), log_dir=str(tmp_path)
        )
        worker = ipc.worker_urls[0]
        assert server_info(worker)["engine"]["decode_path"] == "cuda_graphs"
        start_ids, _ = greedy(worker, prompt)
        trainer = LocalTrainer(str(tiny_checkpoint), TrainerSettings(lr=1e-3, device="cuda"))
        sync = make_weight_sync("auto", trainer, ipc.worker_urls, tmp_path / "w1", ipc_group.weight_buffer_prefix)
        assert sync.mode == "cuda-ipc"
        previous = start_ids
        for version, seed in ((1, 11), (2, 12)):
            nudge(trainer, seed)
            static_before = server_info(worker)["engine"]["static_requests"]
            push_weights(trainer, list(ipc.worker_urls), tmp_path / "w1", version, ipc_group, sync)
            push_weights(
                trainer,
                list(disk.worker_urls),
                tmp_path / "w2",
                version,
                disk_group,
                WeightSync("disk", tmp_path / "w2"),
            )
            ipc_ids, ipc_logprobs = greedy(worker, prompt)
            disk_ids, disk_logprobs = greedy(disk.worker_urls[0], prompt)
            assert server_info(worker)["engine"]["static_requests"] == static_before + 1  # decoded by the graphs
            assert ipc_ids != previous  # the graphs see the new weights
            assert ipc_ids == disk_ids and ipc_logprobs == disk_logprobs  # the same bf16 weights as through the disk
            assert server_info(worker)["weight_version"] == str(version)
            previous = ipc_ids
        assert not (tmp_path / "w1").exists() or not any((tmp_path / "w1").iterdir())  # nothing written to disk
        # A restarted worker opens the trainer's buffer anew and serves the current weights.
        restarts = ipc_group.restarts("teacher")
        ipc_group.kill_worker("teacher", 0)
        deadline = time.monotonic() + 120
        while ipc_group.restarts("teacher") == restarts and time.monotonic() < deadline:
            time.sleep(0.5)
        assert greedy(worker, prompt) == (disk_ids, disk_logprobs)
        assert server_info(worker)["weight_version"] == "2"
        sync.close()
    leftovers = {p.name for p in set(Path(SHARED_MEMORY_DIR).iterdir()) - shm_before}
    assert not [name for name in leftovers if "slime-meta" in name]
