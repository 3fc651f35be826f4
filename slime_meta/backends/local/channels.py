"""The loss channels of one local train step, each a pass of micro-batches with gradient accumulation.

  channel 1  policy gradient (GRPO/PPO with off-policy correction, KL, entropy) over the teacher's
             infos and, with distillation on, the policy's own solutions with shaped token advantages
  channel 2  SDPO: JSD between the policy on the plain prompt and the same weights (no grad) on the
             hint-injected prompt, on the response tokens of the error sites
  channel 3  trace replay: DPO on (teacher-agreed answer, policy answer) pairs

Each pass backpropagates `weight * its mean` (token mean for 1 and 2, pair mean for 3), so a
channel whose weight is zero is skipped and the others are unchanged bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from slime_meta.backends.local.batching import (
    MicroBatch,
    chunks,
    make_micro_batches,
    pad_sequences,
    response_columns,
    PolicySequence,
)
from slime_meta.losses import dpo_loss, entropy_from_logits, generalized_jsd, kl_penalty, policy_loss
from slime_meta.types import PreferencePair, SolverSample


@dataclass(frozen=True)
class LossSettings:
    eps_clip: float = 0.2
    eps_clip_high: float | None = None
    eps_clip_c: float | None = None
    use_tis: bool = False
    tis_clip: float = 2.0
    tis_clip_low: float = 0.0
    aipo_delta: float | None = None
    kl_loss_coef: float = 0.0
    kl_loss_type: str = "k1"
    entropy_coef: float = 0.0
    sdpo_alpha: float = 0.0
    sdpo_beta: float = 0.5
    sdpo_temperature: float = 1.0
    sdpo_top_k: int | None = None
    sdpo_token_clip: float | None = None
    replay_beta: float = 0.0
    replay_dpo_beta: float = 0.1
    # Tokens per chunk of the vocabulary-wide computations (JSD, entropy): measured on an H100 at
    # 8,192 tokens x 151,936 vocab, 256 keeps peak extra memory at 0.07x a full fp32 pass at the
    # same speed as 1024 (docs/performance.md).
    jsd_chunk_size: int | None = 256


Forward = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (tokens, attention) -> logits


def _scaled_logp(logits_B_T_V: torch.Tensor, targets_B_T: torch.Tensor, temperature_B: torch.Tensor):
    scaled_B_T_V = logits_B_T_V.float() / temperature_B.clamp_min(1e-6)[:, None, None]
    log_z_B_T = torch.logsumexp(scaled_B_T_V, dim=-1)
    logp_B_T = scaled_B_T_V.gather(-1, targets_B_T[..., None]).squeeze(-1) - log_z_B_T
    return scaled_B_T_V, logp_B_T


def policy_gradient_pass(
    forward: Forward, reference: Forward | None, sequences: Sequence[PolicySequence], s: LossSettings,
    micro_batch_size: int, pad_id: int, device: torch.device,
) -> dict[str, float]:  # fmt: skip
    total_tokens = sum(len(x.response_ids) for x in sequences)
    sums = {"loss": 0.0, "pg_loss": 0.0, "clipfrac": 0.0, "approx_kl": 0.0, "entropy": 0.0, "logprob_abs_diff": 0.0, "kl_ref": 0.0}
    correct_off_policy = s.use_tis or s.aipo_delta is not None
    for batch in make_micro_batches(sequences, micro_batch_size, pad_id):
        b: MicroBatch = batch.to(device)
        mask = b.loss_mask_B_T
        share = mask.sum().item() / total_tokens
        scaled_B_T_V, logp_B_T = _scaled_logp(forward(b.tokens_B_T, b.attention_mask_B_T)[:, :-1], b.tokens_B_T[:, 1:], b.temperature_B)
        # With TIS/AIPO the trainer's own (pre-update) log-probs are the PPO anchor and the engine's
        # are the behaviour policy that the importance weight corrects for; without them the
        # engine's log-probs are the anchor and the PPO clip bounds the mismatch.
        old_logp = logp_B_T.detach() if correct_off_policy else b.rollout_logp_B_T
        out = policy_loss(
            logp_B_T, old_logp, b.advantages_B_T, mask, eps_clip=s.eps_clip, eps_clip_high=s.eps_clip_high,
            eps_clip_c=s.eps_clip_c, rollout_logp=b.rollout_logp_B_T if correct_off_policy else None,
            tis_clip=s.tis_clip if s.use_tis else None, tis_clip_low=s.tis_clip_low, aipo_delta=s.aipo_delta,
        )  # fmt: skip
        loss = out.loss
        if s.entropy_coef:
            entropy = entropy_from_logits(scaled_B_T_V, mask, chunk_size=s.jsd_chunk_size).entropy
            loss = loss - s.entropy_coef * entropy
        else:  # logged only: no graph through a [B, T, V] computation
            with torch.no_grad():
                entropy = entropy_from_logits(scaled_B_T_V, mask, chunk_size=s.jsd_chunk_size).entropy
        if s.kl_loss_coef and reference is not None:
            with torch.no_grad():
                _, ref_logp_B_T = _scaled_logp(reference(b.tokens_B_T, b.attention_mask_B_T)[:, :-1], b.tokens_B_T[:, 1:], b.temperature_B)
            kl = kl_penalty(logp_B_T, ref_logp_B_T, mask, kind=s.kl_loss_type).kl
            loss = loss + s.kl_loss_coef * kl
            sums["kl_ref"] += kl.item() * share
        (loss * share).backward()
        sums["loss"] += loss.item() * share
        sums["pg_loss"] += out.loss.item() * share
        sums["entropy"] += entropy.item() * share
        sums["clipfrac"] += float(out.metrics.get("clipfrac", 0.0)) * share
        sums["approx_kl"] += float(out.metrics.get("approx_kl", 0.0)) * share
        sums["logprob_abs_diff"] += ((logp_B_T.detach() - b.rollout_logp_B_T).abs() * mask).sum().item() / total_tokens
        if "tis_weight_mean" in out.metrics:
            sums["tis_weight_mean"] = sums.get("tis_weight_mean", 0.0) + float(out.metrics["tis_weight_mean"]) * share
    return sums


def _response_logits(logits_B_T_V: torch.Tensor, prompt_lengths: Sequence[int], response_lengths: Sequence[int]) -> torch.Tensor:
    """The logits that predict each response token, rows concatenated: [sum R, V]."""
    return torch.cat(
        [logits_B_T_V[row, response_columns(p, r)] for row, (p, r) in enumerate(zip(prompt_lengths, response_lengths))]
    )


def sdpo_pass(
    forward: Forward, samples: Sequence[SolverSample], s: LossSettings, micro_batch_size: int, pad_id: int,
    device: torch.device,
) -> dict[str, float]:  # fmt: skip
    """Channel 2: the hint-conditioned self is the target distribution (no gradient through it)."""
    total_tokens = sum(len(x.response_ids) for x in samples)
    jsd_sum = 0.0
    for group in chunks(list(samples), micro_batch_size):
        responses = [x.response_ids for x in group]
        student_tokens, student_att = pad_sequences([x.prompt_ids + x.response_ids for x in group], pad_id)
        hinted_tokens, hinted_att = pad_sequences([x.hint_prompt_ids + x.response_ids for x in group], pad_id)
        with torch.no_grad():
            hinted_logits = forward(hinted_tokens.to(device), hinted_att.to(device))
        student_logits = forward(student_tokens.to(device), student_att.to(device))
        lengths = [len(r) for r in responses]
        student_N_V = _response_logits(student_logits, [len(x.prompt_ids) for x in group], lengths)
        hinted_N_V = _response_logits(hinted_logits, [len(x.hint_prompt_ids) for x in group], lengths)
        jsd = generalized_jsd(
            student_N_V, hinted_N_V, torch.ones(student_N_V.shape[0], device=device), beta=s.sdpo_beta,
            temperature=s.sdpo_temperature, top_k=s.sdpo_top_k, token_clip=s.sdpo_token_clip, chunk_size=s.jsd_chunk_size,
        ).loss  # fmt: skip
        share = sum(lengths) / total_tokens
        (s.sdpo_alpha * jsd * share).backward()
        jsd_sum += jsd.item() * share
    return {"sdpo_jsd": jsd_sum, "sdpo_tokens": float(total_tokens)}


def _sequence_logp_sums(forward: Forward, pairs_ids: Sequence[tuple[tuple[int, ...], tuple[int, ...]]], pad_id: int, device) -> torch.Tensor:
    tokens, attention = pad_sequences([p + r for p, r in pairs_ids], pad_id)
    tokens, attention = tokens.to(device), attention.to(device)
    logits = forward(tokens, attention)[:, :-1].float()
    logp_B_T = torch.log_softmax(logits, dim=-1).gather(-1, tokens[:, 1:, None]).squeeze(-1)
    return torch.stack([logp_B_T[row, response_columns(len(p), len(r))].sum() for row, (p, r) in enumerate(pairs_ids)])


def replay_dpo_pass(
    forward: Forward, reference: Forward, pairs: Sequence[PreferencePair], s: LossSettings, micro_batch_size: int,
    pad_id: int, device: torch.device,
) -> dict[str, float]:  # fmt: skip
    """Channel 3: sigmoid DPO; log-probs summed over response tokens, at temperature 1."""
    sums = {"replay_dpo": 0.0, "replay_reward_accuracy": 0.0, "replay_reward_margin": 0.0}
    for group in chunks(list(pairs), micro_batch_size):
        chosen = [(p.prompt_ids, p.chosen_ids) for p in group]
        rejected = [(p.prompt_ids, p.rejected_ids) for p in group]
        with torch.no_grad():
            ref_chosen, ref_rejected = _sequence_logp_sums(reference, chosen, pad_id, device), _sequence_logp_sums(reference, rejected, pad_id, device)
        out = dpo_loss(
            _sequence_logp_sums(forward, chosen, pad_id, device), _sequence_logp_sums(forward, rejected, pad_id, device),
            ref_chosen, ref_rejected, beta=s.replay_dpo_beta,
        )  # fmt: skip
        share = len(group) / len(pairs)
        (s.replay_beta * out.loss * share).backward()
        sums["replay_dpo"] += out.loss.item() * share
        sums["replay_reward_accuracy"] += float(out.reward_accuracy) * share
        sums["replay_reward_margin"] += float(out.reward_margin) * share
    return sums
