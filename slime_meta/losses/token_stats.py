"""Per-token statistics of logits: log-probs of given tokens, entropy. Memory-aware."""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch
from torch import Tensor

from . import fused
from ._common import (
    as_bool_mask,
    compute_dtype,
    masked_mean,
    rowwise,
    scatter_rows,
    selected_rows,
)


@dataclass
class SequenceLogpsOutput:
    """`token_logps`: `[B, T]` log p(tokens[b, t]), 0 where masked. `seq_logps`: `[B]` sum over
    masked tokens. Both carry gradient to the logits."""

    token_logps: Tensor
    seq_logps: Tensor


@dataclass
class TokenLogpsOutput:
    """`logp_N`: float32 log p(target) per row, with gradient to the logits. `entropy_N`: float32
    entropy per row (nats), detached; None when not asked for."""

    logp_N: Tensor
    entropy_N: Tensor | None


@dataclass
class EntropyOutput:
    """`entropy`: masked mean entropy (scalar, nats). `per_token`: shape of the mask, 0 where masked."""

    entropy: Tensor
    per_token: Tensor


def _check_temperature(temperature: float) -> None:
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")


def _scaled_fp32(logits: Tensor, temperature: float) -> Tensor:
    z = logits.float()
    return z if temperature == 1.0 else z / temperature


def _token_logp_rows(logits_c_V: Tensor, tokens_c: Tensor, temperature: float) -> Tensor:
    z = _scaled_fp32(logits_c_V, temperature)
    picked = z.gather(-1, tokens_c.unsqueeze(-1)).squeeze(-1)
    return picked - torch.logsumexp(z, dim=-1)


def _token_logp_rows_per_row_temperature(logits_c_V: Tensor, tokens_c: Tensor, temperature_c: Tensor) -> Tensor:
    dtype = compute_dtype(logits_c_V.dtype)
    z = logits_c_V.to(dtype) / temperature_c.to(dtype)[:, None]
    picked = z.gather(-1, tokens_c.unsqueeze(-1)).squeeze(-1)
    return picked - torch.logsumexp(z, dim=-1)


def _entropy_rows_per_row_temperature(logits_c_V: Tensor, temperature_c: Tensor) -> Tensor:
    dtype = compute_dtype(logits_c_V.dtype)
    logp = torch.log_softmax(logits_c_V.to(dtype) / temperature_c.to(dtype)[:, None], dim=-1)
    return -(logp.exp() * logp).sum(dim=-1)


def _entropy_rows(logits_c_V: Tensor, temperature: float) -> Tensor:
    logp = torch.log_softmax(_scaled_fp32(logits_c_V, temperature), dim=-1)
    return -(logp.exp() * logp).sum(dim=-1)


def sequence_logps(
    logits_B_T_V: Tensor,
    tokens_B_T: Tensor,
    mask_B_T: Tensor | None,
    temperature: float = 1.0,
    chunk_size: int | None = None,
    backend: str = "auto",
) -> SequenceLogpsOutput:
    """Log-probs of given tokens: `logp[b, t] = log softmax(logits[b, t] / temperature)[tokens[b, t]]`.

    Alignment: `logits_B_T_V[:, t]` is the distribution that scores `tokens_B_T[:, t]`; this
    function does NOT shift. For a causal LM whose output at position t predicts input t+1, pass
    `logits[:, :-1]` with `input_ids[:, 1:]` (and the mask shifted the same way).

    Computed as `z[token] - logsumexp(z)` in float32 (no log_softmax copy of the logits), only on
    masked-in tokens. `chunk_size=c` processes c tokens at a time in forward and backward, so
    the float32 temporaries never exceed `[c, V]` (bf16 logits are upcast per chunk only).
    `mask_B_T=None` counts every token. The token ids at masked-out positions are never read.
    `backend`: "auto" runs the fused Triton kernel (`fused.py`: one read of the logits forward,
    one read and one gradient write backward) on CUDA tensors when Triton imports, else this
    torch code; "torch" or "triton" force one.
    """
    _check_temperature(temperature)
    if logits_B_T_V.dim() != 3 or tokens_B_T.shape != logits_B_T_V.shape[:2]:
        raise ValueError(
            f"expected logits [B, T, V] and tokens [B, T], got {tuple(logits_B_T_V.shape)} and "
            f"{tuple(tokens_B_T.shape)}"
        )
    mask_b = as_bool_mask(mask_B_T, tokens_B_T.shape, logits_B_T_V, name="mask_B_T")
    V = logits_B_T_V.shape[-1]
    row_idx = selected_rows(mask_b.reshape(-1))
    if fused.use_fused(backend, True, logits_B_T_V):
        targets_n = tokens_B_T.reshape(-1).long().index_select(0, row_idx)
        vals_n, _ = fused.token_logps_and_entropy(logits_B_T_V, targets_n, row_idx, temperature)
    else:
        vals_n = rowwise(
            partial(_token_logp_rows, temperature=temperature),
            (logits_B_T_V.reshape(-1, V), tokens_B_T.reshape(-1).long()),
            row_idx,
            chunk_size,
        )
    token_logps = scatter_rows(vals_n, row_idx, mask_b)
    return SequenceLogpsOutput(token_logps=token_logps, seq_logps=token_logps.sum(dim=1))


def token_logps(
    logits_N_V: Tensor,
    targets_N: Tensor,
    temperature: float | Tensor = 1.0,
    chunk_size: int | None = None,
    with_entropy: bool = True,
    backend: str = "auto",
) -> TokenLogpsOutput:
    """Per row of `logits_N_V`: log p(targets_N) under softmax(logits / temperature), and the
    entropy of that distribution as a detached metric.

    For callers that have already gathered the rows that count (no mask). `temperature` is a
    float or a `[N]` tensor (one per row: rows of sequences sampled at different temperatures).
    The fused kernel computes both in one read of the logits; the torch fallback computes the
    log-probs with gradient (`chunk_size` rows at a time, recomputed in backward, when given) and
    the entropy under no_grad in chunks of `chunk_size` rows (all rows at once when None).
    For an entropy with gradient (an entropy bonus) use `entropy_from_logits`.
    """
    if logits_N_V.dim() != 2 or targets_N.shape != logits_N_V.shape[:1]:
        raise ValueError(
            f"expected logits [N, V] and targets [N], got {tuple(logits_N_V.shape)} and {tuple(targets_N.shape)}"
        )
    temperature_N = temperature if isinstance(temperature, Tensor) else None
    if temperature_N is not None:
        if temperature_N.shape != targets_N.shape:
            raise ValueError(
                f"temperature has shape {tuple(temperature_N.shape)}, expected [N] = {tuple(targets_N.shape)}"
            )
    else:
        _check_temperature(temperature)
    n_rows = logits_N_V.shape[0]
    all_rows = torch.arange(n_rows, device=logits_N_V.device)
    if fused.use_fused(backend, True, logits_N_V):
        logp_N, entropy_N = fused.token_logps_and_entropy(logits_N_V, targets_N.long(), all_rows, temperature)
        return TokenLogpsOutput(logp_N, entropy_N if with_entropy else None)
    if temperature_N is None:
        temperature_N = torch.full((n_rows,), float(temperature), device=logits_N_V.device)
    logp_N = rowwise(
        _token_logp_rows_per_row_temperature, (logits_N_V, targets_N.long(), temperature_N), all_rows, chunk_size
    )
    entropy_N = None
    if with_entropy:
        with torch.no_grad():
            step = chunk_size or max(n_rows, 1)
            entropy_N = torch.cat(
                [
                    _entropy_rows_per_row_temperature(logits_N_V[i : i + step], temperature_N[i : i + step])
                    for i in range(0, n_rows, step)
                ]
                or [logits_N_V.new_zeros(0, dtype=torch.float32)]
            )
    return TokenLogpsOutput(logp_N, entropy_N)


def entropy_from_logits(
    logits_B_T_V: Tensor,
    mask: Tensor | None,
    chunk_size: int | None = None,
    temperature: float = 1.0,
    backend: str = "auto",
) -> EntropyOutput:
    """Entropy `H = -sum_v p_v log p_v`, `p = softmax(logits / temperature)`, per token (float32).

    `logits_B_T_V` may be `[B, T, V]` or flattened `[N, V]`; `mask` has the leading shape
    (`None` = all tokens). Returns the masked token mean (with gradient, for an entropy bonus
    use `-coef * entropy`) and per-token values. `chunk_size` bounds float32 temporaries to
    `[chunk_size, V]`, in backward too. Without gradient (under no_grad, or logits that need
    none), `backend="auto"` runs the fused kernel on CUDA (one read of the logits).
    """
    _check_temperature(temperature)
    lead, V = logits_B_T_V.shape[:-1], logits_B_T_V.shape[-1]
    mask_b = as_bool_mask(mask, lead, logits_B_T_V)
    row_idx = selected_rows(mask_b.reshape(-1))
    needs_grad = torch.is_grad_enabled() and logits_B_T_V.requires_grad
    if fused.use_fused(backend, not needs_grad, logits_B_T_V):
        dummy_targets_n = torch.zeros_like(row_idx)
        _, vals_n = fused.token_logps_and_entropy(logits_B_T_V.detach(), dummy_targets_n, row_idx, temperature)
    else:
        vals_n = rowwise(
            partial(_entropy_rows, temperature=temperature), (logits_B_T_V.reshape(-1, V),), row_idx, chunk_size
        )
    per_token = scatter_rows(vals_n, row_idx, mask_b)
    return EntropyOutput(entropy=masked_mean(per_token, mask_b), per_token=per_token)
