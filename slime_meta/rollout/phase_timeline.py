"""When each dependent phase of a rollout ran: the wall time it adds, and what one chain waits in it.

A chain's phases depend on each other (student attempts and their grades, then the teacher's
info, round after round, then the holdout attempts), and all chains run at once without a
barrier, so phases of different chains overlap. Two figures per phase:
- `perf/rollout_phase_{name}_time`: the rollout's wall time up to the last chain leaving this
  phase, less the same for the phase before it (phases ordered by when they first started): the
  part of the rollout this phase holds the step up, summing to the rollout's span;
- `perf/rollout_phase_{name}_chain_time`: the mean time one chain spends in it.
Phases that run beside the chains (`side_phases`, the no-info control) report the second only.
"""

from __future__ import annotations

import contextlib
import time
from typing import Iterator


class PhaseTimeline:
    def __init__(self, side_phases: tuple[str, ...] = ("control",)):
        self.started = time.perf_counter()
        self.side_phases = side_phases
        self.spans: dict[str, list[tuple[float, float]]] = {}

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        begun = time.perf_counter() - self.started
        try:
            yield
        finally:
            self.spans.setdefault(name, []).append((begun, time.perf_counter() - self.started))

    def metrics(self) -> dict[str, float]:
        out = {}
        for name, spans in self.spans.items():
            out[f"perf/rollout_phase_{name}_chain_time"] = sum(end - begun for begun, end in spans) / len(spans)
        chain_phases = sorted((n for n in self.spans if n not in self.side_phases), key=lambda n: min(self.spans[n]))
        previous_end = 0.0
        for name in chain_phases:
            last_end = max(end for _, end in self.spans[name])
            out[f"perf/rollout_phase_{name}_time"] = max(last_end - previous_end, 0.0)
            previous_end = max(previous_end, last_end)
        return out
