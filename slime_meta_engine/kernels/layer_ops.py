"""The element-wise steps of a decoder layer as one Triton kernel each, computing what torch computes.

Why: a graph-replayed decode step of a small model at a few dozen rows is bound by kernel launches
(each costs a few microseconds of replay whatever its size), and a layer's norms, rotation and
gated activation are most of them: RMSNorm is four torch kernels, the rotation four, SiLU-and-
multiply two, each residual add one. Here each of those groups is one kernel, and a residual add
joins the norm that follows it.

Each function takes `use_kernel`; without it (the CPU, or triton missing) it runs its torch
expression, which is also the reference the kernels are held to:
- `rms_norm`:      `weight * F.rms_norm(x.float(), (E,), eps=eps).to(x.dtype)` (HF's RMSNorm)
- `add_rms_norm`:  `hidden = hidden + delta`, then `rms_norm(hidden)`; returns both
- `rotary`:        `x * cos + x.roll(D // 2, dims=-1) * signed_sin` (family_forward._apply_rotary)
- `silu_mul`:      `F.silu(gate) * up` with `gate, up = gate_up.chunk(2, dim=-1)`
- `rotate_into_cache`: a decode step's `rotary` of queries and keys from the q/k/v product, the
  keys and values stored at each row's cache slot (a paged layer: three kernels become one)

Numerics: torch computes an element-wise op on half-precision tensors in float32 and rounds the
result to the tensor's dtype, op by op; the kernels do the same and round at the same places
(round to nearest even; for bf16 written out in integer operations, because Triton's CPU
interpreter truncates in its bf16 cast, so the interpreter rounds as the GPU does). Hence:
- `rotary`, `rotate_into_cache` and the add of `add_rms_norm`: bit for bit in every dtype (products and sums of
  values rounded as torch rounds them; fp contraction into FMAs is switched off).
- `silu_mul`: on CUDA exp is libdevice's expf and the division IEEE-rounded, as in torch's CUDA
  kernel: bit for bit there, float32 included (tests/test_fused_ops.py checks). The interpreter's
  exp is numpy's, which may differ from torch's CPU exp in the last float32 bit: float32 within a
  few ulps, and bf16 rarely one ulp.
- `rms_norm`: the float32 sum of squares adds in another order than torch's, so the float32
  normalised value may differ in its last bits (within 4 float32 ulps in the tests) and, in rare
  elements, its cast to the model dtype by one ulp (two after the weight). The weight multiply
  rounds exactly as torch's: the output is bit for bit `weight * output with a weight of ones`.
  Seen on an H200: bf16 bit for bit in all 700,000 elements of the tests, float16 3 elements of
  470,000 off by at most 2 ulps. (HF's RMSNorm and torch's `rms_norm` differ the same way.)
float16 runs the same code, but the interpreter truncates its casts: checked on CUDA only.

Triton is imported lazily (the engine's CPU path never needs it); `TRITON_INTERPRET=1` runs the
kernels on CPU tensors through Triton's interpreter (tests), where `use_kernel` is asked for.
"""

from __future__ import annotations

import functools
import os

import torch
import torch.nn.functional as F

KERNEL_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# "0" turns the kernels off in decoders built afterwards (read at construction): for A/B runs.
SWITCH_ENV = "SLIME_META_FUSED_OPS"


@functools.lru_cache(maxsize=None)
def triton_unavailable_reason() -> str | None:
    """Why triton cannot be used here, or None; imported once per process."""
    try:
        import triton  # noqa: F401
    except ImportError as error:
        return f"triton does not import ({error})"
    return None


def interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def kernels_unavailable_reason(device: torch.device, dtype: torch.dtype) -> str | None:
    """Why the kernels cannot run for tensors of this device and dtype, or None when they can
    (CUDA, or the CPU under TRITON_INTERPRET=1)."""
    device = torch.device(device)
    if dtype not in KERNEL_DTYPES:
        return f"dtype {dtype} is not one of bfloat16, float16, float32"
    if device.type != "cuda" and not (device.type == "cpu" and interpreted()):
        return f"device {device} is not CUDA (on CPU the kernels run only under TRITON_INTERPRET=1)"
    return triton_unavailable_reason()


def kernels_by_default(device: torch.device, dtype: torch.dtype) -> bool:
    """What a decoder uses when not told: the kernels on CUDA where triton imports, unless
    SLIME_META_FUSED_OPS=0. The CPU keeps the torch expressions, interpreter or not."""
    if os.environ.get(SWITCH_ENV, "1") == "0" or torch.device(device).type != "cuda":
        return False
    return kernels_unavailable_reason(device, dtype) is None


# ----- the operations ----------------------------------------------------------------------------


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, *, use_kernel: bool) -> torch.Tensor:
    """HF's RMSNorm of `x` (..., E): normalise in float32, cast to x's dtype, then scale."""
    if not use_kernel:
        return _torch_rms_norm(x, weight, eps)
    return _launch_rms_norm(x, None, weight, eps)[1]


def _torch_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight * F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)


def add_rms_norm(
    hidden: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float, *, use_kernel: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """(hidden + delta, rms_norm(hidden + delta)): the residual add in the model dtype, then the norm."""
    if not use_kernel or hidden.dtype != delta.dtype or hidden.shape != delta.shape:
        total = hidden + delta
        normed = _launch_rms_norm(total, None, weight, eps)[1] if use_kernel else _torch_rms_norm(total, weight, eps)
        return total, normed
    return _launch_rms_norm(hidden, delta, weight, eps)


def rotary(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor, *, use_kernel: bool) -> torch.Tensor:
    """`x * cos + x.roll(D // 2, dims=-1) * signed_sin` over x (rows, heads, D) or (rows, heads, cols, D),
    any strides; cos/sin broadcast to x (decode: (rows, 1, D); prefill: (cols, D))."""
    if not use_kernel or x.dim() not in (3, 4) or x.shape[-1] % 2 or cos.dtype != x.dtype:
        return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * signed_sin
    return _launch_rotary(x, cos, signed_sin)


def rotate_into_cache(
    qkv_B_X_D: torch.Tensor,
    cos_B_1_D: torch.Tensor,
    sin_B_1_D: torch.Tensor,
    keys_X_K_D: torch.Tensor,
    values_X_K_D: torch.Tensor,
    slots_B: torch.Tensor,
    num_heads: int,
    *,
    use_kernel: bool,
) -> torch.Tensor:
    """One decode step's queries and keys rotated, its keys and values stored in the cache.

    `qkv_B_X_D`: the q/k/v product (rows, H + 2K, D), queries first, then keys, then values;
    `keys_X_K_D`/`values_X_K_D`: a layer's cache as (token slots, K, D); `slots_B`: each row's slot
    for its new token. Returns the rotated queries (rows, H, D).
    """
    num_kv_heads, head_dim = keys_X_K_D.shape[1], keys_X_K_D.shape[2]
    fits = (
        qkv_B_X_D.stride(-1) == 1
        and cos_B_1_D.stride(-1) == 1
        and sin_B_1_D.stride(-1) == 1
        and keys_X_K_D.stride(-1) == 1
        and values_X_K_D.stride() == keys_X_K_D.stride()
        and cos_B_1_D.dtype == qkv_B_X_D.dtype
        and head_dim % 2 == 0
    )
    if not use_kernel or not fits:
        rotated_B_HK_D = rotary(qkv_B_X_D[:, : num_heads + num_kv_heads], cos_B_1_D, sin_B_1_D, use_kernel=use_kernel)
        keys_X_K_D[slots_B] = rotated_B_HK_D[:, num_heads:]
        values_X_K_D[slots_B] = qkv_B_X_D[:, num_heads + num_kv_heads :]
        return rotated_B_HK_D[:, :num_heads]
    rows = qkv_B_X_D.shape[0]
    q_B_H_D = torch.empty(rows, num_heads, head_dim, dtype=qkv_B_X_D.dtype, device=qkv_B_X_D.device)
    if rows:
        heads_block, dim_block = next_power_of_two(num_heads), next_power_of_two(head_dim)
        _kernels().rotate_into_cache[(rows,)](
            qkv_B_X_D,
            cos_B_1_D,
            sin_B_1_D,
            q_B_H_D,
            keys_X_K_D,
            values_X_K_D,
            slots_B,
            qkv_B_X_D.stride(0),
            qkv_B_X_D.stride(1),
            cos_B_1_D.stride(0),
            sin_B_1_D.stride(0),
            q_B_H_D.stride(0),
            q_B_H_D.stride(1),
            keys_X_K_D.stride(0),
            keys_X_K_D.stride(1),
            NUM_HEADS=num_heads,
            NUM_KV_HEADS=num_kv_heads,
            HEAD_DIM=head_dim,
            HEADS_BLOCK=heads_block,
            KV_BLOCK=next_power_of_two(num_kv_heads),
            DIM_BLOCK=dim_block,
            num_warps=_warps_for(heads_block * dim_block),
            enable_fp_fusion=False,
        )
    return q_B_H_D


def silu_mul(gate_up: torch.Tensor, *, use_kernel: bool) -> torch.Tensor:
    """`F.silu(gate) * up` of the gate/up product (..., 2F), gate first; returns (..., F)."""
    if not use_kernel:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up
    return _launch_silu_mul(gate_up)


# ----- launches ----------------------------------------------------------------------------------


def next_power_of_two(value: int) -> int:
    return 1 << max(0, value - 1).bit_length()


def _warps_for(elements: int) -> int:
    """About 256 elements a warp, 1 to 8 warps: these kernels read and write once per element."""
    return max(1, min(8, elements // 256))


def _rows_of(x: torch.Tensor) -> torch.Tensor:
    """x as (rows, last) with the last dimension contiguous (a view where one exists)."""
    flat = x.reshape(-1, x.shape[-1])
    return flat if flat.stride(-1) == 1 else flat.contiguous()


def _launch_rms_norm(x, delta, weight, eps):
    width = x.shape[-1]
    x_R_E = _rows_of(x)
    out_dtype = torch.promote_types(weight.dtype, x.dtype)
    normed_R_E = torch.empty(x_R_E.shape, dtype=out_dtype, device=x.device)
    total_R_E = torch.empty_like(x_R_E) if delta is not None else normed_R_E  # never written without delta
    delta_R_E = _rows_of(delta) if delta is not None else x_R_E
    weight_E = weight if weight.stride(-1) == 1 else weight.contiguous()
    rows = x_R_E.shape[0]
    if rows:
        block = next_power_of_two(width)
        _kernels().rms_norm[(rows,)](
            x_R_E,
            delta_R_E,
            weight_E,
            total_R_E,
            normed_R_E,
            x_R_E.stride(0),
            delta_R_E.stride(0),
            total_R_E.stride(0),
            normed_R_E.stride(0),
            width,
            eps,
            ADD=delta is not None,
            BLOCK=block,
            num_warps=_warps_for(block),
            enable_fp_fusion=False,
        )
    normed = normed_R_E.view(*x.shape[:-1], width)
    if delta is None:
        return None, normed
    return total_R_E.view(x.shape), normed


def _empty_in_stride_order(x: torch.Tensor) -> torch.Tensor:
    """An empty tensor shaped as x, laid out in the order of x's strides (outer to inner), as
    torch lays out an element-wise result: the prefill's (rows, heads, cols, D) slice of a
    (rows, cols, heads, D) product gives (rows, cols, heads, D) memory, as the torch path did."""
    order = sorted(range(x.dim()), key=lambda dim: (-x.stride(dim), dim))
    empty = torch.empty([x.shape[dim] for dim in order], dtype=x.dtype, device=x.device)
    return empty.permute([order.index(dim) for dim in range(x.dim())])


def _launch_rotary(x, cos, signed_sin):
    out = _empty_in_stride_order(x)
    # Work on (rows, heads, cols, D) views; decode's (rows, heads, D) has one column.
    x4, out4 = (x, out) if x.dim() == 4 else (x.unsqueeze(2), out.unsqueeze(2))
    cos4, sin4 = torch.broadcast_to(cos, x.shape), torch.broadcast_to(signed_sin, x.shape)
    if x.dim() == 3:
        cos4, sin4 = cos4.unsqueeze(2), sin4.unsqueeze(2)
    rows, heads, columns, head_dim = x4.shape
    if rows and heads and columns:
        heads_block = next_power_of_two(heads)
        dim_block = next_power_of_two(head_dim)
        _kernels().rotary[(rows, columns)](
            x4,
            cos4,
            sin4,
            out4,
            heads,
            *x4.stride(),
            *cos4.stride(),
            *sin4.stride(),
            *out4.stride(),
            HEAD_DIM=head_dim,
            HEADS_BLOCK=heads_block,
            DIM_BLOCK=dim_block,
            num_warps=_warps_for(heads_block * dim_block),
            enable_fp_fusion=False,
        )
    return out


def _launch_silu_mul(gate_up):
    width = gate_up.shape[-1] // 2
    gate_up_R_2F = _rows_of(gate_up)
    rows = gate_up_R_2F.shape[0]
    out_R_F = torch.empty(rows, width, dtype=gate_up.dtype, device=gate_up.device)
    if rows and width:
        block = min(1024, next_power_of_two(width))
        _kernels().silu_mul[(rows, -(-width // block))](
            gate_up_R_2F,
            out_R_F,
            width,
            gate_up_R_2F.stride(0),
            out_R_F.stride(0),
            BLOCK=block,
            # The interpreter cannot call libdevice; numpy's exp stands in for it there.
            LIBDEVICE_EXP=not interpreted(),
            num_warps=_warps_for(block),
            enable_fp_fusion=False,
        )
    return out_R_F.view(*gate_up.shape[:-1], width)


def _kernels():
    """The kernels' module, imported on first use, so importing this module never imports triton."""
    from slime_meta_engine.kernels import layer_triton

    return layer_triton
