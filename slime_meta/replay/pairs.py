"""Trace replay pairs: N teacher models vote on a replayed sample; a confident vote against the
policy's answer becomes a pair for the trainer's DPO on trace-replay pairs (`--replay-beta`).

For each replayed sample (the solver prompt as plain text and the policy's solution) every teacher
of `--replay-teachers` answers the same prompt, as one user message, in parallel. Each reply's
final answer is `grading.verifier.extract_answer` + `normalize_answer` of it. Identical normalised answers
form groups; the decision:

- the largest group has at least `--replay-min-agree` teachers and is the only group of that size
  -> if its answer differs from the policy's normalised answer: a pair (chosen = the solution of
  the first agreeing teacher in `--replay-teachers` order, rejected = the policy's solution);
  if it equals the policy's answer: no pair (`agree_with_policy`);
- otherwise no pair (`no_agreement`). A tie between two groups of the largest size (possible with
  four or more teachers) is skipped rather than broken by teacher order: the teachers do not
  agree on one answer, and a pair trained on a coin flip would teach noise. Counted in `ties`
  as well.

A teacher whose reply has no answer (an empty reply) abstains, as does one whose API call failed.

A request with a label (`ReplayRequest.label`, the row's ground truth) is decided by the label
instead of the vote: see `slime_meta.replay.vote` (`policy_correct`, `no_correct_teacher`).

The cache (JSONL, in the run dir) holds two kinds of lines:

    {"kind": "answer", "key": ..., "teacher": "name@base_url", "gen": ..., "solution": ..., "answer": ...}
    {"kind": "decision", "key": ..., "config": ..., "outcome": "pair", "pair": {...}}   # or "pair": null

A pair's DPO reference log-probs (under the run's start weights, `reference_logps_for`) are
stored once as a "reference" line (`replay_cache.reference_key`: the reference weights and the
pair's token ids), so a resume reads them instead of computing them again.

Every successful teacher call is stored as an answer line, so a resume never pays for the same
call twice, even when the decision was still open (another teacher had failed): only the missing
teachers are asked again. A decision line is written once the decision is final: every teacher
answered, or the outcome (pair with that answer / no pair) is the same whatever the missing
teachers might answer (two of three agree and the third failed: it cannot change the result).
A decision still open is used for the current step (decided from the teachers that answered; with
fewer than `min_agree` answers there is no pair) and is not cached, so a later step asks the failed
teachers again. `config` fingerprints the ordered teacher list, `min_agree`, temperature and
max_tokens: decisions made under another configuration are not reused (its answers still are,
when teacher, temperature and max_tokens match, through `gen`). Lines are appended once per batch
(also when the batch is cancelled) with flush + fsync; a torn last line (a crash during a write)
is skipped on load.

API failures never fail the step: a call is retried like `grading.OpenAIGrader` does (the SDK's own
retries off; 408/409/429/5xx, timeouts, connection errors and malformed 200 replies are retried
with exponential backoff and jitter, Retry-After honoured; `slime_meta.replay.teachers`), and a call
that still fails, or fails with another status (401, 404, 400, ...), counts as that teacher not
answering (`api_failures`; per teacher and batch, a warning with the first error and one with the
count). API keys are read from the environment by name when the clients are made; they are never
kept in this object's own fields, shown by repr, logged (a server's error text is redacted) or
written to the cache. A base URL with credentials or a query string is refused, because labels
(`name@base_url`) are logged and cached.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

from slime_meta.errors import UserInputError
from slime_meta.grading.verifier import extract_answer
from slime_meta.grading.verifier.text import normalize_answer
from slime_meta.replay.cache import (
    append_replay_records,
    load_reference_logps,
    load_replay_cache,
    with_cached_reference_logps,
)
from slime_meta.replay.teachers import ReplayTeacher, TeacherClients
from slime_meta.replay.vote import _decide, _decide_by_label, _is_final, _is_final_by_label, correct_by_label
from slime_meta.types import PreferencePair

logger = logging.getLogger(__name__)

_FAILED: Any = object()  # a teacher call that failed (distinct from None: answered with nothing)


# --------------------------------------------------------------------------- requests and pairs


def replay_key(prompt_text: str, policy_solution: str) -> str:
    """The stable cache key of a replayed sample: sha256 of the prompt and the policy's solution."""
    payload = json.dumps([prompt_text, policy_solution], ensure_ascii=False)
    return hashlib.sha256(payload.encode("utf-8")).hexdigest()


@dataclass(frozen=True)
class ReplayRequest:
    """One replayed sample. `prompt_text` is the solver prompt as plain text (one user message)."""

    key: str
    prompt_text: str
    policy_solution: str
    problem_uid: str
    label: str | None = None  # the row's ground truth: when given, it decides instead of the vote

    @classmethod
    def build(
        cls, prompt_text: str, policy_solution: str, problem_uid: str, label: str | None = None
    ) -> "ReplayRequest":
        """A request whose key is `replay_key(prompt_text, policy_solution)`."""
        return cls(replay_key(prompt_text, policy_solution), prompt_text, policy_solution, problem_uid, label or None)


@dataclass(frozen=True)
class ReplayPair:
    """A preference pair for the DPO term: the teachers' agreed solution over the policy's.

    `chosen` is the full solution of the first agreeing teacher (in `--replay-teachers` order),
    `teachers` the labels (`name@base_url`) of the agreeing teachers that answered.
    """

    key: str
    prompt_text: str
    chosen: str
    rejected: str
    chosen_answer: str
    rejected_answer: str
    teachers: tuple[str, ...]

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "teachers": list(self.teachers)}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "ReplayPair":
        return cls(**{**data, "teachers": tuple(data["teachers"])})


@dataclass
class ReplayStats:
    """Counters the training loop logs (ints only: safe to print).

    Per unique request of a batch exactly one of: `cache_hits` (decided earlier), `pairs`,
    `no_agreement` (includes `ties` and too few answers), `agree_with_policy`; `undecided` counts
    the decisions of this batch left open (not cached) because teachers failed.
    """

    calls: int = 0  # teacher calls made (a retried call counts once)
    api_retries: int = 0  # requests re-sent after an API error
    api_failures: int = 0  # teacher calls that failed after their retries (the teacher abstains)
    pairs: int = 0
    no_agreement: int = 0
    agree_with_policy: int = 0
    ties: int = 0
    policy_correct: int = 0  # labelled: the policy's answer is right by the label, never rejected
    no_correct_teacher: int = 0  # labelled: no teacher answered right, so nothing to prefer
    undecided: int = 0
    cache_hits: int = 0  # requests whose decision was in the cache: no call made
    cached_answers: int = 0  # teacher answers reused from the cache for an open decision

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


def _fingerprint(value: Any) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True).encode("utf-8")).hexdigest()[:16]


# --------------------------------------------------------------------------- the pairer


class ReplayPairer:
    """Asks N teachers about replayed samples and turns confident disagreement into DPO pairs.

    `concurrency` bounds the calls in flight per teacher (each teacher is its own server with its
    own limits). `initial_backoff`/`max_backoff` shape the retry waits when the server sends no
    Retry-After. See the module docstring for the decision rule, the cache and failures.
    """

    def __init__(
        self,
        teachers: Sequence[ReplayTeacher],
        *,
        min_agree: int = 2,
        cache_path: Path | str,
        concurrency: int = 16,
        temperature: float = 0.0,
        max_tokens: int = 512,
        request_timeout: float = 60.0,
        max_api_retries: int = 3,
        initial_backoff: float = 0.5,
        max_backoff: float = 8.0,
    ):
        self.teachers = tuple(teachers)
        if not self.teachers:
            raise UserInputError("--replay-teachers: trace replay needs at least one teacher (name@base_url)")
        if not 1 <= int(min_agree) <= len(self.teachers):
            raise UserInputError(
                f"--replay-min-agree {min_agree}: must be between 1 and the number of --replay-teachers "
                f"({len(self.teachers)})"
            )
        self.min_agree = int(min_agree)
        self.cache_path = Path(cache_path)
        self.stats = ReplayStats()
        # The request settings live on the calls to the teachers, the one place that reads them.
        self._api = TeacherClients(
            self.teachers,
            stats=self.stats,
            concurrency=max(1, int(concurrency)),
            temperature=float(temperature),
            max_tokens=int(max_tokens),
            request_timeout=request_timeout,
            max_api_retries=max(0, int(max_api_retries)),
            initial_backoff=initial_backoff,
            max_backoff=max_backoff,
        )
        self._labels = tuple(teacher.label for teacher in self.teachers)
        self._gen = _fingerprint({"temperature": self._api.temperature, "max_tokens": self._api.max_tokens})
        self._config = _fingerprint(
            {"teachers": list(self._labels), "min_agree": self.min_agree, "gen": self._gen, "label_rule": 1}
        )
        # The cache, loaded on first use: final decisions of this configuration, and teacher answers
        # (label, key) -> (solution, normalised answer or None) for keys without such a decision.
        self._loaded = False
        self._decisions: dict[str, ReplayPair | None] = {}
        self._answers: dict[tuple[str, str], tuple[str, str | None]] = {}
        self._references: dict[str, tuple[float, float]] | None = None  # loaded on first use

    def __repr__(self) -> str:
        return (
            f"ReplayPairer(teachers={list(self._labels)!r}, min_agree={self.min_agree}, "
            f"cache_path={str(self.cache_path)!r})"
        )

    __str__ = __repr__

    # ----------------------------------------------------------------- the cache

    def _load_cache(self) -> None:
        if self._loaded:
            return
        self._loaded = True
        self._decisions, self._answers = load_replay_cache(
            self.cache_path, config=self._config, gen=self._gen, labels=self._labels, decode_pair=ReplayPair.from_json
        )

    def _append(self, records: Iterable[dict[str, Any]]) -> None:
        append_replay_records(self.cache_path, records)

    def reference_logps_for(
        self,
        pairs: Sequence[PreferencePair],
        score: Callable[[list[PreferencePair]], list[PreferencePair]],
        reference_id: str,
    ) -> list[PreferencePair]:
        """The pairs with their DPO reference log-probs: from the cache, else from `score` (which
        fills them under the reference weights named `reference_id`), then cached."""
        if self._references is None:
            self._references = load_reference_logps(self.cache_path)
        return with_cached_reference_logps(self.cache_path, self._references, pairs, score, reference_id)

    # ----------------------------------------------------------------- the API

    async def aclose(self) -> None:
        await self._api.aclose()

    # ----------------------------------------------------------------- pairing

    async def pairs_for(self, requests: Sequence[ReplayRequest]) -> list[ReplayPair]:
        """The pairs of `requests`, in request order, one per distinct key (a repeated sample
        yields its pair once). Never raises for API failures; see the module docstring."""
        self._load_cache()
        unique: dict[str, ReplayRequest] = {}
        for request in requests:
            unique.setdefault(request.key, request)
        pending = [request for request in unique.values() if request.key not in self._decisions]
        self.stats.cache_hits += len(unique) - len(pending)

        new_records: list[dict[str, Any]] = []
        failed_teachers: Counter = Counter()

        async def answer(request: ReplayRequest, index: int) -> tuple[str, str | None] | Any:
            """(solution, normalised answer or None: abstains), or _FAILED; cached answers are reused."""
            label = self._labels[index]
            cached = self._answers.get((label, request.key))
            if cached is not None:
                self.stats.cached_answers += 1
                return cached
            reply, error = await self._api.ask(index, request.prompt_text)
            if reply is None:
                self.stats.api_failures += 1
                if not failed_teachers[label]:
                    detail = self._api.describe(self.teachers[index], error)
                    logger.warning("replay teacher %s failed (%s); it abstains", label, detail)
                failed_teachers[label] += 1
                return _FAILED
            normalised = normalize_answer(extract_answer(reply)) or None
            self._answers[(label, request.key)] = (reply, normalised)
            record = {"kind": "answer", "key": request.key, "teacher": label, "gen": self._gen}
            new_records.append({**record, "solution": reply, "answer": normalised})
            return reply, normalised

        async def decide(request: ReplayRequest) -> ReplayPair | None:
            given = await asyncio.gather(*(answer(request, index) for index in range(len(self.teachers))))
            missing = [index for index, value in enumerate(given) if value is _FAILED]
            answers = [None if value is _FAILED else value[1] for value in given]
            policy_answer = normalize_answer(extract_answer(request.policy_solution))
            if request.label is not None:
                correct = [None if value is _FAILED else correct_by_label(value[0], request.label) for value in given]
                policy_correct = correct_by_label(request.policy_solution, request.label)
                decision = _decide_by_label(correct, policy_correct)
                final = _is_final_by_label(correct, missing, policy_correct)
            else:
                decision = _decide(answers, policy_answer, self.min_agree)
                final = _is_final(answers, missing, policy_answer, self.min_agree)
            pair = None
            if decision.outcome == "pair":
                first = decision.members[0]
                pair = ReplayPair(
                    key=request.key,
                    prompt_text=request.prompt_text,
                    chosen=given[first][0],
                    rejected=request.policy_solution,
                    chosen_answer=decision.answer or given[first][1] or "",
                    rejected_answer=policy_answer,
                    teachers=tuple(self._labels[index] for index in decision.members),
                )
            counter = "pairs" if decision.outcome == "pair" else decision.outcome
            setattr(self.stats, counter, getattr(self.stats, counter) + 1)
            self.stats.ties += decision.tie
            if final:
                self._decisions[request.key] = pair
                for label in self._labels:
                    self._answers.pop((label, request.key), None)
                new_records.append(
                    {
                        "kind": "decision",
                        "key": request.key,
                        "config": self._config,
                        "problem_uid": request.problem_uid,
                        "outcome": decision.outcome,
                        "pair": None if pair is None else pair.to_json(),
                    }
                )
            else:
                self.stats.undecided += 1
            return pair

        try:
            fresh = dict(zip((r.key for r in pending), await asyncio.gather(*(decide(r) for r in pending))))
        finally:
            self._append(new_records)  # also when cancelled: calls already paid for are kept
            for label, count in failed_teachers.items():
                if count > 1:
                    logger.warning("replay teacher %s: %d call(s) failed in this batch", label, count)
        pairs = []
        for key in unique:
            pair = fresh[key] if key in fresh else self._decisions.get(key)
            if pair is not None:
                pairs.append(pair)
        return pairs

    def pairs_for_sync(self, requests: Sequence[ReplayRequest]) -> list[ReplayPair]:
        """`pairs_for` from synchronous code (no running event loop)."""

        async def run() -> list[ReplayPair]:
            try:
                return await self.pairs_for(requests)
            finally:
                await self.aclose()

        return asyncio.run(run())
