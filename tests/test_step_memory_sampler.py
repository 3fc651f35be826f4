"""benchmarks/step.py's GPU memory sampler counts only the GPUs its run sees.

nvidia-smi cannot run on this machine: its answers are stand-ins for a four-GPU host where other
jobs hold GPUs 2 and 3, replayed through the sampler's one query function.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from gpu_memory_sampler import GpuMemorySampler  # noqa: E402

GPUS = [["0", "GPU-a", "20000"], ["1", "GPU-b", "9000"], ["2", "GPU-c", "70000"], ["3", "GPU-d", "70000"]]
APPS = [["100", "GPU-a", "16000"], ["200", "GPU-b", "8500"], ["300", "GPU-c", "69000"], ["100", "GPU-b", "500"]]


def sampled(monkeypatch, visible: str | None) -> dict:
    if visible is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    sampler = GpuMemorySampler(interval_s=0.01)
    answers = {"--query-gpu=index,uuid,memory.used": GPUS, "--query-compute-apps=pid,gpu_uuid,used_memory": APPS}
    monkeypatch.setattr(sampler, "_query", lambda query: answers[query])
    sampler.start()
    while sampler.samples < 2:
        sampler.stopped.wait(0.01)
    sampler.stopped.set()
    sampler.join()
    return sampler.report(trainer_pid=100)


def test_two_visible_gpus_of_four_are_the_only_ones_counted(monkeypatch):
    report = sampled(monkeypatch, "0,1")
    assert report["peak_by_gpu_gib"] == {"0": 20000 / 1024, "1": 9000 / 1024}
    assert report["peak_device_gib"] == 20000 / 1024  # the run's first GPU: the trainer's
    assert sorted(report["processes"]) == ["100@0", "100@1", "200@1"]  # not the job on GPU 2
    assert report["processes"]["100@0"]["role"] == "trainer (train.py)"
    assert report["processes"]["200@1"]["gpu"] == "1"


def test_without_a_device_list_every_gpu_counts_and_the_first_is_gpu_0(monkeypatch):
    report = sampled(monkeypatch, None)
    assert list(report["peak_by_gpu_gib"]) == ["0", "1", "2", "3"]
    assert report["peak_device_gib"] == 20000 / 1024
    assert len(report["processes"]) == 4
