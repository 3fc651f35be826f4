"""A fused generalised-JSD (forward + backward) in Triton: a candidate for `slime_meta/losses`.

Not part of the package: `benchmarks/losses.py` measures it beside the project's chunked
`generalized_jsd` and the naive float32 reference, as evidence for the change proposed in
`docs/performance.md`. Same semantics as `generalized_jsd(student, teacher, mask, beta,
temperature)` for 0 < beta < 1 without top_k / token_clip (those fall back to the project's code).

Why it is fast: the chunked torch version runs about a dozen float32 elementwise kernels per
chunk, forward and again in backward, each reading and writing `[chunk, V]` float32 tensors. Here
each row is streamed in blocks of the vocabulary with everything in registers:
  forward   pass 1 reads student and teacher once: online max and sum -> both log-normalisers;
            pass 2 reads them again: the row's divergence J and D = sum_v p_v (log p_v - log m_v);
  backward  one pass reads them a third time and writes the student gradient (input dtype):
            dJ/ds_v = (1 - beta) / T * p_v * ((log p_v - log m_v) - D)
with p = softmax(s / T), q = softmax(t / T), m = beta q + (1 - beta) p and
J = beta KL(q || m) + (1 - beta) KL(p || m). Bytes moved: 3 reads of both logits plus one
gradient write, about 2.3x the floor of one read of each and one write.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl


@triton.jit
def _jsd_forward(
    s_ptr, t_ptr, rows_ptr, out_ptr, lse_s_ptr, lse_t_ptr, dot_ptr,
    stride_s, stride_t, inv_temp, log_beta, log_1m_beta, beta, V: tl.constexpr,
    BLOCK: tl.constexpr,
):  # fmt: skip
    i = tl.program_id(0)
    row = tl.load(rows_ptr + i).to(tl.int64)
    s_row = s_ptr + row * stride_s
    t_row = t_ptr + row * stride_t
    offs = tl.arange(0, BLOCK)
    # pass 1: log-normalisers of s/T and t/T (online: running max, rescaled sum)
    m_s = tl.full([BLOCK], -float("inf"), tl.float32)
    m_t = tl.full([BLOCK], -float("inf"), tl.float32)
    z_s = tl.zeros([BLOCK], tl.float32)
    z_t = tl.zeros([BLOCK], tl.float32)
    for start in range(0, V, BLOCK):
        cols = start + offs
        ok = cols < V
        s = tl.load(s_row + cols, mask=ok, other=-float("inf")).to(tl.float32) * inv_temp
        t = tl.load(t_row + cols, mask=ok, other=-float("inf")).to(tl.float32) * inv_temp
        new_m_s = tl.maximum(m_s, s)
        new_m_t = tl.maximum(m_t, t)
        z_s = z_s * tl.exp(m_s - tl.where(new_m_s == -float("inf"), 0.0, new_m_s)) + tl.exp(s - new_m_s)
        z_t = z_t * tl.exp(m_t - tl.where(new_m_t == -float("inf"), 0.0, new_m_t)) + tl.exp(t - new_m_t)
        z_s = tl.where(new_m_s == -float("inf"), 0.0, z_s)
        z_t = tl.where(new_m_t == -float("inf"), 0.0, z_t)
        m_s = new_m_s
        m_t = new_m_t
    max_s = tl.max(m_s, 0)
    max_t = tl.max(m_t, 0)
    lse_s = max_s + tl.log(tl.sum(z_s * tl.exp(m_s - max_s), 0))
    lse_t = max_t + tl.log(tl.sum(z_t * tl.exp(m_t - max_t), 0))
    # pass 2: the divergence and D = <p, log p - log m>
    acc_j = tl.zeros([BLOCK], tl.float32)
    acc_d = tl.zeros([BLOCK], tl.float32)
    for start in range(0, V, BLOCK):
        cols = start + offs
        ok = cols < V
        s = tl.load(s_row + cols, mask=ok, other=0.0).to(tl.float32) * inv_temp
        t = tl.load(t_row + cols, mask=ok, other=0.0).to(tl.float32) * inv_temp
        logp = s - lse_s
        logq = t - lse_t
        a = logq + log_beta
        b = logp + log_1m_beta
        hi = tl.maximum(a, b)
        logm = hi + tl.log(tl.exp(a - hi) + tl.exp(b - hi))
        p = tl.exp(logp)
        q = tl.exp(logq)
        g = logp - logm
        acc_j += tl.where(ok, beta * q * (logq - logm) + (1.0 - beta) * p * g, 0.0)
        acc_d += tl.where(ok, p * g, 0.0)
    tl.store(out_ptr + i, tl.sum(acc_j, 0))
    tl.store(lse_s_ptr + i, lse_s)
    tl.store(lse_t_ptr + i, lse_t)
    tl.store(dot_ptr + i, tl.sum(acc_d, 0))


@triton.jit
def _jsd_backward(
    s_ptr, t_ptr, rows_ptr, grad_ptr, lse_s_ptr, lse_t_ptr, dot_ptr, upstream_ptr,
    stride_s, stride_t, stride_g, inv_temp, log_beta, log_1m_beta, coef, V: tl.constexpr,
    BLOCK: tl.constexpr,
):  # fmt: skip
    i = tl.program_id(0)
    row = tl.load(rows_ptr + i).to(tl.int64)
    s_row = s_ptr + row * stride_s
    t_row = t_ptr + row * stride_t
    g_row = grad_ptr + row * stride_g
    lse_s = tl.load(lse_s_ptr + i)
    lse_t = tl.load(lse_t_ptr + i)
    dot = tl.load(dot_ptr + i)
    scale = tl.load(upstream_ptr + i) * coef
    offs = tl.arange(0, BLOCK)
    for start in range(0, V, BLOCK):
        cols = start + offs
        ok = cols < V
        s = tl.load(s_row + cols, mask=ok, other=0.0).to(tl.float32) * inv_temp
        t = tl.load(t_row + cols, mask=ok, other=0.0).to(tl.float32) * inv_temp
        logp = s - lse_s
        logq = t - lse_t
        a = logq + log_beta
        b = logp + log_1m_beta
        hi = tl.maximum(a, b)
        logm = hi + tl.log(tl.exp(a - hi) + tl.exp(b - hi))
        grad = scale * tl.exp(logp) * ((logp - logm) - dot)
        tl.store(g_row + cols, grad.to(grad_ptr.dtype.element_ty), mask=ok)


class _FusedJSD(torch.autograd.Function):
    @staticmethod
    def forward(ctx, student, teacher, rows, beta, temperature, block):  # type: ignore[override]
        n = rows.numel()
        out = torch.empty(n, dtype=torch.float32, device=student.device)
        lse_s, lse_t, dot = torch.empty_like(out), torch.empty_like(out), torch.empty_like(out)
        consts = (1.0 / temperature, math.log(beta), math.log1p(-beta))
        if n:
            _jsd_forward[(n,)](
                student, teacher, rows, out, lse_s, lse_t, dot, student.stride(0), teacher.stride(0),
                *consts, beta, V=student.shape[1], BLOCK=block, num_warps=8,
            )  # fmt: skip
        ctx.save_for_backward(student, teacher, rows, lse_s, lse_t, dot)
        ctx.consts, ctx.coef, ctx.block = consts, (1.0 - beta) / temperature, block
        return out

    @staticmethod
    def backward(ctx, upstream):  # type: ignore[override]
        student, teacher, rows, lse_s, lse_t, dot = ctx.saved_tensors
        grad = torch.zeros_like(student)  # rows outside the mask get 0
        n = rows.numel()
        if n:
            _jsd_backward[(n,)](
                student, teacher, rows, grad, lse_s, lse_t, dot, upstream.contiguous().float(),
                student.stride(0), teacher.stride(0), grad.stride(0), *ctx.consts, ctx.coef,
                V=student.shape[1], BLOCK=ctx.block, num_warps=8,
            )  # fmt: skip
        return grad, None, None, None, None, None


def fused_generalized_jsd(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    mask: torch.Tensor | None,
    beta: float = 0.5,
    temperature: float = 1.0,
    block: int = 4096,
) -> torch.Tensor:
    """Mean over masked tokens of the generalised JSD (0 < beta < 1); gradient to the student only."""
    if not 0.0 < beta < 1.0:
        raise ValueError("the fused kernel covers 0 < beta < 1; use slime_meta.losses.generalized_jsd otherwise")
    V = student_logits.shape[-1]
    s = student_logits.reshape(-1, V)
    t = teacher_logits.detach().reshape(-1, V)
    if s.stride(-1) != 1 or t.stride(-1) != 1:
        s, t = s.contiguous(), t.contiguous()
    keep = torch.ones(s.shape[0], dtype=torch.bool, device=s.device) if mask is None else mask.reshape(-1) != 0
    rows = keep.nonzero().squeeze(1).to(torch.int32)
    per_row = _FusedJSD.apply(s, t, rows, float(beta), float(temperature), block)
    return per_row.sum() / max(1, rows.numel())
