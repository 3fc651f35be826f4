"""What the static and the paged fast path share: running rows held in slots, each slot with the
number of tokens its row holds, prompts run through a captured prefill graph when one holds them
(fast_path/prefill_graphs.py), and one decode step's logits handed back in the rows' order."""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial

import torch

from slime_meta_engine.fast_path.decode_graphs import DecodeGraphs
from slime_meta_engine.fast_path.prefill_graphs import PrefillGraphs
from slime_meta_engine.rows import GenerationJob, RowState
from slime_meta_engine.sampling import RowSampling

# On a GPU, prompts that no prefill graph holds run padded to a multiple of this many columns. Each
# new token count a matmul runs keeps about 20 KiB of host memory in the CUDA libraries for good (not
# a cache that a setting bounds: benchmarks/shape_memory.py, docs/memory.md), and a worker
# serving prompts of every length meets new counts all its life; rounded widths bound the shapes it
# ever runs. The padding columns cost what a prefill graph's bucket costs (causal attention keeps
# them out of the real tokens' outputs; their keys land past the row's length, or in the scratch page).
EAGER_PREFILL_COLUMNS = 64
# A matmul's token count is rows x width, so the rows of an eager prefill are rounded as well: up the
# ladder `eager_rows` climbs (1, 2, 3, 4, 6, 8, 12, 16, 24, ...: at most half again the prompts), the
# padding rows of length 0 writing where a prefill graph's padding rows write. Over every admission
# of prompts up to 2,048 tokens (rows x longest within --max-prefill-tokens) a worker may then meet
# 80 token counts, where rounded widths alone leave 220 (tests/test_eager_prefill_width.py).
EAGER_PREFILL_ROWS_MODES = ("ladder", "exact")  # --eager-prefill-rows: the first is the default


class ShapeTally:
    """The distinct (rows, columns) of the eager prefills run so far, counted up to `limit` (a worker
    on exact shapes, the CPU's, may meet many; the count is a diagnostic, not worth memory of its own)."""

    def __init__(self, limit: int = 4096):
        self._shapes: set[tuple[int, int]] = set()
        self._limit = limit

    def add(self, rows: int, columns: int) -> None:
        if len(self._shapes) < self._limit:
            self._shapes.add((rows, columns))

    def __len__(self) -> int:
        return len(self._shapes)


def rounded_up(count: int, multiple: int) -> int:
    """`count` rounded up to a multiple of `multiple` (an eager prefill's columns)."""
    return -(-count // multiple) * multiple


def eager_rows(prompts: int) -> int:
    """The rows an eager prefill of `prompts` prompts runs: the smallest power of two, or one and a
    half times one, that holds them."""
    power = 1
    while power < prompts:
        if power >= 2 and power * 3 // 2 >= prompts:
            return power * 3 // 2
        power *= 2
    return power


class SlotBatch:
    def __init__(
        self,
        num_slots: int,
        graphs: DecodeGraphs,
        pad_token_id: int,
        device: torch.device,
        chunk_tokens: int | None,
        prefill_graphs: PrefillGraphs | None = None,
    ):
        self._graphs = graphs
        self._prefill_graphs = prefill_graphs
        self._pad_token_id = pad_token_id
        self._device = device
        self._chunk_tokens = chunk_tokens  # chunked prefill: tokens per prefill forward; None: whole prompts
        # The CPU keeps nothing per shape, and its eager prefill stays exactly the plain one.
        self.eager_width_multiple = EAGER_PREFILL_COLUMNS if device.type == "cuda" else 1
        self.eager_rows_rounded = device.type == "cuda"
        # (rows, columns) of every eager prefill run so far: each new one can cost host memory for good
        # on a GPU (the libraries' per-shape state), so a worker reports how many it has met.
        self.eager_shapes = ShapeTally()
        self._row_by_slot: list[RowState | None] = [None] * num_slots
        self._length_by_slot = [0] * num_slots
        # Derived from membership; reset whenever a row joins or leaves.
        self._rows: list[RowState] | None = None
        self._occupied_index: torch.Tensor | None = None
        self.sampling: RowSampling | None = None  # the engine's settings for `rows`, in order

    @property
    def uses_graphs(self) -> bool:
        return self._graphs.use_graphs

    def __len__(self) -> int:
        return len(self.rows)

    @property
    def rows(self) -> list[RowState]:
        """Running rows in slot order (the order of `decode`'s logits)."""
        if self._rows is None:
            self._rows = [row for row in self._row_by_slot if row is not None]
        return self._rows

    def free_slots(self) -> int:
        return sum(row is None for row in self._row_by_slot)

    # ----- prefill's shared steps --------------------------------------------------------------

    def _slots_for(self, jobs: Sequence[GenerationJob]) -> list[int]:
        """The lowest free slots, one per job (rows kept low keep decode's row bucket small)."""
        free = [slot for slot, row in enumerate(self._row_by_slot) if row is None]
        if len(jobs) > len(free):
            raise RuntimeError(f"{len(jobs)} rows for {len(free)} free slots")
        return free[: len(jobs)]

    def _eager_prompt_tensors(
        self, prompt_jobs: Sequence[GenerationJob], lengths: list[int], where: list[int]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The prompts right-padded to `eager_width` columns and, with `eager_rows_rounded`, followed
        by padding rows of length 0 up to `eager_rows` (where the batch lets padding rows write;
        without such a place, no padding rows): token ids (R, L), lengths (R,) and where each row's
        keys go (R,), on the device."""
        width = self.eager_width(max(lengths))
        padded = [list(job.spec.input_ids) + [self._pad_token_id] * (width - n) for job, n in zip(prompt_jobs, lengths)]
        rows_where = list(where)
        rows_lengths = list(lengths)
        padding_rows = eager_rows(len(padded)) - len(padded) if self.eager_rows_rounded else 0
        padding_where = self._padding_where(where) if padding_rows else None
        if padding_where is not None:
            padded += [[self._pad_token_id] * width] * padding_rows
            rows_lengths += [0] * padding_rows
            rows_where += [padding_where] * padding_rows
        as_tensor = partial(torch.tensor, dtype=torch.int64)
        return (
            as_tensor(padded).to(self._device),
            as_tensor(rows_lengths).to(self._device),
            as_tensor(rows_where).to(self._device),
        )

    def eager_width(self, longest: int) -> int:
        """The columns an eager prefill of prompts of up to `longest` tokens runs."""
        return min(self.capacity, rounded_up(longest, self.eager_width_multiple))

    def _run_prompts(self, prompt_jobs: Sequence[GenerationJob], lengths: list[int], where: list[int]) -> torch.Tensor:
        """Run the prompts, each prompt's keys going to its `where` (the cache layout's index: a
        slot, a page-table row): the logits after each prompt's last token, (P, V).

        Through a prefill graph when one holds them (a view its next run overwrites), else eagerly.
        """
        if self._prefill_graphs is not None:
            prompts = [job.spec.input_ids for job in prompt_jobs]
            logits_P_V = self._prefill_graphs.run(prompts, where, self._padding_where(where))
            if logits_P_V is not None:
                return logits_P_V
        input_ids_R_L, lengths_R, where_R = self._eager_prompt_tensors(prompt_jobs, lengths, where)
        self.eager_shapes.add(input_ids_R_L.shape[0], input_ids_R_L.shape[1])
        logits_R_V = self._decoder.prefill(input_ids_R_L, lengths_R, where_R, self._chunk_tokens)
        return logits_R_V[: len(prompt_jobs)]

    def _padding_where(self, where: list[int]) -> int | None:
        """Where a prefill graph's padding rows (length 0) may write, given the prompts' `where`;
        None: nowhere, the prompts then run eagerly. Up to the cache layout."""
        raise NotImplementedError

    def prefill_graph_info(self) -> dict:
        graphs = self._prefill_graphs
        if graphs is None:
            return {"prefill_graphs": 0}
        return {
            "prefill_graphs": graphs.num_graphs,
            "prefill_graph_capture_s": round(graphs.capture_s, 3),
            "prefill_graph_runs": graphs.runs,
        }

    def _logits_by_row(self, logits_P_V: torch.Tensor, prompt_of_row: list[int]) -> torch.Tensor:
        """Each row's first-token logits, (N, V), from those of its prompt."""
        return logits_P_V.index_select(0, torch.tensor(prompt_of_row, dtype=torch.int64).to(self._device))

    def _start_rows(
        self, jobs: Sequence[GenerationJob], slots: list[int], prompt_of_row: list[int], lengths: list[int]
    ) -> list[RowState]:
        """Rows for `jobs`, placed in `slots` holding their prompts' tokens: once the prefill is done."""
        rows = [RowState(job) for job in jobs]
        for slot, row, prompt in zip(slots, rows, prompt_of_row):
            self._row_by_slot[slot] = row
            self._length_by_slot[slot] = lengths[prompt]
        self._membership_changed()
        return rows

    def _membership_changed(self) -> None:
        self._rows = None
        self._occupied_index = None
        self.sampling = None

    def _top_slot(self) -> int:
        """One past the highest occupied slot: the rows a decode step runs (empty slots below it padded)."""
        return max(slot for slot, row in enumerate(self._row_by_slot) if row is not None) + 1

    def _stepped(self, logits_B_V: torch.Tensor, top: int) -> torch.Tensor:
        """After a decode step over slots 0..top-1: each row holds one token more; its logits, rows in order."""
        for slot in range(top):
            if self._row_by_slot[slot] is not None:
                self._length_by_slot[slot] += 1
        if len(self.rows) == top:
            return logits_B_V[:top]
        if self._occupied_index is None:
            occupied = [slot for slot in range(top) if self._row_by_slot[slot] is not None]
            self._occupied_index = torch.tensor(occupied, dtype=torch.int64).to(self._device)
        return logits_B_V.index_select(0, self._occupied_index)

    def _free_slot(self, slot: int) -> None:
        self._row_by_slot[slot] = None
        self._length_by_slot[slot] = 0

    def release(self, rows: Sequence[RowState]) -> None:
        """Free the slots of `rows` (finished, aborted or failed)."""
        leaving = {id(row) for row in rows}
        if not leaving:
            return
        for slot, row in enumerate(self._row_by_slot):
            if row is not None and id(row) in leaving:
                self._free_slot(slot)
        self._membership_changed()

    def release_all(self) -> list[RowState]:
        rows = list(self.rows)
        self.release(rows)
        return rows
