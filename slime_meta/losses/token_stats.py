"""Per-token statistics of logits: log-probs of given tokens, entropy. Memory-aware."""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch
from torch import Tensor

from ._common import as_bool_mask, masked_mean, rowwise, scatter_rows, selected_rows


@dataclass
class SequenceLogpsOutput:
    """`token_logps`: `[B, T]` log p(tokens[b, t]), 0 where masked. `seq_logps`: `[B]` sum over
    masked tokens. Both carry gradient to the logits."""

    token_logps: Tensor
    seq_logps: Tensor


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


def _entropy_rows(logits_c_V: Tensor, temperature: float) -> Tensor:
    logp = torch.log_softmax(_scaled_fp32(logits_c_V, temperature), dim=-1)
    return -(logp.exp() * logp).sum(dim=-1)


def sequence_logps(
    logits_B_T_V: Tensor,
    tokens_B_T: Tensor,
    mask_B_T: Tensor | None,
    temperature: float = 1.0,
    chunk_size: int | None = None,
) -> SequenceLogpsOutput:
    """Log-probs of given tokens: `logp[b, t] = log softmax(logits[b, t] / temperature)[tokens[b, t]]`.

    Alignment: `logits_B_T_V[:, t]` is the distribution that scores `tokens_B_T[:, t]`; this
    function does NOT shift. For a causal LM whose output at position t predicts input t+1, pass
    `logits[:, :-1]` with `input_ids[:, 1:]` (and the mask shifted the same way).

    Computed as `z[token] - logsumexp(z)` in float32 (no log_softmax copy of the logits), only on
    masked-in tokens. `chunk_size=c` processes c tokens at a time in forward and backward, so
    the float32 temporaries never exceed `[c, V]` (bf16 logits are upcast per chunk only).
    `mask_B_T=None` counts every token. The token ids at masked-out positions are never read.
    """
    _check_temperature(temperature)
    if logits_B_T_V.dim() != 3 or tokens_B_T.shape != logits_B_T_V.shape[:2]:
        raise ValueError(
            f"expected logits [B, T, V] and tokens [B, T], got {tuple(logits_B_T_V.shape)} and {tuple(tokens_B_T.shape)}"
        )
    mask_b = as_bool_mask(mask_B_T, tokens_B_T.shape, logits_B_T_V, name="mask_B_T")
    V = logits_B_T_V.shape[-1]
    row_idx = selected_rows(mask_b.reshape(-1))
    vals_n = rowwise(
        partial(_token_logp_rows, temperature=temperature),
        (logits_B_T_V.reshape(-1, V), tokens_B_T.reshape(-1).long()),
        row_idx,
        chunk_size,
    )
    token_logps = scatter_rows(vals_n, row_idx, mask_b)
    return SequenceLogpsOutput(token_logps=token_logps, seq_logps=token_logps.sum(dim=1))


def entropy_from_logits(
    logits_B_T_V: Tensor,
    mask: Tensor | None,
    chunk_size: int | None = None,
    temperature: float = 1.0,
) -> EntropyOutput:
    """Entropy `H = -sum_v p_v log p_v`, `p = softmax(logits / temperature)`, per token (float32).

    `logits_B_T_V` may be `[B, T, V]` or flattened `[N, V]`; `mask` has the leading shape
    (`None` = all tokens). Returns the masked token mean (with gradient, for an entropy bonus
    use `-coef * entropy`) and per-token values. `chunk_size` bounds float32 temporaries to
    `[chunk_size, V]`, in backward too.
    """
    _check_temperature(temperature)
    lead, V = logits_B_T_V.shape[:-1], logits_B_T_V.shape[-1]
    mask_b = as_bool_mask(mask, lead, logits_B_T_V)
    row_idx = selected_rows(mask_b.reshape(-1))
    vals_n = rowwise(
        partial(_entropy_rows, temperature=temperature), (logits_B_T_V.reshape(-1, V),), row_idx, chunk_size
    )
    per_token = scatter_rows(vals_n, row_idx, mask_b)
    return EntropyOutput(entropy=masked_mean(per_token, mask_b), per_token=per_token)
