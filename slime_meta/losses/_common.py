"""Shared helpers for the loss functions: masks, masked reductions, chunked per-row compute.

Nothing here is public API; callers import the loss modules that use it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor

RowFn = Callable[..., Tensor]
"""Maps row-aligned chunks `[c, ...]` of its inputs to one float32 value per row, `[c]`."""


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float64 stays float64; everything else (bf16, fp16, ints) computes in float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def as_bool_mask(mask: Tensor | None, token_shape: Sequence[int], like: Tensor, name: str = "mask") -> Tensor:
    """Return `mask` as a bool tensor of exactly `token_shape` (non-zero = token counts).

    `None` means every token counts.
    """
    if mask is None:
        return torch.ones(tuple(token_shape), dtype=torch.bool, device=like.device)
    if tuple(mask.shape) != tuple(token_shape):
        raise ValueError(f"{name} has shape {tuple(mask.shape)}, expected {tuple(token_shape)}")
    return mask if mask.dtype == torch.bool else mask != 0


def check_same_shape(ref_name: str, ref: Tensor, **others: Tensor | None) -> None:
    for name, t in others.items():
        if t is not None and t.shape != ref.shape:
            raise ValueError(f"{name} has shape {tuple(t.shape)}, expected {tuple(ref.shape)} (like {ref_name})")


def broadcast_per_sample(x: Tensor, token_shape: torch.Size, name: str) -> Tensor:
    """Accept a per-token tensor of `token_shape`, or a per-sample `[B]` one for `[B, T]` tokens."""
    if x.shape == token_shape:
        return x
    if x.dim() == 1 and len(token_shape) == 2 and x.shape[0] == token_shape[0]:
        return x.unsqueeze(1).expand(token_shape)
    raise ValueError(f"{name} has shape {tuple(x.shape)}; expected [B] or {tuple(token_shape)}")


def masked_sum_count(x: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    total = torch.where(mask, x, torch.zeros((), dtype=x.dtype, device=x.device)).sum()
    return total, mask.sum()


def masked_mean(x: Tensor, mask: Tensor) -> Tensor:
    """Mean of `x` over `mask`; 0 (still attached to the graph of `x`) when the mask is empty."""
    total, count = masked_sum_count(x, mask)
    return total / count.clamp(min=1).to(total.dtype)


def masked_extreme(x: Tensor, mask: Tensor, largest: bool) -> Tensor:
    """Detached max (or min) of `x` over `mask`; 0 when the mask is empty."""
    x = x.detach()
    if x.numel() == 0:
        return x.new_zeros(())
    fill = float("-inf") if largest else float("inf")
    filled = torch.where(mask, x, torch.full((), fill, dtype=x.dtype, device=x.device))
    value = filled.max() if largest else filled.min()
    return torch.where(mask.any(), value, torch.zeros((), dtype=x.dtype, device=x.device))


def fraction(flags: Tensor, mask: Tensor) -> Tensor:
    """Detached fraction of masked tokens where `flags` is true (0 for an empty mask)."""
    return masked_mean(flags.float(), mask).detach()


def selected_rows(mask_flat: Tensor) -> Tensor:
    """Indices of the rows where the flat bool mask is true (int64, [n])."""
    return mask_flat.nonzero().squeeze(1)


class _ChunkedRows(torch.autograd.Function):
    """Evaluate a row-wise `fn` chunk by chunk, also in backward.

    Forward keeps only the per-row outputs. Backward recomputes `fn` on one chunk at a time with
    autograd enabled and writes that chunk's input gradient into one preallocated gradient tensor
    (the input's dtype). So at most one chunk's float32 temporaries are alive at any time.
    Inputs that are not differentiable (token ids, detached teacher logits) get no gradient.
    Double backward is not supported.
    """

    @staticmethod
    def forward(ctx, fn: RowFn, chunk_size: int, row_idx: Tensor, *inputs: Tensor) -> Tensor:  # type: ignore[override]
        ctx.fn = fn
        ctx.chunk_size = chunk_size
        ctx.save_for_backward(row_idx, *inputs)
        pieces = [fn(*(x.index_select(0, idx) for x in inputs)) for idx in row_idx.split(chunk_size)]
        if not pieces:  # no selected rows
            return fn(*(x[:0] for x in inputs))
        return torch.cat(pieces)

    @staticmethod
    def backward(ctx, grad_vals: Tensor):  # type: ignore[override]
        row_idx, *inputs = ctx.saved_tensors
        needs = ctx.needs_input_grad[3:]
        grads: list[Tensor | None] = [
            torch.zeros_like(x) if need else None for x, need in zip(inputs, needs, strict=True)
        ]
        offset = 0
        for idx in row_idx.split(ctx.chunk_size):
            n = idx.numel()
            chunk = [
                x.index_select(0, idx).detach().requires_grad_(need) for x, need in zip(inputs, needs, strict=True)
            ]
            with torch.enable_grad():
                vals = ctx.fn(*chunk)
            wrt = [c for c, need in zip(chunk, needs, strict=True) if need]
            chunk_grads = iter(torch.autograd.grad(vals, wrt, grad_vals[offset : offset + n], allow_unused=True))
            for i, need in enumerate(needs):
                if need:
                    g = next(chunk_grads)
                    if g is not None:
                        grads[i].index_copy_(0, idx, g.to(grads[i].dtype))  # type: ignore[union-attr]
            offset += n
        return (None, None, None, *grads)


def rowwise(fn: RowFn, inputs: Sequence[Tensor], row_idx: Tensor, chunk_size: int | None) -> Tensor:
    """Apply `fn` to the rows `row_idx` of `inputs` (all indexed along dim 0); returns `[n]`.

    `chunk_size=None`: one plain autograd call over all selected rows (fast, memory-hungry).
    `chunk_size=c`: at most `c` rows at a time, forward and backward (see `_ChunkedRows`).
    """
    if chunk_size is None:
        n_rows = inputs[0].shape[0]
        if row_idx.numel() == n_rows:  # every row selected: no gather copy
            return fn(*inputs)
        return fn(*(x.index_select(0, row_idx) for x in inputs))
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size <= 0:
        raise ValueError(f"chunk_size must be a positive int or None, got {chunk_size!r}")
    return _ChunkedRows.apply(fn, chunk_size, row_idx, *inputs)


def scatter_rows(values: Tensor, row_idx: Tensor, mask: Tensor) -> Tensor:
    """Place per-selected-row `values` back into a zero tensor of `mask`'s shape (differentiable)."""
    flat = values.new_zeros(mask.numel()).index_copy(0, row_idx, values)
    return flat.view(mask.shape)
