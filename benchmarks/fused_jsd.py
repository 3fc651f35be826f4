"""Fused per-token logits losses in Triton: candidates for `slime_meta/losses` (not part of the package).

`benchmarks/losses.py` measures them beside the project's chunked torch code and the naive
float32 reference, as evidence for the change proposed in `docs/performance.md`.

- `fused_generalized_jsd(student, teacher, mask, beta, temperature)`: the same value and
  gradient as `slime_meta.losses.generalized_jsd` for 0 < beta < 1 (no top_k / token_clip).
- `fused_logp_and_jsd(student, teacher, targets, mask, beta, temperature)`: per masked row, the
  target token's log-prob (what `sequence_logps` gives, for the GRPO and DPO channels) and the
  JSD (the SDPO channel), from one pass over the logits, with ONE gradient write for both: the
  3-channel loss reads its logits three times and writes its gradient once.

Why it is fast: the chunked torch code runs about a dozen float32 elementwise kernels per chunk,
forward and again in backward, each reading and writing `[chunk, V]` float32 tensors. Here each
row is streamed through registers in blocks of the vocabulary:
  forward   pass 1: online max and sum of 2^x -> both log-normalisers;
            pass 2: the row's J, D = sum_v p_v (log p_v - log m_v), and the target's log-prob;
  backward  one pass writes the student gradient (input dtype):
            dL/ds_v = u_jsd (1 - beta) / T p_v ((log p_v - log m_v) - D) + u_logp / T ([v = target] - p_v)
with p = softmax(s / T), q = softmax(t / T), m = beta q + (1 - beta) p,
J = beta KL(q || m) + (1 - beta) KL(p || m), and u_* the upstream gradients of each row's outputs.
Logs and exponentials are base 2 (the hardware's ex2/lg2), natural only in the results. Bytes
moved: 3 reads of both logits + 1 gradient write, about 2.3x the floor (one read of each, one write).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453


@triton.jit
def _log2_mix(lp, lq, log2_beta, log2_1m_beta):
    """log2(beta 2^lq + (1 - beta) 2^lp), stable."""
    a = lq + log2_beta
    b = lp + log2_1m_beta
    hi = tl.maximum(a, b)
    lo = tl.minimum(a, b)
    return hi + tl.log2(1.0 + tl.exp2(lo - hi))


@triton.jit
def _forward(
    s_ptr, t_ptr, rows_ptr, targets_ptr, jsd_ptr, logp_ptr, lse_s_ptr, lse_t_ptr, dot_ptr,
    stride_s, stride_t, scale, log2_beta, log2_1m_beta, beta,
    V: tl.constexpr, BLOCK: tl.constexpr, WITH_TARGET: tl.constexpr,
):  # fmt: skip
    i = tl.program_id(0)
    row = tl.load(rows_ptr + i).to(tl.int64)
    s_row = s_ptr + row * stride_s
    t_row = t_ptr + row * stride_t
    offs = tl.arange(0, BLOCK)
    # pass 1: per-lane running max and sum of 2^(x - max), x = logits * log2(e) / T
    m_s = tl.full([BLOCK], -float("inf"), tl.float32)
    m_t = tl.full([BLOCK], -float("inf"), tl.float32)
    z_s = tl.zeros([BLOCK], tl.float32)
    z_t = tl.zeros([BLOCK], tl.float32)
    for start in range(0, V, BLOCK):
        cols = start + offs
        ok = cols < V
        u = tl.load(s_row + cols, mask=ok, other=-float("inf")).to(tl.float32) * scale
        w = tl.load(t_row + cols, mask=ok, other=-float("inf")).to(tl.float32) * scale
        new_s = tl.maximum(m_s, u)
        new_t = tl.maximum(m_t, w)
        base_s = tl.where(new_s == -float("inf"), 0.0, new_s)
        base_t = tl.where(new_t == -float("inf"), 0.0, new_t)
        z_s = z_s * tl.exp2(m_s - base_s) + tl.exp2(u - base_s)
        z_t = z_t * tl.exp2(m_t - base_t) + tl.exp2(w - base_t)
        m_s = new_s
        m_t = new_t
    top_s = tl.max(m_s, 0)
    top_t = tl.max(m_t, 0)
    lse_s = top_s + tl.log2(tl.sum(z_s * tl.exp2(m_s - top_s), 0))
    lse_t = top_t + tl.log2(tl.sum(z_t * tl.exp2(m_t - top_t), 0))
    # pass 2: J and D (in bits; converted to nats at the end)
    acc_j = tl.zeros([BLOCK], tl.float32)
    acc_d = tl.zeros([BLOCK], tl.float32)
    for start in range(0, V, BLOCK):
        cols = start + offs
        ok = cols < V
        lp = tl.load(s_row + cols, mask=ok, other=0.0).to(tl.float32) * scale - lse_s
        lq = tl.load(t_row + cols, mask=ok, other=0.0).to(tl.float32) * scale - lse_t
        lm = _log2_mix(lp, lq, log2_beta, log2_1m_beta)
        p = tl.exp2(lp)
        g = lp - lm
        acc_j += tl.where(ok, beta * tl.exp2(lq) * (lq - lm) + (1.0 - beta) * p * g, 0.0)
        acc_d += tl.where(ok, p * g, 0.0)
    tl.store(jsd_ptr + i, tl.sum(acc_j, 0) * 0.6931471805599453)
    tl.store(dot_ptr + i, tl.sum(acc_d, 0) * 0.6931471805599453)
    tl.store(lse_s_ptr + i, lse_s)
    tl.store(lse_t_ptr + i, lse_t)
    if WITH_TARGET:
        target = tl.load(targets_ptr + i).to(tl.int64)
        picked = tl.load(s_row + target).to(tl.float32) * scale
        tl.store(logp_ptr + i, (picked - lse_s) * 0.6931471805599453)


@triton.jit
def _backward(
    s_ptr, t_ptr, rows_ptr, targets_ptr, grad_ptr, lse_s_ptr, lse_t_ptr, dot_ptr, up_jsd_ptr, up_logp_ptr,
    stride_s, stride_t, stride_g, scale, log2_beta, log2_1m_beta, coef_jsd, inv_temp,
    V: tl.constexpr, BLOCK: tl.constexpr, WITH_TARGET: tl.constexpr,
):  # fmt: skip
    i = tl.program_id(0)
    row = tl.load(rows_ptr + i).to(tl.int64)
    s_row = s_ptr + row * stride_s
    t_row = t_ptr + row * stride_t
    g_row = grad_ptr + row * stride_g
    lse_s = tl.load(lse_s_ptr + i)
    lse_t = tl.load(lse_t_ptr + i)
    dot_bits = tl.load(dot_ptr + i) * 1.4426950408889634
    a_jsd = tl.load(up_jsd_ptr + i) * coef_jsd * 0.6931471805599453  # (1-beta)/T, bits -> nats
    if WITH_TARGET:
        a_logp = tl.load(up_logp_ptr + i) * inv_temp
        target = tl.load(targets_ptr + i).to(tl.int64)
    else:
        a_logp = 0.0
        target = -1
    offs = tl.arange(0, BLOCK)
    for start in range(0, V, BLOCK):
        cols = start + offs
        ok = cols < V
        lp = tl.load(s_row + cols, mask=ok, other=0.0).to(tl.float32) * scale - lse_s
        lq = tl.load(t_row + cols, mask=ok, other=0.0).to(tl.float32) * scale - lse_t
        lm = _log2_mix(lp, lq, log2_beta, log2_1m_beta)
        p = tl.exp2(lp)
        grad = a_jsd * p * ((lp - lm) - dot_bits) + a_logp * (tl.where(cols == target, 1.0, 0.0) - p)
        tl.store(g_row + cols, grad.to(grad_ptr.dtype.element_ty), mask=ok)


class _Fused(torch.autograd.Function):
    @staticmethod
    def forward(ctx, student, teacher, rows, targets, beta, temperature, block, warps):  # type: ignore[override]
        n = rows.numel()
        with_target = targets is not None
        jsd = torch.empty(n, dtype=torch.float32, device=student.device)
        logp, lse_s, lse_t, dot = (torch.empty_like(jsd) for _ in range(4))
        consts = (LOG2E / temperature, math.log2(beta), math.log2(1.0 - beta))
        if n:
            _forward[(n,)](
                student, teacher, rows, targets if with_target else rows, jsd, logp, lse_s, lse_t, dot,
                student.stride(0), teacher.stride(0), *consts, beta,
                V=student.shape[1], BLOCK=block, WITH_TARGET=with_target, num_warps=warps,
            )  # fmt: skip
        ctx.save_for_backward(student, teacher, rows, targets if with_target else rows, lse_s, lse_t, dot)
        ctx.consts, ctx.with_target = consts, with_target
        ctx.coef, ctx.inv_temp, ctx.block, ctx.warps = (1.0 - beta) / temperature, 1.0 / temperature, block, warps
        return (jsd, logp) if with_target else jsd

    @staticmethod
    def backward(ctx, up_jsd, up_logp=None):  # type: ignore[override]
        student, teacher, rows, targets, lse_s, lse_t, dot = ctx.saved_tensors
        grad = torch.zeros_like(student)  # rows outside the mask get 0
        n = rows.numel()
        zeros = torch.zeros(n, dtype=torch.float32, device=student.device)
        up_jsd = zeros if up_jsd is None else up_jsd.contiguous().float()
        up_logp = zeros if up_logp is None else up_logp.contiguous().float()
        if n:
            _backward[(n,)](
                student, teacher, rows, targets, grad, lse_s, lse_t, dot, up_jsd, up_logp,
                student.stride(0), teacher.stride(0), grad.stride(0), *ctx.consts, ctx.coef, ctx.inv_temp,
                V=student.shape[1], BLOCK=ctx.block, WITH_TARGET=ctx.with_target, num_warps=ctx.warps,
            )  # fmt: skip
        return grad, None, None, None, None, None, None, None


def _rows(student: torch.Tensor, teacher: torch.Tensor, mask: torch.Tensor | None):
    V = student.shape[-1]
    s = student.reshape(-1, V)
    t = teacher.detach().reshape(-1, V)
    if s.stride(-1) != 1 or t.stride(-1) != 1:
        s, t = s.contiguous(), t.contiguous()
    keep = torch.ones(s.shape[0], dtype=torch.bool, device=s.device) if mask is None else mask.reshape(-1) != 0
    return s, t, keep.nonzero().squeeze(1).to(torch.int32)


def _check_beta(beta: float) -> None:
    if not 0.0 < beta < 1.0:
        raise ValueError("the fused kernel covers 0 < beta < 1; use slime_meta.losses.generalized_jsd otherwise")


def fused_generalized_jsd(student_logits, teacher_logits, mask, beta: float = 0.5, temperature: float = 1.0,
                          block: int = 4096, warps: int = 8) -> torch.Tensor:  # fmt: skip
    """Mean over masked tokens of the generalised JSD; gradient to the student only."""
    _check_beta(beta)
    s, t, rows = _rows(student_logits, teacher_logits, mask)
    per_row = _Fused.apply(s, t, rows, None, float(beta), float(temperature), block, warps)
    return per_row.sum() / max(1, rows.numel())


def fused_logp_and_jsd(student_logits, teacher_logits, targets, mask, beta: float = 0.5, temperature: float = 1.0,
                       block: int = 4096, warps: int = 8) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """Per token of `mask`'s shape (0 where masked out): (log p(target), JSD), one gradient write.

    `targets` has the mask's shape; logits at position t score `targets[t]` (no shift here).
    """
    _check_beta(beta)
    s, t, rows = _rows(student_logits, teacher_logits, mask)
    picked = targets.reshape(-1).index_select(0, rows.long()).to(torch.int32)
    jsd_n, logp_n = _Fused.apply(s, t, rows, picked, float(beta), float(temperature), block, warps)
    shape = student_logits.shape[:-1]
    flat_zero = torch.zeros(s.shape[0], dtype=torch.float32, device=s.device)
    logp = flat_zero.index_copy(0, rows.long(), logp_n).view(shape)
    jsd = flat_zero.index_copy(0, rows.long(), jsd_n).view(shape)
    return logp, jsd
