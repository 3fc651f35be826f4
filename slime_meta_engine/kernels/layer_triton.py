"""The Triton kernels of kernels/layer_ops.py (imported there on first use: importing this module imports triton).

kernels/layer_ops.py says what each computes and how it rounds.
"""

import triton
import triton.language as tl
from triton.language.extra import libdevice


@triton.jit
def round_to(x, dtype: tl.constexpr):
    """float32 `x` to `dtype`, rounded to nearest even as torch's casts round."""
    if dtype == tl.bfloat16:  # in integers: the interpreter's bf16 cast truncates; compiled, the same as cvt.rn
        bits = x.to(tl.int32, bitcast=True)
        rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        rounded = tl.where(x != x, 0x7FC0, rounded)  # NaN stays NaN
        return rounded.to(tl.int16).to(tl.bfloat16, bitcast=True)
    else:
        return x.to(dtype)


@triton.jit
def rms_norm(
    x_ptr,
    delta_ptr,
    weight_ptr,
    total_ptr,
    normed_ptr,
    stride_x,
    stride_delta,
    stride_total,
    stride_normed,
    width,
    eps,
    ADD: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)  # one program per row, the whole row in one block
    columns = tl.arange(0, BLOCK)
    inside = columns < width
    model_dtype = x_ptr.dtype.element_ty
    x = tl.load(x_ptr + row * stride_x + columns, mask=inside, other=0.0).to(tl.float32)
    if ADD:
        delta = tl.load(delta_ptr + row * stride_delta + columns, mask=inside, other=0.0).to(tl.float32)
        total = round_to(x + delta, model_dtype)
        tl.store(total_ptr + row * stride_total + columns, total, mask=inside)
        x = total.to(tl.float32)
    mean_square = tl.math.div_rn(tl.sum(x * x, 0), width * 1.0)
    normalised = round_to(x * tl.math.rsqrt(mean_square + eps), model_dtype).to(tl.float32)
    weight = tl.load(weight_ptr + columns, mask=inside, other=0.0).to(tl.float32)
    normed = round_to(weight * normalised, normed_ptr.dtype.element_ty)
    tl.store(normed_ptr + row * stride_normed + columns, normed, mask=inside)


@triton.jit
def rotary(
    x_ptr,
    cos_ptr,
    sin_ptr,
    out_ptr,
    heads,
    sx_row,
    sx_head,
    sx_col,
    sx_dim,
    sc_row,
    sc_head,
    sc_col,
    sc_dim,
    ss_row,
    ss_head,
    ss_col,
    ss_dim,
    so_row,
    so_head,
    so_col,
    so_dim,
    HEAD_DIM: tl.constexpr,
    HEADS_BLOCK: tl.constexpr,
    DIM_BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    column = tl.program_id(1).to(tl.int64)
    head = tl.arange(0, HEADS_BLOCK)[:, None]
    dim = tl.arange(0, DIM_BLOCK)[None, :]
    inside = (head < heads) & (dim < HEAD_DIM)
    # roll by half the head: output element d takes x's element d - D/2 (mod D) = d + D/2 (mod D).
    partner = (dim + HEAD_DIM // 2) % HEAD_DIM
    model_dtype = out_ptr.dtype.element_ty
    x_row = x_ptr + row * sx_row + column * sx_col + head * sx_head
    x = tl.load(x_row + dim * sx_dim, mask=inside, other=0.0).to(tl.float32)
    rolled = tl.load(x_row + partner * sx_dim, mask=inside, other=0.0).to(tl.float32)
    cos_offsets = row * sc_row + column * sc_col + head * sc_head + dim * sc_dim
    cos = tl.load(cos_ptr + cos_offsets, mask=inside, other=0.0).to(tl.float32)
    sin_offsets = row * ss_row + column * ss_col + head * ss_head + dim * ss_dim
    sin = tl.load(sin_ptr + sin_offsets, mask=inside, other=0.0).to(tl.float32)
    straight = round_to(x * cos, model_dtype).to(tl.float32)
    turned = round_to(rolled * sin, model_dtype).to(tl.float32)
    out_offsets = row * so_row + column * so_col + head * so_head + dim * so_dim
    tl.store(out_ptr + out_offsets, round_to(straight + turned, model_dtype), mask=inside)


@triton.jit
def silu_mul(gate_up_ptr, out_ptr, width, stride_in, stride_out, BLOCK: tl.constexpr, LIBDEVICE_EXP: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    columns = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = columns < width
    model_dtype = out_ptr.dtype.element_ty
    gate_row = gate_up_ptr + row * stride_in
    gate = tl.load(gate_row + columns, mask=inside, other=0.0).to(tl.float32)
    up = tl.load(gate_row + width + columns, mask=inside, other=0.0).to(tl.float32)
    if LIBDEVICE_EXP:
        exp = libdevice.exp(-gate)
    else:
        exp = tl.exp(-gate)
    silu = round_to(tl.math.div_rn(gate, 1.0 + exp), model_dtype).to(tl.float32)
    tl.store(out_ptr + row * stride_out + columns, round_to(silu * up, model_dtype), mask=inside)


@triton.jit
def rotate_into_cache(
    qkv_ptr,
    cos_ptr,
    sin_ptr,
    q_ptr,
    keys_ptr,
    values_ptr,
    slots_ptr,
    s_qkv_row,
    s_qkv_head,
    s_cos_row,
    s_sin_row,
    s_q_row,
    s_q_head,
    s_cache_slot,
    s_cache_head,
    NUM_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEADS_BLOCK: tl.constexpr,
    KV_BLOCK: tl.constexpr,
    DIM_BLOCK: tl.constexpr,
):
    """One decode row: rotate its queries into q and its keys into the cache slot, copy its values
    there. The rotation rounds as `rotary` does."""
    row = tl.program_id(0).to(tl.int64)
    dim = tl.arange(0, DIM_BLOCK)[None, :]
    in_dim = dim < HEAD_DIM
    partner = (dim + HEAD_DIM // 2) % HEAD_DIM
    model_dtype = q_ptr.dtype.element_ty
    cos = tl.load(cos_ptr + row * s_cos_row + dim, mask=in_dim, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + row * s_sin_row + dim, mask=in_dim, other=0.0).to(tl.float32)
    qkv_row = qkv_ptr + row * s_qkv_row

    head = tl.arange(0, HEADS_BLOCK)[:, None]
    inside = (head < NUM_HEADS) & in_dim
    x = tl.load(qkv_row + head * s_qkv_head + dim, mask=inside, other=0.0).to(tl.float32)
    rolled = tl.load(qkv_row + head * s_qkv_head + partner, mask=inside, other=0.0).to(tl.float32)
    straight = round_to(x * cos, model_dtype).to(tl.float32)
    turned = round_to(rolled * sin, model_dtype).to(tl.float32)
    tl.store(q_ptr + row * s_q_row + head * s_q_head + dim, round_to(straight + turned, model_dtype), mask=inside)

    kv_head = tl.arange(0, KV_BLOCK)[:, None]
    kv_inside = (kv_head < NUM_KV_HEADS) & in_dim
    key_row = qkv_row + (NUM_HEADS + kv_head) * s_qkv_head
    x = tl.load(key_row + dim, mask=kv_inside, other=0.0).to(tl.float32)
    rolled = tl.load(key_row + partner, mask=kv_inside, other=0.0).to(tl.float32)
    straight = round_to(x * cos, model_dtype).to(tl.float32)
    turned = round_to(rolled * sin, model_dtype).to(tl.float32)
    slot = tl.load(slots_ptr + row).to(tl.int64)
    cache_at = slot * s_cache_slot + kv_head * s_cache_head + dim
    tl.store(keys_ptr + cache_at, round_to(straight + turned, model_dtype), mask=kv_inside)
    value = tl.load(qkv_row + (NUM_HEADS + NUM_KV_HEADS + kv_head) * s_qkv_head + dim, mask=kv_inside, other=0.0)
    tl.store(values_ptr + cache_at, value, mask=kv_inside)
