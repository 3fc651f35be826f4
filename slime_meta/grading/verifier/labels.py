"""What a label asks for: its forms (one answer may be written two ways) and how each is compared.

A label such as `C(10, 5), or equivalently 252` or `5/14, or approximately 35.7%` names one
answer in two forms, and `100 (i.e., all values)` adds a note: an answer matching any form is
right (these labels are not hedges; the forms come from the label, never from the student). A
number followed only by words (`98 values`, `0 is the only possible value`) is that number.

Each form is one of: yes/no (`Yes`, `No`, `True`, `False`), a number (exact value known), math
(math-verify reads it: LaTeX, `n(n-3)/2`, `sqrt(3)/3`), or text (compared after normalisation).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from fractions import Fraction

from slime_meta.grading.verifier.text import MATH_WORDS, exact_value, normalize_answer, plain, words

YES_NO = {"yes": True, "no": False, "true": True, "false": False}
MAX_MATH_CHARS = 200
_SAME_ANSWER_SEPARATOR = re.compile(
    r",?\s+or\s+(?:equivalently|approximately|an\s+equivalent\s+form\s+such\s+as|in\s+other\s+words)\s+", re.IGNORECASE
)
_NOTE_OPENING = re.compile(r"^(?:i\.\s?e\.|that\s+is|namely)[,:]?\s*", re.IGNORECASE)
_LEADING_NUMBER = re.compile(r"\s*(?P<number>[-+]?\d[\d,]*(?:\.\d+)?)\s+(?P<words>[A-Za-z][A-Za-z\s'-]*)")
# Too costly for sympy however short: towers of powers, huge exponents or factorials.
_NESTED_POWER = re.compile(r"\^\s*\{[^{}]*\^|\^\s*\(?[^\s{}()]*\^")
_HUGE_OPERAND = re.compile(r"\^\s*[{(]?\s*[-+]?\d{4,}|\d{4,}\s*!|\*\*")


@dataclass(frozen=True)
class LabelForm:
    """One form of the label: `kind` is "yes/no", "number", "math" or "text"."""

    text: str
    kind: str
    value: Fraction | None = None
    polarity: bool | None = None


def can_evaluate(text: str) -> bool:
    """Whether math-verify may be asked about this text (short, no towers or huge operands)."""
    return 0 < len(text) <= MAX_MATH_CHARS and not _NESTED_POWER.search(text) and not _HUGE_OPERAND.search(text)


def _trailing_note(text: str) -> tuple[str, str] | None:
    """`100 (i.e., all values)` -> ("100", "all values"): a parenthesised note in words at the end."""
    if not text.endswith(")"):
        return None
    depth = 0
    for position in range(len(text) - 1, -1, -1):
        depth += {")": 1, "(": -1}.get(text[position], 0)
        if depth == 0:
            break
    main, note = text[:position].strip(), text[position + 1 : -1].strip()
    if not main or position == 0 or not text[position - 1].isspace() or "=" in note:
        return None
    if not [w for w in words(note) if w not in MATH_WORDS]:
        return None
    return main.rstrip(",").strip(), _NOTE_OPENING.sub("", note)


def split_label(label: str) -> list[str]:
    """The forms a label names, the whole label first (an answer may repeat it verbatim)."""
    label = label.strip()
    forms = [label]
    for part in _SAME_ANSWER_SEPARATOR.split(label):
        note = _trailing_note(part.strip())
        forms += list(note) if note else [part.strip()]
    for form in list(forms):
        leading = _LEADING_NUMBER.fullmatch(form)
        if leading:
            forms.append(leading.group("number"))
    return list(dict.fromkeys(form for form in forms if form))


def looks_like_math(text: str) -> bool:
    """Digits or LaTeX, and no words but function names: worth asking math-verify."""
    text = plain(text)
    if not re.search(r"\d|\\[A-Za-z]|π|√", text):
        return False
    return all(word in MATH_WORDS for word in words(text))


def classify(form: str, is_math) -> LabelForm:
    """The form's kind; `is_math(text) -> bool` asks math-verify (in the bounded child process)."""
    normalized = normalize_answer(form)
    if normalized in YES_NO:
        return LabelForm(form, "yes/no", polarity=YES_NO[normalized])
    value = exact_value(form)
    if value is not None:
        return LabelForm(form, "number", value=value)
    text = plain(form)
    if looks_like_math(text) and can_evaluate(text) and is_math(text):
        return LabelForm(form, "math")
    return LabelForm(form, "text")
