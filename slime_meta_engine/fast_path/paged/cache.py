"""A paged KV cache: one pool of fixed-size pages that every running row takes its tokens from.

Why pages: a static cache gives every row a slot as long as the longest request it may serve, so
a few long prompts force every slot to that length (64 slots x 8,192 tokens) or send the long
requests off the fast path. Here a row holds a list of pages (its page table) and gets a new page
only when its tokens reach it, so memory follows the tokens in flight, any request the pool can
hold runs on the fast path, and the samples of one `n = k` request point at the same pages for
their common prompt (refcounted; a page returns to the pool when its last row lets go).

Layout: keys and values are each (layers, pages, page_size, kv_heads, head_dim), keys stored after
rotary embedding as HF stores them. Token t of a row lives at offset t % page_size of the row's
page t // page_size. Page 0 is scratch, never handed out: padding columns of a prefill and the
padding rows of a decode step write there, and unused page-table entries point there, so every
index a forward uses is valid and nothing it writes can land in a live row's pages.

Admission reserves pages: a row is admitted only when the pool can give it every page it may
need (prompt plus `max_new_tokens`), counting pages already promised to running rows, so a decode
step never finds the pool empty; the pages themselves are taken as the tokens arrive. Requests
that do not fit yet wait in the queue.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from slime_meta_engine.fast_path.model_support import ModelShape

SCRATCH_PAGE = 0


def pages_for(tokens: int, page_size: int) -> int:
    return -(-tokens // page_size)


@dataclass
class PagedKVCache:
    keys_L_P_S_K_D: torch.Tensor
    values_L_P_S_K_D: torch.Tensor

    @property
    def num_pages(self) -> int:
        return self.keys_L_P_S_K_D.shape[1]

    @property
    def page_size(self) -> int:
        return self.keys_L_P_S_K_D.shape[2]

    @classmethod
    def allocate(cls, model: ModelShape, *, num_pages: int, page_size: int) -> PagedKVCache:
        """Zeroed keys and values for `model`'s layers and kv heads, in its dtype and on its device."""
        size = (model.num_layers, num_pages, page_size, model.num_kv_heads, model.head_dim)
        keys = torch.zeros(size, dtype=model.dtype, device=model.device)
        return cls(keys, torch.zeros_like(keys))

    def copy_pages(self, source_pages: list[int], target_pages: list[int]) -> None:
        """Copy whole pages in every layer (a shared prompt's last, partly filled page per sample)."""
        device = self.keys_L_P_S_K_D.device
        source_C = torch.tensor(source_pages, dtype=torch.int64).to(device)
        target_C = torch.tensor(target_pages, dtype=torch.int64).to(device)
        for tensor_L_P_S_K_D in (self.keys_L_P_S_K_D, self.values_L_P_S_K_D):
            tensor_L_P_S_K_D[:, target_C] = tensor_L_P_S_K_D[:, source_C]


class PagePool:
    """Host-side bookkeeping of the pages: free list, reference counts and reservations."""

    def __init__(self, num_pages: int):
        if num_pages < 2:
            raise ValueError(f"a paged cache needs at least 2 pages (one is scratch), got {num_pages}")
        self.num_pages = num_pages
        # Pop from the end: low page numbers go out first, which keeps a small working set together.
        self._free = list(range(num_pages - 1, SCRATCH_PAGE, -1))
        self._refcount = [0] * num_pages
        self.reserved = 0  # pages promised to running rows and not yet taken
        self.peak_in_use = 0

    @property
    def usable_pages(self) -> int:
        return self.num_pages - 1

    @property
    def free_pages(self) -> int:
        return len(self._free)

    @property
    def in_use(self) -> int:
        return self.usable_pages - len(self._free)

    @property
    def available(self) -> int:
        """Pages a new admission may reserve: free ones not already promised."""
        return len(self._free) - self.reserved

    def reserve(self, count: int) -> None:
        if count > self.available:
            raise RuntimeError(f"reserving {count} pages with {self.available} available")
        self.reserved += count

    def unreserve(self, count: int) -> None:
        self.reserved -= count

    def take_reserved(self) -> int:
        """One page out of a reservation made earlier."""
        if self.reserved <= 0 or not self._free:
            raise RuntimeError("page pool: no reserved page to take")
        self.reserved -= 1
        page = self._free.pop()
        self._refcount[page] = 1
        self.peak_in_use = max(self.peak_in_use, self.in_use)
        return page

    def share(self, page: int) -> None:
        self._refcount[page] += 1

    def release(self, pages: list[int]) -> None:
        for page in pages:
            self._refcount[page] -= 1
            if self._refcount[page] == 0:
                self._free.append(page)
            elif self._refcount[page] < 0:
                raise RuntimeError(f"page {page} released more often than taken")

    def refcount(self, page: int) -> int:
        return self._refcount[page]
