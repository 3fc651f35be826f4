"""Prefills of a few prompts captured as CUDA graphs, one per (row bucket, length bucket).

Why: a prefill through the fast path's forward (fast_path/family_forward.py) launches about twenty kernels
a layer from Python, so for a small model a prefill of one short prompt costs what the host takes
to launch them (about 25 ms for a 30-layer 135M model), whatever its rows and tokens. When
requests come one by one from independent clients, that is nearly every prefill. A captured graph
replays the same launches with one call, as decode steps do (fast_path/decode_graphs.py).

A graph fixes its shapes and addresses, so:
- prompts go through persistent buffers (token ids; each row's length and where its keys go, the
  cache layout's own index: a slot of the static cache, a page-table row of the paged one),
  written before each replay with two host-to-device copies;
- rows are rounded up to a bucket (1, 2, 4, ... `max_rows`) and prompt lengths up to a length
  bucket (64, 128, ...); the padding columns of a row are computed and never read (causal
  attention keeps them out of the real tokens' outputs; their keys land past the row's length in
  a static slot, or in the scratch page), and a padding row has length 0 and writes where the batch
  says it may (a free static slot not in this prefill; any page-table row, since a row of length 0
  writes only to the scratch page);
- only buckets of at most `max_tokens` rows x length are captured, so the graphs' shared memory
  pool stays small; larger prefills, and chunked ones whose windows are smaller, run eagerly
  (their launches are shared by many tokens).
Graphs are captured at start-up, while no row is running (the warm-up writes land in free slots
or the scratch page), into the decode graphs' memory pool (graphs never run at once, and each
copies its logits out of the pool), and read the weights by address, so in-place weight updates
take effect without re-capturing.

With `use_graphs=False` the same bucketed prefill runs eagerly (how the CPU tests check the
padding); the batches use no `PrefillGraphs` at all on the CPU, so the CPU path stays exact.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from functools import partial

import torch

from slime_meta_engine.fast_path.decode_graphs import DecodeGraphs, capture_graph

logger = logging.getLogger(__name__)

_FIRST_LENGTH_BUCKET = 64
# Rows of the largest row bucket: prompts that arrive one by one come alone or a few together;
# larger admissions share one eager forward's launches among many prompts anyway.
DEFAULT_MAX_ROWS = 8
# Rows x length of the largest graph: for a 0.5B model (896 wide, 4,864 MLP) its activations keep
# about 0.2 GB in the graphs' pool; a 4,096-token prefill is also long enough that its matmuls,
# not its launches, take most of its time.
DEFAULT_MAX_TOKENS = 4096


def prefill_buckets(max_rows: int, capacity: int, max_tokens: int) -> list[tuple[int, int]]:
    """(rows, length) pairs to capture, largest first: rows 1, 2, 4, ... `max_rows`, lengths 64,
    128, ... up to `capacity` (a row's most tokens), each pair within `max_tokens` tokens."""
    rows_buckets, rows = [], 1
    while rows < max_rows:
        rows_buckets.append(rows)
        rows *= 2
    rows_buckets.append(max_rows)
    pairs = []
    for rows in rows_buckets:
        length = _FIRST_LENGTH_BUCKET
        while length < capacity and rows * length <= max_tokens:
            pairs.append((rows, length))
            length *= 2
        if length >= capacity and rows * capacity <= max_tokens:
            pairs.append((rows, capacity))
    return sorted(pairs, key=lambda pair: (pair[0] * pair[1], pair), reverse=True)


class PrefillGraphs:
    """Runs a decoder's (`StaticDecoder`, `PagedDecoder`) whole-prompt prefill for a few prompts
    through captured graphs, or eagerly at the same bucketed shapes (`use_graphs=False`)."""

    def __init__(
        self,
        decoder,
        *,
        use_graphs: bool,
        max_rows: int = DEFAULT_MAX_ROWS,
        max_tokens: int = DEFAULT_MAX_TOKENS,
        pool=None,
    ):
        self._decoder = decoder
        device = decoder.shape.device
        max_rows = min(max_rows, decoder.num_rows)
        self.buckets = prefill_buckets(max_rows, decoder.capacity, max_tokens)
        longest = max((length for _, length in self.buckets), default=1)
        self._input_ids_R_L = torch.zeros(max_rows, longest, dtype=torch.int64, device=device)
        self._lengths_and_where_2_R = torch.zeros(2, max_rows, dtype=torch.int64, device=device)
        self._logits_R_V = torch.zeros(max_rows, decoder.shape.vocab_size, dtype=decoder.shape.dtype, device=device)
        self._graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.use_graphs = use_graphs
        self.capture_s = 0.0
        self.runs = 0  # prefills served here (replayed, or run eagerly at a bucket's shape)
        if use_graphs and self.buckets:
            self._capture_all(pool)

    @property
    def num_graphs(self) -> int:
        return len(self._graphs)

    def bucket_for(self, prompts: int, longest: int) -> tuple[int, int] | None:
        """The smallest captured (rows, length) pair holding `prompts` prompts of up to `longest`
        tokens, or None (the prefill then runs eagerly)."""
        fitting = [(rows, length) for rows, length in self.buckets if rows >= prompts and length >= longest]
        return min(fitting, key=lambda pair: (pair[0] * pair[1], pair)) if fitting else None

    def _prefill_into_buffer(self, rows: int, length: int) -> None:
        lengths_B, where_B = self._lengths_and_where_2_R[:, :rows]
        logits_B_V = self._decoder.prefill(self._input_ids_R_L[:rows, :length], lengths_B, where_B)
        self._logits_R_V[:rows].copy_(logits_B_V)

    def _capture_all(self, pool) -> None:
        started = time.perf_counter()
        pool = pool if pool is not None else torch.cuda.graph_pool_handle()
        with torch.inference_mode():
            for rows, length in self.buckets:  # largest first: the pool grows once, the rest fit in it
                # Rows 0..rows-1, every column real: at start-up those slots are free and those
                # page-table rows point at the scratch page, so the warm-up writes harm nothing.
                self._input_ids_R_L.zero_()
                self._lengths_and_where_2_R[0].fill_(length)
                self._lengths_and_where_2_R[1].copy_(torch.arange(self._lengths_and_where_2_R.shape[1]))
                self._graphs[(rows, length)] = capture_graph(partial(self._prefill_into_buffer, rows, length), pool)
        torch.cuda.synchronize()
        self.capture_s = time.perf_counter() - started
        logger.info(
            "captured %d prefill graphs (rows x length up to %s) in %.1f s",
            len(self._graphs),
            max(rows * length for rows, length in self.buckets),
            self.capture_s,
        )

    def run(
        self, prompts: Sequence[Sequence[int]], where: Sequence[int], padding_where: int | None
    ) -> torch.Tensor | None:
        """The logits after each prompt's last token, (P, V), with each prompt's keys and values
        stored at its `where`; None when no bucket holds the prompts, or padding rows are needed
        and the batch has no `padding_where` (the caller then runs them eagerly).

        The returned view is overwritten by the next run: consume it first.
        """
        lengths = [len(prompt) for prompt in prompts]
        bucket = self.bucket_for(len(prompts), max(lengths))
        if bucket is None:
            return None
        rows, length = bucket
        padding_rows = rows - len(prompts)
        if padding_rows and padding_where is None:
            return None
        # Any id may fill the padding columns: causal attention keeps them from the real tokens.
        input_ids_B_L = torch.tensor([list(prompt) + [0] * (length - len(prompt)) for prompt in prompts])
        if padding_rows:
            input_ids_B_L = torch.cat([input_ids_B_L, input_ids_B_L.new_zeros(padding_rows, length)])
        lengths_and_where_2_B = torch.tensor(
            [lengths + [0] * padding_rows, list(where) + [padding_where] * padding_rows], dtype=torch.int64
        )
        self._input_ids_R_L[:rows, :length].copy_(input_ids_B_L)
        self._lengths_and_where_2_R[:, :rows].copy_(lengths_and_where_2_B)
        graph = self._graphs.get(bucket) if self.use_graphs else None
        if graph is not None:
            graph.replay()
        else:
            self._prefill_into_buffer(rows, length)
        self.runs += 1
        return self._logits_R_V[: len(prompts)]


def prefill_graph_tokens_for(use_graphs: bool, requested: int | None, chunk_tokens: int | None) -> int:
    """The largest prefill graph's rows x length: `requested` (None: `DEFAULT_MAX_TOKENS` with graphs,
    none without, so the CPU path runs its prompts as before), within a chunked prefill's window."""
    tokens = (DEFAULT_MAX_TOKENS if use_graphs else 0) if requested is None else requested
    return tokens if chunk_tokens is None else min(tokens, chunk_tokens)


def build_prefill_graphs(
    decoder, graphs: DecodeGraphs, *, requested_tokens: int | None, chunk_tokens: int | None
) -> PrefillGraphs | None:
    """`PrefillGraphs` for the decoder beside its decode `graphs` (captured, or not, as they are, and in
    their memory pool), sized by `prefill_graph_tokens_for`; None when that is 0 or capturing fails
    (the prefills then run eagerly; the decode graphs are not affected)."""
    max_tokens = prefill_graph_tokens_for(graphs.use_graphs, requested_tokens, chunk_tokens)
    if max_tokens <= 0:
        return None
    try:
        return PrefillGraphs(decoder, use_graphs=graphs.use_graphs, max_tokens=max_tokens, pool=graphs.pool)
    except RuntimeError as error:  # out of memory, or an operation that cannot be captured
        logger.warning("prefill graphs off (prefills run eagerly): %s", error)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
        return None
