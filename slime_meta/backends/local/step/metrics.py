"""What the local run logs per step besides the rollout's and the trainer's own metrics: where the
step's wall time went, the pools' and grader's counters, worker restarts and router retries, the
workers' own time split, and how stale the rollout's weights were; the run's progress for the
console (elapsed time, ETA)."""

from __future__ import annotations

import time

from slime_meta.backends.local.workers.engine_time import WorkerTimeMeter
from slime_meta.backends.local.workers.launcher import LocalProcessGroup
from slime_meta.rollout.clients import counter_metrics
from slime_meta.rollout.meta_rollout import MetaLearningRollout
from slime_meta.rollout.pools import SGLangPool


class StepClock:
    """The step's wall time split where it is spent: waiting for the rollout (its part not hidden
    behind the previous step with --max-async-level), training, the weight push."""

    def __init__(self):
        self._started = self._last = time.perf_counter()
        self._parts: dict[str, float] = {}

    def mark(self, part: str) -> None:
        now = time.perf_counter()
        self._parts[part], self._last = now - self._last, now

    def metrics(self) -> dict[str, float]:
        return {
            "perf/step_time": self._last - self._started,
            "perf/rollout_wait_time": self._parts["rollout"],
            "perf/train_time": self._parts["train"],
            "perf/weight_push_time": self._parts["push"],
        }


def staleness_metrics(samples, rollout_id: int, start_step: int, unchanged_steps=frozenset()) -> dict[str, float]:
    """How many optimizer steps behind the trained policy the rollout's weights were.

    A sample reports the version its worker served (v = weights after v steps). A step in
    `unchanged_steps` (skipped: non-finite, or no training signal) pushed nothing, so weights v
    were also weights v + 1: such a sample is counted at the newest version its weights equal.
    """
    versions = []
    for sample in samples:
        try:
            version = int(sample.weight_version)
        except (TypeError, ValueError):  # the weights a worker started with
            version = start_step
        while version < rollout_id and version in unchanged_steps:
            version += 1
        versions.append(version)
    if not versions:
        return {}
    return {
        "async/max_staleness": float(rollout_id - min(versions)),
        "async/mean_staleness": rollout_id - sum(versions) / len(versions),
    }


def process_metrics(processes: LocalProcessGroup) -> dict[str, float]:
    """Worker restarts and router retries of each local pool, counted since the run started."""
    metrics = {}
    for name in processes.pool_names():
        metrics[f"pool/{name}_worker_restarts"] = float(processes.restarts(name))
        metrics[f"pool/{name}_router_retries"] = float(processes.router_retries(name))
    return metrics


class StepCounters:
    """The per-step counters of the run's pools, grader, processes and workers (each read once per step)."""

    def __init__(
        self,
        processes: LocalProcessGroup,
        teacher_pool: SGLangPool,
        student_pool: SGLangPool,
        rollout: MetaLearningRollout,
    ):
        self.processes, self.teacher_pool, self.student_pool, self.rollout = (
            processes,
            teacher_pool,
            student_pool,
            rollout,
        )
        # Each step: the local workers' seconds in prefill, decode and idle (worker/*).
        pools = {name: list(processes.pool(name).worker_urls) for name in processes.pool_names()}
        self.worker_time = WorkerTimeMeter(pools)

    def counters(self) -> dict[str, float]:
        """The pools' and grader's counters since the last read (reset)."""
        return counter_metrics(self.teacher_pool, self.student_pool, self.rollout.grader)

    def blocking_counters(self) -> dict[str, float]:
        """Restarts, router retries and the workers' time split: HTTP calls (run off the event loop)."""
        return {**process_metrics(self.processes), **self.worker_time.metrics()}
