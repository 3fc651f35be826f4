"""Per-request state for the embedded worker's generation loop.

A `GenerationJob` is what the HTTP side queues; a `RowState` is that job's progress while it
occupies a row of the running batch: the tokens so far, their log-probs, and when to stop.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from slime_meta_engine.protocol import FinishedGeneration, GenerationSpec, render_output_text
from slime_meta_engine.sampling import prompt_logprobs

Decode = Callable[[Sequence[int], bool], str]  # (token ids, skip_special_tokens) -> text


@dataclass
class GenerationJob:
    """A request in flight. `on_done` is called exactly once, from the generation thread."""

    spec: GenerationSpec
    on_done: Callable[[FinishedGeneration | BaseException], None]
    received_at: float = field(default_factory=time.monotonic)
    cancelled: bool = False  # set by the HTTP side when the client has gone away
    settled: bool = False

    def settle(self, outcome: FinishedGeneration | BaseException) -> None:
        if not self.settled:
            self.settled = True
            self.on_done(outcome)


def shared_prompts(jobs: Sequence[GenerationJob]) -> tuple[list[int], list[GenerationJob]]:
    """Which prompts a prefill must run for `jobs`: (prompt index of each job, one job per prompt).

    The k samples of one `n = k` request hold the same prompt; it is computed once and its KV
    cache copied into the k rows. Jobs without a shared-prefill key each get their own prompt.
    """
    prompt_jobs: list[GenerationJob] = []
    prompt_of_job: list[int] = []
    index_by_key: dict[str, int] = {}
    for job in jobs:
        key = job.spec.shared_prefill
        if key is not None and key in index_by_key:
            prompt_of_job.append(index_by_key[key])
            continue
        if key is not None:
            index_by_key[key] = len(prompt_jobs)
        prompt_of_job.append(len(prompt_jobs))
        prompt_jobs.append(job)
    return prompt_of_job, prompt_jobs


class RowState:
    """One job's generation state inside the running batch."""

    def __init__(self, job: GenerationJob):
        self.job = job
        self.output_ids: list[int] = []
        self.output_logprobs: list[float] = []
        self.output_top_logprobs: list[list[tuple[float, int]]] = []
        self.input_logprobs: list[float | None] = []
        self.input_top_logprobs: list[list[tuple[float, int]] | None] = []
        # Tokens to decode when looking for a stop string: generous, since one character can
        # take several byte-level tokens.
        self._stop_window = 4 * max((len(s) for s in job.spec.sampling.stop), default=0) + 4

    def record_token(
        self, token: int, logprob: float, top_values: list[float] | None, top_ids: list[int] | None
    ) -> None:
        spec = self.job.spec
        self.output_ids.append(token)
        if spec.return_logprob:
            self.output_logprobs.append(logprob)
            if spec.top_logprobs_num > 0 and top_values is not None and top_ids is not None:
                count = spec.top_logprobs_num
                self.output_top_logprobs.append(list(zip(top_values[:count], top_ids[:count])))

    def record_prompt_logprobs(self, logits_T_V: torch.Tensor, input_ids_T: torch.Tensor, padding: int) -> None:
        """Prompt log-probs from a prefill's logits (`padding` leading columns are not the prompt)."""
        spec = self.job.spec
        first_scored = max(spec.logprob_start_len, 1)  # position 0 has nothing before it
        start, end = padding + first_scored, input_ids_T.shape[0]
        values, tops = prompt_logprobs(logits_T_V[start - 1 : end - 1], input_ids_T[start:end], spec.top_logprobs_num)
        leading_none: list[None] = [None] if spec.logprob_start_len == 0 else []
        self.input_logprobs = leading_none + values
        if spec.top_logprobs_num > 0:
            self.input_top_logprobs = leading_none + tops

    def finish_reason(self, eos_token_ids: frozenset[int], decode: Decode) -> dict[str, Any] | None:
        """Why the row is done after its newest token, or None to keep going.

        A stop token or stop string wins over the length limit when both happen on the same
        token, so callers can tell a complete answer from a truncated one.
        """
        sampling = self.job.spec.sampling
        token = self.output_ids[-1]
        if token in sampling.stop_token_ids or (not sampling.ignore_eos and token in eos_token_ids):
            return {"type": "stop", "matched": token}
        if sampling.stop:
            tail = decode(self.output_ids[-self._stop_window :], sampling.skip_special_tokens)
            found = [(tail.find(stop), stop) for stop in sampling.stop if stop in tail]
            if found:
                return {"type": "stop", "matched": min(found)[1]}
        if len(self.output_ids) >= sampling.max_new_tokens:
            return {"type": "length", "length": len(self.output_ids)}
        return None

    def result(self, finish_reason: dict[str, Any], decode: Decode, weight_version: str) -> FinishedGeneration:
        spec = self.job.spec
        return FinishedGeneration(
            spec=spec,
            output_ids=self.output_ids,
            finish_reason=finish_reason,
            text=render_output_text(decode, self.output_ids, finish_reason, spec.sampling),
            weight_version=weight_version,
            e2e_latency=time.monotonic() - self.job.received_at,
            output_logprobs=self.output_logprobs,
            output_top_logprobs=self.output_top_logprobs,
            input_logprobs=self.input_logprobs,
            input_top_logprobs=self.input_top_logprobs,
        )
