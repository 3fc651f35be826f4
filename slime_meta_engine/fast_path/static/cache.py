"""A preallocated KV cache with one fixed slot per running row, for the fast decode path.

Each row of the running batch owns a slot for its whole life; its keys and values sit at columns
0..length-1 of that slot (stored after rotary embedding, as HF stores them). Rows join by
prefilling a free slot and leave by freeing it: no cache tensor is ever copied, padded or
reallocated, which is what lets a decode step keep fixed shapes and be captured in a CUDA graph.

Memory is (layers x slots x kv_heads x capacity x head_dim) elements, twice (keys and values),
allocated once at start-up.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from slime_meta_engine.fast_path.model_support import ModelShape

logger = logging.getLogger(__name__)

# The static cache may take at most this share of the device memory free at start-up; the rest is
# left to the dynamic path's caches, activations and, on a shared GPU, the trainer.
_MAX_SHARE_OF_FREE_MEMORY = 0.3
_MIN_CAPACITY = 128


@dataclass
class StaticKVCache:
    keys_L_S_K_T_D: torch.Tensor
    values_L_S_K_T_D: torch.Tensor

    @property
    def num_slots(self) -> int:
        return self.keys_L_S_K_T_D.shape[1]

    @property
    def capacity(self) -> int:
        """Tokens one slot holds: prompt plus generated tokens of a row must fit."""
        return self.keys_L_S_K_T_D.shape[3]

    @classmethod
    def allocate(cls, model: ModelShape, *, num_slots: int, capacity: int) -> StaticKVCache:
        """Zeroed keys and values for `model`'s layers and kv heads, in its dtype and on its device."""
        size = (model.num_layers, num_slots, model.num_kv_heads, capacity, model.head_dim)
        keys = torch.zeros(size, dtype=model.dtype, device=model.device)
        return cls(keys, torch.zeros_like(keys))


def fit_capacity(requested: int, max_positions: int | None, column_bytes: int, free_bytes: int | None) -> int:
    """The capacity to allocate: the request, capped by the model's positions and by memory.

    Halves the capacity until the cache fits its share of free memory; 0 means it cannot fit even
    `_MIN_CAPACITY` columns (the fast path is then off).
    """
    capacity = requested if max_positions is None else min(requested, max_positions)
    if free_bytes is not None:
        budget = int(free_bytes * _MAX_SHARE_OF_FREE_MEMORY)
        while capacity >= _MIN_CAPACITY and capacity * column_bytes > budget:
            capacity //= 2
        if capacity * column_bytes > budget:
            return 0
    if capacity < requested:
        logger.info("static KV cache capacity %d tokens per row (asked for %d)", capacity, requested)
    return max(capacity, 0)
