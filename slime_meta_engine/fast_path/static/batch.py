"""The fast path's running batch: rows pinned to slots of a static KV cache.

The generation loop (engine.py) owns token choice, stop rules and answers; this class
owns where each row's keys and values live and runs the model for those rows:
- `prefill` puts new rows into the lowest free slots and returns their first-token logits;
- `decode` advances every row by one token through `DecodeGraphs`, whose graphs cover slots
  0..B-1 (B a bucket), so keeping rows in the lowest slots keeps B small; free slots below the
  highest row decode padding that nothing reads;
- `release` frees the slots of rows that finished. Nothing is copied when rows come and go.

A slot holds every token of its row except the newest output token, which is fed in by the next
decode step (the same invariant as the DynamicCache path).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from slime_meta_engine.fast_path.decode_graphs import DecodeGraphs
from slime_meta_engine.fast_path.model_support import model_shape, unsupported_reason
from slime_meta_engine.fast_path.paged.batch import DEFAULT_PAGE_SIZE, PagedBatch, build_paged_batch
from slime_meta_engine.fast_path.prefill_graphs import PrefillGraphs, build_prefill_graphs
from slime_meta_engine.fast_path.slot_batch import SlotBatch
from slime_meta_engine.fast_path.static.cache import StaticKVCache, fit_capacity
from slime_meta_engine.fast_path.static.model import StaticDecoder
from slime_meta_engine.protocol import GenerationSpec
from slime_meta_engine.rows import GenerationJob, RowState, shared_prompts

logger = logging.getLogger("slime_meta.worker")


class StaticBatch(SlotBatch):
    def __init__(
        self,
        decoder: StaticDecoder,
        graphs: DecodeGraphs,
        pad_token_id: int,
        chunk_tokens: int | None = None,
        prefill_graphs: PrefillGraphs | None = None,
    ):
        super().__init__(
            decoder.cache.num_slots, graphs, pad_token_id, decoder.shape.device, chunk_tokens, prefill_graphs
        )
        self._decoder = decoder

    @property
    def capacity(self) -> int:
        return self._decoder.cache.capacity

    def describe(self) -> dict:
        graphs = self._graphs
        return {
            "kv_cache": "static",
            "slots": self._decoder.cache.num_slots,
            "capacity": self.capacity,
            "graphs": graphs.num_graphs,
            "graph_capture_s": round(graphs.capture_s, 3),
            **self.prefill_graph_info(),
        }

    def can_serve(self, spec: GenerationSpec) -> bool:
        """Prompt scoring stays on the generic path; every position a row will write must fit."""
        return not spec.wants_input_logprobs and len(spec.input_ids) + spec.sampling.max_new_tokens <= self.capacity

    def admission_gate(self) -> None:
        """No gate: requests beyond the free slots go to the DynamicCache path (see PagedBatch)."""
        return None

    def prefill(self, jobs: Sequence[GenerationJob]) -> tuple[list[RowState], torch.Tensor, int]:
        """Place `jobs` in free slots and run their prompts: (rows, first-token logits, prompts run).

        The samples of one `n` request run their common prompt once, in the first sample's slot;
        its keys and values are then copied into the other samples' slots.
        """
        slots = self._slots_for(jobs)
        prompt_of_row, prompt_jobs = shared_prompts(jobs)
        first_row_of_prompt = {prompt: row for row, prompt in reversed(list(enumerate(prompt_of_row)))}
        prompt_slots = [slots[first_row_of_prompt[prompt]] for prompt in range(len(prompt_jobs))]
        lengths = [len(job.spec.input_ids) for job in prompt_jobs]
        logits_P_V = self._run_prompts(prompt_jobs, lengths, prompt_slots)
        copies = [
            (prompt_slots[prompt], slots[row])
            for row, prompt in enumerate(prompt_of_row)
            if first_row_of_prompt[prompt] != row
        ]
        if copies:
            width = max(lengths)
            source_C = torch.tensor([source for source, _ in copies], dtype=torch.int64).to(self._device)
            target_C = torch.tensor([target for _, target in copies], dtype=torch.int64).to(self._device)
            cache = self._decoder.cache
            for tensor_L_S_K_T_D in (cache.keys_L_S_K_T_D, cache.values_L_S_K_T_D):
                tensor_L_S_K_T_D[:, target_C, :, :width] = tensor_L_S_K_T_D[:, source_C, :, :width]
        logits_N_V = self._logits_by_row(logits_P_V, prompt_of_row)
        return self._start_rows(jobs, slots, prompt_of_row, lengths), logits_N_V, len(prompt_jobs)

    def _padding_where(self, where: list[int]) -> int | None:
        """A free slot this prefill does not fill: a padding row writes a whole prompt's columns
        into its slot, which only a later prefill of that slot (rewriting them) makes readable."""
        taken = set(where)
        free = [slot for slot, row in enumerate(self._row_by_slot) if row is None and slot not in taken]
        return free[-1] if free else None

    def decode(self) -> torch.Tensor:
        """One token for every running row; returns logits (len(rows), V) in `rows` order."""
        top = self._top_slot()
        token_ids, positions = [], []
        for slot in range(top):
            row = self._row_by_slot[slot]
            token_ids.append(row.output_ids[-1] if row is not None else self._pad_token_id)
            positions.append(self._length_by_slot[slot] if row is not None else 0)
        return self._stepped(self._graphs.step(token_ids, positions), top)


def default_pool_tokens(model: torch.nn.Module, requested: int) -> int:
    """Without a memory budget: `requested` tokens, capped like the static cache at its share of
    the device memory free now."""
    shape = model_shape(model)
    free_bytes = torch.cuda.mem_get_info(shape.device)[0] if shape.device.type == "cuda" else None
    return fit_capacity(requested, None, shape.kv_bytes_per_token, free_bytes)


def build_static_batch(
    model: torch.nn.Module,
    *,
    num_slots: int,
    requested_capacity: int,
    pad_token_id: int,
    use_graphs: bool,
    chunk_tokens: int | None = None,
    budgeted: bool = False,
    prefill_graph_tokens: int | None = None,
) -> StaticBatch:
    """Allocate the static cache, build the decoder and (with `use_graphs`) capture the graphs.

    `budgeted`: the slots and capacity come from a memory budget (fast_path/memory_budget.py) and are
    allocated as they are; otherwise the capacity is capped to a share of the free memory.
    `prefill_graph_tokens`: as in `build_paged_batch`. Raises ValueError when the model is not
    supported or the cache does not fit in memory.
    """
    reason = unsupported_reason(model)
    if reason is not None:
        raise ValueError(reason)
    shape = model_shape(model)
    free_bytes = torch.cuda.mem_get_info(shape.device)[0] if shape.device.type == "cuda" and not budgeted else None
    max_positions = getattr(model.config.get_text_config(), "max_position_embeddings", None)
    column_bytes = num_slots * shape.kv_bytes_per_token  # one column of capacity across all slots
    capacity = fit_capacity(requested_capacity, max_positions, column_bytes, free_bytes)
    if capacity <= 0:
        raise ValueError(f"a static KV cache for {num_slots} rows does not fit in free memory")
    cache = StaticKVCache.allocate(shape, num_slots=num_slots, capacity=capacity)
    decoder = StaticDecoder(model, cache)
    graphs = DecodeGraphs(decoder, use_graphs=use_graphs)
    prefill_graphs = build_prefill_graphs(
        decoder, graphs, requested_tokens=prefill_graph_tokens, chunk_tokens=chunk_tokens
    )
    return StaticBatch(decoder, graphs, pad_token_id, chunk_tokens, prefill_graphs)


def build_fast_path(
    mode: str,
    model: torch.nn.Module,
    device: torch.device,
    num_slots: int,
    cache_len: int,
    pad_token_id: int,
    *,
    chunk_tokens: int | None = None,
    budgeted: bool = False,
    kv_cache: str = "static",
    pool_tokens: int | None = None,
    page_size: int = DEFAULT_PAGE_SIZE,
    prefill_graph_tokens: int | None = None,
    eager_prefill_columns: int | None = None,
    eager_prefill_rows: str = "ladder",
) -> StaticBatch | PagedBatch | None:
    """The fast decode path for `--cuda-graphs`, or None for the DynamicCache path.

    `kv_cache` "static": `num_slots` slots of `cache_len` tokens (`chunk_tokens` and `budgeted`:
    see `StaticBatch` and `build_static_batch`). "paged": one pool of `pool_tokens` tokens (None:
    as many as the static cache would hold, `num_slots` x `cache_len`, capped at the same share
    of free memory) in pages of `page_size`, for `num_slots` running rows. `prefill_graph_tokens`:
    the largest captured prefill's rows x length (None: the default; 0: prefills run eagerly).
    `eager_prefill_columns`: the multiple an eager prefill's width is rounded up to (None: the
    default, `slot_batch.EAGER_PREFILL_COLUMNS`; 1: exact widths). `eager_prefill_rows`: "ladder" rounds
    an eager prefill's rows up `slot_batch.eager_rows`, "exact" runs the prompts' own count.
    """
    if mode == "off":
        return None
    problem = "it needs a CUDA device" if device.type != "cuda" else None
    if problem is None:
        try:
            if kv_cache == "paged":
                if pool_tokens is None:
                    pool_tokens = default_pool_tokens(model, num_slots * cache_len)
                batch = build_paged_batch(
                    model,
                    num_rows=num_slots,
                    pool_tokens=pool_tokens,
                    pad_token_id=pad_token_id,
                    use_graphs=True,
                    page_size=page_size,
                    chunk_tokens=chunk_tokens,
                    prefill_graph_tokens=prefill_graph_tokens,
                )
            else:
                batch = build_static_batch(
                    model,
                    num_slots=num_slots,
                    requested_capacity=cache_len,
                    pad_token_id=pad_token_id,
                    use_graphs=True,
                    chunk_tokens=chunk_tokens,
                    budgeted=budgeted,
                    prefill_graph_tokens=prefill_graph_tokens,
                )
            if eager_prefill_columns is not None:
                batch.eager_width_multiple = eager_prefill_columns
            batch.eager_rows_rounded = eager_prefill_rows == "ladder"
            return batch
        except (ValueError, RuntimeError) as error:  # unsupported model, no memory, failed capture
            problem = str(error)
            torch.cuda.empty_cache()
    if mode == "on":
        raise SystemExit(f"error: --cuda-graphs on, but the fast decode path cannot run: {problem}")
    logger.info("decoding through the DynamicCache path (CUDA graphs off: %s)", problem)
    return None
