"""The teachers' vote of trace replay: whether a replayed sample becomes a DPO pair.

The rule is described in the docstring of `slime_meta.replay.pairs`; `_decide` applies it to the answers
given, `_is_final` tells whether the teachers that did not answer could still change the outcome.

Where the row has a label, the label decides and votes do not (`_decide_by_label`): a policy
answer that is correct by the label is never rejected (no pair, `policy_correct`), and the chosen
side is a teacher solution that is correct by the label, however many teachers agreed on another
answer (no correct teacher: no pair, `no_correct_teacher`). Correct means what the built-in
verifier says (`60.0` == `60` == `\\frac{120}{2}`; several different final answers are wrong),
so a pair never teaches the policy to prefer a hedge or a wrong majority over the right answer.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from itertools import product
from typing import Sequence

from slime_meta.grading.graders import VerifierGrader
from slime_meta.types import Problem

_MAX_MISSING_FOR_FINALITY = 4  # beyond this many failed teachers, an open decision stays open


@dataclass(frozen=True)
class _Decision:
    outcome: str  # "pair" | "no_agreement" | "agree_with_policy"
    answer: str | None  # the agreed answer (pair, agree_with_policy)
    members: tuple[int, ...] = ()  # teacher indices of the agreeing group
    tie: bool = False


def _decide(answers: Sequence[str | None], policy_answer: str, min_agree: int) -> _Decision:
    """The vote over normalised answers (None: the teacher abstained)."""
    counts = Counter(answer for answer in answers if answer is not None)
    if not counts:
        return _Decision("no_agreement", None)
    largest = max(counts.values())
    if largest < min_agree:
        return _Decision("no_agreement", None)
    leaders = [answer for answer, count in counts.items() if count == largest]
    if len(leaders) > 1:
        return _Decision("no_agreement", None, tie=True)
    answer = leaders[0]
    members = tuple(index for index, given in enumerate(answers) if given == answer)
    return _Decision("agree_with_policy" if answer == policy_answer else "pair", answer, members)


def _is_final(answers: Sequence[str | None], missing: Sequence[int], policy_answer: str, min_agree: int) -> bool:
    """Whether the missing teachers' answers, whatever they are, leave (outcome, answer) unchanged."""
    if not missing:
        return True
    if len(missing) > _MAX_MISSING_FOR_FINALITY:
        return False
    current = _decide(answers, policy_answer, min_agree)
    fresh = [object() for _ in missing]  # answers nobody gave yet (distinct, or shared by several)
    options = list({a for a in answers if a is not None} | {policy_answer}) + fresh + [None]
    trial = list(answers)
    for assignment in product(options, repeat=len(missing)):
        for index, option in zip(missing, assignment):
            trial[index] = option
        outcome = _decide(trial, policy_answer, min_agree)
        if (outcome.outcome, outcome.answer) != (current.outcome, current.answer):
            return False
    return True


def correct_by_label(solution: str, label: str) -> bool:
    """Whether the built-in verifier gives `solution` full marks against `label`."""
    problem = Problem(uid="replay", prompt="", label=label)
    return VerifierGrader("normalized").grade_now(problem, solution).score == 1.0


def _decide_by_label(correct: Sequence[bool | None], policy_correct: bool) -> _Decision:
    """The label's decision (None: the teacher did not answer); `answer` is unused here."""
    if policy_correct:
        return _Decision("policy_correct", None)
    members = tuple(index for index, is_correct in enumerate(correct) if is_correct)
    if not members:
        return _Decision("no_correct_teacher", None)
    return _Decision("pair", None, members)


def _is_final_by_label(correct: Sequence[bool | None], missing: Sequence[int], policy_correct: bool) -> bool:
    """Final unless no answering teacher is correct yet and a missing one could be."""
    return policy_correct or any(correct) or not missing
