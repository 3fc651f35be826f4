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
  --kl-loss-coef x KL to `ref_log_probs`. The surrogate is `slime_meta.losses.policy.policy_loss`;
  our --aipo-delta works too. Where slime's Megatron backend is not installed (a CPU test
  machine) the log-probs come from the pure path below, on one rank only, with a warning that
  says why; with tensor or context parallel size > 1 that path would read one shard of the
  vocabulary, so it is refused, with the import error. Any other import error of slime's
  modules (a dependency missing, a renamed function) is raised as it is.
channel 2, SDPO (--sdpo-alpha, --sdpo-form jsd): the error sites' answers arrive as samples of
  their own kind (`samples.SDPO_JSD_INDEX_BASE`, advantage 0, outside the policy-gradient terms)
  whose `teacher_log_probs[i]` is the hint-conditioned model's top-k at each token, `[R_i, 2k]`
  (ids then log-probs, `samples.pack_topk`; 8k bytes per token), scored by the pool at rollout
  time. The term is `topk_generalized_jsd` of the policy's logits against them, the teacher's
  remaining mass and the policy's mass outside those ids as one tail bucket each; vocabulary-
  parallel over Megatron's tensor-parallel group; context parallel size 1 only. Its token mean
  is over the step's SDPO tokens (the conversion plugin's denominators), as the local SDPO pass.
  `hold_sdpo_topk` (--rollout-data-postprocess-path) keeps the 2-D top-k away from slime's
  rollout logging. In its shaping form (--sdpo-form shaping) channel 2 is token advantages.
channel 3, replay DPO (--replay-beta): active when the batch carries `replay_pair_index[i]` (a
  pair id, -1 for none), `replay_is_chosen[i]` and `ref_log_probs`; a pair counts when both of
  its samples are in this micro-batch. Skipped otherwise.
slime (checked at 624b824) forwards a fixed set of keys into this batch, without channel 3's keys
above, so on stock slime replay arrives as two samples per pair with advantages
(replay_samples.py); channel 3 runs here as soon as a slime forwards its keys.
"""

from __future__ import annotations

import functools
import logging
from argparse import Namespace
from typing import Any, Callable, Sequence

import torch
from torch import Tensor

from slime_meta.losses.combine import ThreeChannelInputs, total_loss
from slime_meta.losses.policy import kl_penalty, policy_loss
from slime_meta.losses.preference import dpo_loss
from slime_meta.losses.token_stats import entropy_from_logits, sequence_logps
from slime_meta.losses.topk_distill import ProcessGroupShards, topk_generalized_jsd

# Where `hold_sdpo_topk` keeps a sample's packed hint top-k on its teacher_log_probs placeholder.
SDPO_TOPK_ATTRIBUTE = "sdpo_topk"
# Tokens per chunk of the top-k JSD: float32 temporaries of a few [256, V / TP] (docs/performance.md).
SDPO_CHUNK_TOKENS = 256
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
    logger.warning(
        "slime's Megatron log-probs do not import (%s): the loss computes them on one rank in "
        "plain torch (tensor and context parallel size 1 only)",
        reason,
    )


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
        logits,
        args=args,
        unconcat_tokens=batch["unconcat_tokens"],
        total_lengths=batch["total_lengths"],
        response_lengths=batch["response_lengths"],
        with_entropy=with_entropy,
        **get_rollout_top_p_logprob_kwargs(args, batch),
    )
    return result["log_probs"], result.get("entropy")


def _cat(tensors: Sequence[Tensor], like: Tensor) -> Tensor:
    return torch.cat([t.to(like.device, torch.float32) for t in tensors]) if len(tensors) else like.new_zeros(0)


def _kl_per_token(logp: Tensor, ref: Tensor, kind: str) -> Tensor:
    """slime's KL estimators (k1, k2, k3; low_var_kl is k3 clamped to [-10, 10])."""
    ones = torch.ones_like(logp, dtype=torch.bool)
    per_token = kl_penalty(logp, ref, ones, kind="k3" if kind == "low_var_kl" else kind).per_token
    return per_token.clamp(-10, 10) if kind == "low_var_kl" else per_token


def grpo_channel(
    args: Namespace,
    batch: dict[str, Any],
    log_probs: list[Tensor],
    entropy: list[Tensor] | None,
    reduce: Reducer,
    like: Tensor,
) -> tuple[Tensor, dict[str, Tensor]]:
    logp = _cat(log_probs, like)
    use_rollout = bool(getattr(args, "use_rollout_logprobs", False))
    anchors = batch.get("rollout_log_probs") if use_rollout else batch.get("log_probs")
    old = _cat(anchors, like).detach() if anchors else logp.detach()
    advantages = _cat(batch["advantages"], like)
    aipo_delta = getattr(args, "aipo_delta", None)
    use_tis = bool(getattr(args, "use_tis", False))
    rollout = _cat(batch["rollout_log_probs"], like) if (use_tis or aipo_delta is not None) else None
    out = policy_loss(
        logp,
        old,
        advantages,
        torch.ones_like(logp, dtype=torch.bool),
        eps_clip=args.eps_clip,
        eps_clip_high=getattr(args, "eps_clip_high", None),
        eps_clip_c=getattr(args, "eps_clip_c", None),
        rollout_logp=rollout,
        tis_clip=args.tis_clip if use_tis else None,
        tis_clip_low=float(getattr(args, "tis_clip_low", 0.0) or 0.0),
        aipo_delta=aipo_delta,
    )
    trained = _policy_gradient_tokens(batch, like)
    pg_loss = reduce(out.per_token_loss * trained)

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
        entropy_loss = reduce(_cat(entropy, like) * trained)
        loss = loss - entropy_coef * entropy_loss
        metrics["entropy_loss"] = entropy_loss.detach()
    kl_coef = float(getattr(args, "kl_loss_coef", 0.0) or 0.0)
    if (getattr(args, "use_kl_loss", False) or kl_coef) and batch.get("ref_log_probs"):
        kl_per_token = _kl_per_token(logp, _cat(batch["ref_log_probs"], like), getattr(args, "kl_loss_type", "k1"))
        kl_loss = reduce(kl_per_token * trained)
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


def sdpo_topk_of(teacher_log_probs: Tensor | None) -> Tensor | None:
    """A sample's packed hint top-k `[R, 2K]` (`samples.pack_topk`), or None when it has none: as
    slime hands it over (2-D `teacher_log_probs`), or held by `hold_sdpo_topk` on a placeholder."""
    if teacher_log_probs is None:
        return None
    held = getattr(teacher_log_probs, SDPO_TOPK_ATTRIBUTE, None)
    if held is not None:
        return held
    return teacher_log_probs if teacher_log_probs.dim() == 2 else None


def hold_sdpo_topk(args: Namespace, rollout_id: int, rollout_data: dict[str, Any]) -> None:
    """slime's --rollout-data-postprocess-path: the trainer-side hook after the advantages, before
    slime's rollout logging. That logging concatenates every per-sample tensor of a field, which a
    2-D top-k beside 1-D log-probs would break; so each packed top-k is held as an attribute of a
    1-D zero placeholder of the sample's response length. slime's data iterator hands the loss the
    very tensor objects of this dict, attribute included (checked at slime 624b824)."""
    teachers = rollout_data.get("teacher_log_probs")
    for i, teacher in enumerate(teachers or []):
        if teacher.dim() == 2:
            placeholder = teacher.new_zeros(teacher.shape[0])
            setattr(placeholder, SDPO_TOPK_ATTRIBUTE, teacher)
            teachers[i] = placeholder


def _tensor_parallel_shards() -> ProcessGroupShards:
    """Megatron's tensor-parallel group: rank r holds vocabulary slice r of the output layer."""
    from megatron.core import mpu

    return ProcessGroupShards(mpu.get_tensor_model_parallel_group())


def sdpo_channel(args: Namespace, batch: dict[str, Any], logits: Tensor, reduce: Reducer) -> tuple[Tensor | None, int]:
    """Channel 2, JSD form: the policy's logits against the hint-conditioned top-k of each answer of
    SDPO's kind (a tail bucket on both sides, `topk_generalized_jsd`); (None, 0) without any."""
    if not getattr(args, "sdpo_alpha", 0.0) or getattr(args, "sdpo_form", "jsd") != "jsd":
        return None, 0
    packed = [sdpo_topk_of(t) for t in (batch.get("teacher_log_probs") or [])]
    if not any(p is not None for p in packed):
        return None, 0
    tp, cp = _parallel_sizes(args)
    if cp > 1:
        raise NotImplementedError(
            f"the SDPO JSD reads each answer's logit rows whole; with context parallel size {cp} they are split over "
            "ranks in slime's zigzag layout, which this loss does not map (give --context-parallel-size 1)"
        )
    shards = _tensor_parallel_shards() if tp > 1 else None
    per_token, num_samples = [], 0
    for rows_R_V, topk_R_2K in zip(response_logits(batch, logits), packed):
        if topk_R_2K is None or rows_R_V.shape[0] == 0:  # not an SDPO answer: no JSD term
            per_token.append(rows_R_V.new_zeros(rows_R_V.shape[0], dtype=torch.float32))
            continue
        k = topk_R_2K.shape[1] // 2
        topk_R_2K = topk_R_2K.to(rows_R_V.device)
        out = topk_generalized_jsd(
            rows_R_V,
            topk_R_2K[:, :k].round().long(),
            topk_R_2K[:, k:].float(),
            None,
            beta=args.sdpo_beta,
            temperature=float(getattr(args, "sdpo_temperature", 1.0)),
            token_clip=getattr(args, "sdpo_token_clip", None),
            chunk_size=SDPO_CHUNK_TOKENS,
            shards=shards,
        )
        per_token.append(out.per_token)
        num_samples += 1
    return reduce(torch.cat(per_token)), num_samples


def _policy_gradient_tokens(batch: dict[str, Any], like: Tensor) -> Tensor:
    """1 on the tokens of samples the policy-gradient channel trains, 0 on SDPO's JSD answers (whose
    only term is the JSD, as the local trainer's SDPO pass)."""
    teachers = batch.get("teacher_log_probs") or [None] * len(batch["response_lengths"])
    return _cat(
        [
            torch.full((int(r),), 0.0 if sdpo_topk_of(t) is not None else 1.0)
            for r, t in zip(batch["response_lengths"], teachers)
        ],
        like,
    )


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
        torch.stack([sequences[i] for i in c]),
        torch.stack([sequences[i] for i in r]),
        torch.stack([references[i] for i in c]),
        torch.stack([references[i] for i in r]),
        beta=args.replay_dpo_beta,
    )
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
    sdpo, sdpo_samples = sdpo_channel(args, batch, logits, reduce)
    replay, num_pairs = replay_channel(args, batch, log_probs)
    out = total_loss(
        ThreeChannelInputs(grpo=grpo, sdpo_jsd=sdpo, replay_dpo=replay),
        alpha=float(getattr(args, "sdpo_alpha", 0.0) or 0.0),
        beta=float(getattr(args, "replay_beta", 0.0) or 0.0),
    )
    loss = out.loss
    if sum(lp.numel() for lp in log_probs) == 0:
        loss = loss + 0 * logits.sum()  # no response token on this rank: keep the graph connected (as slime does)
    channels = step_metrics(args, batch, out.metrics, sdpo_samples, num_pairs, logits)
    return loss, {"loss": loss.detach(), **metrics, **channels}


def step_metrics(
    args: Namespace,
    batch: dict[str, Any],
    channel_metrics: dict[str, Tensor],
    sdpo_samples: int,
    num_pairs: int,
    like: Tensor,
) -> dict[str, Tensor]:
    """The channels' metrics with the same keys, in the same order, for every micro-batch of a run.

    slime sums each micro-batch's metric values position by position (train_metric_utils.
    reduce_train_step_metrics), so a key present in one micro-batch only (one with SDPO answers or
    a complete replay pair) breaks the step. SDPO's keys follow the flags (--sdpo-alpha with the JSD
    form), replay's whether this slime forwards the pair keys at all; a micro-batch without such
    samples adds 0, which is its share of the step's token mean.
    """
    zero = like.new_zeros((), dtype=torch.float32)
    sdpo_on = bool(float(getattr(args, "sdpo_alpha", 0.0) or 0.0)) and getattr(args, "sdpo_form", "jsd") == "jsd"
    replay_on = bool(float(getattr(args, "replay_beta", 0.0) or 0.0)) and REPLAY_PAIR_INDEX in batch
    out = {"loss/grpo": channel_metrics["loss/grpo"]}
    if sdpo_on:
        out["loss/sdpo_kl"] = channel_metrics.get("loss/sdpo_kl", zero)
    if replay_on:
        out["loss/trace_replay_dpo"] = channel_metrics.get("loss/trace_replay_dpo", zero)
    out.update({k: v for k, v in channel_metrics.items() if k not in out})  # loss/total, and any other
    if sdpo_on:
        out["sdpo_samples"] = torch.tensor(float(sdpo_samples), device=like.device)
    if replay_on:
        out["replay_pairs"] = torch.tensor(float(num_pairs), device=like.device)
    return out
