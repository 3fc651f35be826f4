"""Triton kernels behind `fused.py`: one program per selected row, the vocabulary streamed in blocks.

Imported only through `fused.py`, which falls back to the torch code when this import fails.

Every row's logits are read in blocks of `BLOCK` through registers; nothing `[rows, V]` is
written except the gradient. Logs and exponentials are base 2 (the hardware's ex2/lg2): with
`scale = log2(e) / T`, `u = logits * scale` is the scaled logit in bits, `lse = log2 sum 2^u`
and `log2 p = u - lse`; results are converted to nats on the way out.

Token statistics (target log-prob, entropy) take ONE pass forward (online max and sums per lane)
and one pass backward. The divergence takes two passes forward (log-normalisers, then the sums
that need them) and one backward. `MODE` selects the divergence:
  0  0 < beta < 1   J = beta KL(q || m) + (1 - beta) KL(p || m),  m = beta q + (1 - beta) p
  1  beta == 1      J = KL(p || q)   (reverse)
  2  beta == 0      J = KL(q || p)   (forward)
with p the student's and q the teacher's distribution. Gradients with respect to the student
logits s (derived per mode, g the per-entry log-ratio in nats):
  0  dJ/ds_v = (1 - beta) / T * p_v (g_v - sum_u p_u g_u),  g = log p - log m
  1  dJ/ds_v = 1 / T * p_v (g_v - J),                        g = log p - log q
  2  dJ/ds_v = 1 / T * (p_v - q_v)
and for the target log-prob, d log p_y / ds_v = 1 / T ([v == y] - p_v).
"""

from __future__ import annotations

import triton
import triton.language as tl

LN2 = tl.constexpr(0.6931471805599453)  # a constexpr: kernels may read no other globals


@triton.jit
def _online_lse(x_row, scale, V: tl.constexpr, BLOCK: tl.constexpr):
    """log2 sum_v 2^(x_v * scale) of one row, by a per-lane running max and rescaled sum."""
    offs = tl.arange(0, BLOCK)
    run_max = tl.full([BLOCK], -float("inf"), tl.float32)
    run_sum = tl.zeros([BLOCK], tl.float32)
    for start in range(0, V, BLOCK):
        cols = start + offs
        u = tl.load(x_row + cols, mask=cols < V, other=-float("inf")).to(tl.float32) * scale
        new_max = tl.maximum(run_max, u)
        base = tl.where(new_max == -float("inf"), 0.0, new_max)
        run_sum = run_sum * tl.exp2(run_max - base) + tl.exp2(u - base)
        run_max = new_max
    top = tl.max(run_max, 0)
    return top + tl.log2(tl.sum(run_sum * tl.exp2(run_max - top), 0))


@triton.jit
def token_stats_forward(
    x_ptr,
    rows_ptr,
    targets_ptr,
    scale_ptr,
    logp_ptr,
    lse_ptr,
    entropy_ptr,
    stride_x,
    V: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Per selected row: log p(target), the log-normaliser (bits, for backward) and the entropy.

    Entropy in bits is lse - sum_v p_v u_v; `acc` carries sum 2^(u - max) u, rescaled like the sum.
    """
    i = tl.program_id(0)
    row = tl.load(rows_ptr + i).to(tl.int64)
    scale = tl.load(scale_ptr + i)
    x_row = x_ptr + row * stride_x
    offs = tl.arange(0, BLOCK)
    run_max = tl.full([BLOCK], -float("inf"), tl.float32)
    run_sum = tl.zeros([BLOCK], tl.float32)
    run_acc = tl.zeros([BLOCK], tl.float32)
    for start in range(0, V, BLOCK):
        cols = start + offs
        u = tl.load(x_row + cols, mask=cols < V, other=-float("inf")).to(tl.float32) * scale
        new_max = tl.maximum(run_max, u)
        base = tl.where(new_max == -float("inf"), 0.0, new_max)
        shrink = tl.exp2(run_max - base)
        e = tl.exp2(u - base)
        run_sum = run_sum * shrink + e
        run_acc = run_acc * shrink + tl.where(e > 0.0, e * u, 0.0)  # 0 * -inf would be NaN
        run_max = new_max
    top = tl.max(run_max, 0)
    lane_weight = tl.exp2(run_max - top)
    total = tl.sum(run_sum * lane_weight, 0)
    lse = top + tl.log2(total)
    mean_u = tl.sum(run_acc * lane_weight, 0) / total
    target = tl.load(targets_ptr + i).to(tl.int64)
    # An id outside the vocabulary gives NaN (visible), never a read outside the row.
    picked = tl.load(x_row + target, mask=(target >= 0) & (target < V), other=float("nan")).to(tl.float32)
    tl.store(logp_ptr + i, (picked * scale - lse) * LN2)
    tl.store(lse_ptr + i, lse)
    tl.store(entropy_ptr + i, (lse - mean_u) * LN2)


@triton.jit
def token_logp_backward(
    x_ptr,
    rows_ptr,
    targets_ptr,
    scale_ptr,
    lse_ptr,
    up_ptr,
    grad_ptr,
    stride_x,
    stride_g,
    V: tl.constexpr,
    BLOCK: tl.constexpr,
):
    i = tl.program_id(0)
    row = tl.load(rows_ptr + i).to(tl.int64)
    scale = tl.load(scale_ptr + i)
    lse = tl.load(lse_ptr + i)
    coef = tl.load(up_ptr + i) * scale * LN2  # upstream / T
    target = tl.load(targets_ptr + i).to(tl.int64)
    x_row = x_ptr + row * stride_x
    g_row = grad_ptr + row * stride_g
    offs = tl.arange(0, BLOCK)
    for start in range(0, V, BLOCK):
        cols = start + offs
        ok = cols < V
        p = tl.exp2(tl.load(x_row + cols, mask=ok, other=0.0).to(tl.float32) * scale - lse)
        grad = coef * (tl.where(cols == target, 1.0, 0.0) - p)
        tl.store(g_row + cols, grad.to(grad_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _block_log2_probs(s_row, t_row, cols, scale, lse_s, lse_t, V: tl.constexpr):
    """One block of a row pair, forward and backward alike: which columns are in range, both
    log2-probs (student s, target t) and the student's probabilities."""
    ok = cols < V
    lp = tl.load(s_row + cols, mask=ok, other=0.0).to(tl.float32) * scale - lse_s
    lq = tl.load(t_row + cols, mask=ok, other=0.0).to(tl.float32) * scale - lse_t
    return ok, lp, lq, tl.exp2(lp)


@triton.jit
def _log2_mixture(lp, lq, log2_beta, log2_1m_beta):
    """log2(beta 2^lq + (1 - beta) 2^lp), without overflow."""
    a = lq + log2_beta
    b = lp + log2_1m_beta
    hi = tl.maximum(a, b)
    return hi + tl.log2(1.0 + tl.exp2(tl.minimum(a, b) - hi))


@triton.jit
def divergence_forward(
    s_ptr,
    t_ptr,
    rows_ptr,
    targets_ptr,
    div_ptr,
    dot_ptr,
    lse_s_ptr,
    lse_t_ptr,
    logp_ptr,
    stride_s,
    stride_t,
    scale,
    log2_beta,
    log2_1m_beta,
    beta,
    V: tl.constexpr,
    BLOCK: tl.constexpr,
    MODE: tl.constexpr,
    WITH_TARGET: tl.constexpr,
):
    """Per selected row: the divergence J (nats), D = sum p g (nats, for backward), both lse (bits),
    and with WITH_TARGET the student's log p(target)."""
    i = tl.program_id(0)
    row = tl.load(rows_ptr + i).to(tl.int64)
    s_row = s_ptr + row * stride_s
    t_row = t_ptr + row * stride_t
    lse_s = _online_lse(s_row, scale, V, BLOCK)
    lse_t = _online_lse(t_row, scale, V, BLOCK)
    offs = tl.arange(0, BLOCK)
    acc_j = tl.zeros([BLOCK], tl.float32)
    acc_d = tl.zeros([BLOCK], tl.float32)
    for start in range(0, V, BLOCK):
        cols = start + offs
        ok, lp, lq, p = _block_log2_probs(s_row, t_row, cols, scale, lse_s, lse_t, V)
        if MODE == 0:
            lm = _log2_mixture(lp, lq, log2_beta, log2_1m_beta)
            g = lp - lm
            term_j = beta * tl.exp2(lq) * (lq - lm) + (1.0 - beta) * p * g
            term_d = p * g
        elif MODE == 1:
            term_j = p * (lp - lq)
            term_d = term_j
        else:
            term_j = tl.exp2(lq) * (lq - lp)
            term_d = tl.zeros([BLOCK], tl.float32)
        acc_j += tl.where(ok, term_j, 0.0)
        acc_d += tl.where(ok, term_d, 0.0)
    tl.store(div_ptr + i, tl.sum(acc_j, 0) * LN2)
    tl.store(dot_ptr + i, tl.sum(acc_d, 0) * LN2)
    tl.store(lse_s_ptr + i, lse_s)
    tl.store(lse_t_ptr + i, lse_t)
    if WITH_TARGET:
        target = tl.load(targets_ptr + i).to(tl.int64)
        picked = tl.load(s_row + target, mask=(target >= 0) & (target < V), other=float("nan")).to(tl.float32)
        tl.store(logp_ptr + i, (picked * scale - lse_s) * LN2)


@triton.jit
def divergence_backward(
    s_ptr,
    t_ptr,
    rows_ptr,
    targets_ptr,
    lse_s_ptr,
    lse_t_ptr,
    dot_ptr,
    up_div_ptr,
    up_logp_ptr,
    grad_ptr,
    stride_s,
    stride_t,
    stride_g,
    scale,
    log2_beta,
    log2_1m_beta,
    coef_div,
    inv_temp,
    V: tl.constexpr,
    BLOCK: tl.constexpr,
    MODE: tl.constexpr,
    WITH_TARGET: tl.constexpr,
):
    """One gradient write for both outputs: up_div dJ/ds + up_logp d log p(target)/ds.

    `coef_div` folds the mode's factor ((1 - beta) / T or 1 / T) and, for modes 0 and 1, the
    bits-to-nats factor of g."""
    i = tl.program_id(0)
    row = tl.load(rows_ptr + i).to(tl.int64)
    s_row = s_ptr + row * stride_s
    t_row = t_ptr + row * stride_t
    g_row = grad_ptr + row * stride_g
    lse_s = tl.load(lse_s_ptr + i)
    lse_t = tl.load(lse_t_ptr + i)
    dot_bits = tl.load(dot_ptr + i) / LN2
    a_div = tl.load(up_div_ptr + i) * coef_div
    if WITH_TARGET:
        a_logp = tl.load(up_logp_ptr + i) * inv_temp
        target = tl.load(targets_ptr + i).to(tl.int64)
    else:
        a_logp = 0.0
        target = -1
    offs = tl.arange(0, BLOCK)
    for start in range(0, V, BLOCK):
        cols = start + offs
        ok, lp, lq, p = _block_log2_probs(s_row, t_row, cols, scale, lse_s, lse_t, V)
        if MODE == 0:
            grad = a_div * p * ((lp - _log2_mixture(lp, lq, log2_beta, log2_1m_beta)) - dot_bits)
        elif MODE == 1:
            grad = a_div * p * ((lp - lq) - dot_bits)
        else:
            grad = a_div * (p - tl.exp2(lq))
        grad += a_logp * (tl.where(cols == target, 1.0, 0.0) - p)
        tl.store(g_row + cols, grad.to(grad_ptr.dtype.element_ty), mask=ok)
