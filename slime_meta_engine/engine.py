"""The embedded worker's generation loop: one thread that owns the model and batches requests.

Why one thread: the model is not safe to call concurrently, and the HTTP event loop must never
wait on a forward pass. The HTTP side only puts `GenerationJob`s on a queue and gets each result
through the job's callback (which hops back onto the event loop).

How batching works (continuous batching on top of HF's `DynamicCache`):
- A running batch holds, per row, the tokens generated so far and a KV cache, left-padded so
  that every row's newest token sits in the last column. Position ids come from each row's own
  token count, so padding never shifts a row's positions.
- Each loop turn first admits waiting requests (up to `max_batch_size` rows): they are prefilled
  together in a fresh cache, sample their first token, and are then joined to the running batch
  by left-padding the shorter cache. Then every row decodes one token.
- The admission window (`prefill_window_s`): a request is admitted once the oldest waiting one has
  waited that long, or at once when the waiting ones fill the free rows or the prefill token budget.
  Requests of independent clients arrive a few milliseconds apart, and each prefill costs about the
  same whatever its row count (its time goes to launching kernels), so prompts that arrive within
  the window share one forward. Rows already decoding keep decoding meanwhile (a waiting request
  never holds a decode step back); only an idle engine sleeps, for at most the window.
- The k samples of one `n = k` request share one prefill: their prompt is computed once and its
  KV cache rows are copied into the k decode rows (`shared_prompts`).
- Rows that finish (EOS, stop token, stop string, max_new_tokens, client gone) leave the batch at
  once; padding columns that no remaining row uses are cut away.
- Joining and trimming edit the cache tensors directly, which is only valid for plain
  full-attention layers (`DynamicLayer`). For other cache types (sliding window, hybrid models)
  the loop falls back to static batching: new requests wait until the running batch is done.
- Work that must not overlap a generation step (a weight swap) is queued with
  `run_between_batches`: admission stops, the running batch drains, the operation runs, and
  admission resumes.

Admission and prefill live in prefill.py (a mixin of the engine).

The fast path (CUDA, Llama/Qwen2 family; fast_path/static/batch.py, fast_path/paged/batch.py): when the engine is
given a `StaticBatch` or a `PagedBatch`, requests it can serve (no prompt scoring, prompt plus
max_new_tokens within its cache) run there instead: each row owns a slot of a preallocated KV
cache (static) or pages of one pool (paged), and decode steps replay CUDA graphs, as do prefills
of a few short prompts (fast_path/prefill_graphs.py). A paged batch gates admission: a request waits in the
queue until the pool can promise it every page it may need. Everything else (scoring, longer
requests) runs on the DynamicCache batch beside it; each loop turn steps both. Token choice, stop
rules and answers are shared by the two.
"""

from __future__ import annotations

import concurrent.futures
import logging
import random
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
import torch.nn.functional as F

from slime_meta_engine.cache_names import cache_of
from slime_meta_engine.caches import supports_row_surgery, trim_unused_columns
from slime_meta_engine.fast_path.slot_batch import EAGER_PREFILL_COLUMNS, ShapeTally
from slime_meta_engine.fast_path.static.batch import StaticBatch
from slime_meta_engine.kernels import layer_ops
from slime_meta_engine.prefill import _Prefill, _RunningBatch
from slime_meta_engine.protocol import FinishedGeneration
from slime_meta_engine.rows import GenerationJob, RowState
from slime_meta_engine.sampling import RowSampling, choose_next_tokens

logger = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass
class _ControlOp:
    operation: Callable[[], Any]
    future: concurrent.futures.Future


class GenerationEngine(_Prefill):
    """Owns the model; thread-safe `submit` / `run_between_batches` / `abort_all` / `stop`."""

    def __init__(
        self,
        model: torch.nn.Module,
        decode: Callable[[Sequence[int], bool], str],
        *,
        device: torch.device,
        eos_token_ids: frozenset[int],
        pad_token_id: int,
        max_batch_size: int = 64,
        max_prefill_tokens: int = 16384,
        prefill_window_s: float = 0.003,
        seed: int = 0,
        weight_version: str = "default",
        static_batch: StaticBatch | None = None,
        chunked_prefill_size: int | None = None,
        sampling_kernel_on: bool | None = None,
        prefill_width_multiple: int | None = None,
    ):
        self._model = model
        self._static = static_batch
        self._decode = decode
        self._device = device
        self._eos_token_ids = eos_token_ids
        self._pad_token_id = pad_token_id
        self._max_batch_size = max_batch_size
        self._max_prefill_tokens = max_prefill_tokens
        self._chunked_prefill_size = chunked_prefill_size  # DynamicCache prefill; the static batch has its own
        # The DynamicCache path's prefills (prompt scoring, rows beyond the fast path's slots) pad their
        # prompts on the left to a multiple of this many columns on a GPU, as the fast path's eager
        # prefills do on the right (fast_path/slot_batch.py: each new matmul shape keeps host memory).
        default_multiple = EAGER_PREFILL_COLUMNS if device.type == "cuda" else 1
        self._prefill_width_multiple = prefill_width_multiple or default_multiple
        self.dynamic_prefill_shapes = ShapeTally()  # (prompts, columns) this path has run
        self._prefill_window_s = prefill_window_s
        self._vocab_size = int(model.config.get_text_config().vocab_size)
        self._generator = torch.Generator(device=device).manual_seed(seed)
        # Where the fused kernels run, a batch without top-p/top-k cuts picks its tokens with Triton
        # kernels seeded from this host stream (sampling.py); elsewhere torch's ops draw from the generator.
        dtype = next(model.parameters()).dtype
        use_kernel = layer_ops.kernels_by_default(device, dtype) if sampling_kernel_on is None else sampling_kernel_on
        self._kernel_seeds = random.Random(seed) if use_kernel else None
        self._condition = threading.Condition()
        self._waiting: deque[GenerationJob] = deque()
        self._control_ops: deque[_ControlOp] = deque()
        self._stopping = False
        self._abort_message: str | None = None
        self._thread = threading.Thread(target=self._run, name="generation-loop", daemon=True)
        self.weight_version = weight_version
        # Admitted and not yet answered; only the generation thread writes it, and it drops before
        # the answer goes out, so a client holding its result never sees itself counted.
        self.running_rows = 0
        self.counters = {"requests_finished": 0, "tokens_generated": 0, "prefill_batches": 0, "decode_steps": 0}
        # Prompts run through a prefill, and rows that got a prompt's cache without running it (`n`).
        self.counters.update(prefill_prompts=0, shared_prefill_rows=0)
        self.counters.update(static_requests=0, static_decode_steps=0)  # the fast path's share
        # Where the generation thread's time goes (seconds since start). Every section ends with the
        # sampled tokens read back to the host, so host time is GPU time here: a busy share near 1
        # means the engine bounds the rollout; a low one, that the clients do not keep it fed.
        self.counters.update(prefill_s=0.0, fast_decode_s=0.0, dynamic_decode_s=0.0, idle_s=0.0)
        self._waiting_since: float | None = None  # when the thread began waiting for work, if it is
        self._can_join = self._probe_cache_is_joinable()

    # ----- thread-safe API -------------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout_s: float = 10.0) -> None:
        with self._condition:
            self._stopping = True
            self._condition.notify_all()
        if self._thread.is_alive():
            self._thread.join(timeout_s)

    def submit(self, job: GenerationJob) -> None:
        self.submit_all([job])

    def submit_all(self, jobs: Sequence[GenerationJob]) -> None:
        """Queue `jobs` at once, so that the samples of one `n` request are admitted together."""
        with self._condition:
            if self._stopping:
                for job in jobs:
                    job.settle(RuntimeError("the worker is shutting down"))
                return
            self._waiting.extend(jobs)
            self._condition.notify_all()

    def run_between_batches(self, operation: Callable[[], T]) -> concurrent.futures.Future[T]:
        """Run `operation` in the generation thread once no batch is running."""
        future: concurrent.futures.Future[T] = concurrent.futures.Future()
        with self._condition:
            if self._stopping:
                future.set_exception(RuntimeError("the worker is shutting down"))
            else:
                self._control_ops.append(_ControlOp(operation, future))
                self._condition.notify_all()
        return future

    def abort_all(self, message: str = "aborted by abort_all_requests") -> None:
        """Finish every waiting and running request now with finish_reason `abort`."""
        with self._condition:
            waiting, self._waiting = list(self._waiting), deque()
            self._abort_message = message
            self._condition.notify_all()
        for job in waiting:
            finish_reason = {"type": "abort", "message": message}
            job.settle(RowState(job).result(finish_reason, self._decode, self.weight_version))

    def counters_now(self) -> dict[str, float | int]:
        """The counters, with a wait for work still going on counted as idle up to now."""
        counters = dict(self.counters)
        waiting_since = self._waiting_since
        if waiting_since is not None:
            counters["idle_s"] += time.perf_counter() - waiting_since
        return counters

    def memory_now(self) -> dict[str, float | int]:
        """What a long run watches grow: the distinct eager prefill shapes run so far (each new one may
        keep host memory on a GPU; a prefill graph's are fixed) and, on a GPU, the caching allocator's
        allocated and reserved MiB (a larger reserve for a longer batch, told from tensors kept)."""
        static_shapes = len(self._static.eager_shapes) if self._static is not None else 0
        out: dict[str, float | int] = {"eager_prefill_shapes": static_shapes + len(self.dynamic_prefill_shapes)}
        if self._device.type == "cuda":
            out["gpu_allocated_mib"] = round(torch.cuda.memory_allocated(self._device) / 2**20, 1)
            out["gpu_reserved_mib"] = round(torch.cuda.memory_reserved(self._device) / 2**20, 1)
        return out

    def queue_depth(self) -> int:
        return len(self._waiting)

    @property
    def decode_path(self) -> str:
        """Which decode path serves requests that fit the fast path."""
        if self._static is None:
            return "dynamic_cache"
        return "cuda_graphs" if self._static.uses_graphs else "static_eager"

    @property
    def fast_path_info(self) -> dict | None:
        return self._static.describe() if self._static is not None else None

    def _static_row_count(self) -> int:
        return len(self._static) if self._static is not None else 0

    # ----- the loop ----------------------------------------------------------------------------

    def _run(self) -> None:
        running: _RunningBatch | None = None
        counters = self.counters
        while True:
            rows_in_batch = (len(running.rows) if running else 0) + self._static_row_count()
            self._waiting_since = time.perf_counter()
            jobs, control_op, abort_message = self._take_work(rows_in_batch)
            waited_s, self._waiting_since = time.perf_counter() - self._waiting_since, None
            counters["idle_s"] += waited_s
            if self._stopping:
                break
            if abort_message is not None:
                aborted = (running.rows if running is not None else []) + self._release_static_rows()
                for row in aborted:
                    self._finish(row, {"type": "abort", "message": abort_message})
                running = None
            if control_op is not None:
                self._run_control_op(control_op)
                continue
            try:
                with torch.inference_mode():
                    began = time.perf_counter()
                    if jobs:
                        running = self._admit(running, jobs)
                        counters["prefill_s"] += time.perf_counter() - began
                    began = time.perf_counter()
                    if self._static_row_count():
                        self._static_decode_step()
                        counters["fast_decode_s"] += time.perf_counter() - began
                    began = time.perf_counter()
                    if running is not None:
                        running = self._decode_step(running)
                        counters["dynamic_decode_s"] += time.perf_counter() - began
            except Exception as error:  # keep serving: fail only the requests in this batch
                logger.exception("generation step failed")
                batch_jobs = [row.job for row in running.rows] if running is not None else []
                batch_jobs += [row.job for row in self._release_static_rows()]
                for job in jobs + batch_jobs:
                    self._release(job, error)
                running = None
                if self._device.type == "cuda":
                    torch.cuda.empty_cache()
        self._shut_down(running)

    def _take_work(self, rows_in_batch: int) -> tuple[list[GenerationJob], _ControlOp | None, str | None]:
        """Block until there is work; returns (jobs to admit, op to run now, abort message).

        No jobs while the admission window is open (see the module docstring): with rows running,
        the caller decodes a step and asks again; idle, this waits for the window's end or a new
        arrival, whichever comes first.
        """
        with self._condition:
            while True:
                while not (
                    self._stopping or self._waiting or self._control_ops or rows_in_batch or self._abort_message
                ):
                    self._condition.wait()
                abort_message, self._abort_message = self._abort_message, None
                if self._stopping:
                    return [], None, abort_message
                if self._control_ops:
                    if rows_in_batch and abort_message is None:
                        return [], None, None  # let the running batch drain; admit nothing meanwhile
                    return [], self._control_ops.popleft(), abort_message
                if rows_in_batch and not self._can_join:
                    return [], None, abort_message
                window_left_s = self._window_left_s(rows_in_batch)
                if window_left_s <= 0:
                    return self._pop_admissible(rows_in_batch), None, abort_message
                if rows_in_batch or abort_message is not None:
                    return [], None, abort_message
                self._condition.wait(window_left_s)

    def _window_left_s(self, rows_in_batch: int) -> float:
        """How much longer the waiting requests should wait for company (<= 0: admit now)."""
        if not self._waiting or self._prefill_window_s <= 0 or self._waiting_fill_a_prefill(rows_in_batch):
            return 0.0
        return self._waiting[0].received_at + self._prefill_window_s - time.monotonic()

    def _waiting_fill_a_prefill(self, rows_in_batch: int) -> bool:
        """Whether the waiting requests already take every free row or the prefill token budget:
        waiting longer could add no prompt to their prefill."""
        if len(self._waiting) >= self._max_batch_size - rows_in_batch:
            return True
        prompts: set[str | int] = set()
        longest = 0
        for job in self._waiting:
            prompts.add(job.spec.shared_prefill if job.spec.shared_prefill is not None else id(job))
            longest = max(longest, len(job.spec.input_ids))
        return longest * len(prompts) >= self._max_prefill_tokens

    def _pop_admissible(self, rows_in_batch: int) -> list[GenerationJob]:
        taken: list[GenerationJob] = []
        prompts: set[str | int] = set()  # what the prefill will compute: a shared prompt counts once
        longest = 0
        # A paged cache admits a request only when its pages are free; the rest wait in the queue.
        gate = self._static.admission_gate() if self._static is not None else None
        while self._waiting and rows_in_batch + len(taken) < self._max_batch_size:
            job = self._waiting[0]
            if job.cancelled:
                self._waiting.popleft()
                job.settle(RuntimeError("request cancelled"))
                continue
            if gate is not None and not gate.admit(job.spec):
                break
            key = job.spec.shared_prefill if job.spec.shared_prefill is not None else id(job)
            if key not in prompts:
                new_longest = max(longest, len(job.spec.input_ids))
                if taken and new_longest * (len(prompts) + 1) > self._max_prefill_tokens:
                    break
                prompts.add(key)
                longest = new_longest
            taken.append(self._waiting.popleft())
        return taken

    def _run_control_op(self, control_op: _ControlOp) -> None:
        if not control_op.future.set_running_or_notify_cancel():
            return
        try:
            control_op.future.set_result(control_op.operation())
        except BaseException as error:
            control_op.future.set_exception(error)

    def _shut_down(self, running: _RunningBatch | None) -> None:
        error = RuntimeError("the worker is shutting down")
        with self._condition:
            waiting, self._waiting = list(self._waiting), deque()
            control_ops, self._control_ops = list(self._control_ops), deque()
        for job in waiting:
            job.settle(error)
        for row in (running.rows if running is not None else []) + self._release_static_rows():
            self._release(row.job, error)
        for control_op in control_ops:
            control_op.future.set_exception(error)

    # ----- model work (generation thread only) ------------------------------------------------

    def _probe_cache_is_joinable(self) -> bool:
        """One-token forward: doubles as a warm-up and tells which cache layout the model uses."""
        with torch.inference_mode():
            probe = torch.tensor([[self._pad_token_id]], device=self._device)
            cache = cache_of(self._model(input_ids=probe, use_cache=True))
        if not supports_row_surgery(cache):
            logger.warning("cache type %s cannot be joined: static batching only", type(cache).__name__)
            return False
        return True

    def _row_sampling(self, rows: Sequence[RowState]) -> RowSampling:
        return RowSampling.from_params(
            [row.job.spec.sampling for row in rows],
            [row.job.spec.top_logprobs_num for row in rows],
            self._vocab_size,
            self._device,
        )

    def _decode_step(self, batch: _RunningBatch) -> _RunningBatch | None:
        newest = torch.tensor([[row.output_ids[-1]] for row in batch.rows], dtype=torch.int64, device=self._device)
        mask = F.pad(batch.attention_mask, (0, 1), value=1)
        output = self._forward(newest, mask, batch.next_positions.unsqueeze(1), batch.cache, all_logits=False)
        batch.attention_mask = mask
        batch.next_positions = batch.next_positions + 1
        self.counters["decode_steps"] += 1
        return self._advance(batch, output.logits[:, -1, :], from_prefill=False)

    def _advance(self, batch: _RunningBatch, logits: torch.Tensor, from_prefill: bool) -> _RunningBatch | None:
        """Append one chosen token to every row, settle finished rows, and drop them."""
        return self._compact(batch, self._take_tokens(batch.rows, logits, batch.sampling, from_prefill))

    # ----- the fast path (static cache, CUDA graphs) -------------------------------------------

    def _release_static_rows(self) -> list[RowState]:
        return self._static.release_all() if self._static is not None else []

    def _static_decode_step(self) -> None:
        static = self._static
        logits = static.decode()
        rows = static.rows
        if static.sampling is None:
            static.sampling = self._row_sampling(rows)
        self.counters["decode_steps"] += 1
        self.counters["static_decode_steps"] += 1
        self._drop_finished_static(rows, self._take_tokens(rows, logits, static.sampling, from_prefill=False))

    def _drop_finished_static(self, rows: list[RowState], keep: list[int]) -> None:
        if len(keep) < len(rows):
            kept = set(keep)
            self._static.release([row for index, row in enumerate(rows) if index not in kept])

    # ----- token choice, shared by both paths -----------------------------------------------------

    def _take_tokens(
        self, rows: list[RowState], logits: torch.Tensor, sampling: RowSampling, from_prefill: bool
    ) -> list[int]:
        """Append one chosen token to every row and settle finished rows; returns the rows kept."""
        kernel_seed = self._kernel_seeds.getrandbits(31) if self._kernel_seeds is not None else None
        choice = choose_next_tokens(logits, sampling, self._generator, kernel_seed)
        token_ids = choice.token_ids.tolist()
        logprobs = choice.logprobs.tolist()
        top_values = choice.top_logprobs.tolist() if choice.top_logprobs is not None else None
        top_ids = choice.top_token_ids.tolist() if choice.top_token_ids is not None else None
        keep: list[int] = []
        for index, row in enumerate(rows):
            spec = row.job.spec
            if row.job.cancelled:
                self._finish(row, {"type": "abort", "message": "request cancelled"})
                continue
            if from_prefill and spec.sampling.max_new_tokens == 0:  # a scoring-only request
                self._finish(row, {"type": "length", "length": 0})
                continue
            row.record_token(
                token_ids[index],
                logprobs[index],
                top_values[index] if top_values is not None else None,
                top_ids[index] if top_ids is not None else None,
            )
            self.counters["tokens_generated"] += 1
            finish_reason = row.finish_reason(self._eos_token_ids, self._decode)
            if finish_reason is None:
                keep.append(index)
            else:
                self._finish(row, finish_reason)
        return keep

    def _finish(self, row: RowState, finish_reason: dict[str, Any]) -> None:
        self.counters["requests_finished"] += 1
        self._release(row.job, row.result(finish_reason, self._decode, self.weight_version))

    def _release(self, job: GenerationJob, outcome: FinishedGeneration | BaseException) -> None:
        """Answer an admitted job (once), taking it off the running gauge first."""
        if not job.settled:
            self.running_rows -= 1
            job.settle(outcome)

    def _compact(self, batch: _RunningBatch, keep: list[int]) -> _RunningBatch | None:
        if not keep:
            return None
        if len(keep) == len(batch.rows):
            return batch
        index = torch.tensor(keep, dtype=torch.int64, device=self._device)
        batch.cache.batch_select_indices(index)
        mask = batch.attention_mask.index_select(0, index)
        if self._can_join:
            mask = trim_unused_columns(batch.cache, mask)
        rows = [batch.rows[i] for i in keep]
        return _RunningBatch(
            rows, batch.cache, mask, batch.next_positions.index_select(0, index), self._row_sampling(rows)
        )
