"""Fused CUDA paths for the vocabulary-wide per-token losses (Triton), with the torch code as fallback.

Why: the chunked torch code (`_common.rowwise`) runs about a dozen float32 elementwise kernels
per chunk, forward and again in the recomputing backward; on an H100 at 8,192 tokens x vocab
151,936 that is 80-110x the time needed to read the logits once and write one gradient. The
kernels in `triton_kernels.py` stream each row through registers instead: the token log-prob
reads the logits once forward and once backward, the divergence three times, and each writes
one gradient (the logits' dtype). No `[rows, V]` float32 temporary exists at any point.

Measured on an H100 (`benchmarks/losses.py`, `benchmarks/results/losses_h100.json`), 8,192 tokens
x vocab 151,936, bf16, forward + backward: `generalized_jsd` 8.9 ms (3.5x the time to move the
floor's bytes; the torch code, chunk 256: 208 ms), `token_logps_and_jsd` plus the 3-channel
loss 10.0 ms (4.0x; torch code 275 ms); memory beyond the inputs 2.49 GB, the bf16 gradient
itself (0.04x a naive float32 pass).

Dispatch (`use_fused`): backend "auto" takes the kernels only for CUDA tensors of float32, bf16 or
fp16 when Triton imports and the call is one they cover (no `top_k`); everything else, and
float64 always, runs the exact torch code. "torch" forces the torch code; "triton" demands the
kernels (an error when they cannot run). Triton is imported on first use, never at package import.

Results match the torch code to float32 rounding: the kernels accumulate in float32 lanes and
sum the lanes at the end (a different summation order from torch's), so values agree to about
1e-6 relative, and gradients to the rounding of the output dtype.
"""

from __future__ import annotations

import functools
import math
from types import ModuleType

import torch
from torch import Tensor

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453
KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
BACKENDS = ("auto", "torch", "triton")
# Vocabulary block per program step and warps: 4096 / 8 measured best among
# (2048..8192) x (4..16) on an H100 at vocab 151,936 (docs/performance.md, section 2).
MAX_BLOCK, MAX_WARPS = 4096, 8


@functools.cache
def kernels() -> ModuleType | None:
    """The Triton kernel module, or None where Triton cannot be imported (its error is kept)."""
    try:
        from . import triton_kernels
    except Exception as error:  # ImportError, or a broken Triton install: the torch code runs
        kernels.import_error = error  # type: ignore[attr-defined]
        return None
    return triton_kernels


def kernels_usable(*tensors: Tensor) -> bool:
    """True when every tensor is a CUDA tensor of a kernel dtype and Triton imports."""
    return all(t.is_cuda and t.dtype in KERNEL_DTYPES for t in tensors) and kernels() is not None


def use_fused(backend: str, covered: bool, *tensors: Tensor) -> bool:
    """Whether a call runs the kernels. `covered`: the options of this call are ones they implement."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "torch":
        return False
    if backend == "auto":
        return covered and kernels_usable(*tensors)
    if not covered:
        raise ValueError("backend='triton' does not cover this call (top_k); use 'auto' or 'torch'")
    if kernels() is None:
        raise RuntimeError(f"backend='triton' needs Triton: {getattr(kernels, 'import_error', 'not importable')}")
    if any(t.dtype not in KERNEL_DTYPES for t in tensors):
        raise ValueError(f"backend='triton' takes {KERNEL_DTYPES}, got {[t.dtype for t in tensors]}")
    return True


def _launch_shape(vocab: int) -> tuple[int, int]:
    block = min(MAX_BLOCK, 1 << max(4, math.ceil(math.log2(vocab))))
    return block, max(1, min(MAX_WARPS, block // 512))


def _launch_per_row(kernel_name: str, n: int, vocab: int, *args: object, **constexprs: object) -> None:
    """Run kernel `kernel_name` with one program per selected row, its vocabulary block and warps
    sized for `vocab`; nothing is launched when no row is selected."""
    if not n:
        return
    block, warps = _launch_shape(vocab)
    getattr(kernels(), kernel_name)[(n,)](*args, V=vocab, BLOCK=block, num_warps=warps, **constexprs)


def _rows_view(x: Tensor) -> Tensor:
    """`x` as `[rows, V]` with unit stride along V (a copy only when that is not already so)."""
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def _gradient_buffer(x: Tensor, n_selected: int) -> Tensor:
    # Rows come from a sorted nonzero(): all rows selected means each one is written by a program.
    return torch.empty_like(x) if n_selected == x.shape[0] else torch.zeros_like(x)


class _TokenLogps(torch.autograd.Function):
    """(log p(target), entropy) per selected row; the entropy carries no gradient."""

    @staticmethod
    def forward(ctx, logits_N_V: Tensor, rows_n: Tensor, targets_n: Tensor, scale_n: Tensor):  # type: ignore[override]
        n = rows_n.numel()
        logp_n = torch.empty(n, dtype=torch.float32, device=logits_N_V.device)
        lse_n, entropy_n = torch.empty_like(logp_n), torch.empty_like(logp_n)
        _launch_per_row(
            "token_stats_forward",
            n,
            logits_N_V.shape[1],
            logits_N_V,
            rows_n,
            targets_n,
            scale_n,
            logp_n,
            lse_n,
            entropy_n,
            logits_N_V.stride(0),
        )
        ctx.save_for_backward(logits_N_V, rows_n, targets_n, scale_n, lse_n)
        ctx.mark_non_differentiable(entropy_n)
        return logp_n, entropy_n

    @staticmethod
    def backward(ctx, up_logp_n: Tensor | None, _up_entropy: Tensor | None):  # type: ignore[override]
        logits_N_V, rows_n, targets_n, scale_n, lse_n = ctx.saved_tensors
        if up_logp_n is None:
            return None, None, None, None
        n = rows_n.numel()
        grad_N_V = _gradient_buffer(logits_N_V, n)
        _launch_per_row(
            "token_logp_backward",
            n,
            logits_N_V.shape[1],
            logits_N_V,
            rows_n,
            targets_n,
            scale_n,
            lse_n,
            up_logp_n.contiguous().float(),
            grad_N_V,
            logits_N_V.stride(0),
            grad_N_V.stride(0),
        )
        return grad_N_V, None, None, None


def token_logps_and_entropy(
    logits: Tensor, targets_n: Tensor, rows_n: Tensor, temperature: float | Tensor
) -> tuple[Tensor, Tensor]:
    """Rows `rows_n` of `logits` (`[..., V]`, flattened to rows): log p(targets_n) under
    softmax(logits / temperature) with gradient, and the entropy (detached), both float32 `[n]`.
    `temperature`: a float or one value per selected row."""
    logits_N_V = _rows_view(logits)
    n = rows_n.numel()
    if isinstance(temperature, Tensor):
        scale_n = (LOG2E / temperature.to(device=logits_N_V.device, dtype=torch.float32)).expand(n).contiguous()
    else:
        scale_n = torch.full((n,), LOG2E / float(temperature), dtype=torch.float32, device=logits_N_V.device)
    return _TokenLogps.apply(logits_N_V, rows_n.contiguous(), targets_n.contiguous(), scale_n)


def _divergence_mode(beta: float) -> tuple[int, float, float, float]:
    """(MODE, log2 beta, log2 (1 - beta), the gradient factor of J without 1/T) for a beta in [0, 1]."""
    if beta == 1.0:
        return 1, 0.0, 0.0, LN2
    if beta == 0.0:
        return 2, 0.0, 0.0, 1.0
    return 0, math.log2(beta), math.log2(1.0 - beta), (1.0 - beta) * LN2


class _Divergence(torch.autograd.Function):
    """Per selected row the generalised JSD and (optionally) the student's target log-prob."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx, student_N_V, teacher_N_V, rows_n, targets_n, beta: float, temperature: float
    ):
        n = rows_n.numel()
        with_target = targets_n is not None
        div_n = torch.empty(n, dtype=torch.float32, device=student_N_V.device)
        dot_n, lse_s_n, lse_t_n, logp_n = (torch.empty_like(div_n) for _ in range(4))
        if not with_target:
            logp_n.zero_()
        mode, log2_beta, log2_1m_beta, factor = _divergence_mode(beta)
        scale = LOG2E / temperature
        _launch_per_row(
            "divergence_forward",
            n,
            student_N_V.shape[1],
            student_N_V,
            teacher_N_V,
            rows_n,
            targets_n if with_target else rows_n,
            div_n,
            dot_n,
            lse_s_n,
            lse_t_n,
            logp_n,
            student_N_V.stride(0),
            teacher_N_V.stride(0),
            scale,
            log2_beta,
            log2_1m_beta,
            beta,
            MODE=mode,
            WITH_TARGET=with_target,
        )
        ctx.save_for_backward(
            student_N_V, teacher_N_V, rows_n, targets_n if with_target else rows_n, lse_s_n, lse_t_n, dot_n
        )
        ctx.settings = (mode, scale, log2_beta, log2_1m_beta, factor / temperature, 1.0 / temperature, with_target)
        if not with_target:
            ctx.mark_non_differentiable(logp_n)
        return div_n, logp_n

    @staticmethod
    def backward(ctx, up_div_n: Tensor | None, up_logp_n: Tensor | None):  # type: ignore[override]
        student_N_V, teacher_N_V, rows_n, targets_n, lse_s_n, lse_t_n, dot_n = ctx.saved_tensors
        mode, scale, log2_beta, log2_1m_beta, coef_div, inv_temp, with_target = ctx.settings
        n = rows_n.numel()
        zeros_n = torch.zeros(n, dtype=torch.float32, device=student_N_V.device)
        up_div_n = zeros_n if up_div_n is None else up_div_n.contiguous().float()
        up_logp_n = zeros_n if (up_logp_n is None or not with_target) else up_logp_n.contiguous().float()
        grad_N_V = _gradient_buffer(student_N_V, n)
        _launch_per_row(
            "divergence_backward",
            n,
            student_N_V.shape[1],
            student_N_V,
            teacher_N_V,
            rows_n,
            targets_n,
            lse_s_n,
            lse_t_n,
            dot_n,
            up_div_n,
            up_logp_n,
            grad_N_V,
            student_N_V.stride(0),
            teacher_N_V.stride(0),
            grad_N_V.stride(0),
            scale,
            log2_beta,
            log2_1m_beta,
            coef_div,
            inv_temp,
            MODE=mode,
            WITH_TARGET=with_target,
        )
        return grad_N_V, None, None, None, None, None


def divergence_and_logps(
    student_logits: Tensor,
    teacher_logits: Tensor,
    rows_n: Tensor,
    beta: float,
    temperature: float,
    targets_n: Tensor | None = None,
) -> tuple[Tensor, Tensor | None]:
    """Rows `rows_n` of the `[..., V]` logits: the generalised JSD per row (TRL GKD semantics, as
    `generalized_jsd`) and, with `targets_n`, the student's log p(target) per row; float32 `[n]`.
    Gradient to the student only, one gradient tensor for both outputs."""
    student_N_V, teacher_N_V = _rows_view(student_logits), _rows_view(teacher_logits.detach())
    targets = None if targets_n is None else targets_n.contiguous()
    div_n, logp_n = _Divergence.apply(
        student_N_V, teacher_N_V, rows_n.contiguous(), targets, float(beta), float(temperature)
    )
    return div_n, (logp_n if targets_n is not None else None)
