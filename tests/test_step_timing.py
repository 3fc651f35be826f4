"""Where a step's time goes: the trainer's parts (reference forward, forward and backward,
optimizer) and the rollout's dependent phases, as the loop logs them under perf/*."""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path

import pytest
import torch
from test_trainer_memory import moved_reference
from test_trainer_reference import KL, samples

from slime_meta.backends.local.training.trainer import LocalTrainer
from slime_meta.rollout.phase_timeline import PhaseTimeline


def test_a_train_step_reports_its_parts_within_its_time(tiny_checkpoint):
    trainer = LocalTrainer(str(tiny_checkpoint), KL, reference_path=str(moved_reference(Path(tiny_checkpoint))))
    metrics = trainer.train_step(samples())
    parts = [metrics[f"perf/train_{part}_time"] for part in ("reference_forward", "forward_backward", "optimizer")]
    assert all(seconds > 0 for seconds in parts)
    assert sum(parts) <= metrics["train/step_time"]
    # Without a reference to read (the policy is its own before its first update), no such part.
    own = LocalTrainer(str(tiny_checkpoint), KL, reference_path=str(tiny_checkpoint)).train_step(samples())
    assert "perf/train_reference_forward_time" not in own and own["perf/train_forward_backward_time"] > 0
    assert not any(name.startswith("memory/") for name in metrics)  # the allocator's figures: on a GPU only


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_train_step_on_the_gpu_reports_what_the_allocator_holds(tiny_checkpoint):
    trainer = LocalTrainer(str(tiny_checkpoint), dataclasses.replace(KL, device="cuda"))
    weights_mib = sum(p.numel() * p.element_size() for p in trainer.model.parameters()) / 2**20
    first, second = trainer.train_step(samples()), trainer.train_step(samples(seed=1))
    for m in (first, second):
        # after the step: at least the weights, all of it within the reserve; at its height more (activations)
        assert weights_mib <= m["memory/gpu_allocated_mib"] <= m["memory/gpu_reserved_mib"]
        assert m["memory/gpu_allocated_mib"] < m["memory/gpu_peak_allocated_mib"]
    # the peak is the process's so far: the trainer does not reset what benchmarks time with it
    assert second["memory/gpu_peak_allocated_mib"] >= first["memory/gpu_peak_allocated_mib"]


def test_phase_times_add_up_to_the_span_and_side_phases_stay_out():
    timeline = PhaseTimeline()

    async def chain(delay_s: float) -> None:
        with timeline.phase("student_0"):
            await asyncio.sleep(delay_s)
        with timeline.phase("teacher_0"):
            await asyncio.sleep(0.05)

    async def control() -> None:
        with timeline.phase("control"):
            await asyncio.sleep(0.2)

    async def rollout() -> None:
        await asyncio.gather(chain(0.02), chain(0.08), control())

    asyncio.run(rollout())
    m = timeline.metrics()
    span = max(end for spans in timeline.spans.values() for _, end in spans if spans is not timeline.spans["control"])
    assert m["perf/rollout_phase_student_0_time"] + m["perf/rollout_phase_teacher_0_time"] == pytest.approx(span)
    assert m["perf/rollout_phase_student_0_time"] >= 0.08  # the slower chain holds the phase up
    assert m["perf/rollout_phase_student_0_chain_time"] == pytest.approx(0.05, abs=0.02)  # the mean of 0.02 and 0.08
    assert "perf/rollout_phase_control_time" not in m and m["perf/rollout_phase_control_chain_time"] >= 0.2
