"""Keeping every request inside the model's context, so that no request ends a run for its length.

An SGLang server refuses a request whose prompt plus `max_new_tokens` reaches the model's context
length (HTTP 400; equal is refused too), and aborts one whose prompt alone comes within
`SGLANG_INPUT_MARGIN` tokens of it; a refused request ends the run. `longest_prompt` is what one
request may carry. Three places can overflow:

  - the teacher's prompt carries every graded attempt of its problems, and real solutions run to
    thousands of tokens: `fit_teacher_prompt` shortens the attempts to the budget
    (`longest_prompt(context, --teacher-max-tokens)`), so the prompt fits by construction;
  - a student prompt (problem + the teacher's info) can leave less room than
    `--rollout-max-response-len`: `student_new_tokens` clamps the request to what is left;
  - a flag, or a data row, can make a request that can never fit: `check_flags_fit` and
    `split_rows_by_fit` find them before any process starts.

Every shortening is counted (`ContextBudgetStats`, logged as `meta_learning/...` metrics) and
the elided text carries a marker, so traces show what the teacher did not see.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

from slime_meta.errors import UserInputError
from slime_meta.types import GradedAttempt, Problem

ELISION_MARKER = "\n[... {count} tokens cut for length ...]\n"
# A shortened solution keeps at least this many tokens (its start and its end); below that it is
# dropped instead, since a few tokens around a marker tell the teacher nothing.
MIN_SOLUTION_TOKENS = 64
MIN_EXPLANATION_TOKENS = 32
EXPLANATION_SHARE = 0.25  # of an attempt's room, at most, for the grader's explanation
# A student request sends text; its token count is at most its UTF-8 bytes plus the tokenizer's
# special tokens. Under that bound nothing needs counting.
SPECIAL_TOKENS_SLACK = 8
# A row is kept only if the student can still write this many tokens (or the whole flag value, if smaller).
MIN_ANSWER_TOKENS = 16
CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length")
# SGLang's limits on one request (its tokenizer manager: prompt + max_new_tokens >= context is
# refused; its scheduler: a prompt of context - 6 tokens or more is aborted). The embedded worker
# refuses the same (slime_meta_engine/protocol.py), so a run tested here is not refused on a cluster.
SGLANG_INPUT_MARGIN = 6


def longest_prompt(context_length: int, max_new_tokens: int) -> int:
    """The most prompt tokens an SGLang server serves with `max_new_tokens` new ones in this context."""
    return context_length - max(max_new_tokens, SGLANG_INPUT_MARGIN) - 1


def context_length_of(model_dir: str | None) -> int | None:
    """The model's context length from its HF config (`max_position_embeddings`); None if unknown."""
    if not model_dir:
        return None
    path = Path(model_dir) / "config.json"
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    for section in (config, config.get("text_config") or {}, config.get("llm_config") or {}):
        for key in CONTEXT_KEYS:
            value = section.get(key)
            if isinstance(value, int) and value > 0:
                return value
    return None


@dataclass
class ContextBudgetStats:
    """What was shortened to fit the context, per step (read and reset by `metrics_of`)."""

    teacher_prompts: int = 0
    teacher_prompts_truncated: int = 0
    teacher_solutions_elided: int = 0
    teacher_attempts_dropped: int = 0
    teacher_explanations_cut: int = 0
    teacher_problems_elided: int = 0
    student_requests: int = 0
    student_requests_clamped: int = 0
    student_requests_skipped: int = 0  # prompt alone fills the context: not sent, an empty answer


def metrics_of(*roles: Any) -> dict[str, float]:
    """The roles' context counters as metrics, then reset (roles without counters add nothing)."""
    total = ContextBudgetStats()
    for role in roles:
        stats = getattr(role, "budget_stats", None)
        if stats is None:
            continue
        for name in vars(total):
            setattr(total, name, getattr(total, name) + getattr(stats, name))
            setattr(stats, name, 0)
    totals = ("teacher_prompts", "student_requests", "teacher_prompts_truncated")
    metrics = {f"meta_learning/{name}": float(value) for name, value in vars(total).items() if name not in totals}
    # The share of teacher prompts shortened this step; the other counters count items.
    metrics["meta_learning/teacher_prompt_truncated"] = total.teacher_prompts_truncated / max(1, total.teacher_prompts)
    return metrics


class TokenCounter:
    """Counts and shortens text in one tokenizer's tokens (no special tokens added)."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self._backend = getattr(tokenizer, "backend_tokenizer", None)  # the Rust tokenizer: ids and offsets

    def _encoding(self, text: str):
        if self._backend is not None:
            encoding = self._backend.encode(text, add_special_tokens=False)
            return encoding.ids, encoding.offsets
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"]), None

    def count(self, text: str) -> int:
        return len(self._encoding(text)[0]) if text else 0

    def elide_middle(self, text: str, max_tokens: int) -> tuple[str, bool]:
        """`text` cut to about `max_tokens` tokens: its start and end around a marker; (text, cut?)."""
        ids, offsets = self._encoding(text)
        if len(ids) <= max_tokens:
            return text, False
        marker = ELISION_MARKER.format(count=len(ids) - max_tokens)
        keep = max(0, max_tokens - self.count(marker))
        head, tail = (keep + 1) // 2, keep // 2
        if keep < 2:  # no room for the marker: the start alone
            marker, head, tail = "", max(0, max_tokens), 0
        if offsets is not None:  # slices of the text itself: nothing re-decoded
            start = text[: offsets[head - 1][1]] if head else ""
            end = text[offsets[len(ids) - tail][0] :] if tail else ""
        else:
            start = self.tokenizer.decode(ids[:head]) if head else ""
            end = self.tokenizer.decode(ids[len(ids) - tail :]) if tail else ""
        return start + marker + end, True


BuildPrompt = Callable[[Sequence[Problem], Sequence[Sequence[GradedAttempt]], str], tuple[str, list[int]]]


def _water_level(lengths: Sequence[int], room: int) -> int:
    """The largest cap c with sum(min(length, c)) <= room: long texts are cut, short ones kept whole."""
    low, high = 0, max(lengths, default=0)
    while low < high:
        middle = (low + high + 1) // 2
        if sum(min(n, middle) for n in lengths) <= room:
            low = middle
        else:
            high = middle - 1
    return low


def fit_teacher_prompt(
    build: BuildPrompt,
    problems: Sequence[Problem],
    attempts_K_M: Sequence[Sequence[GradedAttempt]],
    previous_info: str,
    budget: int,
    counter: TokenCounter,
    stats: ContextBudgetStats,
) -> tuple[str, list[int]]:
    """The teacher's prompt (text, ids) in at most `budget` tokens.

    Over the budget, in this order: grader explanations are cut to a share of each attempt's
    room; long solutions lose their middle (all cut to one common length, short ones kept
    whole); if even `MIN_SOLUTION_TOKENS` each is too much, attempts are dropped, the oldest
    inner iteration first (within one, the last attempt of each problem first). Only if the
    problems alone overflow are their texts and the previous info shortened.
    """
    stats.teacher_prompts += 1
    text, ids = build(problems, attempts_K_M, previous_info)
    if len(ids) <= budget:
        return text, ids
    stats.teacher_prompts_truncated += 1
    flat = [(k, j, a) for k, attempts_M in enumerate(attempts_K_M) for j, a in enumerate(attempts_M)]
    empty_K = [[] for _ in attempts_K_M]
    fixed = len(build(problems, empty_K, previous_info)[1])

    def blank(a: GradedAttempt) -> GradedAttempt:
        return dataclasses.replace(a, solution="", grade=dataclasses.replace(a.grade, explanation=""))

    blank_K_M = [[blank(a) for a in attempts_M] for attempts_M in attempts_K_M]
    overhead = (len(build(problems, blank_K_M, previous_info)[1]) - fixed) / max(1, len(flat))
    solution_tokens = [counter.count(a.solution) for _, _, a in flat]
    explanation_tokens = [counter.count(a.grade.explanation) for _, _, a in flat]
    drop_order = sorted(range(len(flat)), key=lambda i: (flat[i][2].iteration, -flat[i][1], flat[i][0]))
    dropped: set[int] = set()
    room = budget - fixed
    for _ in range(8):  # each round corrects for tokens merging across the pieces' boundaries
        kept = [i for i in range(len(flat)) if i not in dropped]
        while kept:
            share = (room - overhead * len(kept)) / len(kept)
            explanation_cap = max(MIN_EXPLANATION_TOKENS, int(share * EXPLANATION_SHARE))
            explanations = sum(min(explanation_tokens[i], explanation_cap) for i in kept)
            left = int(room - overhead * len(kept) - explanations)
            cap = _water_level([solution_tokens[i] for i in kept], left)
            if left >= 0 and (cap >= MIN_SOLUTION_TOKENS or cap >= max(solution_tokens[i] for i in kept)):
                break
            dropped.add(next(i for i in drop_order if i not in dropped))
            kept = [i for i in range(len(flat)) if i not in dropped]
        if not kept:
            break
        fitted_K_M: list[list[GradedAttempt]] = [[] for _ in attempts_K_M]
        elided = cut = 0
        for i in kept:
            k, _, attempt = flat[i]
            solution, was_elided = counter.elide_middle(attempt.solution, cap)
            explanation, was_cut = counter.elide_middle(attempt.grade.explanation, explanation_cap)
            elided, cut = elided + was_elided, cut + was_cut
            grade = dataclasses.replace(attempt.grade, explanation=explanation)
            fitted_K_M[k].append(dataclasses.replace(attempt, solution=solution, grade=grade))
        text, ids = build(problems, fitted_K_M, previous_info)
        if len(ids) <= budget:
            stats.teacher_solutions_elided += elided
            stats.teacher_explanations_cut += cut
            stats.teacher_attempts_dropped += len(dropped)
            return text, ids
        room -= len(ids) - budget + 1
    stats.teacher_attempts_dropped += len(flat)
    return _fit_problems(build, problems, empty_K, previous_info, budget, counter, stats)


def _fit_problems(build, problems, empty_K, previous_info, budget, counter, stats) -> tuple[str, list[int]]:
    """No attempt fits: shorten the problem texts, rubrics and the previous info themselves."""
    stats.teacher_problems_elided += 1
    text, ids = build(problems, empty_K, previous_info)
    scale = budget / max(1, len(ids))
    for _ in range(8):

        def cut(value: str) -> str:
            return counter.elide_middle(value, int(counter.count(value) * scale))[0] if value else value

        shortened = [dataclasses.replace(p, prompt=cut(p.prompt), rubric=cut(p.rubric)) for p in problems]
        text, ids = build(shortened, empty_K, cut(previous_info))
        if len(ids) <= budget:
            return text, ids
        scale *= 0.8
    # The template text alone overflows (the start-time check refuses this): keep its two ends.
    return text, ids[: budget // 2] + ids[len(ids) - (budget - budget // 2) :]


def student_new_tokens(
    prompt: str, max_new_tokens: int, context_length: int | None, count: Callable[[str], int]
) -> tuple[int, int | None]:
    """(max_new_tokens that fit, the prompt's token count or None when it was not needed).

    At most `context_length - 1` tokens in all (SGLang refuses a request that fills the context);
    0 when the prompt alone is more than a server takes.
    """
    if context_length is None:
        return max_new_tokens, None
    if len(prompt.encode("utf-8")) + SPECIAL_TOKENS_SLACK <= longest_prompt(context_length, max_new_tokens):
        return max_new_tokens, None
    prompt_tokens = count(prompt)
    if prompt_tokens > longest_prompt(context_length, 0):
        return 0, prompt_tokens
    return min(max_new_tokens, context_length - 1 - prompt_tokens), prompt_tokens


# ---------------------------------------------------------------------------- start-time checks

EMPTY_PROBLEM = Problem(uid="", prompt="", label="", rubric="")


@dataclass(frozen=True)
class ContextLimits:
    """The contexts of the teacher's and the student's models and what each role needs of them."""

    teacher_context: int | None
    student_context: int | None
    teacher_source: str  # the flag and checkpoint the context came from, for messages
    student_source: str
    teacher_max_tokens: int
    student_max_tokens: int
    teacher_ids: Callable[[list], list[int]]  # messages -> ids, in the teacher pool's tokenizer
    student_ids: Callable[[list], list[int]]


def teacher_prompt_tokens(limits: ContextLimits, teacher_template: Any, problems: Sequence[Problem]) -> int:
    """The teacher prompt of `problems` without attempts or previous info, in tokens."""
    return len(limits.teacher_ids(teacher_template.build(list(problems), [[] for _ in problems], "")))


def student_prompt_tokens(limits: ContextLimits, generator_template: Any, problem: Problem, position: str) -> int:
    """A student prompt of `problem` with a one-character info (its block's text counts), in tokens."""
    return len(limits.student_ids(generator_template.build(problem, "x", position)))


def check_flags_fit(limits: ContextLimits, generator_template: Any, teacher_template: Any, position: str) -> None:
    """Refuse flags with which a request can never fit its model's context (exit 2, one line)."""
    T, R = limits.teacher_max_tokens, limits.student_max_tokens
    if limits.teacher_context is not None:
        C = limits.teacher_context
        template = teacher_prompt_tokens(limits, teacher_template, [EMPTY_PROBLEM])
        if template >= C:
            raise UserInputError(
                f"--teacher-template {teacher_template.source}: its text alone is {template} tokens, the whole "
                f"{C}-token context of {limits.teacher_source}; use a shorter template or a model with a longer context"
            )
        if template + T > longest_prompt(C, T):
            raise UserInputError(
                f"--teacher-max-tokens {T}: the teacher's prompt ({template} tokens of template, up to {T} of previous "
                f"info) plus {T} new tokens do not fit the {C}-token context of {limits.teacher_source}; "
                f"use --teacher-max-tokens {max(1, (C - template) // 4)} (a quarter of what the template leaves) "
                "or less"
            )
    if limits.student_context is not None:
        C = limits.student_context
        template = student_prompt_tokens(limits, generator_template, EMPTY_PROBLEM, position)
        if template + T > longest_prompt(C, R):
            fit = (C - 1 - template - T) // 2
            fix = (
                f"use --rollout-max-response-len {fit} (half of what is left) or less"
                if fit >= 1 and template + T <= longest_prompt(C, fit)
                else "lower --teacher-max-tokens (the info goes into the student's prompt)"
            )
            raise UserInputError(
                f"--rollout-max-response-len {R}: the student's prompt ({template} tokens of template, up to {T} of "
                f"info from --teacher-max-tokens) plus {R} new tokens do not fit the {C}-token context of "
                f"{limits.student_source}; {fix}"
            )


def flags_fit(limits: ContextLimits, generator_template: Any, teacher_template: Any, position: str) -> bool:
    try:
        check_flags_fit(limits, generator_template, teacher_template, position)
    except UserInputError:
        return False
    return True


def row_need(
    limits: ContextLimits, generator_template: Any, teacher_template: Any, position: str, problem: Problem
) -> tuple[int, int, str] | None:
    """None if `problem` fits both roles' contexts; else (tokens needed, context, which role)."""
    T, R = limits.teacher_max_tokens, limits.student_max_tokens
    answer = min(R, MIN_ANSWER_TOKENS)
    if limits.student_context is not None:
        prompt = student_prompt_tokens(limits, generator_template, problem, position) + T
        if prompt > longest_prompt(limits.student_context, answer):
            return prompt + answer, limits.student_context, "student"
    if limits.teacher_context is not None:
        prompt = teacher_prompt_tokens(limits, teacher_template, [problem]) + T
        if prompt > longest_prompt(limits.teacher_context, T):
            return prompt + T, limits.teacher_context, "teacher"
    return None


def split_rows_by_fit(
    problems: Sequence[Problem],
    limits: ContextLimits,
    generator_template: Any,
    teacher_template: Any,
    position: str,
    path: str,
    report: Callable[[str], None] | None = None,
    max_lines: int = 10,
) -> list[Problem]:
    """The problems whose prompts fit; each other one is reported (file, row, length) and skipped.

    Exits (UserInputError) when no row fits. Flags that never fit are left to `check_flags_fit`.
    """
    if not flags_fit(limits, generator_template, teacher_template, position):
        return list(problems)
    report = report or (lambda line: print(line, file=sys.stderr, flush=True))
    contexts = [c for c in (limits.teacher_context, limits.student_context) if c is not None]
    if not contexts:
        return list(problems)
    smallest = min(contexts)
    T, answer = limits.teacher_max_tokens, min(limits.student_max_tokens, MIN_ANSWER_TOKENS)
    # A row's own tokens are at most its UTF-8 bytes: under this bound it fits without being counted.
    template = max(
        teacher_prompt_tokens(limits, teacher_template, [EMPTY_PROBLEM]) + 2 * T,
        student_prompt_tokens(limits, generator_template, EMPTY_PROBLEM, position) + T + answer,
    )
    bound = smallest - template - 2 * SPECIAL_TOKENS_SLACK - SGLANG_INPUT_MARGIN - 1
    kept, skipped = [], []
    for problem in problems:
        size = sum(len(s.encode("utf-8")) for s in (problem.prompt, problem.rubric, problem.ground_truth))
        need = None if size <= bound else row_need(limits, generator_template, teacher_template, position, problem)
        (kept if need is None else skipped).append((problem, need))
    for problem, (need, context, role) in skipped[:max_lines]:
        report(
            f"warning: {problem.source or path}: the {role}'s prompt of this problem needs {need} tokens "
            f"(with --teacher-max-tokens/--rollout-max-response-len), more than its {context}-token context "
            "serves; row skipped"
        )
    if skipped:
        report(f"warning: {path}: skipped {len(skipped)} of {len(problems)} rows too long for the model's context")
    if not kept:
        problem, (need, context, role) = min(skipped, key=lambda item: item[1][0])
        raise UserInputError(
            f"{path}: every row is too long for the model's context; the shortest ({problem.source or problem.uid}) "
            f"needs {need} tokens of the {role}'s {context}; lower --teacher-max-tokens / --rollout-max-response-len, "
            "shorten the problems, or use a model with a longer context"
        )
    return [problem for problem, _ in kept]
