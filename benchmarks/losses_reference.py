"""The loss settings benchmarks/losses.py measures at, and their float64 reference."""

from __future__ import annotations

import torch
import torch.nn.functional as F

BETA_JSD, TEMPERATURE = 0.5, 1.0
ALPHA_SDPO, BETA_DPO, DPO_BETA = 1.0, 0.1, 0.1

# Own code, independent of slime_meta.losses (whose JSD computes in float32 whatever the input):
# the textbook formulas in float64, chunked over rows with activation checkpointing so that the
# whole-vocabulary float64 intermediates of one chunk at a time are alive.

REF_CHUNK = 256


def _jsd_rows64(s: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    logp_s = torch.log_softmax(s / TEMPERATURE, dim=-1)
    logp_t = torch.log_softmax(t / TEMPERATURE, dim=-1)
    p_s, p_t = logp_s.exp(), logp_t.exp()
    logp_m = torch.log(BETA_JSD * p_t + (1 - BETA_JSD) * p_s)
    return BETA_JSD * (p_t * (logp_t - logp_m)).sum(-1) + (1 - BETA_JSD) * (p_s * (logp_s - logp_m)).sum(-1)


def _token_logp_rows64(s: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(s / TEMPERATURE, dim=-1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


def _by_rows(fn, *tensors: torch.Tensor) -> torch.Tensor:
    from torch.utils.checkpoint import checkpoint

    n = tensors[0].shape[0]
    return torch.cat(
        [checkpoint(fn, *(t[i : i + REF_CHUNK] for t in tensors), use_reentrant=False) for i in range(0, n, REF_CHUNK)]
    )


def reference_jsd64(x: dict) -> torch.Tensor:
    V = x["student"].shape[-1]
    per = _by_rows(_jsd_rows64, x["student"].reshape(-1, V), x["teacher"].reshape(-1, V))
    mask = x["mask"].reshape(-1).double()
    return (per * mask).sum() / mask.sum()


def reference_three_channel64(x: dict) -> torch.Tensor:
    B, T, V = x["student"].shape
    logp = _by_rows(_token_logp_rows64, x["student"].reshape(-1, V), x["tokens"].reshape(-1)).reshape(B, T)
    mask = x["mask"].double()
    ratio = torch.exp(logp - x["old_logp"])
    adv = x["advantages"].unsqueeze(1)
    grpo = (torch.maximum(-ratio * adv, -torch.clamp(ratio, 0.8, 1.2) * adv) * mask).sum() / mask.sum()
    seq = (logp * mask).sum(1)
    half = B // 2
    delta = (seq[:half] - x["ref_seq"][:half]) - (seq[half:] - x["ref_seq"][half:])
    dpo = -F.logsigmoid(DPO_BETA * delta).mean()
    return grpo + ALPHA_SDPO * reference_jsd64(x) + BETA_DPO * dpo
