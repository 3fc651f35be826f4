"""The verdict: one final answer, compared with the label's forms; every other shape scores 0.

Rules (docs/reliability.md, "The built-in verifier", says why and which attack each one stops):
- several different final answers score 0; more than `MAX_DISTINCT_ANSWERS` differently written
  ones score 0 without comparing them (one answer needs no such list);
- one answer offering several numbers ("12 or 60", "12, 60", "12 60") scores 0;
- a chain whose values differ (`12 = 30 = 60`, `x = 12 = 60`, `60 \\approx 61`) scores 0; a leading name
  (`x = 60`, `T(n) = ...`) and equal values (`3 + 5 = 8`, `60 = 60.0`) are one answer;
- text after the answer that offers another one ("or maybe 12", "or maybe twelve", a line that is
  just another number, "No wait, no", a retraction ending on another value: "Actually no, it is
  12.") scores 0; numbers written in words count as numbers when looking for a second candidate;
- a statement holding another one and more ("\\boxed{\\boxed{60} 12}", "Answer: 12 or \\boxed{60}")
  offers several candidates and scores 0;
- yes/no labels: the answer's first word decides and the opposite word must not appear;
- numbers are compared exactly (fractions, thousands separators, `$`, units dropped), other math
  by math-verify in a bounded child process, anything else as normalised text.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from slime_meta.grading.verifier import labels
from slime_meta.grading.verifier import reading as reading_rules
from slime_meta.grading.verifier import text as text_rules
from slime_meta.grading.verifier.labels import YES_NO, LabelForm, can_evaluate
from slime_meta.grading.verifier.text import (
    exact_value,
    normalize_answer,
    numbers,
    plain,
    spelled_as_digits,
    without_words,
    words,
)

MAX_DISTINCT_ANSWERS = 8
MAX_CHAIN_PARTS = 6
MAX_QUOTED_CHARS = 200

MATCH, WRONG, HEDGE, CHAIN = "match", "wrong", "hedge", "chain"
_ALTERNATIVE = re.compile(
    r"\b(?:maybe|perhaps|possibly|alternatively|otherwise|either|or(?=\s+(?:maybe\s+|perhaps\s+)?[$\\(]*[-+−]?\d))\b",
    re.IGNORECASE,
)
# A piece that is only a number, with markup around it. The dots that end the number belong to the
# number's own class, so the closing markup starts with a character the number cannot hold: the
# same texts as `[\d,./]*[\s$\\)*_.]*`, without the two dot-holding runs that backtracked over each
# other (quadratic on a long run of dots).
_BARE_VALUE = re.compile(r"[\s$\\(*_]*[-+−]?\d[\d,./]*(?:[\s$\\)*_][\s$\\)*_.]*)?")
_TRAILING_PIECES = re.compile(r"(?<=[.!?])\s+|\n")
_RETRACTION = re.compile(
    r"\b(?:actually|wait|hmm|oops|sorry|scratch|correction|instead|rather|wrong|mistake|incorrect|recalculat\w*"
    r"|re-?check\w*|on second thought|hold on|no,)",
    re.IGNORECASE,
)
# Relations that join two values as `=` does: `60 \approx 61` offers two candidates.
_RELATION = re.compile(r"\\(?:approx|simeq|sim|cong|equiv|doteq)(?![A-Za-z])|[≈≃≅≡∼]")


@dataclass(frozen=True)
class Verdict:
    score: float
    explanation: str
    answer: str  # the final answer as read ("" when none)


def quote(text: str) -> str:
    text = " ".join(text.split())
    return text if len(text) <= MAX_QUOTED_CHARS else text[: MAX_QUOTED_CHARS - 1] + "…"


class Judge:
    """Compares answers for one grading call; `math` is a `MathSession` (bounded math-verify)."""

    def __init__(self, math):
        self.math = math

    # ------------------------------------------------------------------ values

    def same_value(self, first: str, second: str) -> bool:
        """Two values are the same answer: equal text, equal exact numbers, or equal to math-verify."""
        if normalize_answer(first) == normalize_answer(second):
            return True
        a, b = exact_value(first), exact_value(second)
        if a is not None and b is not None:
            return a == b
        a_text, b_text = plain(first), plain(second)
        if not (labels.looks_like_math(a_text) and labels.looks_like_math(b_text)):
            return False
        return can_evaluate(a_text) and can_evaluate(b_text) and self.math.equal(a_text, b_text)

    def chain_value(self, answer: str, form: LabelForm) -> tuple[str, bool]:
        """(the value a `=` chain ends with, whether all its values agree)."""
        if "=" in form.text or _RELATION.search(form.text):
            return answer, True  # an equation label (`x = 2`) is compared whole
        parts = [part.strip() for part in _RELATION.sub("=", plain(answer)).split("=")]
        if len(parts) == 1:
            return answer, True
        if len(parts) > MAX_CHAIN_PARTS:
            return answer, False
        while len(parts) > 1 and not any(ch.isdigit() for ch in parts[0]):
            parts = parts[1:]  # a name: `x =`, `T(n) =`, `the total =`
        values = [without_words(part) or part for part in parts]
        if any(not value for value in values):
            return answer, False
        return values[-1], all(self.same_value(value, values[-1]) for value in values[:-1])

    def equals_form(self, value: str, form: LabelForm) -> bool:
        text = plain(value)
        candidates = [text, without_words(text)]
        if "%" not in form.text:
            candidates += [c.replace("\\%", "").replace("%", "").strip() for c in candidates if "%" in c]
        candidates = [c for c in dict.fromkeys(candidates) if c]
        if form.kind == "number":
            for candidate in candidates:
                exact = exact_value(candidate)
                if exact is not None:
                    return exact == form.value
        gold = plain(form.text)
        return any(
            labels.looks_like_math(c) and can_evaluate(c) and can_evaluate(gold) and self.math.equal(gold, c)
            for c in candidates
        )

    def outcome(self, answer: str, form: LabelForm) -> str:
        """MATCH, WRONG, HEDGE (several candidates in one answer) or CHAIN (a chain of unequal values)."""
        if normalize_answer(answer) == normalize_answer(form.text):
            return MATCH
        if form.kind == "yes/no":
            said = [YES_NO[w] for w in words(plain(answer)) if w in YES_NO]
            if not said or said[0] != form.polarity:
                return WRONG
            return MATCH if all(polarity == form.polarity for polarity in said) else HEDGE
        if form.kind == "text":
            return WRONG
        if text_rules.offers_several_numbers(answer, form.text):
            return HEDGE
        value, agrees = self.chain_value(answer, form)
        if not agrees:
            return CHAIN
        return MATCH if self.equals_form(value, form) else WRONG

    def outcome_for_label(self, answer: str, forms: list[LabelForm]) -> str:
        found = [self.outcome(answer, form) for form in forms]
        for kind in (MATCH, HEDGE, CHAIN):
            if kind in found:
                return kind
        return WRONG

    # ------------------------------------------------------------------ the solution

    def another_answer_after(self, trailing: str, answer: str, forms: list[LabelForm]) -> str | None:
        """A piece of the text after the answer that offers another answer, or None."""
        if not trailing.strip():
            return None
        stated = set(numbers(plain(answer)))
        exact = exact_value(without_words(plain(answer)))
        if exact is not None:
            stated.add(exact)
        polarity = next((YES_NO[w] for w in words(plain(answer)) if w in YES_NO), None)
        for piece in _TRAILING_PIECES.split(trailing):
            if not piece.strip():
                continue
            in_digits = spelled_as_digits(piece)
            others = [n for n in numbers(in_digits) if n not in stated]
            if others and (_ALTERNATIVE.search(in_digits) or _BARE_VALUE.fullmatch(in_digits)):
                return piece
            if others and _RETRACTION.search(piece):
                # "Actually no, it is 12.": a retraction whose own result differs; a check that
                # ends on the stated value ("Wait, let me check: 5 * 12 = 60") offers nothing else.
                result = numbers(reading_rules.final_value(in_digits))
                if result and any(n not in stated for n in result):
                    return piece
            if polarity is not None and any(f.kind == "yes/no" for f in forms):
                said = [YES_NO[w] for w in words(piece) if w in YES_NO]
                if said and said[0] != polarity and (words(piece)[0] in YES_NO or _ALTERNATIVE.search(piece)):
                    return piece
        return None

    def fallback_is_hedge(self, sentence: str, before: str, value: str) -> bool:
        """The last sentence, read without a statement, offers its result as one of several
        ("It is 12 = 12, or maybe 60 = 60", "It is 12. Or maybe 60.")."""
        if not _ALTERNATIVE.search(sentence):
            return False
        in_value = set(numbers(plain(value)))
        elsewhere = numbers(sentence)
        if _ALTERNATIVE.match(sentence.lstrip(" *_-")):
            elsewhere += numbers(before)
        return any(n not in in_value for n in elsewhere)


def _wants_math(forms: list[LabelForm]) -> bool:
    return any(form.kind in ("number", "math") for form in forms)


def _stated_values(read: reading_rules.Reading, forms: list[LabelForm], judge_: Judge) -> tuple[list[str], bool]:
    """The final answers as written, in order, and whether the last sentence offers candidates
    (read without statements: see `reading.final_value`)."""
    if read.statements:
        values = [text_rules.clean(text_rules.clean(value).rstrip(".")) for value in read.values]
        return [value for value in values if value], False
    hedge = False
    if _wants_math(forms):
        value = reading_rules.final_value(read.last_sentence)
        if value:
            hedge = judge_.fallback_is_hedge(read.last_sentence, read.before_last_sentence, value)
        else:
            value = read.short_line  # `x^2 + 2x + 1`; a hedge such as "3 or 8" is refused by the comparison
    else:
        value = read.last_line
    value = text_rules.clean(value).rstrip(".").strip()
    return ([value] if value else []), hedge


def _several_answers(judge_: Judge, distinct: list[str], answer: str) -> Verdict | None:
    """A verdict when the distinct written answers are not one answer; comparing stops at the
    second different one (more cannot change the verdict)."""
    if not any(not judge_.same_value(value, distinct[0]) for value in distinct[1:]):
        return None
    listed = "; ".join(f'"{quote(v)}"' for v in distinct[:4])
    explanation = f"Incorrect: the solution states {len(distinct)} different final answers ({listed}); "
    explanation += "state exactly one."
    return Verdict(0.0, explanation, answer)


def judge(solution: str, label: str, metric: str, math) -> Verdict:
    """The verdict on `solution` against `label` (see the module doc); `math` bounds math-verify."""
    judge_ = Judge(math)
    forms = [labels.classify(form, math.is_math) for form in labels.split_label(label)]
    read = reading_rules.read(solution)
    from_fallback = not read.statements
    values, fallback_hedge = _stated_values(read, forms, judge_)
    if not values:
        return Verdict(0.0, 'Incorrect: no final answer found; end with a line "Answer: <answer>".', "")
    answer = values[-1]
    holding = next((s for s in read.statements if s.holds_more), None)
    if holding is not None:
        explanation = (
            f'Incorrect: the final answer "{quote(holding.value)}" offers several candidate answers '
            "(a statement holding another one and more); state exactly one."
        )
        return Verdict(0.0, explanation, holding.value)
    first_by_text: dict[str, str] = {}
    for value in values:
        first_by_text.setdefault(normalize_answer(value), value)
        if len(first_by_text) > MAX_DISTINCT_ANSWERS:  # more forms than one answer needs: not compared
            explanation = (
                f"Incorrect: the solution states more than {MAX_DISTINCT_ANSWERS} different final answers; "
                "state exactly one."
            )
            return Verdict(0.0, explanation, answer)
    distinct = list(first_by_text.values())
    offered = judge_.another_answer_after(read.trailing, answer, forms)
    if metric in ("exact", "char"):
        if len(distinct) > 1 and (verdict := _several_answers(judge_, distinct, answer)) is not None:
            return verdict
        if offered is not None or fallback_hedge:
            return _offers_another(answer, offered)
        return _by_characters(metric, answer, label.strip(), from_fallback)
    outcomes = {text: judge_.outcome_for_label(value, forms) for text, value in first_by_text.items()}
    if all(outcome == MATCH for outcome in outcomes.values()) and offered is None and not fallback_hedge:
        return Verdict(1.0, f'Correct: the final answer "{quote(answer)}" matches the reference.', answer)
    if len(distinct) > 1 and (verdict := _several_answers(judge_, distinct, answer)) is not None:
        return verdict
    if offered is not None or fallback_hedge:
        return _offers_another(answer, offered)
    detail = {
        HEDGE: " (it offers several candidate answers; state exactly one)",
        CHAIN: ' (its chain of "=" gives different values; state one value)',
    }.get(outcomes[normalize_answer(answer)], "")
    return _wrong(answer, detail, from_fallback)


def _wrong(answer: str, detail: str, from_fallback: bool) -> Verdict:
    if from_fallback:
        explanation = (
            'Incorrect: no final answer found; end with a line "Answer: <answer>" '
            f'(read from the last sentence instead: "{quote(answer)}" does not match the reference{detail}).'
        )
    else:
        explanation = f'Incorrect: the final answer "{quote(answer)}" does not match the reference{detail}.'
    return Verdict(0.0, explanation, answer)


def _offers_another(answer: str, offered: str | None) -> Verdict:
    where = f' ("{quote(offered)}")' if offered else ""
    explanation = (
        f'Incorrect: besides the final answer "{quote(answer)}" the solution offers another one{where}; '
        "state exactly one."
    )
    return Verdict(0.0, explanation, answer)


def _by_characters(metric: str, answer: str, expected: str, from_fallback: bool) -> Verdict:
    """The `exact` and `char` metrics: equal text, or equal characters position by position."""
    detail = ""
    if metric == "exact":
        score = float(answer == expected)
    else:
        want, got = normalize_answer(expected), normalize_answer(answer)
        longest = max(len(want), len(got))
        same = sum(a == b for a, b in zip(want, got))
        score = 1.0 if longest == 0 else same / longest
        detail = f" ({same} of {longest} characters match)" if 0 < score < 1 else ""
    if score == 1.0:
        return Verdict(1.0, f'Correct: the final answer "{quote(answer)}" matches the reference.', answer)
    verdict = _wrong(answer, detail, from_fallback)
    return Verdict(score, verdict.explanation, answer)
