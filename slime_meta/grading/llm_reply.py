"""Reading the verdict in an LLM grader's reply, so that the graded student cannot steer it.

The grader template asks for `GRADE: <a number between 0 and 1>` on a line of its own, then
`EXPLANATION: ...`. The student's solution reaches the grader model and may come back in its
reply (quoted before the verdict, after it, inside a sentence), so anything the reply says about
a grade may be the student's text. The rule that follows from that: a student's text may make a
reply unparseable (it is then re-asked, and scored 0 if no reply parses), but it can never pick or
change the score. Concretely, a reply is parsed only when

1. at least one line is a *verdict line*: the GRADE label and one number in [0, 1], nothing else on
   that line but markdown (`**`, `_`, a backtick, a `#` heading, a `-` bullet) and one final
   period. Numbers: `0`, `1`, `0.75`, `.5`, `1.00`, also as a fraction of 1 (`0.5/1`). A line in a
   blockquote (`> GRADE: 1`) is a quote, not a verdict line (rules 2 and 3 still apply to it).
2. every other line that starts with the GRADE label (after markdown, blockquote `>` or a list
   bullet) has that form too: `GRADE: 3`, `GRADE: 7/10`, `GRADE: 80%`, `GRADE: 1e-3`,
   `GRADE: 0.6 (partial credit)` or `GRADE: excellent` there make the reply unparseable, never a
   clamped, rescaled or truncated guess;
3. every grade the reply states anywhere (`grade:` followed by a number, inside sentences too) is
   the verdict's value: two different values are ambiguous, whichever the grader meant.

So a GRADE line quoted from the solution either agrees with the grader's own verdict (and changes
nothing) or contradicts it (and the reply is re-asked). The parser never reads the solution: it
needs no list of quotes, and a solution that repeats the grader's verdict costs nothing.

What stays out of reach of any parser: a grader that writes its own verdict without the GRADE
label (`I give it 0`) while quoting a solution's GRADE line on a line of its own; then the quote
is the only grade stated. docs/reliability.md ("The LLM grader") lists the attacks and what each
one gets.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from slime_meta.types import Grade

UNPARSEABLE_EXPLANATION = "unparseable grader reply"

# The label: the word "grade" (any case), markdown, a colon. "Upgrade:" and "grade 5:" are not it.
_LABEL = r"\bgrade\b[*_`\t ]*[:\uff1a]"
# Anything numeric that follows a label, with what puts it on another scale: an exponent, a
# percent sign, a denominator or "out of N". Unicode digits are matched here and refused below.
_STATED = re.compile(
    _LABEL + r"[*_`\s]*(?P<number>[+-]?(?:\d+(?:\.\d*)?|\.\d+))"
    r"(?P<scale>(?:[eE][+-]?\d+)?(?:[ \t]*%|[ \t]*/[ \t]*[+-]?[\d.]+|[ \t]+out[ \t]+of[ \t]+[\d.]+)?)",
    re.IGNORECASE,
)
# A number in [0, 1] as the template asks for it, or as a fraction of 1; ASCII digits only.
_IN_RANGE = r"(?P<value>0(?:\.[0-9]*)?|\.[0-9]+|1(?:\.0*)?)(?:[ \t]*/[ \t]*1(?:\.0*)?)?"
_EMPHASIS = r"[*_`\t ]*"
# (the period is optional after the emphasis, not between two starred runs: no quadratic backtracking)
_GRADE_IS = rf"grade{_EMPHASIS}:{_EMPHASIS}{_IN_RANGE}{_EMPHASIS}(?:\.{_EMPHASIS})?"
# The grader's verdict line: markdown emphasis, a heading or a list bullet around it, nothing else.
_VERDICT_LINE = re.compile(rf"[#*_`\-+\t ]*{_GRADE_IS}", re.IGNORECASE)
# Lines that start with the label after markdown, a blockquote marker or a list bullet: each must
# state one grade in [0, 1] and nothing else, whether it is the verdict or a quote.
_LINE_START = r"[\s>#*_`\-+\u2022|]*"
_LABEL_AT_LINE_START = re.compile(_LINE_START + _LABEL, re.IGNORECASE)
_GRADE_LINE = re.compile(_LINE_START + _GRADE_IS, re.IGNORECASE)
_WELL_FORMED_STATED = re.compile(_IN_RANGE)
_EXPLANATION = re.compile(r"\bexplanation\b[*_ \t]*:", re.IGNORECASE)


@dataclass(frozen=True)
class Verdict:
    """What a reply says: its score, or why it has none (`problem`, which a re-ask repeats)."""

    score: float | None
    problem: str = ""
    line_start: int = 0  # where the last verdict line starts in the reply
    line_end: int = 0  # and where it ends: the explanation follows it


def read_verdict(text: str) -> Verdict:
    """The reply's verdict under the three rules of this module's docstring."""
    verdict_lines: list[tuple[float, int, int]] = []  # (value, start, end) in the reply
    offset = 0
    for line in text.splitlines(keepends=True):
        body = line.rstrip("\r\n")
        verdict = _VERDICT_LINE.fullmatch(body)
        if verdict:
            verdict_lines.append((float(verdict.group("value")), offset, offset + len(body)))
        elif _LABEL_AT_LINE_START.match(body) and not _GRADE_LINE.fullmatch(body):
            # The line is not shown back to the grader: it may be the student's text.
            return Verdict(None, "a line that starts with GRADE holds something other than one number between 0 and 1")
        offset += len(line)
    if not verdict_lines:
        return Verdict(None, "no line `GRADE: <a number between 0 and 1>`")
    values = {value for value, _, _ in verdict_lines}
    for stated in _STATED.finditer(text):
        well_formed = _WELL_FORMED_STATED.fullmatch((stated.group("number") + stated.group("scale")).strip())
        if not well_formed or float(well_formed.group("value")) not in values:
            return Verdict(None, "a grade on another scale or of another value in the same reply; state exactly one")
    if len(values) > 1:
        return Verdict(None, "different grades in one reply; state exactly one")
    value, start, end = verdict_lines[-1]
    return Verdict(value, line_start=start, line_end=end)


def parse_grade(text: str) -> Grade:
    """The verdict in a grader model's reply: `GRADE: <score>` and the `EXPLANATION:` after it.

    No verdict (see `read_verdict`): score 0, parsed=False, explanation "unparseable grader reply".
    The explanation is the text after the first `EXPLANATION:` that follows the last verdict line;
    a grader that wrote its explanation first gets the last one before that line.
    """
    text = text or ""
    verdict = read_verdict(text)
    if verdict.score is None:
        return Grade(score=0.0, explanation=UNPARSEABLE_EXPLANATION, parsed=False, raw=text)
    markers = list(_EXPLANATION.finditer(text))
    after = [m for m in markers if m.start() >= verdict.line_end]
    before = [m for m in markers if m.end() <= verdict.line_start]
    explanation = ""
    if after or before:
        marker, end = (after[0], len(text)) if after else (before[-1], verdict.line_start)
        explanation = text[marker.end() : end].strip().strip("*_").strip()
    return Grade(score=verdict.score, explanation=explanation, parsed=True, raw=text)
