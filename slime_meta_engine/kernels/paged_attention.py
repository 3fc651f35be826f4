"""Decode attention that reads the paged KV cache in place: a split-K ("flash-decoding") Triton kernel.

Why: the gather path of fast_path/paged/model.py copies each row's first `attended` tokens (a fixed bucket
per captured graph) into a contiguous block, twice per layer, then attends under a length mask,
so every row pays for the bucket's length and the copies. Here each program follows one row's
page table and stops at the row's own length; nothing is copied.

The work, for one new token per row (q: B rows x H heads x D):
- program (row, kv head, split) takes the G = H / K query heads of that kv head together, as a
  (G padded to 16 or more) x D tile, so one tl.dot serves the whole group, and walks its share of
  the row's tokens in blocks of BLOCK_N. A token's address comes from its page (page table) and
  offset (token % page_size), so any page size works and pages may sit anywhere in the pool.
  Softmax is online in float32 (base 2, the scale folded into the exponent).
- a row's tokens are cut into `num_splits` equal ranges of whole blocks; a range past the row's
  length is empty and writes a log-sum-exp of -inf, which the combine weighs as 0 (no max over
  -inf alone is ever subtracted, so no NaN).
- a second small kernel combines each head's splits with their log-sum-exps; one split writes
  the output directly.
`num_splits` is chosen in Python from (rows, kv heads, longest length) and never from device
values: no host synchronisation, so the call can be captured in a CUDA graph and replayed with any
lengths and pages.

Triton is imported lazily: the engine's CPU path (and CI's CPU-only torch) never needs it.
`TRITON_INTERPRET=1` runs the kernels on CPU through Triton's interpreter (tests).
"""

from __future__ import annotations

import functools
import importlib.util
import os

import torch

from slime_meta_engine.kernels.layer_ops import next_power_of_two

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MIN_GROUP_TILE = 16  # tl.dot needs 16 rows at least; smaller groups are padded with masked heads
MAX_SPLITS = 64
# A full-length row is cut into ranges of about this many tokens, whatever the rows: with mixed
# lengths (the usual case) the few long rows are the step's tail, and these ranges keep them short.
TOKENS_PER_SPLIT = 256
# ...and at least this many programs per multiprocessor, so that few rows still fill the GPU.
PROGRAMS_PER_PROCESSOR = 4
LOG2_E = 1.4426950408889634


def paged_attention_unavailable_reason(device: torch.device, dtype: torch.dtype, head_dim: int) -> str | None:
    """Why the kernel cannot run for this device, dtype and head size, or None when it can."""
    device = torch.device(device)
    if dtype not in SUPPORTED_DTYPES:
        return f"dtype {dtype} is not one of float16, bfloat16, float32"
    if head_dim < 16 or head_dim > 256 or head_dim & (head_dim - 1):
        return f"head size {head_dim} is not a power of two from 16 to 256"
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    if device.type != "cuda" and not (device.type == "cpu" and interpreted):
        return f"device {device} is not CUDA (on CPU the kernel runs only under TRITON_INTERPRET=1)"
    if importlib.util.find_spec("triton") is None:
        return "triton is not installed"
    return None


def block_tokens(head_dim: int) -> int:
    """Tokens per inner block: larger blocks for small heads keep one block's tile about 8 KB."""
    return 64 if head_dim <= 64 else 32


def choose_num_splits(rows: int, kv_heads: int, max_length: int, head_dim: int, processors: int) -> int:
    """Splits per (row, kv head): the longest row in ranges of about TOKENS_PER_SPLIT tokens, or more
    splits where that leaves the GPU short of programs; at least one block per split, at most
    MAX_SPLITS. Depends only on shapes, so it is fixed per captured graph. On an H200, against fixed
    counts of 4 to 32 at the 0.5B and 1.5B shapes, 8 to 64 rows, 256 to 4,400 tokens, it was never
    more than 10% slower than the fastest (benchmarks/results/paged_attention_sweep_h200.json)."""
    blocks = -(-max_length // block_tokens(head_dim))
    for_length = -(-max_length // TOKENS_PER_SPLIT)
    for_processors = -(-PROGRAMS_PER_PROCESSOR * processors // max(1, rows * kv_heads))
    return max(1, min(max(for_length, for_processors), blocks, MAX_SPLITS))


@functools.lru_cache(maxsize=None)
def _processors(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 132  # the interpreter: behave as on an H100/H200, so CPU tests see the same splits


def paged_decode_attention(
    q_B_H_D: torch.Tensor,
    keys_P_S_K_D: torch.Tensor,
    values_P_S_K_D: torch.Tensor,
    page_table_R_M: torch.Tensor,
    lengths_B: torch.Tensor,
    scale: float,
    *,
    max_length: int | None = None,
    num_splits: int | None = None,
) -> torch.Tensor:
    """Attention of each row's new query over its first `lengths_B[b]` tokens; returns (B, H x D).

    Row b's token t lives at `keys_P_S_K_D[page_table_R_M[b, t // S], t % S]` (rows 0..B-1 of the
    table are used; the table must cover every length). `max_length` (a Python int, default the
    table's width in tokens) bounds the lengths and picks the number of splits; `num_splits`
    overrides that choice. Output in q's dtype, heads flattened as `_decode_attention` returns them.
    """
    rows, num_heads, head_dim = q_B_H_D.shape
    num_pages, page_size, kv_heads, key_dim = keys_P_S_K_D.shape
    if key_dim != head_dim or values_P_S_K_D.shape != keys_P_S_K_D.shape or num_heads % kv_heads:
        shapes = f"q {tuple(q_B_H_D.shape)}, keys {tuple(keys_P_S_K_D.shape)}, values {tuple(values_P_S_K_D.shape)}"
        raise ValueError(f"paged decode attention: shapes do not agree: {shapes}")
    group = num_heads // kv_heads
    if max_length is None:
        max_length = page_table_R_M.shape[1] * page_size
    if num_splits is None:
        num_splits = choose_num_splits(rows, kv_heads, max_length, head_dim, _processors(q_B_H_D.device))
    # The kernels index the last dimension as contiguous; these are views of contiguous tensors in
    # the decoder, so the copies below never run there.
    q_B_H_D = q_B_H_D if q_B_H_D.stride(-1) == 1 else q_B_H_D.contiguous()
    keys_P_S_K_D = keys_P_S_K_D if keys_P_S_K_D.stride(-1) == 1 else keys_P_S_K_D.contiguous()
    values_P_S_K_D = values_P_S_K_D if values_P_S_K_D.stride(-1) == 1 else values_P_S_K_D.contiguous()
    out_B_HD = torch.empty(rows, num_heads * head_dim, dtype=q_B_H_D.dtype, device=q_B_H_D.device)
    if rows == 0:
        return out_B_HD
    split_kernel, combine_kernel = _kernels()
    final = num_splits == 1
    if final:  # the split kernel writes the output itself; these are never read
        partial_B_H_N_D = lse_B_H_N = out_B_HD
    else:
        partial_B_H_N_D = torch.empty(rows, num_heads, num_splits, head_dim, dtype=torch.float32, device=q_B_H_D.device)
        lse_B_H_N = torch.empty(rows, num_heads, num_splits, dtype=torch.float32, device=q_B_H_D.device)
    split_kernel[(rows, kv_heads, num_splits)](
        q_B_H_D,
        keys_P_S_K_D,
        values_P_S_K_D,
        page_table_R_M,
        lengths_B,
        partial_B_H_N_D,
        lse_B_H_N,
        out_B_HD,
        scale * LOG2_E,  # the kernel exponentiates in base 2
        *q_B_H_D.stride()[:2],
        *keys_P_S_K_D.stride()[:3],
        *values_P_S_K_D.stride()[:3],
        page_table_R_M.stride(0),
        page_size,
        num_splits,
        GROUP=group,
        GROUP_TILE=max(MIN_GROUP_TILE, next_power_of_two(group)),
        HEAD_DIM=head_dim,
        BLOCK_N=block_tokens(head_dim),
        FINAL=final,
        # A float32 dot would run in tf32 by default, far from the float32 forward it replaces.
        DOT_PRECISION="ieee" if q_B_H_D.dtype == torch.float32 else "tf32",
        num_warps=4,
    )
    if not final:
        combine_kernel[(rows, num_heads)](
            partial_B_H_N_D,
            lse_B_H_N,
            out_B_HD,
            num_splits,
            num_heads,
            HEAD_DIM=head_dim,
            SPLITS_TILE=next_power_of_two(num_splits),
            num_warps=1 if head_dim <= 64 else 2,
        )
    return out_B_HD


@functools.lru_cache(maxsize=None)
def _kernels():
    """Define the Triton kernels on first use, so importing this module never imports triton."""
    import triton
    import triton.language as tl

    if os.environ.get("TRITON_INTERPRET") == "1":
        _let_the_interpreter_take_loop_bounds_from_tensors()

    @triton.jit
    def split_kernel(
        q_ptr,
        keys_ptr,
        values_ptr,
        table_ptr,
        lengths_ptr,
        partial_ptr,
        lse_ptr,
        out_ptr,
        scale_log2,
        stride_q_row,
        stride_q_head,
        stride_k_page,
        stride_k_slot,
        stride_k_head,
        stride_v_page,
        stride_v_slot,
        stride_v_head,
        stride_table_row,
        page_size,
        num_splits,
        GROUP: tl.constexpr,
        GROUP_TILE: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        BLOCK_N: tl.constexpr,
        FINAL: tl.constexpr,
        DOT_PRECISION: tl.constexpr,
    ):
        row = tl.program_id(0)
        kv_head = tl.program_id(1)
        split = tl.program_id(2)
        num_heads = tl.num_programs(1) * GROUP
        length = tl.load(lengths_ptr + row).to(tl.int32)
        # This split's tokens: an equal share of the row's, in whole blocks; empty past its length.
        per_split = tl.cdiv(tl.cdiv(length, num_splits), BLOCK_N) * BLOCK_N
        start = split * per_split
        end = tl.minimum(start + per_split, length)

        in_group = tl.arange(0, GROUP_TILE)
        dims = tl.arange(0, HEAD_DIM)
        heads = kv_head * GROUP + in_group
        real_head = in_group < GROUP
        q_offsets = row * stride_q_row + heads[:, None] * stride_q_head + dims[None, :]
        q = tl.load(q_ptr + q_offsets, mask=real_head[:, None], other=0.0)
        running_max = tl.full([GROUP_TILE], float("-inf"), dtype=tl.float32)
        running_sum = tl.zeros([GROUP_TILE], dtype=tl.float32)
        acc = tl.zeros([GROUP_TILE, HEAD_DIM], dtype=tl.float32)
        table_row = table_ptr + row * stride_table_row
        for block_start in range(start, end, BLOCK_N):
            tokens = block_start + tl.arange(0, BLOCK_N)
            real_token = tokens < end
            pages = tl.load(table_row + tokens // page_size, mask=real_token, other=0).to(tl.int64)
            slots = tokens % page_size
            key_rows = pages * stride_k_page + slots * stride_k_slot + kv_head * stride_k_head
            keys = tl.load(keys_ptr + key_rows[:, None] + dims[None, :], mask=real_token[:, None], other=0.0)
            scores = tl.dot(q, tl.trans(keys), input_precision=DOT_PRECISION) * scale_log2
            scores = tl.where(real_token[None, :], scores, float("-inf"))
            # Every block holds a real token, so the new max is finite and nothing becomes NaN.
            new_max = tl.maximum(running_max, tl.max(scores, 1))
            rescale = tl.exp2(running_max - new_max)
            weights = tl.exp2(scores - new_max[:, None])
            running_sum = running_sum * rescale + tl.sum(weights, 1)
            value_rows = pages * stride_v_page + slots * stride_v_slot + kv_head * stride_v_head
            values = tl.load(values_ptr + value_rows[:, None] + dims[None, :], mask=real_token[:, None], other=0.0)
            acc = acc * rescale[:, None] + tl.dot(weights.to(values.dtype), values, input_precision=DOT_PRECISION)
            running_max = new_max

        has_tokens = running_sum > 0
        normalised = acc / tl.where(has_tokens, running_sum, 1.0)[:, None]
        if FINAL:
            out_offsets = row * num_heads * HEAD_DIM + heads[:, None] * HEAD_DIM + dims[None, :]
            tl.store(out_ptr + out_offsets, normalised.to(out_ptr.dtype.element_ty), mask=real_head[:, None])
        else:
            head_splits = (row * num_heads + heads) * num_splits + split
            partial_offsets = head_splits[:, None] * HEAD_DIM + dims[None, :]
            tl.store(partial_ptr + partial_offsets, normalised, mask=real_head[:, None])
            log_sum = running_max + tl.log2(tl.where(has_tokens, running_sum, 1.0))
            log_sum = tl.where(has_tokens, log_sum, float("-inf"))
            tl.store(lse_ptr + head_splits, log_sum, mask=real_head)

    @triton.jit
    def combine_kernel(
        partial_ptr, lse_ptr, out_ptr, num_splits, num_heads, HEAD_DIM: tl.constexpr, SPLITS_TILE: tl.constexpr
    ):
        row = tl.program_id(0)
        head = tl.program_id(1)
        splits = tl.arange(0, SPLITS_TILE)
        dims = tl.arange(0, HEAD_DIM)
        real_split = splits < num_splits
        head_splits = (row * num_heads + head) * num_splits + splits
        log_sums = tl.load(lse_ptr + head_splits, mask=real_split, other=float("-inf"))
        top = tl.max(log_sums, 0)
        top = tl.where(top == float("-inf"), 0.0, top)  # a row with no tokens: all weights 0, output 0
        weights = tl.exp2(log_sums - top)
        total = tl.sum(weights, 0)
        partial_offsets = head_splits[:, None] * HEAD_DIM + dims[None, :]
        partials = tl.load(partial_ptr + partial_offsets, mask=real_split[:, None], other=0.0)
        attended = tl.sum(partials * weights[:, None], 0) / tl.where(total > 0, total, 1.0)
        out_offsets = row * num_heads * HEAD_DIM + head * HEAD_DIM + dims
        tl.store(out_ptr + out_offsets, attended.to(out_ptr.dtype.element_ty))

    return split_kernel, combine_kernel


def _let_the_interpreter_take_loop_bounds_from_tensors() -> None:
    """Triton 3.6's interpreter holds every scalar as a 1-element array and turns a loop bound into
    an int with `int(array)`, which numpy 2.4 refuses (triton-lang/triton#9171, fixed after 3.6).
    Take the element instead; the compiled kernels are untouched."""
    from triton.runtime import interpreter

    patch_tensor = interpreter._patch_lang_tensor
    if getattr(patch_tensor, "takes_loop_bounds_from_tensors", False):
        return

    def patch_tensor_with_scalar_index(tensor, scope) -> None:
        patch_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patch_tensor_with_scalar_index.takes_loop_bounds_from_tensors = True
    interpreter._patch_lang_tensor = patch_tensor_with_scalar_index
