"""Where a train step's time goes: reference forward, forward and backward, optimizer.

On CUDA the parts are read from CUDA events recorded in the stream between them: no
synchronisation is added to the step (the host reads them once, after the step's last kernel,
which the weight push waits for anyway). The time between two events is the stream's wall time,
kernels and the gaps where it waited for the host alike. On the CPU, the host's clock.
"""

from __future__ import annotations

import time

import torch


class StepTimer:
    """`mark(part)`: the time since the previous mark (or the start) counts to `part`; a part marked
    more than once adds up. `metrics()`: `perf/train_{part}_time` in seconds."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.marks: list[tuple[str, object]] = [("start", self._now())]

    def _now(self):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def mark(self, part: str) -> None:
        self.marks.append((part, self._now()))

    def metrics(self) -> dict[str, float]:
        if self.cuda:
            self.marks[-1][1].synchronize()
        parts: dict[str, float] = {}
        for (_, earlier), (part, later) in zip(self.marks, self.marks[1:]):
            seconds = earlier.elapsed_time(later) / 1000 if self.cuda else later - earlier
            parts[part] = parts.get(part, 0.0) + seconds
        return {f"perf/train_{part}_time": seconds for part, seconds in parts.items()}


class NoTimer:
    """A `StepTimer` that records nothing (gradients computed outside a train step)."""

    def mark(self, part: str) -> None:
        pass
