"""KV-cache surgery that lets the generation loop add and drop rows mid-generation.

Hugging Face's `DynamicCache` keeps, per layer, key and value tensors of shape
(batch, heads, sequence, head_dim). Rows are left-padded so each row's newest token is in the
last column, and every row carries its own position ids, so:
- two batches can be merged by left-padding the shorter cache with zeros (masked out by the
  attention mask) and concatenating along the batch dimension;
- leading columns that are padding for every row can be cut off.
Keys are stored after rotary embedding, so moving a column does not change what it encodes.

This edits `layer.keys` / `layer.values` directly, which is only valid for plain full-attention
layers; `supports_row_surgery` says whether a cache qualifies (sliding-window or recurrent
layers do not, and the loop then falls back to static batching).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from transformers.cache_utils import DynamicLayer


def supports_row_surgery(cache: Any) -> bool:
    layers = getattr(cache, "layers", None)
    return bool(layers) and all(
        type(layer) is DynamicLayer and isinstance(getattr(layer, "keys", None), torch.Tensor) and layer.keys.dim() == 4
        for layer in layers
    )


def left_pad_columns(tensor: torch.Tensor, missing: int, sequence_dim_from_end: int) -> torch.Tensor:
    """Prepend `missing` zero columns along the sequence dimension (counted from the end)."""
    if missing == 0:
        return tensor
    return F.pad(tensor, (0, 0) * (sequence_dim_from_end - 1) + (missing, 0))


def join_caches(older: Any, older_width: int, newer: Any, newer_width: int) -> Any:
    """Append `newer`'s rows to `older` (in place), left-padding whichever is shorter."""
    width = max(older_width, newer_width)
    for older_layer, newer_layer in zip(older.layers, newer.layers):
        older_layer.keys = torch.cat(
            [
                left_pad_columns(older_layer.keys, width - older_width, 2),
                left_pad_columns(newer_layer.keys, width - newer_width, 2),
            ]
        )
        older_layer.values = torch.cat(
            [
                left_pad_columns(older_layer.values, width - older_width, 2),
                left_pad_columns(newer_layer.values, width - newer_width, 2),
            ]
        )
    return older


def drop_leading_columns(cache: Any, count: int) -> None:
    for layer in cache.layers:
        layer.keys = layer.keys[:, :, count:, :]
        layer.values = layer.values[:, :, count:, :]


def trim_unused_columns(cache: Any, mask: torch.Tensor) -> torch.Tensor:
    """Drop leading cache columns that are padding for every remaining row; returns the new mask."""
    first_used = int(mask.any(dim=0).to(torch.int8).argmax())
    if first_used == 0:
        return mask
    drop_leading_columns(cache, first_used)
    return mask[:, first_used:]
