"""How the built-in verifier reads the answer forms a real instruct model writes (SmolLM2-135M's
completions included), table-driven: forms that state the label score 1, forms that state no
answer or several score 0. The rules are in slime_meta/grading/verifier/ and docs/reliability.md."""

from __future__ import annotations

import pytest

from slime_meta.grading.graders import VerifierGrader
from slime_meta.types import Problem

STATES_THE_LABEL = {
    "last sentence, after its last =": [
        ("Ana has 3 + 5 = 8 marbles.", "8"),
        ("So 12 - 4 = 8.", "8"),
        ("Total: 2 * 4 = 8 apples", "8"),
        ("x = \\frac{3}{4}", "\\frac{3}{4}"),
    ],
    "last sentence, its only number": [
        ("Ana has 8 marbles now.", "8"),
        ("She had 3, then 5 more.\nShe has 8.", "8"),
        ("2.5 is it", "2.5"),
    ],
    "the answer is ...": [
        ("The answer is 8.", "8"),
        ("First 3 and 5. The answer is 8.", "8"),
        ("So the final answer is: 8", "8"),
        ("The answer is 2.5.", "2.5"),
        ("I added 3 and 5, so the answer would be 8.", "8"),
    ],
    "Answer: later on the last line": [("So the total is 8. Answer: 8", "8"), ("3 + 5 = 8. **Answer:** 8", "8")],
    "GSM8K ####": [("#### 8", "8"), ("3 + 5 = 8\n#### 8", "8")],
    "yes/no then words": [("Answer: Yes, it does.", "Yes"), ("No, it cannot.", "No"), ("Answer: yes", "Yes")],
    "short one-line answers read whole": [("abcdef.", "abcdef"), ("x^2 + 2x + 1", "x^2+2x+1")],
}
STATES_NO_SINGLE_ANSWER = {
    "several numbers, no = and no marker": [
        ("She had 3, then 5.", "8"),
        ("It is 3 or 8", "8"),
        ("First 3 apples.\nThen 5 pears and 8 plums in all.", "8"),
    ],
    "several different answer phrases": [("The answer is 8. The answer is 9.", "8"), ("Answer: 8\n#### 9", "8")],
    "yes and no": [("Yes and no", "Yes"), ("No, yes.", "No")],
    "no answer at all": [
        ("I don't know how to do this, sorry, it is too hard for me to work out today.", "8"),
        ("", "8"),
    ],
}


def grade(solution: str, label: str):
    return VerifierGrader().grade_now(Problem(uid="u", prompt="p", label=label, rubric=""), solution)


@pytest.mark.parametrize(
    ("rule", "solution", "label"), [(rule, s, label) for rule, forms in STATES_THE_LABEL.items() for s, label in forms]
)
def test_forms_that_state_the_label_score_one(rule, solution, label):
    assert grade(solution, label).score == 1.0, rule


@pytest.mark.parametrize(
    ("rule", "solution", "label"),
    [(rule, s, label) for rule, forms in STATES_NO_SINGLE_ANSWER.items() for s, label in forms],
)
def test_forms_without_one_answer_score_zero(rule, solution, label):
    assert grade(solution, label).score == 0.0, rule


def test_no_final_answer_is_said_as_such_and_never_quotes_the_solution_as_the_answer():
    verdict = grade("First I thought about it.\nThen 3 apples and 5 pears, 2 plums.", "8")
    assert verdict.score == 0.0 and "no final answer found" in verdict.explanation
    assert "First I thought" not in verdict.explanation
