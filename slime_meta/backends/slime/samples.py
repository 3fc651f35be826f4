"""Between slime's `Sample` and ours: problems from the data source, trained samples back to slime.

Pure functions: a slime `Sample` is read and written through its attributes and its own
`Status` enum, so nothing here imports slime.

What a trained teacher sample becomes (slime's trainer reads these fields):
  tokens             teacher prompt ids + the info's sampled ids, exactly as the engine used them
  response_length    number of sampled ids; loss_mask all ones over them
  rollout_log_probs  the engine's log-probs of those ids (the behaviour policy)
  reward             the mean holdout grade of the chain (raw reward, what slime logs)
  status             from the engine's finish reason (length -> TRUNCATED)
  metadata["meta_learning"]  the GRPO advantage over the holdout rewards (read back by the
                     reward post-process plugin), the info, the inner-loop trace when sampled

What a solver sample becomes (context distillation, SDPO shaping: the policy answering a train
problem itself, `SolverSample`): the same fields over the solver's prompt and answer, with
  teacher_log_probs  log p(answer | prompt with the context or hint), the scoring call's
  reward             the answer's grade; metadata["meta_learning"]["advantage"] its task advantage
  index              SOLVER_INDEX_BASE + n (distillation, context scores), SDPO_INDEX_BASE + n
                     (SDPO shaping, hint scores) or SDPO_JSD_INDEX_BASE + n (SDPO's JSD form:
                     teacher_log_probs is the hint's top-k, `pack_topk`): the mark by which the advantage and conversion
                     plugins tell the kinds apart (slime forwards `Sample.index` to the trainer as
                     `sample_indices`, and no free-form per-sample field). An answer trained by
                     both channels is two samples, one of each kind.
  rollout_id         the rollout of the chain it came from: slime keeps a rollout's samples in one
                     training step, and the number of rollouts per step stays slime's own count
When a step has solver samples every teacher sample carries `teacher_log_probs` too (slime forwards
the field only when its first sample has it): its own rollout log-probs, which nothing reads.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import numpy as np

from slime_meta.types import Problem, SolverSample, TeacherSample

META_KEY = "meta_learning"
SOLVER_INDEX_BASE = 1 << 40  # far above any data-source index: distillation's solver samples
SDPO_INDEX_BASE = 2 << 40  # the same answers as SDPO's shaping samples (hint scores)
REPLAY_INDEX_BASE = 3 << 40  # the two sides of replay DPO pairs (replay_samples.py)
SDPO_JSD_INDEX_BASE = 4 << 40  # the error sites' answers for SDPO's JSD form (hint top-k, no advantage)
KINDS = ("info", "distill", "sdpo", "replay", "sdpo_jsd")
DEFAULT_SDPO_TOPK = 100  # the k of SDPO's reference implementation, when --sdpo-topk is not given
_INDEX_BASE_OF_KIND = {"distill": SOLVER_INDEX_BASE, "sdpo": SDPO_INDEX_BASE, "sdpo_jsd": SDPO_JSD_INDEX_BASE}
_STATUS_BY_FINISH = {"stop": "completed", "length": "truncated", "abort": "aborted"}


def prompt_text(prompt: Any) -> str:
    """A data-source prompt as plain text: a string as is, a chat list as its user turns."""
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, (list, tuple)):
        texts = []
        for message in prompt:
            if not isinstance(message, Mapping) or message.get("role", "user") != "user":
                continue
            content = message.get("content")
            if isinstance(content, list):  # content parts: [{"type": "text", "text": ...}]
                content = "\n".join(str(p.get("text", "")) for p in content if isinstance(p, Mapping))
            if content:
                texts.append(str(content))
        return "\n\n".join(texts)
    return "" if prompt is None else str(prompt)


def problem_from_sample(sample: Any, *, rubric_key: str, fallback_uid: str) -> Problem:
    """A problem from a data-source sample: prompt, label, and rubric/uid from its metadata."""
    metadata = dict(getattr(sample, "metadata", None) or {})
    rubric = metadata.get(rubric_key, metadata.get("rubric", ""))
    uid = metadata.get("uid")
    return Problem(
        uid=str(uid) if uid is not None else fallback_uid,
        prompt=prompt_text(getattr(sample, "prompt", "")),
        label=getattr(sample, "label", None),
        rubric="" if rubric is None else str(rubric),
        metadata=metadata,
    )


def status_value(finish_reason: str | None) -> str:
    """slime's `Sample.Status` value for an engine finish reason."""
    return _STATUS_BY_FINISH.get(finish_reason or "stop", "completed")


def _token_fields(
    sample: TeacherSample | SolverSample, prompt: str, response: str, teacher_log_probs: Sequence[float] | None
) -> dict[str, Any]:
    """The fields every trained sample has: its text, its token ids, its mask and log-probs."""
    fields: dict[str, Any] = {
        "prompt": prompt,
        "tokens": [int(t) for t in sample.prompt_ids] + [int(t) for t in sample.response_ids],
        "response": response,
        "response_length": len(sample.response_ids),
        "loss_mask": [1] * len(sample.response_ids),
        "rollout_log_probs": [float(x) for x in sample.rollout_logprobs],
    }
    if teacher_log_probs is not None:
        if len(teacher_log_probs) != len(sample.response_ids):
            raise ValueError(
                f"{len(teacher_log_probs)} teacher log-probs for {len(sample.response_ids)} response tokens"
            )
        packed = isinstance(teacher_log_probs, np.ndarray) and teacher_log_probs.ndim == 2  # SDPO's top-k
        fields["teacher_log_probs"] = teacher_log_probs if packed else [float(x) for x in teacher_log_probs]
    return fields


def teacher_sample_fields(
    sample: TeacherSample,
    *,
    prompt: str,
    response: str,
    base_metadata: Mapping[str, Any] | None = None,
    trace: Mapping[str, Any] | None = None,
    teacher_log_probs: Sequence[float] | None = None,
    rollout_id: int | None = None,
) -> dict[str, Any]:
    """The slime `Sample` fields of one trained teacher sample (`status` as its enum value)."""
    meta = {
        "advantage": float(sample.advantage),
        "group_index": sample.group_index,
        "sample_index": sample.sample_index,
        "inner_iteration": sample.inner_iteration,
        **{k: v for k, v in sample.metadata.items()},
    }
    if trace is not None:
        meta["trace"] = dict(trace)
    fields = {
        **_token_fields(sample, prompt, response, teacher_log_probs),
        "reward": float(sample.reward),
        "status": status_value(sample.metadata.get("finish_reason")),
        "weight_versions": [sample.weight_version] if sample.weight_version is not None else [],
        "metadata": {**dict(base_metadata or {}), META_KEY: meta},
    }
    if rollout_id is not None:
        fields["rollout_id"] = rollout_id
    return fields


def apply_fields(sample: Any, fields: Mapping[str, Any]) -> Any:
    """Set `fields` on a slime `Sample` (the status through the sample's own enum); returns it."""
    for name, value in fields.items():
        setattr(sample, name, type(sample).Status(value) if name == "status" else value)
    return sample


def advantage_of(sample: Any) -> float | None:
    meta = (getattr(sample, "metadata", None) or {}).get(META_KEY) or {}
    value = meta.get("advantage")
    return None if value is None else float(value)


def solver_sample_fields(
    sample: SolverSample,
    *,
    prompt: str,
    response: str,
    teacher_log_probs: Sequence[float],
    index: int,
    rollout_id: int,
    base_metadata: Mapping[str, Any] | None = None,
    kind: str = "distill",
) -> dict[str, Any]:
    """The slime `Sample` fields of one solver sample of `kind` ("distill" | "sdpo" | "sdpo_jsd");
    `index` counts from 0 within the step and kind. An "sdpo_jsd" sample's `teacher_log_probs` is the
    packed hint top-k (`pack_topk`) and its advantage 0: its only term is the JSD."""
    advantage = 0.0 if kind == "sdpo_jsd" else float(sample.task_advantage)
    return {
        "index": _INDEX_BASE_OF_KIND[kind] + index,
        **_token_fields(sample, prompt, response, teacher_log_probs),
        "reward": float(sample.grade),
        "status": "completed",
        "rollout_id": rollout_id,
        "metadata": {
            **dict(base_metadata or {}),
            META_KEY: {
                "kind": kind,
                "advantage": advantage,
                "problem_uid": sample.problem_uid,
                "error_site": bool(sample.is_error_site),
            },
        },
    }


def kind_of_index(index: Any) -> str:
    index = int(index)
    bases = (
        (SDPO_JSD_INDEX_BASE, "sdpo_jsd"),
        (REPLAY_INDEX_BASE, "replay"),
        (SDPO_INDEX_BASE, "sdpo"),
        (SOLVER_INDEX_BASE, "distill"),
    )
    for base, kind in bases:
        if index >= base:
            return kind
    return "info"


def replay_sample_fields(
    sample: Any, *, index: int, rollout_id: int, base_metadata: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """The slime `Sample` fields of one side of a replay pair (`replay_samples.ReplaySample`): its
    advantage (+-replay_beta * w) travels as the reward post-process plugin's value."""
    logps = [float(x) for x in sample.policy_logprobs]
    return {
        "index": REPLAY_INDEX_BASE + index,
        "prompt": "",
        "tokens": [int(t) for t in sample.prompt_ids] + [int(t) for t in sample.response_ids],
        "response": "",
        "response_length": len(sample.response_ids),
        "loss_mask": [1] * len(sample.response_ids),
        "rollout_log_probs": logps,
        "teacher_log_probs": logps,
        "reward": float(sample.advantage),
        "status": "completed",
        "rollout_id": rollout_id,
        "metadata": {
            **dict(base_metadata or {}),
            META_KEY: {
                "kind": "replay",
                "advantage": float(sample.advantage),
                "pair_index": sample.pair_index,
                "chosen": sample.chosen,
            },
        },
    }


def is_solver_index(index: Any) -> bool:
    return kind_of_index(index) != "info"


def pack_topk(ids_R_K: Any, logprobs_R_K: Any) -> np.ndarray:
    """The hint top-k of an answer as one float32 `[R, 2K]` array (ids, then log-probs): it travels in
    `Sample.teacher_log_probs`, the one per-token field slime carries from the rollout to the loss
    (it checks only its length, R). Token ids below 2**24 are exact in float32; 8 K bytes per token."""
    ids_R_K, logprobs_R_K = np.asarray(ids_R_K), np.asarray(logprobs_R_K)
    if ids_R_K.shape != logprobs_R_K.shape or ids_R_K.ndim != 2:
        raise ValueError(f"top-k ids and log-probs must be [R, K] alike, got {ids_R_K.shape} and {logprobs_R_K.shape}")
    if ids_R_K.size and int(ids_R_K.max()) >= 1 << 24:
        raise ValueError(f"token id {int(ids_R_K.max())} is not exact in float32 (vocabularies below 2**24 only)")
    return np.concatenate([ids_R_K.astype(np.float32), logprobs_R_K.astype(np.float32)], axis=1)
