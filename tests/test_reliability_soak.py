"""Soak (slow, run separately): 50 outer steps of the embedded default without resident memory
or file descriptors growing after warm-up; and a fast check of the same thing in the default run.

    python -m pytest -q -s -m slow tests/test_reliability_soak.py
    # longer, under CPU contention (busy loops beside the run): 200 steps, one core kept busy
    SLIME_META_SOAK_STEPS=200 SLIME_META_SOAK_CPU_LOAD=1 python -m pytest -q -s -m slow tests/test_reliability_soak.py

The run is `scripts/run_synthetic.sh` (what `scripts/demo.sh` runs: the demo model, four teacher
prompts x eight infos, checkpoints every two steps) with `NUM_ROLLOUT=50`, sampled by
`benchmarks/soak.py` (the same run as a benchmark with a results file): after every step (a new
line in metrics.jsonl) the resident set size and the open file descriptors of the trainer and of
each child (router, worker). Warm-up is the first `WARMUP_STEPS` steps (allocator arenas, torch
caches, the optimizer's state, the router's connection pool), and lasts until the run's first plot
(drawn 60 s in: matplotlib's import and caches, ~30 MiB once); the figure is the median of the last
five samples before the final step (which is taken while the run shuts down) against the median of
the five samples after warm-up: at most 10% more. The samples are written to `soak.json` in the run
directory and printed.

Under contention the trainer once grew 24% (895 -> 1,107 MB) while it stayed flat alone: its
step ran on asyncio's default executor, which starts a new thread when asked while its last one
is still winding down, and each new thread that trained kept its own glibc arena of freed memory.
The trainer's work now runs on one thread of its own; the fast test below holds that in place.

Alone on an idle machine it later grew 15% in 50 steps (430 -> 495 MiB) and kept creeping: the
tokenizer's word cache held every distinct prompt (`assembly.without_word_cache`), and the trainer
thread's arena held 10-60 MiB of freed memory, a different amount each step
(`settings.return_freed_heap`). `test_the_trainer_keeps_no_memory_from_step_to_step` catches the
first kind (memory kept per step) in the default run, from glibc's count of bytes in use.
"""

from __future__ import annotations

import ctypes
import gc
import json
import os
import statistics
import sys
import threading
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from benchmarks.soak import run_soak, summarise  # noqa: E402

NUM_ROLLOUT = int(os.environ.get("SLIME_META_SOAK_STEPS", "50"))
CPU_LOAD = int(os.environ.get("SLIME_META_SOAK_CPU_LOAD", "0"))  # busy-loop processes beside the run
WARMUP_STEPS = 10
MAX_GROWTH = 0.10


@pytest.mark.slow
def test_fifty_outer_steps_without_memory_or_fd_growth(tmp_path):
    run = run_soak(NUM_ROLLOUT, tmp_path / "soak", cpu_load=CPU_LOAD, log_path=tmp_path / "soak.log")
    assert run.returncode == 0, run.log[-3000:]
    assert len(run.step_times) == NUM_ROLLOUT
    report = summarise(run, WARMUP_STEPS)
    (tmp_path / "soak" / "soak.json").write_text(
        json.dumps({"samples": run.samples, "plot_steps": run.plot_steps, "report": report}, indent=1)
    )
    print(
        f"\nsoak: {NUM_ROLLOUT} steps in {run.seconds:.0f}s (median step {statistics.median(run.step_times):.1f}s, "
        f"{CPU_LOAD} busy loop(s) beside the run, warm-up to step {run.warmup_end(WARMUP_STEPS)})"
    )
    for name, figures in report.items():
        print(f"  {name}: {json.dumps(figures)}")
    assert "trainer" in report and any(name.startswith("worker") for name in report)
    for name, figures in report.items():
        assert figures["growth"] <= MAX_GROWTH, (name, figures)
        assert figures["fds_end"] <= figures["fds_after_warmup"] + 8, (name, figures)


class _Mallinfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks")
        + ("keepcost",)
    ]


def heap_in_use() -> int:
    """Bytes the process's malloc calls hold, every arena and mmapped block (glibc's mallinfo2):
    what the program keeps, Python's objects and native libraries' alike, without the freed memory
    glibc keeps resident (which `return_freed_heap` hands back, and RSS shows)."""
    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = _Mallinfo2
    info = libc.mallinfo2()
    return info.uordblks + info.hblkhd


FAST_STEPS = 22
FAST_WARMUP = 6
FAST_BATCH = ("--rollout-batch-size", "16", "--heldout-ipb", "8")  # 4 teacher prompts x 3 infos a step
# What a typical step after warm-up adds to the heap in use, KiB. Measured with this configuration
# (docs/memory.md): 50-52 KiB with the tokenizer's word cache on
# (every prompt kept), 2-3 KiB with it off.
MAX_KIB_PER_STEP = 16


def write_demo_tokenizer_checkpoint(out: Path) -> Path:
    """The demo model's tokenizer (character-level BPE without a pre-tokenizer, as
    `python -m slime_meta.models.tiny` builds it) with an untrained model of its shape: its infos are
    random, so nearly every prompt of a step is one the process has not encoded before."""
    import torch

    from slime_meta.models.tiny import build as tiny
    from slime_meta.models.tiny.tokenizer import new_model, train_char_tokenizer

    tokenizer = train_char_tokenizer(tiny.tokenizer_corpus(tiny.read_rows(ROOT / "data/synthetic_suffix.jsonl")))
    torch.manual_seed(0)
    new_model(tokenizer).save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def demo_tokenizer_checkpoint(tmp_path_factory) -> Path:
    return write_demo_tokenizer_checkpoint(tmp_path_factory.mktemp("demo-tokenizer"))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallinfo2")
def test_the_trainer_keeps_no_memory_from_step_to_step(demo_tokenizer_checkpoint, tmp_path, monkeypatch):
    """22 outer steps in this process; after each (and a garbage collection), the bytes malloc holds.
    The typical step's change, the median of the step-to-step differences after 6 steps of warm-up,
    stays near zero: a per-step cache, list or native buffer that is never freed shows up here within
    a minute, where RSS needs the slow soak's 50 steps to rise above the noise of freed memory.
    One-time costs (a code path run for the first time) are single jumps the median leaves out."""
    from test_train_e2e import synthetic_args

    from slime_meta.artifacts.tracking import Tracker
    from slime_meta.backends.local import run as local_run
    from slime_meta.config.arguments import parse_config

    in_use: list[int] = []
    log = Tracker.log

    def sampled(self, step, metrics):
        log(self, step, metrics)
        gc.collect()  # cyclic garbage (closed connections, a redrawn plot) is not kept memory
        in_use.append(heap_in_use())

    monkeypatch.setattr(Tracker, "log", sampled)
    # The plot is drawn at the end; a redraw 60 s in would import matplotlib mid-run (warm-up, not growth).
    monkeypatch.setattr(local_run.PlotRefresher, "after_step", lambda self: None)
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    args = synthetic_args(demo_tokenizer_checkpoint, tmp_path / "run", "--num-rollout", str(FAST_STEPS), *FAST_BATCH)
    local_run.run(parse_config(args))
    assert len(in_use) == FAST_STEPS
    kept = typical_step_kib(in_use[FAST_WARMUP:])
    print(
        f"\nheap in use {in_use[FAST_WARMUP] / 2**20:.1f} -> {in_use[-1] / 2**20:.1f} MiB after warm-up, "
        f"{kept:+.1f} KiB kept by a typical step"
    )
    assert kept <= MAX_KIB_PER_STEP, [round(b / 2**20, 3) for b in in_use]


def typical_step_kib(series: list[int]) -> float:
    """The median of the step-to-step differences of `series` (bytes), KiB."""
    return statistics.median((b - a) / 1024 for a, b in zip(series, series[1:]))


@pytest.mark.parametrize("max_async_level", [0, 1, 2])
def test_the_pipeline_keeps_the_data_cursors_of_steps_still_to_come_only(max_async_level):
    """A run without --save (or with a long interval) kept a copy of the sampler's state for every
    step it drew (17 KiB a step with the synthetic data's 64 families). Now the cursors before a
    finished step are dropped, and a checkpoint still gets the cursor before the next step's draw."""
    import asyncio

    from slime_meta.backends.local.step.pipeline import RolloutPipeline

    sampler = {"drawn": 0}

    def draw():
        sampler["drawn"] += 1
        return []

    async def produce(step, episodes):
        return step

    async def steps():
        pipeline = RolloutPipeline(
            produce, draw, lambda: dict(sampler), max_async_level=max_async_level, start_step=0, end_step=40
        )
        for step in range(40):
            assert await pipeline.result(step, weights_version=step) == step
            assert len(pipeline._state_before_draw) <= max_async_level
            # What a checkpoint after this step resumes from: the cursor before step + 1 drew.
            assert pipeline.sampler_state_for_resume(step + 1) == {"drawn": step + 1}

    asyncio.run(steps())


def test_the_trainers_work_runs_on_one_thread_of_its_own(tiny_checkpoint, tmp_path, monkeypatch):
    """A step, the weight push and a checkpoint all on one dedicated thread, never asyncio's default
    executor (a new thread there under contention kept its own arena: the +24% above)."""
    from test_train_e2e import synthetic_args

    from slime_meta.backends.local import run as local_run
    from slime_meta.backends.local.training.trainer import LocalTrainer
    from slime_meta.backends.local.workers import weight_sync
    from slime_meta.config.arguments import parse_config

    seen: list[tuple[str, int, str]] = []

    def recording(what: str, call):
        def wrapper(*args, **kwargs):
            seen.append((what, threading.get_ident(), threading.current_thread().name))
            return call(*args, **kwargs)

        return wrapper

    monkeypatch.setattr(LocalTrainer, "train_step", recording("train_step", LocalTrainer.train_step))
    monkeypatch.setattr(weight_sync, "push_weights", recording("push_weights", weight_sync.push_weights))
    monkeypatch.setattr(local_run, "save_checkpoint", recording("save_checkpoint", local_run.save_checkpoint))
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    run_dir = tmp_path / "run"
    args = synthetic_args(
        tiny_checkpoint, run_dir, "--num-rollout", "3", "--save", str(run_dir / "ckpt"), "--save-interval", "1"
    )
    local_run.run(parse_config(args))
    assert {what for what, _, _ in seen} == {"train_step", "push_weights", "save_checkpoint"}
    assert sum(what == "train_step" for what, _, _ in seen) == 3
    assert len({ident for _, ident, _ in seen}) == 1, seen
    assert all(name.startswith("trainer") for _, _, name in seen), seen  # not asyncio's default executor
