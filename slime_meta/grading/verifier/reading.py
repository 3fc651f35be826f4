"""Where a solution states its final answer, read as a careful human grader reads it.

Statements of a final answer, found anywhere in the solution:
- `\\boxed{...}` / `\\fbox{...}` (braces balanced);
- `Answer:` / `Final answer:` at the start of a line, after the end of a sentence, or anywhere on
  the last non-empty line ("So the total is 8. Answer: 8"); the value is the rest of the line (the
  next non-empty line when the rest is empty), up to the end of its sentence or a clause such as
  ", because ...";
- GSM8K's `#### 72` (a line whose value has digits and no words, so markdown headings are not read);
- `the answer is 8` / `the final answer is 8` when a value follows (a number, LaTeX, a variable,
  yes/no), or anything in the solution's last sentence ("The answer is New York.").
A statement inside another one's value replaces it: a box on an answer line, "Answer: the answer
is 8"; unless the outer one states more (another number beside an inner box, "12 or \\boxed{60}"):
then it is kept whole and marked, and the verdict calls it several candidates. The text after the
last statement is kept: it may offer another answer ("or maybe 12").

Without any statement, the final result of the last sentence is read (`Ana has 3 + 5 = 8
marbles.` -> 8; see `final_value`), or for a text label the whole solution when it is one line
(the synthetic tasks' short answers), else its last line.

Every scan is linear in the solution's length: boundaries (sentence ends, clause cuts, line
ends) are found once and looked up by bisection; no statement rescans the text after it.
"""

from __future__ import annotations

import bisect
import re
from dataclasses import dataclass, field, replace

from slime_meta.grading.verifier.text import LATEX_COMMAND, NUMBER, WORD

_BOX = re.compile(r"\\(?:boxed|fbox)\s*\{")
_ANSWER_MARK = re.compile(r"(?:final[*_ \t]+)?answer[*_ \t]*[:：]", re.IGNORECASE)
_GSM8K = re.compile(r"^[ \t]*####[ \t]*(?P<value>[^\n]*)", re.MULTILINE)
_PHRASE = re.compile(
    r"\b(?:final[ \t]+|correct[ \t]+)?answer[ \t]+(?:is|would[ \t]+be|will[ \t]+be)\b[*_ \t]*:?[*_ \t$]*", re.IGNORECASE
)
_VALUE_START = re.compile(
    r"[\d\-−+.$\\({\[√π]"  # a number, a sign, a currency or a bracket
    r"|(?:yes|no|true|false)\b"
    r"|(?![aAI]\b)[A-Za-z](?![A-Za-z])",  # one letter alone (a variable), not the words a / A / I
    re.IGNORECASE,
)
# Where a stated value ends: the end of its sentence (not `3.5`, `i.e.`, `e.g.`), or a clause.
_SENTENCE_END = re.compile(r"(?<!\bi\.e)(?<!\be\.g)(?<!\betc)(?<!\bapprox)[.!?](?=\s)", re.IGNORECASE)
_CLAUSE = re.compile(
    r",[ \t]*(?=(?:because|since|as|which|so|given|thus|hence|therefore|where|when)\b)"
    r"|(?<![ \t])[ \t]+(?=(?:because|since|given[ \t]+that|which)\b)",  # from a run's start only: linear
    re.IGNORECASE,
)
_NON_SPACE = re.compile(r"\S")
_NOT_DECORATION = re.compile(r"[^\s*_`]")
_DECORATION = set(" \t>#*_-`")
SHORT_ANSWER_CHARS = 64
_ALTERNATIVE_WORD = re.compile(r"\b(?:or|maybe|perhaps|possibly|alternatively|either)\b", re.IGNORECASE)
_NO_VALUE = re.compile(r"[\s{}()\[\].,;:!?*_`'\"#>-]*")


@dataclass(frozen=True)
class Statement:
    """One stated final answer: where the statement and its value lie, and the value as written
    (filled in once nesting is resolved: the kept values do not overlap, so copying them is linear)."""

    kind: str  # "box", "answer line", "####", "answer is"
    start: int
    value_start: int
    value_end: int
    value: str = ""
    holds_more: bool = False  # it holds another statement and states more besides (see `_holds_more`)


@dataclass
class Reading:
    """What a solution states: its statements in order and the text after the last one.

    Without statements, `last_sentence` (the last sentence holding a digit, else the last one)
    and `last_line` (the whole solution when it is one line, else its last line) are what a
    grader falls back on; `before_last_sentence` is the text before that sentence; `short_line`
    is the whole solution when it is one line of at most `SHORT_ANSWER_CHARS` (read whole: an
    expression such as `x^2 + 2x + 1`, a synthetic task's word), else "".
    """

    statements: list[Statement] = field(default_factory=list)
    trailing: str = ""
    short_line: str = ""
    last_sentence: str = ""
    before_last_sentence: str = ""
    last_line: str = ""

    @property
    def values(self) -> list[str]:
        return [s.value for s in self.statements]


class _Boundaries:
    """Sorted positions where a value ends (newlines, sentence ends, clause cuts), found once."""

    def __init__(self, text: str):
        self.text = text
        self.newlines = [m.start() for m in re.finditer("\n", text)]
        ends = [m.start() for m in _SENTENCE_END.finditer(text)] + [m.start() for m in _CLAUSE.finditer(text)]
        self.value_ends = sorted(set(ends + self.newlines))

    def line_end(self, position: int) -> int:
        index = bisect.bisect_left(self.newlines, position)
        return self.newlines[index] if index < len(self.newlines) else len(self.text)

    def line_start(self, position: int) -> int:
        index = bisect.bisect_left(self.newlines, position)
        return self.newlines[index - 1] + 1 if index > 0 else 0

    def value_end(self, position: int) -> int:
        index = bisect.bisect_left(self.value_ends, position)
        return self.value_ends[index] if index < len(self.value_ends) else len(self.text)


def _boxes(text: str) -> list[Statement]:
    """Every box whose braces close, in one pass over the braces (unclosed boxes are skipped)."""
    openings = {m.end() - 1: m.start() for m in _BOX.finditer(text)}
    if not openings:
        return []
    found, stack = [], []
    for brace in re.finditer(r"[{}]", text):
        position = brace.start()
        if text[position] == "{":
            stack.append(position)
        elif stack:
            opened = stack.pop()
            if opened in openings:
                found.append(Statement("box", openings[opened], opened + 1, position))
    return found


def _last_line_start(text: str) -> int:
    stripped_end = len(text.rstrip())
    return text.rfind("\n", 0, stripped_end) + 1


def _answer_lines(text: str, bounds: _Boundaries) -> list[Statement]:
    found = []
    last_line_start = _last_line_start(text)
    for match in _ANSWER_MARK.finditer(text):
        # What precedes the marker: decoration only (line start), a sentence end, or the last line.
        position = match.start()
        while position > 0 and text[position - 1] in _DECORATION:
            position -= 1
        at_line_start = position == 0 or text[position - 1] == "\n"
        after_sentence = position > 0 and text[position - 1] in ".!?:"
        if not (at_line_start or after_sentence or match.start() >= last_line_start):
            continue
        value_start = match.end()
        line_end = bounds.line_end(value_start)
        if not _NOT_DECORATION.search(text, value_start, line_end):  # stops at the first character of a value
            next_text = _NON_SPACE.search(text, line_end)  # stops at the next non-empty line
            if next_text is None:
                continue
            value_start = next_text.start()
        found.append(Statement("answer line", match.start(), value_start, bounds.value_end(value_start)))
    return found


def _gsm8k_lines(text: str) -> list[Statement]:
    found = []
    for match in _GSM8K.finditer(text):
        value = match.group("value")
        if any(ch.isdigit() for ch in value) and not WORD.search(LATEX_COMMAND.sub(" ", value)):
            found.append(Statement("####", match.start(), match.start("value"), match.end("value")))
    return found


def _phrases(text: str, bounds: _Boundaries, last_sentence_start: int) -> list[Statement]:
    found = []
    for match in _PHRASE.finditer(text):
        value_start = match.end()
        if not _VALUE_START.match(text, value_start) and value_start < last_sentence_start:
            continue  # "whether the answer is larger than 10": reasoning, not a statement
        value_end = bounds.value_end(value_start)
        if _NOT_DECORATION.search(text, value_start, value_end):
            found.append(Statement("answer is", match.start(), value_start, value_end))
    return found


def _end(statement: Statement) -> int:
    return statement.value_end + (1 if statement.kind == "box" else 0)  # a box ends after its brace


def _holds_more(text: str, statements: list[Statement], starts: list[int], index: int) -> bool:
    """Whether statement `index`, which holds other statements, states more than they do: a box
    holding a box and another number (`\\boxed{\\boxed{60} 12}`), or an alternative beside the
    inner statement (`Answer: 12 or \\boxed{60}`). `5 \\times 12 = \\boxed{60}` states no more.
    Reads only the text outside its direct children, so over all statements each character once."""
    outer = statements[index]
    outside, position = [], outer.value_start
    inner = max(bisect.bisect_left(starts, outer.value_start), index + 1)
    while inner < len(statements) and starts[inner] < outer.value_end:
        outside.append(text[position : starts[inner]])
        position = max(position, min(_end(statements[inner]), outer.value_end))
        inner = max(bisect.bisect_left(starts, position), inner + 1)
    outside.append(text[position : outer.value_end])
    rest = " ".join(outside)
    if not any(ch.isdigit() for ch in rest):
        return False
    return outer.kind == "box" or bool(_ALTERNATIVE_WORD.search(rest))


def _innermost(text: str, statements: list[Statement]) -> list[Statement]:
    """Statements in order, each replaced by the statements inside its value ("Answer: \\boxed{8}"
    is the box), unless it states more than they do: then it is kept whole, marked `holds_more`."""
    statements = sorted(statements, key=lambda s: (s.start, -s.value_end))
    starts = [s.start for s in statements]
    kept: list[Statement] = []
    for index, statement in enumerate(statements):
        if kept and kept[-1].holds_more and statement.start < kept[-1].value_end:
            continue  # inside a statement kept whole
        inner = bisect.bisect_left(starts, statement.value_start)
        inner = max(inner, index + 1)
        if inner < len(starts) and starts[inner] < statement.value_end:
            if not _holds_more(text, statements, starts, index):
                continue
            statement = replace(statement, holds_more=True)
        if kept and (kept[-1].start, kept[-1].value_start) == (statement.start, statement.value_start):
            continue
        kept.append(statement)
    return kept


def _sentences(text: str, bounds: _Boundaries) -> list[tuple[int, int]]:
    """(start, end) of each non-empty sentence or line, in order."""
    cuts = sorted(set(bounds.newlines + [m.start() + 1 for m in _SENTENCE_END.finditer(text)]))
    spans, start = [], 0
    for cut in cuts + [len(text)]:
        if text[start:cut].strip():
            spans.append((start, cut))
        start = cut
    return spans


def read(solution: str) -> Reading:
    """The statements of a solution and what a grader falls back on without them (module doc)."""
    text = solution or ""
    bounds = _Boundaries(text)
    sentences = _sentences(text, bounds)
    last_sentence_start = sentences[-1][0] if sentences else len(text)
    statements = _boxes(text) + _answer_lines(text, bounds) + _gsm8k_lines(text)
    statements = _innermost(text, statements + _phrases(text, bounds, last_sentence_start))
    statements = [replace(s, value=text[s.value_start : s.value_end]) for s in statements]
    # A value of punctuation alone ("Answer: {" in a rambling completion) states nothing.
    reading = Reading(statements=[s for s in statements if not _NO_VALUE.fullmatch(s.value)])
    if reading.statements:
        last = reading.statements[-1]
        end = last.value_end + (1 if last.kind == "box" else 0)
        reading.trailing = text[end:]
        return reading
    chosen = next((span for span in reversed(sentences) if any(ch.isdigit() for ch in text[span[0] : span[1]])), None)
    if chosen is None and sentences:
        chosen = sentences[-1]
    if chosen is not None:
        reading.last_sentence = text[chosen[0] : chosen[1]].strip()
        reading.before_last_sentence = text[: chosen[0]]
        reading.trailing = text[chosen[1] :]
    stripped = text.strip()
    reading.last_line = stripped[stripped.rfind("\n") + 1 :].strip() if stripped else ""
    if "\n" not in stripped and len(stripped) <= SHORT_ANSWER_CHARS:
        reading.short_line = stripped
    return reading


def final_value(sentence: str) -> str:
    """The final result a sentence states, when no explicit statement exists.

    The value after its last `=` (`3 + 5 = 8 marbles` -> `8 marbles`), else its last `$...$`
    math, else the text from its only number on (`she has 8 marbles in total` -> `8 marbles in
    total`: the words are dropped when compared). Empty when it states no value, or several
    numbers and no `=` to say which one is the result ("She had 3, then 5.").
    """
    if "=" in sentence:
        return sentence[sentence.rindex("=") + 1 :].strip().rstrip(".").strip()
    closing = max(sentence.rfind("$"), sentence.rfind("\\)"))
    opening = max(sentence.rfind("$", 0, closing), sentence.rfind("\\(", 0, closing)) if closing > 0 else -1
    if opening >= 0:
        math = sentence[opening + (1 if sentence[opening] == "$" else 2) : closing].strip()
        if math and not WORD.search(LATEX_COMMAND.sub(" ", math)):  # "$5 and $7" are dollars, not math
            return math
    found = list(NUMBER.finditer(sentence))
    if not found or len({m.group(0) for m in found}) > 1:
        return ""  # no number, or several and no `=` to say which is the result
    start = found[-1].start()
    if start > 0 and sentence[start - 1] in "-−":
        start -= 1
    return sentence[start:].strip().rstrip(".").strip()
