"""Answer text as the verifier compares it: normalisation, exact numbers, words, hedges.

Everything here is linear in the text's length (regexes without nested quantifiers over the same
characters, whitespace collapsed before patterns that could backtrack on it): answers are written
by a student that the teacher, trained with RL, can teach to write anything.
"""

from __future__ import annotations

import ast
import re
import unicodedata
from fractions import Fraction

# Superscripts and subscripts are powers and indices: NFKC would turn `1²` into `12`.
_SUPERSCRIPT = str.maketrans("⁰¹²³⁴⁵⁶⁷⁸⁹⁺⁻⁼⁽⁾ⁿⁱ", "0123456789+-=()ni")
_SUBSCRIPT = str.maketrans("₀₁₂₃₄₅₆₇₈₉₊₋₌₍₎", "0123456789+-=()")
_SUPERSCRIPT_RUN = re.compile("[⁰¹²³⁴⁵⁶⁷⁸⁹⁺⁻⁼⁽⁾ⁿⁱ]+")
_SUBSCRIPT_RUN = re.compile("[₀₁₂₃₄₅₆₇₈₉₊₋₌₍₎]+")

NUMBER = re.compile(r"\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+(?:\.\d+)?|\.\d+")
LATEX_COMMAND = re.compile(r"\\[A-Za-z]+")
_TEXT_COMMAND = re.compile(r"\\(?:text|textbf|textit|mathrm|mbox|operatorname)\s*\{([^{}]*)\}")
# A word: two or more letters not part of a LaTeX command (`\frac`). Single letters are variables.
WORD = re.compile(r"(?<![\\A-Za-z])[A-Za-z]{2,}")
# Function names a math label may hold in plain text (`sqrt(3)/3`); any other word makes it text.
MATH_WORDS = frozenset({"sqrt", "log", "ln", "exp", "sin", "cos", "tan", "pi"})
_SPACING_ONLY = re.compile(r"(?:\s|~|\\[ ,;:!]|\\q?quad\b)*")
_CURRENCY = re.compile(r"\\\$|[$€£¥]")
_WRAPPER = re.compile(r"\\[()\[\]!]|\\(?:left|right|displaystyle)(?![A-Za-z])")
_DECORATION = "*_`"


def math_notation(text: str) -> str:
    """NFKC (full-width digits are digits) with superscripts kept as powers: `1²` -> `1^{2}`."""
    if not text.isascii():
        text = _SUPERSCRIPT_RUN.sub(lambda m: "^{" + m.group(0).translate(_SUPERSCRIPT) + "}", text)
        text = _SUBSCRIPT_RUN.sub(lambda m: "_{" + m.group(0).translate(_SUBSCRIPT) + "}", text)
        text = unicodedata.normalize("NFKC", text).replace("\u2044", "/").replace("\u2212", "-")
    return text


def clean(text: str) -> str:
    """Without surrounding space and markdown emphasis (`**60**` -> `60`)."""
    return text.strip().strip(_DECORATION).strip()


def plain(text: str) -> str:
    """The answer as math text: no `$`/`\\$`/`\\(`, `\\text{x}` -> x, no markdown or final period."""
    text = _CURRENCY.sub("", math_notation(text))
    text = _WRAPPER.sub("", text)
    text = _TEXT_COMMAND.sub(lambda m: f" {m.group(1)} ", text.replace("\\%", "%"))
    return clean(clean(text).rstrip(".").strip())


def normalize_answer(text: str) -> str:
    """Text equality: plain, casefold, whitespace collapsed, no spaces around `=`, no final period."""
    text = " ".join(plain(text).casefold().split())
    return text.replace(" =", "=").replace("= ", "=").rstrip(".").strip()


def words(text: str) -> list[str]:
    """The words (2+ letters, LaTeX commands aside) of a text, lower case."""
    return [w.lower() for w in WORD.findall(LATEX_COMMAND.sub(" ", text))]


def without_words(text: str) -> str:
    """`60 dollars` -> `60`: words around a value are not the value."""
    return " ".join(WORD.sub(" ", text).split())


_PLAIN_NUMBER = re.compile(r"[-+]?(?:\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+(?:\.\d*)?|\.\d+)")
_LATEX_FRACTION = re.compile(r"([-+]?)\\[dt]?frac\s*\{\s*(\d+)\s*\}\s*\{\s*(\d+)\s*\}")
_ARITHMETIC = re.compile(r"[\d\s.+\-*/()]+")
_TIMES = re.compile(r"\\times|\\cdot|[×·⋅]")
_DIVIDE = re.compile(r"\\div|÷")
MAX_EXACT_CHARS = 60


def exact_value(text: str) -> Fraction | None:
    """The exact value of a plain number, `a/b`, `\\frac{a}{b}` or a small sum/product of them.

    The fast path: most answers compared are numbers, and this costs microseconds where
    math-verify costs milliseconds. None: not such a text (math-verify decides then).
    """
    text = " ".join(plain(text).split())
    if not text or len(text) > MAX_EXACT_CHARS:
        return None
    if _PLAIN_NUMBER.fullmatch(text):
        return Fraction(text.replace(",", ""))
    text = _LATEX_FRACTION.sub(lambda m: f"{m.group(1)}({m.group(2)}/{m.group(3)})", text)
    text = _DIVIDE.sub("/", _TIMES.sub("*", text))
    if not _ARITHMETIC.fullmatch(text) or "**" in text or "//" in text:
        return None
    try:
        return _evaluate(ast.parse(text, mode="eval").body)
    except (SyntaxError, ValueError, ZeroDivisionError, RecursionError, MemoryError):
        return None


def _evaluate(node: ast.AST) -> Fraction | None:
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
        return Fraction(str(node.value))
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        value = _evaluate(node.operand)
        return None if value is None else (-value if isinstance(node.op, ast.USub) else value)
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Sub, ast.Mult, ast.Div)):
        left, right = _evaluate(node.left), _evaluate(node.right)
        if left is None or right is None:
            return None
        if isinstance(node.op, ast.Add):
            return left + right
        if isinstance(node.op, ast.Sub):
            return left - right
        return left * right if isinstance(node.op, ast.Mult) else left / right
    return None


def numbers(text: str) -> list[Fraction]:
    """The numbers written in a text, in order (`1,234.5` is one number)."""
    return [Fraction(m.group(0).replace(",", "")) for m in NUMBER.finditer(text)]


_UNITS = "zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen".split()
_UNITS += "sixteen seventeen eighteen nineteen".split()
_TENS = dict(zip("twenty thirty forty fifty sixty seventy eighty ninety".split(), range(20, 100, 10)))
_SCALES = {"hundred": 100, "thousand": 1_000, "million": 1_000_000, "billion": 1_000_000_000}
_NUMBER_WORD_VALUES = {**{word: value for value, word in enumerate(_UNITS)}, **_TENS}
_NUMBER_WORD = "(?:" + "|".join(sorted([*_NUMBER_WORD_VALUES, *_SCALES], key=len, reverse=True)) + ")"
# A run of number words ("sixty-one", "two hundred and five"); whitespace is collapsed first, so the
# separators match at most a few characters and the scan stays linear.
_SPELLED_RUN = re.compile(
    rf"\b{_NUMBER_WORD}(?:(?:(?<=hundred) and |(?<=thousand) and |(?<=million) and |[ -]){_NUMBER_WORD})*\b",
    re.IGNORECASE,
)


def _spelled_values(run: str) -> str:
    """The numbers a run of number words states: `sixty one` -> 61, `one two` -> `1 2`."""
    found, total, current = [], 0, 0
    for word in re.split(r"[ -]+", run.lower()):
        if word == "and":
            continue
        if word in _NUMBER_WORD_VALUES:
            value = _NUMBER_WORD_VALUES[word]
            # A unit after tens ("sixty one") or anything after hundreds joins; "zero" never does.
            joins = value != 0 and (current % 100 == 0 or (current % 100 >= 20 and current % 10 == 0 and value < 10))
            if (current or total) and not joins:
                found.append(total + current)
                total = current = 0
            current += value
        elif word == "hundred":
            if current >= 100:  # "one hundred hundred" is two numbers, not ten thousand
                found.append(total + current)
                total = current = 0
            current = (current or 1) * 100
        else:
            scale = _SCALES[word]
            if total and total % (scale * 1000) != 0:  # a scale only after a larger one: "2 million 3 thousand"
                found.append(total + current)
                total = current = 0
            total, current = total + (current or 1) * scale, 0
    return " ".join(str(value) for value in [*found, total + current])


def spelled_as_digits(text: str) -> str:
    """Numbers written as words in digits (`60 or twelve` -> `60 or 12`), whitespace collapsed:
    a second candidate spelled out is still a second candidate."""
    return _SPELLED_RUN.sub(lambda m: _spelled_values(m.group(0)), " ".join(text.split()))


def offers_several_numbers(answer: str, label: str) -> bool:
    """Whether one stated answer offers several numbers where the label states one.

    Two different numbers next to each other count as candidates when what separates them is a
    word ("12 or 60"; "60 or twelve": numbers in words count), a comma or semicolon ("12, 60",
    unless the label itself is a list), or only spacing ("12 60"). The same number twice ("60, i.e.
    60") offers no second candidate; operators (`3 + 5`, `12 = 60`) are left to the chain rule.
    """
    text = spelled_as_digits(plain(answer))
    lists_allowed = any(separator in label for separator in ",;")
    found = list(NUMBER.finditer(text))
    for left, right in zip(found, found[1:]):
        if left.group(0) == right.group(0):
            continue
        between = text[left.end() : right.start()]
        if WORD.search(LATEX_COMMAND.sub(" ", between)):
            return True
        if not lists_allowed and (";" in between or "," in between):
            return True
        if _SPACING_ONLY.fullmatch(between):
            return True
    return False
