"""Rollouts run ahead of training: `--max-async-level N` (0 = synchronous).

The rollout of step s may start once the pool serves weights of version >= s - N (version v =
v optimizer steps applied), so with N = 1 the rollout of step t+1 runs while step t trains, and
no sample is more than N versions stale. Batches are drawn in step order at launch time; the
sampler state before each draw is kept so that a checkpoint written after step t resumes at
step t+1's batch even when that batch was already drawn for an in-flight rollout.
Off-policy samples are corrected by the loss: the PPO ratio is anchored to the engine's
behaviour log-probs (or TIS/AIPO weights them, with --use-tis / --aipo-delta).
"""

from __future__ import annotations

import asyncio
import copy
from typing import Awaitable, Callable

from slime_meta.backends.local.step.batch import StepBatch
from slime_meta.types import Episode


class RolloutPipeline:
    def __init__(
        self,
        produce: Callable[[int, list[Episode]], Awaitable[StepBatch]],
        draw: Callable[[], list[Episode]],
        sampler_state: Callable[[], dict],
        *,
        max_async_level: int,
        start_step: int,
        end_step: int,
    ):
        self._produce, self._draw, self._sampler_state = produce, draw, sampler_state
        self.max_async_level = max_async_level
        self._next_to_launch = start_step
        self._end_step = end_step
        self._tasks: dict[int, asyncio.Task[StepBatch]] = {}
        self._state_before_draw: dict[int, dict] = {}

    def _launch_ready(self, weights_version: int, up_to: int) -> None:
        while (
            self._next_to_launch <= min(up_to, self._end_step - 1)
            and weights_version >= self._next_to_launch - self.max_async_level
        ):
            step = self._next_to_launch
            self._state_before_draw[step] = copy.deepcopy(self._sampler_state())
            episodes = self._draw()
            self._tasks[step] = asyncio.create_task(self._produce(step, episodes))
            self._next_to_launch += 1

    async def result(self, rollout_id: int, weights_version: int) -> StepBatch:
        """Step `rollout_id`'s batch; launches the rollouts the staleness bound allows."""
        self._launch_ready(weights_version, rollout_id)
        output = await self._tasks.pop(rollout_id)
        # A checkpoint after this step resumes at the next step's draw: the cursors before this one are
        # never needed again (kept, a run without --save held one copy of the sampler's state a step).
        self._forget_states_before(rollout_id + 1)
        self._launch_ready(weights_version, rollout_id + self.max_async_level)
        return output

    def sampler_state_for_resume(self, next_rollout_id: int) -> dict:
        """The data cursor as it was before step `next_rollout_id` drew its batch."""
        self._forget_states_before(next_rollout_id)
        return self._state_before_draw.get(next_rollout_id) or self._sampler_state()

    def _forget_states_before(self, step: int) -> None:
        for earlier in [s for s in self._state_before_draw if s < step]:
            del self._state_before_draw[earlier]

    async def cancel(self) -> None:
        for task in self._tasks.values():
            task.cancel()
        await asyncio.gather(*self._tasks.values(), return_exceptions=True)
        self._tasks.clear()
