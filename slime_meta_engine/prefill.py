"""Prefill of newly admitted requests, and merging them into the running batch.

A mixin of `GenerationEngine` (engine.py): it uses the engine's model, device, counters, static
batch and `_advance` / `_take_tokens` / `_row_sampling`. Admission splits the new jobs between
the fast path (static cache slots) and the DynamicCache batch, runs their prompts, and joins the
prefilled rows to the running batch (see engine.py for the batching scheme).

Chunked prefill (`--chunked-prefill-size N`): a prefill runs in column windows of N // rows
tokens (at least one column) over all its prompts, each window extending the same cache, so the
activations and attention scores of one forward cover about N tokens, not every prompt token at
once; the outputs are those of one forward up to float rounding (tests/test_worker_chunked_prefill.py).
The static batch does the same in its own forward (fast_path/static/model.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from slime_meta_engine.cache_names import cache_kwargs, cache_of
from slime_meta_engine.caches import join_caches, left_pad_columns
from slime_meta_engine.fast_path.slot_batch import rounded_up
from slime_meta_engine.rows import GenerationJob, RowState, shared_prompts
from slime_meta_engine.sampling import RowSampling

# Cap on the float32 logits a prompt-scoring prefill may hold at once (B * T * V elements):
# scoring needs logits at every position, which for large vocabularies dwarfs the KV cache.
_MAX_SCORING_LOGIT_ELEMENTS = 1 << 28


@dataclass
class _RunningBatch:
    rows: list[RowState]
    cache: Any  # transformers Cache holding every row's tokens except its newest one
    attention_mask: torch.Tensor  # (B, cache length) int64; 0 marks left padding
    next_positions: torch.Tensor  # (B,) int64: position id of each row's newest token
    sampling: RowSampling


@dataclass
class _PrefillOutput:
    logits: torch.Tensor  # (P, T, V) with all logits, else (P, 1, V): after each prompt's last token
    cache: Any


class _Prefill:
    """Admission and prefill steps of `GenerationEngine` (generation thread only)."""

    def _forward(self, input_ids, attention_mask, position_ids, cache, all_logits: bool):
        extra = {} if all_logits else {"logits_to_keep": 1}
        return self._model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            use_cache=True,
            **cache_kwargs(self._model, cache),
            **extra,
        )

    def _chunked_forward(self, input_ids_P_T, mask_P_T, positions_P_T, all_logits: bool) -> _PrefillOutput:
        """The prefill forward, in column windows of about `_chunked_prefill_size` tokens over all
        rows when that is set (each window extends the same cache), else in one forward.

        Rows are left-padded, so the last window's last column is every row's last prompt token.
        """
        width = input_ids_P_T.shape[1]
        chunk_tokens = self._chunked_prefill_size
        window = width if chunk_tokens is None else max(1, chunk_tokens // input_ids_P_T.shape[0])
        cache, logits_parts = None, []
        for start in range(0, width, window):
            end = min(width, start + window)
            output = self._forward(
                input_ids_P_T[:, start:end], mask_P_T[:, :end], positions_P_T[:, start:end], cache, all_logits
            )
            if all_logits or end == width:  # otherwise one logit row per prompt, not needed
                logits_parts.append(output.logits)
            cache = cache_of(output)
        logits = logits_parts[0] if len(logits_parts) == 1 else torch.cat(logits_parts, dim=1)
        return _PrefillOutput(logits, cache)

    def _admit(self, running: _RunningBatch | None, jobs: list[GenerationJob]) -> _RunningBatch | None:
        self.running_rows += len(jobs)
        to_prefill = []
        for job in jobs:
            if job.spec.sampling.max_new_tokens == 0 and not job.spec.wants_input_logprobs:
                self._finish(RowState(job), {"type": "length", "length": 0})  # nothing to compute
            else:
                to_prefill.append(job)
        if self._static is not None:
            fast = [job for job in to_prefill if self._static.can_serve(job.spec)][: self._static.free_slots()]
            if fast:
                taken = {id(job) for job in fast}
                to_prefill = [job for job in to_prefill if id(job) not in taken]
                self._prefill_static(fast)
        scoring = [job for job in to_prefill if job.spec.wants_input_logprobs]
        plain = [job for job in to_prefill if not job.spec.wants_input_logprobs]
        if not self._can_join:
            groups = [(to_prefill, bool(scoring))] if to_prefill else []
        else:
            groups = [(chunk, True) for chunk in self._chunk_for_scoring(scoring)]
            if plain:
                groups.append((plain, False))
        for group, all_logits in groups:
            prefilled = self._prefill(group, all_logits)
            if prefilled is not None:
                running = prefilled if running is None else self._join(running, prefilled)
        return running

    def _chunk_for_scoring(self, jobs: list[GenerationJob]) -> list[list[GenerationJob]]:
        chunks: list[list[GenerationJob]] = []
        current: list[GenerationJob] = []
        longest = 0
        for job in jobs:
            new_longest = max(longest, len(job.spec.input_ids))
            if current and new_longest * (len(current) + 1) * self._vocab_size > _MAX_SCORING_LOGIT_ELEMENTS:
                chunks.append(current)
                current, new_longest = [], len(job.spec.input_ids)
            current.append(job)
            longest = new_longest
        return chunks + [current] if current else chunks

    def _prefill(self, jobs: list[GenerationJob], all_logits: bool) -> _RunningBatch | None:
        rows = [RowState(job) for job in jobs]
        # Row surgery (copying cache rows) is only known to be valid for joinable caches.
        prompt_of_row, prompt_jobs = shared_prompts(jobs) if self._can_join else (list(range(len(jobs))), jobs)
        lengths = [len(job.spec.input_ids) for job in prompt_jobs]
        width = rounded_up(max(lengths), self._prefill_width_multiple)  # the left padding is masked out
        padded = [[self._pad_token_id] * (width - n) + list(job.spec.input_ids) for job, n in zip(prompt_jobs, lengths)]
        input_ids_P_T = torch.tensor(padded, dtype=torch.int64, device=self._device)
        mask_P_T = torch.tensor([[0] * (width - n) + [1] * n for n in lengths], dtype=torch.int64, device=self._device)
        positions_P_T = (mask_P_T.cumsum(dim=-1) - 1).clamp(min=0)
        output = self._chunked_forward(input_ids_P_T, mask_P_T, positions_P_T, all_logits)
        self.dynamic_prefill_shapes.add(len(prompt_jobs), width)
        self.counters["prefill_batches"] += 1
        self.counters["prefill_prompts"] += len(prompt_jobs)
        self.counters["shared_prefill_rows"] += len(jobs) - len(prompt_jobs)
        if all_logits:
            for row, prompt in zip(rows, prompt_of_row):
                if row.job.spec.wants_input_logprobs:
                    row.record_prompt_logprobs(output.logits[prompt], input_ids_P_T[prompt], width - lengths[prompt])
        cache, mask_R_T, last_logits_R_V = output.cache, mask_P_T, output.logits[:, -1, :]
        if len(prompt_jobs) < len(jobs):
            # Each of a prompt's k rows starts from a copy of that prompt's keys and values.
            prompt_of_row_R = torch.tensor(prompt_of_row, dtype=torch.int64, device=self._device)
            cache.batch_select_indices(prompt_of_row_R)
            mask_R_T = mask_P_T.index_select(0, prompt_of_row_R)
            last_logits_R_V = last_logits_R_V.index_select(0, prompt_of_row_R)
        batch = _RunningBatch(rows, cache, mask_R_T, mask_R_T.sum(dim=-1), self._row_sampling(rows))
        return self._advance(batch, last_logits_R_V, from_prefill=True)

    def _prefill_static(self, jobs: list[GenerationJob]) -> None:
        rows, logits, prompts = self._static.prefill(jobs)
        self.counters["prefill_batches"] += 1
        self.counters["prefill_prompts"] += prompts
        self.counters["shared_prefill_rows"] += len(rows) - prompts
        self.counters["static_requests"] += len(rows)
        self._drop_finished_static(rows, self._take_tokens(rows, logits, self._row_sampling(rows), from_prefill=True))

    def _join(self, older: _RunningBatch, newer: _RunningBatch) -> _RunningBatch:
        """Merge two batches by left-padding the shorter cache (positions are per row, so safe)."""
        older_width, newer_width = older.attention_mask.shape[1], newer.attention_mask.shape[1]
        width = max(older_width, newer_width)
        cache = join_caches(older.cache, older_width, newer.cache, newer_width)
        mask = torch.cat(
            [
                left_pad_columns(older.attention_mask, width - older_width, 1),
                left_pad_columns(newer.attention_mask, width - newer_width, 1),
            ]
        )
        rows = older.rows + newer.rows
        next_positions = torch.cat([older.next_positions, newer.next_positions])
        return _RunningBatch(rows, cache, mask, next_positions, self._row_sampling(rows))
