"""Decode steps captured as CUDA graphs, one per (row bucket, attended-length bucket).

Why: an eager decode step of a 0.5B model launches several hundred small kernels from Python and
takes tens of milliseconds of CPU time for well under a millisecond of GPU work. A captured graph
replays the same launches with one call.

A graph fixes its shapes and its input/output addresses, so:
- inputs go through persistent buffers (`token_ids_S`, `positions_S`) written before each replay;
  a graph for B rows reads their first B entries, i.e. cache slots 0..B-1;
- rows are rounded up to a bucket (1, 2, 4, ... `num_slots`); the extra slots decode a padding
  token at position 0 of a free slot, which nothing reads;
- the key columns attended are rounded up to a length bucket (128, 256, ... capacity), so short
  rows do not pay for reading the whole capacity;
- every graph writes its logits into one shared buffer (`logits_S_V`), which the caller must
  consume before the next replay.
All graphs are captured at start-up (no row is running then, so the warm-up writes land in free
slots), share one memory pool, and read the model's weights by address, so in-place weight updates
take effect without re-capturing.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

import torch

from slime_meta.serving.static_model import StaticDecoder

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


class DecodeGraphs:
    """Runs `StaticDecoder.decode` for the first B slots, through captured graphs or eagerly."""

    def __init__(self, decoder: StaticDecoder, use_graphs: bool):
        self._decoder = decoder
        cache = decoder.cache
        device = decoder.shape.device
        self.row_buckets = row_buckets(cache.num_slots)
        self.length_buckets = length_buckets(cache.capacity)
        # One buffer for both inputs, so a step costs one host-to-device copy.
        self._inputs_2_S = torch.zeros(2, cache.num_slots, dtype=torch.int64, device=device)
        self.token_ids_S, self.positions_S = self._inputs_2_S[0], self._inputs_2_S[1]
        shape = decoder.shape
        self.logits_S_V = torch.zeros(cache.num_slots, shape.vocab_size, dtype=shape.dtype, device=device)
        self._graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.use_graphs = use_graphs
        self.capture_s = 0.0
        if use_graphs:
            self._capture_all()

    @property
    def num_graphs(self) -> int:
        return len(self._graphs)

    def _step_into_buffer(self, rows: int, attended: int) -> None:
        logits_B_V = self._decoder.decode(self.token_ids_S[:rows], self.positions_S[:rows], attended)
        self.logits_S_V[:rows].copy_(logits_B_V)

    def _capture_all(self) -> None:
        started = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        self._inputs_2_S.zero_()
        with torch.inference_mode():
            for attended in self.length_buckets:
                for rows in self.row_buckets:
                    # Warm-up outside the capture: lazily initialised kernels and library handles
                    # must exist before capturing.
                    side = torch.cuda.Stream()
                    side.wait_stream(torch.cuda.current_stream())
                    with torch.cuda.stream(side):
                        self._step_into_buffer(rows, attended)
                    torch.cuda.current_stream().wait_stream(side)
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
                        self._step_into_buffer(rows, attended)
                    self._graphs[(rows, attended)] = graph
        torch.cuda.synchronize()
        self.capture_s = time.perf_counter() - started
        logger.info(
            "captured %d decode graphs (rows %s x attended %s) in %.1f s",
            len(self._graphs),
            self.row_buckets,
            self.length_buckets,
            self.capture_s,
        )

    def step(self, token_ids: Sequence[int], positions: Sequence[int]) -> torch.Tensor:
        """Decode one token for slots 0..len(token_ids)-1; returns (bucket rows, V) logits.

        `positions[i]` is slot i's new position (see `StaticDecoder.decode`). The returned view
        is overwritten by the next step.
        """
        needed = len(token_ids)
        rows = smallest_bucket(self.row_buckets, needed)
        attended = smallest_bucket(self.length_buckets, max(positions) + 1)
        padding = rows - needed
        inputs_2_B = torch.tensor(
            [list(token_ids) + [0] * padding, list(positions) + [0] * padding], dtype=torch.int64
        )
        self._inputs_2_S[:, :rows].copy_(inputs_2_B)
        graph = self._graphs.get((rows, attended)) if self.use_graphs else None
        if graph is not None:
            graph.replay()
        else:
            self._step_into_buffer(rows, attended)
        return self.logits_S_V[:rows]
