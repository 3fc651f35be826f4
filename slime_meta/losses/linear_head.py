"""Token log-probs straight from the last hidden states: the output projection fused into the chunks.

`token_logps(head(hidden), ...)` first makes the `[N, V]` logits of every row, keeps them for
the backward and allocates their gradient: at a 49k-token vocabulary and a micro-batch's 2,000
response rows, about 0.4 GB each in float32. Here the projection runs `chunk_size` rows at a
time, in the backward too (recomputed), so at most one chunk's `[c, V]` float32 temporaries are
alive, and what is kept is the `[N, H]` hidden rows. Same function, up to float rounding.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ._common import compute_dtype
from .token_stats import TokenLogpsOutput


def _chunk_logits(hidden_c_H: Tensor, weight_V_H: Tensor, temperature_c: Tensor) -> Tensor:
    dtype = compute_dtype(hidden_c_H.dtype)
    return (hidden_c_H.to(dtype) @ weight_V_H.to(dtype).T) / temperature_c.to(dtype)[:, None]


class _LinearTokenLogps(torch.autograd.Function):
    """log softmax(hidden W^T / T)[target] per row, with a detached entropy; chunked both ways.

    Gradient of a row's log-prob with respect to its scaled logits z: onehot(target) - softmax(z);
    the chain rule through z = h W^T / T gives the hidden rows' and the weight's gradients, the
    weight's summed over the chunks into one tensor.
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx, hidden_N_H, weight_V_H, targets_N, temperature_N, chunk_size: int, with_entropy: bool
    ):
        logps, entropies = [], []
        for start in range(0, hidden_N_H.shape[0], chunk_size):
            rows = slice(start, start + chunk_size)
            z_c_V = _chunk_logits(hidden_N_H[rows], weight_V_H, temperature_N[rows])
            logsumexp_c = torch.logsumexp(z_c_V, dim=-1)
            logps.append(z_c_V.gather(-1, targets_N[rows, None]).squeeze(-1) - logsumexp_c)
            if with_entropy:  # H = logsumexp(z) - sum_v p_v z_v
                entropies.append(logsumexp_c - (torch.softmax(z_c_V, dim=-1) * z_c_V).sum(dim=-1))
            del z_c_V
        empty = hidden_N_H.new_zeros(0, dtype=compute_dtype(hidden_N_H.dtype))
        logp_N = torch.cat(logps) if logps else empty
        entropy_N = torch.cat(entropies) if entropies else empty
        ctx.save_for_backward(hidden_N_H, weight_V_H, targets_N, temperature_N)
        ctx.chunk_size = chunk_size
        ctx.mark_non_differentiable(entropy_N)
        return logp_N, entropy_N

    @staticmethod
    def backward(ctx, grad_logp_N, _grad_entropy_N):  # type: ignore[override]
        hidden_N_H, weight_V_H, targets_N, temperature_N = ctx.saved_tensors
        need_hidden, need_weight = ctx.needs_input_grad[:2]
        grad_hidden_N_H = torch.zeros_like(hidden_N_H) if need_hidden else None
        grad_weight_V_H = None
        if need_weight:  # summed over the chunks in float32, cast to the weight's dtype once
            dtype = compute_dtype(weight_V_H.dtype)
            grad_weight_V_H = torch.zeros(weight_V_H.shape, dtype=dtype, device=weight_V_H.device)
        for start in range(0, hidden_N_H.shape[0], ctx.chunk_size):
            rows = slice(start, start + ctx.chunk_size)
            z_c_V = _chunk_logits(hidden_N_H[rows], weight_V_H, temperature_N[rows])
            grad_c = grad_logp_N[rows].to(z_c_V.dtype)
            grad_z_c_V = torch.softmax(z_c_V, dim=-1).mul_(-grad_c[:, None])
            grad_z_c_V.scatter_add_(-1, targets_N[rows, None], grad_c[:, None])
            grad_z_c_V.div_(temperature_N[rows].to(z_c_V.dtype)[:, None])
            del z_c_V
            if need_hidden:
                grad_hidden_N_H[rows] = (grad_z_c_V @ weight_V_H.to(grad_z_c_V.dtype)).to(hidden_N_H.dtype)
            if need_weight:
                grad_weight_V_H.addmm_(grad_z_c_V.T, hidden_N_H[rows].to(grad_z_c_V.dtype))
        if grad_weight_V_H is not None:
            grad_weight_V_H = grad_weight_V_H.to(weight_V_H.dtype)
        return grad_hidden_N_H, grad_weight_V_H, None, None, None, None


def linear_token_logps(
    hidden_N_H: Tensor,
    weight_V_H: Tensor,
    targets_N: Tensor,
    temperature: float | Tensor = 1.0,
    chunk_size: int = 256,
    with_entropy: bool = True,
) -> TokenLogpsOutput:
    """`token_logps(hidden_N_H @ weight_V_H.T, targets_N, temperature)` without the `[N, V]` logits.

    `weight_V_H`: the output projection's weight (no bias). `temperature`: a float or one per row.
    The log-probs carry gradient to `hidden_N_H` and `weight_V_H`; the entropy is a detached metric
    (an entropy bonus needs `entropy_from_logits`). float32 compute (float64 stays float64).
    """
    if hidden_N_H.dim() != 2 or weight_V_H.dim() != 2 or hidden_N_H.shape[1] != weight_V_H.shape[1]:
        shapes = f"{tuple(hidden_N_H.shape)} and {tuple(weight_V_H.shape)}"
        raise ValueError(f"expected hidden [N, H] and weight [V, H], got {shapes}")
    if targets_N.shape != hidden_N_H.shape[:1]:
        raise ValueError(f"targets has shape {tuple(targets_N.shape)}, expected [N] = {tuple(hidden_N_H.shape[:1])}")
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size <= 0:
        raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")
    if isinstance(temperature, Tensor):
        if temperature.shape != targets_N.shape:
            expected = tuple(targets_N.shape)
            raise ValueError(f"temperature has shape {tuple(temperature.shape)}, expected [N] = {expected}")
        temperature_N = temperature
    else:
        if not temperature > 0:
            raise ValueError(f"temperature must be > 0, got {temperature}")
        temperature_N = torch.full(targets_N.shape, float(temperature), device=hidden_N_H.device)
    logp_N, entropy_N = _LinearTokenLogps.apply(
        hidden_N_H, weight_V_H, targets_N.long(), temperature_N, chunk_size, with_entropy
    )
    return TokenLogpsOutput(logp_N, entropy_N if with_entropy else None)
