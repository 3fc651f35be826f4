"""slime's `--loss-type custom_loss --custom-loss-function-path`: our three channels on its batch.

    meta_loss(args, batch, logits, sum_of_sample_mean) -> (loss, metrics)

    loss = grpo + sdpo_alpha * sdpo_jsd + replay_beta * replay_dpo

slime's batch (Megatron backend, one micro-batch): `logits` [1, T, V] float32 over the
sequences packed one after another; per sample i `unconcat_tokens[i]` (prompt + response ids),
`total_lengths[i]`, `response_lengths[i]` (R_i), and per response token `loss_masks[i]`,
`advantages[i]`, `log_probs[i]` (the trainer's before this step), `rollout_log_probs[i]` (the
engine's), `ref_log_probs[i]` with a reference model, `teacher_log_probs[i]` when distilling.
Logits at packed position t score token t+1, so sample i's response rows are
[end_i - R_i - 1, end_i - 1). `sum_of_sample_mean(x)` reduces a per-token tensor over the
concatenated responses (sum_i (x_i * mask_i).sum() / rollout_mask_sums[i]) and slime scales the
returned loss for gradient accumulation (divides by --global-batch-size rollouts), so every
term here is such a sum. Our conversion plugin (`train_data.py`) sets rollout_mask_sums[i] to the
step's tokens of sample i's kind (teacher info or solver sample) and `channel_token_mean`
multiplies by --global-batch-size: the step loss is then the local trainer's, one token mean
over the infos plus one over the solver samples (context distillation, SDPO shaping), each
sample trained with the PPO surrogate on its advantages (advantages.py).

channel 1, GRPO: slime's own policy loss for the grpo estimator, term by term: log-probs from
  slime's `get_log_probs_and_entropy` (vocab- and context-parallel aware, at
  --rollout-temperature); the PPO anchor `rollout_log_probs` with --use-rollout-logprobs, else
  `log_probs`; the clipped surrogate with --eps-clip/--eps-clip-high, dual clip --eps-clip-c,
  vanilla TIS (--use-tis, --tis-clip, --tis-clip-low); minus --entropy-coef x entropy, plus
  --kl-loss-coef x KL to `ref_log_probs`. The surrogate is `slime_meta.losses.policy_loss`;
  our --aipo-delta works too. Where slime's Megatron backend is not installed (a CPU test
  machine) the log-probs come from the pure path below, on one rank only, with a warning that
  says why; with tensor or context parallel size > 1 that path would read one shard of the
  vocabulary, so it is refused, with the import error. Any other import error of slime's
  modules (a dependency missing, a renamed function) is raised as it is.
channel 2, SDPO (--sdpo-alpha): active when the batch carries `sdpo_topk_ids[i]` [R_i, k] and
  `sdpo_topk_logprobs[i]` [R_i, k] (the hint-conditioned model's top-k); the JSD is over those k
  ids, renormalised. Skipped otherwise.
channel 3, replay DPO (--replay-beta): active when the batch carries `replay_pair_index[i]` (a
  pair id, -1 for none), `replay_is_chosen[i]` and `ref_log_probs`; a pair counts when both of
  its samples are in this micro-batch. Skipped otherwise.
slime (checked at 624b824) forwards a fixed set of keys into this batch, without the channel 2
and 3 keys above, so on stock slime both channels arrive as advantages instead: SDPO in its
shaping form (--sdpo-form shaping) and replay as two samples per pair (advantages.py,
replay_samples.py); the launcher refuses --sdpo-form jsd. The two channels here run as soon as
a slime forwards their keys.
"""

from __future__ import annotations

import functools
import logging
from argparse import Namespace
from typing import Any, Callable, Sequence

import torch
from torch import Tensor

from slime_meta.losses import (
    ThreeChannelInputs,
    dpo_loss,
    entropy_from_logits,
    generalized_jsd,
    kl_penalty,
    policy_loss,
    sequence_logps,
    total_loss,
)

SDPO_TOPK_IDS = "sdpo_topk_ids"
SDPO_TOPK_LOGPROBS = "sdpo_topk_logprobs"
REPLAY_PAIR_INDEX = "replay_pair_index"
REPLAY_IS_CHOSEN = "replay_is_chosen"

Reducer = Callable[[Tensor], Tensor]
# Top-level packages whose absence means "no Megatron training here" (a CPU machine): the only
# import errors the single-rank path stands in for.
_NOT_INSTALLED = frozenset({"slime", "megatron"})

logger = logging.getLogger(__name__)


def _parallel_sizes(args: Namespace) -> tuple[int, int]:
    return int(getattr(args, "tensor_model_parallel_size", 1) or 1), int(getattr(args, "context_parallel_size", 1) or 1)


def _require_single_rank(args: Namespace, what: str, reason: str = "") -> None:
    tp, cp = _parallel_sizes(args)
    if tp > 1 or cp > 1:
        raise NotImplementedError(
            f"{reason}{what} reads whole-vocabulary logits of whole responses; it runs with tensor and context "
            f"parallel size 1 (got {tp} and {cp})"
        )


@functools.cache
def slime_log_prob_functions() -> tuple[tuple[Callable, Callable] | None, str]:
    """(slime's `get_log_probs_and_entropy` and `get_rollout_top_p_logprob_kwargs`, "") where slime's
    Megatron backend imports; (None, the import error) where slime or Megatron is not installed.

    Narrow on purpose: a module missing inside slime or Megatron (a broken install) or a name
    slime no longer has raises here, instead of training on a different log-prob computation.
    """
    try:
        from slime.backends.megatron_utils.loss import get_log_probs_and_entropy, get_rollout_top_p_logprob_kwargs
    except ModuleNotFoundError as error:
        if (error.name or "").split(".")[0] not in _NOT_INSTALLED:
            raise
        return None, str(error)
    return (get_log_probs_and_entropy, get_rollout_top_p_logprob_kwargs), ""


@functools.cache
def _warn_single_rank(reason: str) -> None:
    logger.warning("slime's Megatron log-probs do not import (%s): the loss computes them on one rank in "
                   "plain torch (tensor and context parallel size 1 only)", reason)  # fmt: skip


def response_logits(batch: dict[str, Any], logits: Tensor) -> list[Tensor]:
    """Per sample, the logit rows `[R_i, V]` that score its response tokens (one rank, no CP)."""
    logits_T_V = logits.squeeze(0)
    rows, end = [], 0
    for total, response in zip(batch["total_lengths"], batch["response_lengths"]):
        end += int(total)
        rows.append(logits_T_V[end - int(response) - 1 : end - 1])
    return rows


def single_rank_log_probs(args: Namespace, batch: dict[str, Any], logits: Tensor, with_entropy: bool):
    """log p(response token) (and entropy) at --rollout-temperature, per sample: the pure path."""
    _require_single_rank(args, "the log-probs without Megatron")
    temperature = float(getattr(args, "rollout_temperature", 1.0) or 1.0)
    log_probs, entropies = [], []
    for rows_R_V, tokens, response in zip(
        response_logits(batch, logits), batch["unconcat_tokens"], batch["response_lengths"]
    ):
        response = int(response)
        targets = torch.as_tensor(tokens, device=rows_R_V.device)[len(tokens) - response :].long()
        if response == 0:
            log_probs.append(rows_R_V.new_zeros(0, dtype=torch.float32))
            entropies.append(rows_R_V.new_zeros(0, dtype=torch.float32))
            continue
        log_probs.append(sequence_logps(rows_R_V[None], targets[None], None, temperature=temperature).token_logps[0])
        if with_entropy:
            entropies.append(entropy_from_logits(rows_R_V, None, temperature=temperature).per_token)
    return log_probs, (entropies if with_entropy else None)


def response_log_probs(args: Namespace, batch: dict[str, Any], logits: Tensor, with_entropy: bool = True):
    """Per-sample response log-probs and entropy: slime's own computation where Megatron is."""
    functions, missing = slime_log_prob_functions()
    if functions is None:  # no Megatron here (a CPU machine): one rank, plain torch, said once
        reason = f"slime's log-probs do not import ({missing}); "
        _require_single_rank(args, "the log-probs without Megatron", reason=reason)
        _warn_single_rank(missing)
        return single_rank_log_probs(args, batch, logits, with_entropy)
    get_log_probs_and_entropy, get_rollout_top_p_logprob_kwargs = functions
    _, result = get_log_probs_and_entropy(
        logits, args=args, unconcat_tokens=batch["unconcat_tokens"], total_lengths=batch["total_lengths"],
        response_lengths=batch["response_lengths"], with_entropy=with_entropy, **get_rollout_top_p_logprob_kwargs(args, batch),
    )  # fmt: skip
    return result["log_probs"], result.get("entropy")


def _cat(tensors: Sequence[Tensor], like: Tensor) -> Tensor:
    return torch.cat([t.to(like.device, torch.float32) for t in tensors]) if len(tensors) else like.new_zeros(0)


def _kl_per_token(logp: Tensor, ref: Tensor, kind: str) -> Tensor:
    """slime's KL estimators (k1, k2, k3; low_var_kl is k3 clamped to [-10, 10])."""
    ones = torch.ones_like(logp, dtype=torch.bool)
    per_token = kl_penalty(logp, ref, ones, kind="k3" if kind == "low_var_kl" else kind).per_token
    return per_token.clamp(-10, 10) if kind == "low_var_kl" else per_token


def grpo_channel(args: Namespace, batch: dict[str, Any], log_probs: list[Tensor], entropy: list[Tensor] | None,
                 reduce: Reducer, like: Tensor) -> tuple[Tensor, dict[str, Tensor]]:  # fmt: skip
    logp = _cat(log_probs, like)
    use_rollout = bool(getattr(args, "use_rollout_logprobs", False))
    anchors = batch.get("rollout_log_probs") if use_rollout else batch.get("log_probs")
    old = _cat(anchors, like).detach() if anchors else logp.detach()
    advantages = _cat(batch["advantages"], like)
    aipo_delta = getattr(args, "aipo_delta", None)
    use_tis = bool(getattr(args, "use_tis", False))
    rollout = _cat(batch["rollout_log_probs"], like) if (use_tis or aipo_delta is not None) else None
    out = policy_loss(
        logp, old, advantages, torch.ones_like(logp, dtype=torch.bool), eps_clip=args.eps_clip,
        eps_clip_high=getattr(args, "eps_clip_high", None), eps_clip_c=getattr(args, "eps_clip_c", None),
        rollout_logp=rollout, tis_clip=args.tis_clip if use_tis else None,
        tis_clip_low=float(getattr(args, "tis_clip_low", 0.0) or 0.0), aipo_delta=aipo_delta,
    )  # fmt: skip
    pg_loss = reduce(out.per_token_loss)

    with torch.no_grad():  # slime's per-token clip fraction and k1, reduced the same way
        ratio = torch.exp(logp.detach() - old)
        eps_high = args.eps_clip if getattr(args, "eps_clip_high", None) is None else args.eps_clip_high
        clipped = -torch.clamp(ratio, 1 - args.eps_clip, 1 + eps_high) * advantages > -ratio * advantages
    metrics = {
        "pg_loss": pg_loss.detach(),
        "pg_clipfrac": reduce(clipped.float()),
        "ppo_kl": reduce(old - logp.detach()),
    }

    loss = pg_loss
    entropy_coef = float(getattr(args, "entropy_coef", 0.0) or 0.0)
    if entropy is not None:
        entropy_loss = reduce(_cat(entropy, like))
        loss = loss - entropy_coef * entropy_loss
        metrics["entropy_loss"] = entropy_loss.detach()
    kl_coef = float(getattr(args, "kl_loss_coef", 0.0) or 0.0)
    if (getattr(args, "use_kl_loss", False) or kl_coef) and batch.get("ref_log_probs"):
        kl_loss = reduce(_kl_per_token(logp, _cat(batch["ref_log_probs"], like), getattr(args, "kl_loss_type", "k1")))
        loss = loss + kl_coef * kl_loss
        metrics["kl_loss"] = kl_loss.detach()
    if batch.get("rollout_log_probs"):
        metrics["train_rollout_logprob_abs_diff"] = reduce((old - _cat(batch["rollout_log_probs"], like)).abs())
    if use_tis:
        with torch.no_grad():
            metrics["tis"] = reduce(
                torch.exp(old - rollout).clamp(float(getattr(args, "tis_clip_low", 0.0) or 0.0), args.tis_clip)
            )
    metrics["advantage"] = reduce(advantages)
    return loss, metrics


def sdpo_channel(args: Namespace, batch: dict[str, Any], logits: Tensor, reduce: Reducer) -> Tensor | None:
    ids_list, logprobs_list = batch.get(SDPO_TOPK_IDS), batch.get(SDPO_TOPK_LOGPROBS)
    if not getattr(args, "sdpo_alpha", 0.0) or ids_list is None or logprobs_list is None:
        return None
    _require_single_rank(args, "the SDPO channel")
    per_token = []
    for rows_R_V, ids, target in zip(response_logits(batch, logits), ids_list, logprobs_list):
        if ids is None or torch.as_tensor(ids).numel() == 0:
            per_token.append(rows_R_V.new_zeros(rows_R_V.shape[0], dtype=torch.float32))
            continue
        ids = torch.as_tensor(ids, device=rows_R_V.device).long()
        student_R_K = rows_R_V.gather(-1, ids)
        out = generalized_jsd(
            student_R_K, torch.as_tensor(target, device=rows_R_V.device, dtype=torch.float32), None,
            beta=args.sdpo_beta, temperature=args.sdpo_temperature, token_clip=getattr(args, "sdpo_token_clip", None),
        )  # fmt: skip
        per_token.append(out.per_token)
    return reduce(torch.cat(per_token))


def replay_channel(args: Namespace, batch: dict[str, Any], log_probs: list[Tensor]) -> tuple[Tensor | None, int]:
    pair_index, is_chosen, ref = batch.get(REPLAY_PAIR_INDEX), batch.get(REPLAY_IS_CHOSEN), batch.get("ref_log_probs")
    if not getattr(args, "replay_beta", 0.0) or pair_index is None or is_chosen is None or not ref:
        return None, 0
    _require_single_rank(args, "the replay channel")
    masks = batch["loss_masks"]
    sequences = [(lp * m.to(lp.dtype)).sum() for lp, m in zip(log_probs, masks)]
    references = [
        (r.to(lp.device, torch.float32) * m.to(lp.device, torch.float32)).sum()
        for lp, r, m in zip(log_probs, ref, masks)
    ]
    members: dict[int, dict[bool, int]] = {}
    for i, (pid, chosen) in enumerate(zip(pair_index, is_chosen)):
        if int(pid) >= 0:
            members.setdefault(int(pid), {})[bool(chosen)] = i
    pairs = [(m[True], m[False]) for m in members.values() if True in m and False in m]
    if not pairs:
        return None, 0
    c, r = zip(*pairs)
    out = dpo_loss(
        torch.stack([sequences[i] for i in c]), torch.stack([sequences[i] for i in r]),
        torch.stack([references[i] for i in c]), torch.stack([references[i] for i in r]), beta=args.replay_dpo_beta,
    )  # fmt: skip
    return out.loss * len(pairs), len(pairs)  # a sum over pairs, like every other term


def channel_token_mean(args: Namespace, sum_of_sample_mean: Reducer) -> Reducer:
    """slime's reducer times its rollouts per step (--global-batch-size): with the denominators of
    `train_data.convert_samples_to_train_data` (each sample's kind's tokens in the step) slime's
    step loss becomes the local trainer's, the infos' token mean plus the solver samples' one."""
    rollouts_per_step = float(getattr(args, "global_batch_size", None) or 1)
    if getattr(args, "custom_convert_samples_to_train_data_path", None) is None:
        rollouts_per_step = 1.0  # slime's own denominators: its per-rollout means, as slime has them
    return lambda x: rollouts_per_step * sum_of_sample_mean(x)


def meta_loss(
    args: Namespace, batch: dict[str, Any], logits: Tensor, sum_of_sample_mean: Reducer
) -> tuple[Tensor, dict[str, Tensor]]:
    log_probs, entropy = response_log_probs(args, batch, logits, with_entropy=True)
    reduce = channel_token_mean(args, sum_of_sample_mean)
    grpo, metrics = grpo_channel(args, batch, log_probs, entropy, reduce, logits)
    sdpo = sdpo_channel(args, batch, logits, reduce)
    replay, num_pairs = replay_channel(args, batch, log_probs)
    out = total_loss(
        ThreeChannelInputs(grpo=grpo, sdpo_jsd=sdpo, replay_dpo=replay),
        alpha=float(getattr(args, "sdpo_alpha", 0.0) or 0.0), beta=float(getattr(args, "replay_beta", 0.0) or 0.0),
    )  # fmt: skip
    loss = out.loss
    if sum(lp.numel() for lp in log_probs) == 0:
        loss = loss + 0 * logits.sum()  # no response token on this rank: keep the graph connected (as slime does)
    metrics = {"loss": loss.detach(), **metrics, **out.metrics}
    if replay is not None:
        metrics["replay_pairs"] = torch.tensor(float(num_pairs), device=logits.device)
    return loss, metrics
