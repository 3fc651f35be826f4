"""What the embedded worker's HTTP handlers share, and their bridge to the generation thread.

`run_specs` queues a request's specs on the generation thread together (so the samples of an
`n` request are admitted at once and share one prefill) and waits for their results on the event
loop; a handler cancelled because its client went away marks its rows cancelled, freeing them.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from slime_meta_engine.engine import GenerationEngine
from slime_meta_engine.protocol import FinishedGeneration, GenerationSpec
from slime_meta_engine.rows import GenerationJob


@dataclass
class WorkerContext:
    """Everything the handlers share; one per server, stored on the aiohttp app."""

    engine: GenerationEngine
    model: torch.nn.Module
    tokenizer: Any
    model_path: str
    tokenizer_path: str
    weights_root: str | None
    device: torch.device
    dtype: torch.dtype
    max_batch_size: int
    max_positions: int | None
    embedding_rows: int
    weight_buffer_prefix: str | None = None  # same-host weight transfers only from buffers so named
    in_flight: dict[str, GenerationJob] = field(default_factory=dict)
    generate_requests: int = 0
    weight_updates: int = 0
    update_lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    async def run_spec(self, spec: GenerationSpec) -> FinishedGeneration:
        """Queue one spec on the generation thread and wait for its result."""
        return (await self.run_specs([spec]))[0]

    async def run_specs(self, specs: Sequence[GenerationSpec]) -> list[FinishedGeneration]:
        """Queue `specs` together (the samples of an `n` request then share one admission, hence
        one prefill) and wait for all their results, in order."""
        loop = asyncio.get_running_loop()
        futures: list[asyncio.Future[FinishedGeneration]] = []
        jobs: list[GenerationJob] = []
        for spec in specs:
            future: asyncio.Future[FinishedGeneration] = loop.create_future()

            def deliver(outcome: FinishedGeneration | BaseException, future=future) -> None:
                if not future.done():
                    if isinstance(outcome, BaseException):
                        future.set_exception(outcome)
                    else:
                        future.set_result(outcome)

            on_done = lambda outcome, deliver=deliver: loop.call_soon_threadsafe(deliver, outcome)  # noqa: E731
            jobs.append(GenerationJob(spec, on_done=on_done))
            futures.append(future)
        for job in jobs:
            self.in_flight[job.spec.rid] = job
        try:
            self.engine.submit_all(jobs)
            outcomes = await asyncio.gather(*futures, return_exceptions=True)
        except asyncio.CancelledError:
            for job in jobs:
                job.cancelled = True  # the client went away: free the batch slots
            raise
        finally:
            for job in jobs:
                if self.in_flight.get(job.spec.rid) is job:
                    del self.in_flight[job.spec.rid]
        for outcome in outcomes:
            if isinstance(outcome, BaseException):
                raise outcome
        return outcomes
