"""The loss channels of one local train step, each a pass of micro-batches with gradient accumulation.

  channel 1  policy gradient (GRPO/PPO with off-policy correction, KL, entropy) over the teacher's
             infos and, with distillation on, over the policy's own solutions with shaped token
             advantages: two passes, each its own token mean
  channel 2  SDPO: JSD between the policy on the plain prompt and the same weights (no grad) on the
             hint-injected prompt, on the response tokens of the error sites (full vocabulary, or with
             `sdpo_topk` the hinted self's top-k plus a tail bucket, as slime has it); or (sdpo_form
             "shaping") a policy-gradient pass over those answers with token advantages
             alpha * (log p_hint - log p), its own token mean (the form slime runs too)
  channel 3  trace replay: DPO on (teacher-agreed answer, policy answer) pairs

Each pass backpropagates `weight * its mean` (token mean for 1 and 2, pair mean for 3), so a
channel whose weight is zero is skipped and the others are unchanged bit for bit.

Logits are made only for the positions a loss reads (response tokens): the model returns its
last hidden states and the output projection runs on those rows alone (`SplitModelCall`), so no
`[B, T, V]` tensor exists, and the vocabulary-wide work (token log-probs, entropy, JSD) goes
through `slime_meta.losses`, whose fused kernels on CUDA read the `[rows, V]` logits in their
own dtype and write one gradient. Token log-probs (`SplitModelCall.token_logps`) on the CPU fold the
projection into chunks of rows, so not even the `[rows, V]` logits of a micro-batch are held.

The KL anchor's log-probs come with the sequences (`PolicySequence.reference_logprobs`, computed
by `reference_token_logps` before the passes), or, while the policy still is the start weights,
are the policy's own (detached): the same numbers without a second forward.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from slime_meta.backends.local.training.batching import (
    MicroBatching,
    PolicySequence,
    budget_chunks,
    pad_sequences,
    response_columns,
)
from slime_meta.backends.local.training.model_call import SplitModelCall
from slime_meta.backends.local.training.packing import PackedBatch, pack_micro_batches
from slime_meta.losses.advantages import context_distillation_advantages
from slime_meta.losses.distill import generalized_jsd
from slime_meta.losses.policy import kl_penalty, policy_loss
from slime_meta.losses.preference import dpo_loss
from slime_meta.losses.token_stats import entropy_from_logits, token_logps
from slime_meta.losses.topk_distill import teacher_topk, topk_generalized_jsd
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
    # k3: as a loss on on-policy samples its gradient pulls towards the reference (k1's is zero in expectation).
    kl_loss_type: str = "k3"
    entropy_coef: float = 0.0
    sdpo_alpha: float = 0.0
    sdpo_beta: float = 0.5
    sdpo_temperature: float = 1.0
    sdpo_topk: int | None = None  # the hinted self as its top-k (+ a tail bucket: what slime computes); None: full
    sdpo_topk_tail: bool = True  # False: both sides renormalised over the top-k ids
    sdpo_token_clip: float | None = None
    sdpo_form: str = "jsd"  # "jsd": sdpo_pass; "shaping": sdpo_shaping_sequences through the policy gradient
    replay_beta: float = 0.0
    replay_dpo_beta: float = 0.1
    # Tokens per chunk of the vocabulary-wide computations (JSD, entropy): measured on an H100 at
    # 8,192 tokens x 151,936 vocab, 256 keeps peak extra memory at 0.07x a full fp32 pass at the
    # same speed as 1024 (docs/performance.md).
    jsd_chunk_size: int | None = 256


def _row_hidden(
    model: SplitModelCall, tokens_B_T: torch.Tensor, attention_B_T: torch.Tensor, rows_B_T: torch.Tensor
) -> torch.Tensor:
    """Hidden states `[N, H]` predicting the tokens at `rows_B_T` (bool, shifted `[B, T-1]`), rows in
    row-major order."""
    return model.hidden_states(tokens_B_T, attention_B_T)[:, :-1][rows_B_T]


def _row_logits(
    model: SplitModelCall, tokens_B_T: torch.Tensor, attention_B_T: torch.Tensor, rows_B_T: torch.Tensor
) -> torch.Tensor:
    """Logits `[N, V]` predicting the tokens at `rows_B_T`, rows in row-major order."""
    return model.logits(_row_hidden(model, tokens_B_T, attention_B_T, rows_B_T))


def _response_rows(prompt_lengths: Sequence[int], response_lengths: Sequence[int], width: int) -> torch.Tensor:
    rows_B_T = torch.zeros(len(prompt_lengths), width, dtype=torch.bool)
    for row, (p, r) in enumerate(zip(prompt_lengths, response_lengths)):
        rows_B_T[row, response_columns(p, r)] = True
    return rows_B_T


def _packed_batches(
    forward: SplitModelCall, sequences: Sequence[PolicySequence], batching: MicroBatching
) -> list[PackedBatch]:
    """The micro-batches of a pass: sequences that share a prompt share its forward where the call allows it."""
    share = bool(getattr(forward, "shares_prompts", False))
    return pack_micro_batches(
        sequences, share, batching.micro_batch_size, batching.pad_id, batching.max_tokens, batching.width_multiple
    )


def _loss_hidden(forward: SplitModelCall, b: PackedBatch) -> torch.Tensor:
    """Hidden states `[N, H]` predicting the batch's loss tokens, in the batch's token order."""
    return forward.packed_hidden_states(b).flatten(0, 1)[b.source_N]


def policy_gradient_pass(
    forward: SplitModelCall,
    sequences: Sequence[PolicySequence],
    s: LossSettings,
    batching: MicroBatching,
    *,
    reference_is_policy: bool = False,
) -> dict[str, float]:
    """Channel 1. Each micro-batch's token mean is weighted by its share of the step's response
    tokens, so the gradient is the step's token mean whatever the split (`batching.max_tokens`: by tokens).

    The KL term (`s.kl_loss_coef`) is on when the sequences carry reference log-probs, or when
    `reference_is_policy` (the policy has not moved from the start weights: its own log-probs).
    """
    total_tokens = sum(len(x.response_ids) for x in sequences)
    sums = dict.fromkeys(("loss", "pg_loss", "clipfrac", "approx_kl", "entropy", "logprob_abs_diff", "kl_ref"), 0.0)
    sums["forward_tokens"] = 0.0
    correct_off_policy = s.use_tis or s.aipo_delta is not None
    kl_on = bool(s.kl_loss_coef) and (reference_is_policy or all(x.reference_logprobs is not None for x in sequences))
    for batch in _packed_batches(forward, sequences, batching):
        b = batch.to(batching.device)
        mask_N = torch.ones_like(b.targets_N, dtype=torch.bool)
        share = len(b.targets_N) / total_tokens
        # The distribution each sequence was sampled from: logits / its temperature.
        temperature_N = b.temperature_N.clamp_min(1e-6)
        hidden_N_H = _loss_hidden(forward, b)
        logits_N_V = forward.logits(hidden_N_H) if s.entropy_coef else None  # the bonus needs the logits' gradient
        if logits_N_V is None:
            stats = forward.token_logps(hidden_N_H, b.targets_N, temperature_N, s.jsd_chunk_size, with_entropy=True)
        else:
            stats = token_logps(logits_N_V, b.targets_N, temperature_N, chunk_size=s.jsd_chunk_size, with_entropy=False)
        logp_N = stats.logp_N
        # With TIS/AIPO the trainer's own (pre-update) log-probs are the PPO anchor and the engine's
        # are the behaviour policy that the importance weight corrects for; without them the
        # engine's log-probs are the anchor and the PPO clip bounds the mismatch.
        old_logp_N = logp_N.detach() if correct_off_policy else b.rollout_logp_N
        out = policy_loss(
            logp_N,
            old_logp_N,
            b.advantages_N,
            mask_N,
            eps_clip=s.eps_clip,
            eps_clip_high=s.eps_clip_high,
            eps_clip_c=s.eps_clip_c,
            rollout_logp=b.rollout_logp_N if correct_off_policy else None,
            tis_clip=s.tis_clip if s.use_tis else None,
            tis_clip_low=s.tis_clip_low,
            aipo_delta=s.aipo_delta,
        )
        loss = out.loss
        if logits_N_V is not None:  # a float32 [N, V] pass with gradient
            scaled_N_V = logits_N_V.float() / temperature_N[:, None]
            entropy = entropy_from_logits(scaled_N_V, None, chunk_size=s.jsd_chunk_size).entropy
            loss = loss - s.entropy_coef * entropy
            del scaled_N_V
        else:  # logged only: computed with the log-probs, no graph
            entropy = stats.entropy_N.sum() / max(stats.entropy_N.numel(), 1)
        if kl_on:
            reference_logp_N = logp_N.detach() if reference_is_policy else b.reference_logp_N
            kl = kl_penalty(logp_N, reference_logp_N, mask_N, kind=s.kl_loss_type).kl
            loss = loss + s.kl_loss_coef * kl
            sums["kl_ref"] += kl.item() * share
        del logits_N_V, stats, hidden_N_H
        (loss * share).backward()
        sums["loss"] += loss.item() * share
        sums["pg_loss"] += out.loss.item() * share
        sums["entropy"] += entropy.item() * share
        sums["clipfrac"] += float(out.metrics.get("clipfrac", 0.0)) * share
        sums["approx_kl"] += float(out.metrics.get("approx_kl", 0.0)) * share
        sums["logprob_abs_diff"] += (logp_N.detach() - b.rollout_logp_N).abs().sum().item() / total_tokens
        sums["forward_tokens"] += float(batch.attention_B_T.sum())
        if "tis_weight_mean" in out.metrics:
            sums["tis_weight_mean"] = sums.get("tis_weight_mean", 0.0) + float(out.metrics["tis_weight_mean"]) * share
    return sums


def reference_token_logps(
    reference: SplitModelCall,
    sequences: Sequence[PolicySequence],
    chunk_size: int | None,
    batching: MicroBatching,
) -> list[tuple[float, ...]]:
    """Each sequence's response-token log-probs under `reference` (no gradient), at the sequence's
    temperature, micro-batched as the policy pass will be; in sequence order."""
    out: list[tuple[float, ...]] = [()] * len(sequences)
    with torch.no_grad():
        for batch in _packed_batches(reference, sequences, batching):
            b = batch.to(batching.device)
            hidden_N_H = _loss_hidden(reference, b)
            temperature_N = b.temperature_N.clamp_min(1e-6)
            logp_N = reference.token_logps(
                hidden_N_H, b.targets_N, temperature_N, chunk_size, with_entropy=False
            ).logp_N
            values = logp_N.float().tolist()
            offset = 0
            for i in b.members:  # the batch's tokens are its sequences' response tokens in turn
                n = len(sequences[i].response_ids)
                out[i] = tuple(values[offset : offset + n])
                offset += n
    return out


def sdpo_pass(
    forward: SplitModelCall,
    samples: Sequence[SolverSample],
    s: LossSettings,
    batching: MicroBatching,
) -> dict[str, float]:
    """Channel 2: the hint-conditioned self is the target distribution (no gradient through it)."""
    pad_id, device, multiple = batching.pad_id, batching.device, batching.width_multiple
    total_tokens = sum(len(x.response_ids) for x in samples)
    jsd_sum = 0.0
    jsd_settings = dict(
        beta=s.sdpo_beta, temperature=s.sdpo_temperature, token_clip=s.sdpo_token_clip, chunk_size=s.jsd_chunk_size
    )
    longest = [max(len(x.prompt_ids), len(x.hint_prompt_ids)) + len(x.response_ids) for x in samples]
    for group in budget_chunks(
        list(samples), longest, batching.micro_batch_size, batching.max_tokens, batching.width_multiple
    ):
        responses = [x.response_ids for x in group]
        student_tokens, student_att = pad_sequences([x.prompt_ids + x.response_ids for x in group], pad_id, multiple)
        hinted_tokens, hinted_att = pad_sequences([x.hint_prompt_ids + x.response_ids for x in group], pad_id, multiple)
        lengths = [len(r) for r in responses]
        student_rows = _response_rows([len(x.prompt_ids) for x in group], lengths, student_tokens.shape[1] - 1)
        hinted_rows = _response_rows([len(x.hint_prompt_ids) for x in group], lengths, hinted_tokens.shape[1] - 1)
        with torch.no_grad():
            hinted_N_V = _row_logits(forward, hinted_tokens.to(device), hinted_att.to(device), hinted_rows.to(device))
        student_N_V = _row_logits(forward, student_tokens.to(device), student_att.to(device), student_rows.to(device))
        if s.sdpo_topk is not None and s.sdpo_topk_tail:  # what a scoring server gives: the hint's top-k log-probs
            topk_ids_N_K, topk_logps_N_K = teacher_topk(hinted_N_V, s.sdpo_topk, s.sdpo_temperature)
            del hinted_N_V
            jsd = topk_generalized_jsd(student_N_V, topk_ids_N_K, topk_logps_N_K, None, **jsd_settings).loss
        else:
            jsd = generalized_jsd(student_N_V, hinted_N_V, None, top_k=s.sdpo_topk, **jsd_settings).loss
        share = sum(lengths) / total_tokens
        (s.sdpo_alpha * jsd * share).backward()
        jsd_sum += jsd.item() * share
    return {"sdpo_jsd": jsd_sum, "sdpo_tokens": float(total_tokens)}


def sdpo_shaping_sequences(samples: Sequence[SolverSample], alpha: float) -> list[PolicySequence]:
    """Channel 2, shaping form: the error sites' answers with token advantages
    alpha * (log p(token | hint prompt) - log p(token | prompt)), the first from the pool's scoring
    call, the second the engine's own (both known at rollout time, as on slime)."""
    out = []
    for x in samples:
        if not x.response_ids or not x.is_error_site or x.hint_logprobs is None:
            continue
        advantages_T = context_distillation_advantages(
            torch.zeros(1),
            torch.tensor([x.hint_logprobs]),
            torch.tensor([x.rollout_logprobs]),
            adv_tau=0.0,
            teacher_tau=alpha,
            student_tau=alpha,
        )[0]
        advantages = tuple(advantages_T.tolist())
        out.append(PolicySequence(x.prompt_ids, x.response_ids, x.rollout_logprobs, advantages, x.temperature))
    return out


def _sequence_logp_sums(
    forward: SplitModelCall,
    pairs_ids: Sequence[tuple[tuple[int, ...], tuple[int, ...]]],
    batching: MicroBatching,
    chunk_size: int | None,
) -> torch.Tensor:
    """Summed log-probs (temperature 1) of each response given its prompt, `[pairs]`."""
    device = batching.device
    tokens, attention = pad_sequences([p + r for p, r in pairs_ids], batching.pad_id, batching.width_multiple)
    rows_B_T = _response_rows([len(p) for p, _ in pairs_ids], [len(r) for _, r in pairs_ids], tokens.shape[1] - 1)
    tokens, attention, rows_B_T = tokens.to(device), attention.to(device), rows_B_T.to(device)
    hidden_N_H = _row_hidden(forward, tokens, attention, rows_B_T)
    temperature_N = torch.ones(hidden_N_H.shape[0], device=device)
    targets_N = tokens[:, 1:][rows_B_T]
    logp_N = forward.token_logps(hidden_N_H, targets_N, temperature_N, chunk_size, with_entropy=False).logp_N
    pair_of_row_N = torch.arange(len(pairs_ids), device=device)[:, None].expand(rows_B_T.shape)[rows_B_T]
    return torch.zeros(len(pairs_ids), dtype=logp_N.dtype, device=device).index_add(0, pair_of_row_N, logp_N)


def reference_logp_sums(
    reference: SplitModelCall,
    pairs: Sequence[PreferencePair],
    batching: MicroBatching,
    chunk_size: int | None,
) -> list[tuple[float, float]]:
    """(chosen, rejected) summed log-probs of each pair under `reference` (no gradient), in pair order."""
    values: dict[int, tuple[float, float]] = {}
    with torch.no_grad():
        for group in budget_chunks(
            list(range(len(pairs))),
            _pair_lengths(pairs),
            batching.micro_batch_size,
            batching.max_tokens,
            batching.width_multiple,
        ):
            chosen_ids = [(pairs[i].prompt_ids, pairs[i].chosen_ids) for i in group]
            rejected_ids = [(pairs[i].prompt_ids, pairs[i].rejected_ids) for i in group]
            chosen = _sequence_logp_sums(reference, chosen_ids, batching, chunk_size)
            rejected = _sequence_logp_sums(reference, rejected_ids, batching, chunk_size)
            values.update(zip(group, zip(chosen.float().tolist(), rejected.float().tolist())))
    return [values[i] for i in range(len(pairs))]


def _pair_lengths(pairs: Sequence[PreferencePair]) -> list[int]:
    """Each pair's longest forward row: prompt + the longer response."""
    return [len(p.prompt_ids) + max(len(p.chosen_ids), len(p.rejected_ids)) for p in pairs]


def replay_dpo_pass(
    forward: SplitModelCall,
    pairs: Sequence[PreferencePair],
    s: LossSettings,
    batching: MicroBatching,
) -> dict[str, float]:
    """Channel 3: sigmoid DPO; log-probs summed over response tokens, at temperature 1.

    The reference log-probs are the pairs' own (`PreferencePair.reference_*_logp`), computed once
    under the start weights when the pair was made (`LocalTrainer.with_reference_logps`).
    """
    device = batching.device
    if any(p.reference_chosen_logp is None or p.reference_rejected_logp is None for p in pairs):
        raise ValueError(
            "replay_dpo_pass: every pair needs its reference log-probs (LocalTrainer.with_reference_logps)"
        )
    sums = {"replay_dpo": 0.0, "replay_reward_accuracy": 0.0, "replay_reward_margin": 0.0}
    for group in budget_chunks(
        list(pairs), _pair_lengths(pairs), batching.micro_batch_size, batching.max_tokens, batching.width_multiple
    ):
        chosen = [(p.prompt_ids, p.chosen_ids) for p in group]
        rejected = [(p.prompt_ids, p.rejected_ids) for p in group]
        ref_chosen = torch.tensor([p.reference_chosen_logp for p in group], dtype=torch.float32, device=device)
        ref_rejected = torch.tensor([p.reference_rejected_logp for p in group], dtype=torch.float32, device=device)
        out = dpo_loss(
            _sequence_logp_sums(forward, chosen, batching, s.jsd_chunk_size),
            _sequence_logp_sums(forward, rejected, batching, s.jsd_chunk_size),
            ref_chosen,
            ref_rejected,
            beta=s.replay_dpo_beta,
        )
        share = len(group) / len(pairs)
        (s.replay_beta * out.loss * share).backward()
        sums["replay_dpo"] += out.loss.item() * share
        sums["replay_reward_accuracy"] += float(out.reward_accuracy) * share
        sums["replay_reward_margin"] += float(out.reward_margin) * share
    return sums
