"""What the static and the paged fast path share: running rows held in slots, each slot with the
number of tokens its row holds, and one decode step's logits handed back in the rows' order."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from slime_meta_engine.cuda_graphs import DecodeGraphs
from slime_meta_engine.rows import RowState
from slime_meta_engine.sampling import RowSampling


class SlotBatch:
    def __init__(
        self, num_slots: int, graphs: DecodeGraphs, pad_token_id: int, device: torch.device, chunk_tokens: int | None
    ):
        self._graphs = graphs
        self._pad_token_id = pad_token_id
        self._device = device
        self._chunk_tokens = chunk_tokens  # chunked prefill: tokens per prefill forward; None: whole prompts
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
