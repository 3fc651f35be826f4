"""Decode steps captured as CUDA graphs, one per (row bucket, attended-length bucket).

Why: an eager decode step of a 0.5B model launches several hundred small kernels from Python and
takes tens of milliseconds of CPU time for well under a millisecond of GPU work. A captured graph
replays the same launches with one call.

A graph fixes its shapes and its input/output addresses, so:
- inputs go through persistent buffers (token ids, positions and, for the paged cache, the page
  each new token goes to) written before each replay with one copy; a graph for B rows reads
  their first B entries, i.e. cache slots (page-table rows) 0..B-1;
- rows are rounded up to a bucket (1, 2, 4, ... `num_slots`); the extra slots decode a padding
  token at position 0 of a free slot, which nothing reads;
- the key columns attended are rounded up to a length bucket (128, 256, ... capacity), so short
  rows do not pay for reading the whole capacity;
- every graph writes its logits into one shared buffer (`logits_S_V`), which the caller must
  consume before the next replay;
- with `max_graph_tokens`, pairs whose rows x attended exceed it are not captured (the paged
  forward gathers that many tokens' keys per layer, memory the graph pool would keep); such
  steps run eagerly.
All graphs are captured at start-up (no row is running then, so the warm-up writes land in free
slots), share one memory pool, and read the model's weights by address, so in-place weight updates
take effect without re-capturing.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from functools import partial

import torch

from slime_meta_engine.fast_path.static.model import StaticDecoder

logger = logging.getLogger(__name__)

_FIRST_LENGTH_BUCKET = 128


def row_buckets(num_slots: int) -> list[int]:
    buckets = []
    size = 1
    while size < num_slots:
        buckets.append(size)
        size *= 2
    return buckets + [num_slots]


def length_buckets(capacity: int) -> list[int]:
    buckets = []
    size = _FIRST_LENGTH_BUCKET
    while size < capacity:
        buckets.append(size)
        size *= 2
    return buckets + [capacity]


def smallest_bucket(buckets: Sequence[int], needed: int) -> int:
    for bucket in buckets:
        if bucket >= needed:
            return bucket
    raise ValueError(f"{needed} exceeds the largest bucket {buckets[-1]}")


def capture_graph(step: Callable[[], None], pool) -> torch.cuda.CUDAGraph:
    """`step` captured as a CUDA graph in `pool`, after one warm-up run on a side stream outside the
    capture: lazily initialised kernels and library handles must exist before capturing."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
        step()
    return graph


class DecodeGraphs:
    """Runs the decoder's `decode` for the first B slots, through captured graphs or eagerly.

    The decoder (`StaticDecoder`, `PagedDecoder`) has `num_rows`, `capacity`, `shape` and
    `step_inputs` (per-row int64 inputs of `decode`, before `attended`).
    """

    def __init__(self, decoder: StaticDecoder, use_graphs: bool, max_graph_tokens: int | None = None):
        self._decoder = decoder
        device = decoder.shape.device
        self.row_buckets = row_buckets(decoder.num_rows)
        self.length_buckets = length_buckets(decoder.capacity)
        self._max_graph_tokens = max_graph_tokens
        # One buffer for all inputs, so a step costs one host-to-device copy.
        self._inputs_I_S = torch.zeros(decoder.step_inputs, decoder.num_rows, dtype=torch.int64, device=device)
        shape = decoder.shape
        self.logits_S_V = torch.zeros(decoder.num_rows, shape.vocab_size, dtype=shape.dtype, device=device)
        self._graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.use_graphs = use_graphs
        self.capture_s = 0.0
        self.pool = None  # the graphs' memory pool, which the prefill graphs share (fast_path/prefill_graphs.py)
        if use_graphs:
            self._capture_all()

    @property
    def num_graphs(self) -> int:
        return len(self._graphs)

    def _step_into_buffer(self, rows: int, attended: int) -> None:
        logits_B_V = self._decoder.decode(*self._inputs_I_S[:, :rows], attended)
        self.logits_S_V[:rows].copy_(logits_B_V)

    def _capture_all(self) -> None:
        started = time.perf_counter()
        pool = self.pool = torch.cuda.graph_pool_handle()
        self._inputs_I_S.zero_()
        with torch.inference_mode():
            for attended in self.length_buckets:
                for rows in self.row_buckets:
                    if self._max_graph_tokens is not None and rows * attended > self._max_graph_tokens:
                        continue
                    step = partial(self._step_into_buffer, rows, attended)
                    self._graphs[(rows, attended)] = capture_graph(step, pool)
        torch.cuda.synchronize()
        self.capture_s = time.perf_counter() - started
        logger.info(
            "captured %d decode graphs (rows %s x attended %s) in %.1f s",
            len(self._graphs),
            self.row_buckets,
            self.length_buckets,
            self.capture_s,
        )

    def step(self, token_ids: Sequence[int], positions: Sequence[int], *more: Sequence[int]) -> torch.Tensor:
        """Decode one token for slots 0..len(token_ids)-1; returns (bucket rows, V) logits.

        `positions[i]` is slot i's new position (see `StaticDecoder.decode`); `more`: the
        decoder's further per-row inputs (the paged forward's write pages). Padding rows get 0
        everywhere. The returned view is overwritten by the next step.
        """
        needed = len(token_ids)
        rows = smallest_bucket(self.row_buckets, needed)
        attended = smallest_bucket(self.length_buckets, max(positions) + 1)
        padding = [0] * (rows - needed)
        inputs_I_B = torch.tensor(
            [list(values) + padding for values in (token_ids, positions, *more)], dtype=torch.int64
        )
        self._inputs_I_S[:, :rows].copy_(inputs_I_B)
        graph = self._graphs.get((rows, attended)) if self.use_graphs else None
        if graph is not None:
            graph.replay()
        else:
            self._step_into_buffer(rows, attended)
        return self.logits_S_V[:rows]
