"""The fast path's running batch over a paged KV cache (fast_path/paged/cache.py, fast_path/paged/model.py).

The same contract as `StaticBatch` (fast_path/static/batch.py), which the generation loop drives: `prefill`
places new rows in the lowest free page-table rows, `decode` advances every row by one token
through `DecodeGraphs`, `release` lets rows go. What differs is memory:
- a row takes pages for its prompt at prefill and one more page each time its tokens reach the
  next page, so any request the pool can hold stays on the fast path and memory follows the
  tokens in flight;
- the k samples of one `n = k` request share their prompt's full pages (refcounted); only the
  prompt's last, partly filled page is copied per sample, since each sample writes its own
  tokens after it;
- admission goes through `admission_gate`: a request is taken from the queue only when a row and
  every page it may need (counting pages promised to running rows) are free, so decode never
  runs out of pages and requests that do not fit wait.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from slime_meta_engine.fast_path.decode_graphs import DecodeGraphs
from slime_meta_engine.fast_path.model_support import model_shape, unsupported_reason
from slime_meta_engine.fast_path.paged.cache import SCRATCH_PAGE, PagedKVCache, PagePool, pages_for
from slime_meta_engine.fast_path.paged.model import PagedDecoder
from slime_meta_engine.fast_path.prefill_graphs import PrefillGraphs, build_prefill_graphs
from slime_meta_engine.fast_path.slot_batch import SlotBatch
from slime_meta_engine.protocol import GenerationSpec
from slime_meta_engine.rows import GenerationJob, RowState, shared_prompts

logger = logging.getLogger("slime_meta.worker")

DEFAULT_PAGE_SIZE = 16


class PagedBatch(SlotBatch):
    def __init__(
        self,
        decoder: PagedDecoder,
        graphs: DecodeGraphs,
        pool: PagePool,
        pad_token_id: int,
        chunk_tokens: int | None = None,
        prefill_graphs: PrefillGraphs | None = None,
    ):
        super().__init__(decoder.num_rows, graphs, pad_token_id, decoder.shape.device, chunk_tokens, prefill_graphs)
        self._decoder = decoder
        self.pool = pool
        self._page_size = decoder.page_size
        self._pages_by_slot: list[list[int]] = [[] for _ in range(decoder.num_rows)]
        self._budget_by_slot = [0] * decoder.num_rows  # pages reserved for the row and not yet taken

    @property
    def capacity(self) -> int:
        """Tokens one row may hold: the page table's width, and never more than the pool."""
        return min(self._decoder.capacity, self.pool.usable_pages * self._page_size)

    def describe(self) -> dict:
        pool = self.pool
        return {
            "kv_cache": "paged",
            "slots": self._decoder.num_rows,
            "capacity": self.capacity,
            "page_size": self._page_size,
            "pages": pool.usable_pages,
            "pages_in_use": pool.in_use,
            "pages_reserved": pool.reserved,
            "pages_peak": pool.peak_in_use,
            "graphs": self._graphs.num_graphs,
            "graph_capture_s": round(self._graphs.capture_s, 3),
            **self.prefill_graph_info(),
        }

    def can_serve(self, spec: GenerationSpec) -> bool:
        """Prompt scoring stays on the generic path; the rest when the empty pool could hold the row."""
        if spec.wants_input_logprobs:
            return False
        tokens = len(spec.input_ids) + spec.sampling.max_new_tokens
        return tokens <= self.capacity and pages_for(tokens, self._page_size) <= self.pool.usable_pages

    def pages_needed(self, spec: GenerationSpec, shares_prompt: bool) -> int:
        """Pages to reserve for one row; a row that shares an earlier row's prompt needs no full
        prompt pages of its own."""
        prompt = len(spec.input_ids)
        total = pages_for(prompt + spec.sampling.max_new_tokens, self._page_size)
        return total - prompt // self._page_size if shares_prompt else total

    def admission_gate(self) -> _AdmissionGate:
        return _AdmissionGate(self)

    # ----- admission -------------------------------------------------------------------------

    def prefill(self, jobs: Sequence[GenerationJob]) -> tuple[list[RowState], torch.Tensor, int]:
        """Give `jobs` rows and pages and run their prompts: (rows, first-token logits, prompts run).

        If anything fails on the way (a reservation, the forward), the rows never start, so every
        page they took or reserved goes back to the pool before the error propagates; otherwise
        those pages would stay in use for good and shrink what later requests can be given.
        """
        slots = self._slots_for(jobs)
        prompt_of_row, prompt_jobs = shared_prompts(jobs)
        lengths = [len(job.spec.input_ids) for job in prompt_jobs]
        try:
            prompt_slots, copies = self._place_rows(jobs, slots, prompt_of_row, lengths)
            self._write_page_tables(slots)
            logits_P_V = self._run_prompts(prompt_jobs, lengths, prompt_slots)
            if copies:
                self._decoder.cache.copy_pages([source for source, _ in copies], [target for _, target in copies])
            logits_N_V = self._logits_by_row(logits_P_V, prompt_of_row)
        except BaseException:
            for slot in slots:  # free before this call: holding nothing but what it gave them
                self._free_slot(slot)
            raise
        return self._start_rows(jobs, slots, prompt_of_row, lengths), logits_N_V, len(prompt_jobs)

    def _place_rows(
        self, jobs: Sequence[GenerationJob], slots: list[int], prompt_of_row: list[int], lengths: list[int]
    ) -> tuple[list[int], list[tuple[int, int]]]:
        """Reserve each row's pages and take those of its prompt; the first row of each prompt
        owns its pages, the others share its full pages and get a copy of its partial one.

        Returns each prompt's slot and the (prompt's partial page, a sharing row's copy) pairs.
        """
        prompt_slots: list[int] = [-1] * len(lengths)
        copies: list[tuple[int, int]] = []
        for row_index, (job, slot) in enumerate(zip(jobs, slots)):
            prompt = prompt_of_row[row_index]
            shares = prompt_slots[prompt] >= 0
            needed = self.pages_needed(job.spec, shares)
            self.pool.reserve(needed)
            self._budget_by_slot[slot] = needed
            full_pages, partial = divmod(lengths[prompt], self._page_size)
            if shares:
                owner_pages = self._pages_by_slot[prompt_slots[prompt]]
                pages = list(owner_pages[:full_pages])
                for page in pages:
                    self.pool.share(page)
                self._pages_by_slot[slot] = pages  # held from here on: released with the slot
                if partial:
                    pages.append(self._take_page(slot))
                    copies.append((owner_pages[full_pages], pages[-1]))
            else:
                prompt_slots[prompt] = slot
                pages = self._pages_by_slot[slot] = []
                for _ in range(full_pages + (1 if partial else 0)):
                    pages.append(self._take_page(slot))
        return prompt_slots, copies

    def _take_page(self, slot: int) -> int:
        self._budget_by_slot[slot] -= 1
        return self.pool.take_reserved()

    def _write_page_tables(self, slots: list[int]) -> None:
        width = self._decoder.page_table_R_M.shape[1]
        table_N_M = torch.full((len(slots), width), SCRATCH_PAGE, dtype=torch.int64)
        for index, slot in enumerate(slots):
            pages = self._pages_by_slot[slot]
            table_N_M[index, : len(pages)] = torch.tensor(pages, dtype=torch.int64)
        slots_N = torch.tensor(slots, dtype=torch.int64).to(self._device)
        self._decoder.page_table_R_M[slots_N] = table_N_M.to(self._device)

    def _padding_where(self, where: list[int]) -> int:
        """Any page-table row: a padding row has length 0, so all its columns go to the scratch page."""
        return 0

    # ----- decode ----------------------------------------------------------------------------

    def decode(self) -> torch.Tensor:
        """One token for every running row; returns logits (len(rows), V) in `rows` order."""
        top = self._top_slot()
        token_ids, positions, write_pages = [], [], []
        for slot in range(top):
            row = self._row_by_slot[slot]
            if row is None:
                token_ids.append(self._pad_token_id)
                positions.append(0)
                write_pages.append(SCRATCH_PAGE)
                continue
            position = self._length_by_slot[slot]
            pages = self._pages_by_slot[slot]
            if position // self._page_size == len(pages):  # the row's tokens reach a new page
                pages.append(self._take_page(slot))
            token_ids.append(row.output_ids[-1])
            positions.append(position)
            write_pages.append(pages[position // self._page_size])
        return self._stepped(self._graphs.step(token_ids, positions, write_pages), top)

    def _free_slot(self, slot: int) -> None:
        """The slot and its row's pages and reservation (finished, aborted or failed)."""
        self.pool.release(self._pages_by_slot[slot])
        self.pool.unreserve(self._budget_by_slot[slot])
        self._pages_by_slot[slot] = []
        self._budget_by_slot[slot] = 0
        super()._free_slot(slot)


class _AdmissionGate:
    """Decides, job by job in queue order, whether the jobs taken so far still fit rows and pages."""

    def __init__(self, batch: PagedBatch):
        self._batch = batch
        self._free_rows = batch.free_slots()
        self._available_pages = batch.pool.available
        self._prompts_seen: set[str] = set()

    def admit(self, spec: GenerationSpec) -> bool:
        if not self._batch.can_serve(spec):
            return True  # served by the generic path, outside the pool
        key = spec.shared_prefill
        needed = self._batch.pages_needed(spec, shares_prompt=key is not None and key in self._prompts_seen)
        if self._free_rows < 1 or needed > self._available_pages:
            return False
        self._free_rows -= 1
        self._available_pages -= needed
        if key is not None:
            self._prompts_seen.add(key)
        return True


def build_paged_batch(
    model: torch.nn.Module,
    *,
    num_rows: int,
    pool_tokens: int,
    pad_token_id: int,
    use_graphs: bool,
    page_size: int = DEFAULT_PAGE_SIZE,
    chunk_tokens: int | None = None,
    prefill_graph_tokens: int | None = None,
) -> PagedBatch:
    """Allocate a pool of `pool_tokens` tokens (rounded up to pages, plus the scratch page), build
    the paged decoder for `num_rows` running rows and (with `use_graphs`) capture its graphs.

    A row may grow to the pool's size or the model's positions, whichever is smaller. Graphs are
    captured for (rows, attended) pairs that gather at most twice the pool's tokens per layer.
    `prefill_graph_tokens`: the largest prefill graph's rows x length (fast_path/prefill_graphs.py; None: the
    default with `use_graphs`, none without; with it but without `use_graphs`, the prompts run
    eagerly at the graphs' bucketed shapes). Raises ValueError when the model is not supported.
    """
    reason = unsupported_reason(model)
    if reason is not None:
        raise ValueError(reason)
    if page_size < 1 or page_size > 128 or page_size & (page_size - 1):
        raise ValueError(f"page size {page_size}: give a power of two up to 128")
    shape = model_shape(model)
    num_pages = pages_for(pool_tokens, page_size) + 1
    cache = PagedKVCache.allocate(shape, num_pages=num_pages, page_size=page_size)
    max_positions = getattr(model.config.get_text_config(), "max_position_embeddings", None) or pool_tokens
    max_row_tokens = min(max_positions, (num_pages - 1) * page_size)
    decoder = PagedDecoder(model, cache, num_rows=num_rows, max_row_tokens=max_row_tokens)
    # The gather path copies rows x attended tokens' keys per layer into memory the graph pool would
    # keep, so it captures only pairs near the pool's size; the kernel copies nothing.
    max_graph_tokens = None if decoder.attention == "kernel" else max(2 * (num_pages - 1) * page_size, num_rows * 128)
    graphs = DecodeGraphs(decoder, use_graphs=use_graphs, max_graph_tokens=max_graph_tokens)
    prefill_graphs = build_prefill_graphs(
        decoder, graphs, requested_tokens=prefill_graph_tokens, chunk_tokens=chunk_tokens
    )
    logger.info(
        "paged KV cache: %d pages of %d tokens (%.2f GB), rows up to %d tokens, %d running rows",
        num_pages - 1,
        page_size,
        2 * cache.keys_L_P_S_K_D.nbytes / 1e9,
        decoder.capacity,
        num_rows,
    )
    return PagedBatch(decoder, graphs, PagePool(num_pages), pad_token_id, chunk_tokens, prefill_graphs)
