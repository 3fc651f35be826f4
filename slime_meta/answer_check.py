"""How the built-in verifier reads a solution: one final answer, compared with the label.

Why this is strict: the teacher is trained with RL against the grader, and the teacher writes the
student's prompt, so any answer format the verifier over-rewards becomes the teacher's hint
("list every candidate", "end with a GRADE line"). The rules, in order:

- The final answers a solution states are the contents of its `\\boxed{...}`, of its `Answer:`
  lines (`Final answer:` too; a box on an answer line counts once; on the last line `Answer:` may
  follow other text), of GSM8K's `#### N` lines, and of each "the (final) answer is ..." phrase (up
  to the end of its sentence). Real instruct models state answers these ways, and rarely exactly as
  the prompt asked.
- A solution that states none: its result in the last sentence that has a number, read as a
  careful human grader would (`Ana has 3 + 5 = 8 marbles.` states 8: the value after the last `=`,
  or the sentence's only number); a sentence with several numbers and no `=` states no answer. A
  one-line solution of a few words with no number is read whole (the synthetic tasks' answers). Else
  there is no final answer (score 0; the feedback says so).
- Yes/no labels: an answer that starts with yes or no and goes on in words (`Yes, it does.`) states
  that word; one that says both yes and no is a hedge.
- Several final answers that are not the same answer: the solution is hedging, and scores 0.
- A hedge inside one answer ("12 or maybe 60", "12, 60", "12 60") scores 0 when the label is a
  single math answer: two numbers separated by words, a comma or a semicolon (unless the label
  has one), or only spaces.
- Math labels (a number, a fraction, an expression such as `x = 6` or `\\frac{3}{4}`) are
  compared with math-verify (`60.0` == `60` == `\\frac{120}{2}`, `3/4` == `0.75`); any other label
  is compared as normalised text. Text is NFKC-normalised first, so full-width digits are digits;
  look-alike letters from other scripts stay different letters.
- An answer too long or too deep to check quickly (a tower of powers) is not evaluated: sympy
  could spend seconds on it, and a student (taught by the teacher) could stall the inner loop.
"""

from __future__ import annotations

import functools
import re
import threading
import unicodedata

_ANSWER_LINE = re.compile(r"^[\s>#*_\-`]*(?:final[*_ \t]+)?answer[*_ \t]*[:：](?P<rest>.*)$", re.IGNORECASE)
# `Answer:` after other text, on the last line only ("So she has 8. Answer: 8").
_ANSWER_IN_LINE = re.compile(r"\banswer[*_ \t]*[:：](?P<rest>[^:：]*)$", re.IGNORECASE)
_GSM8K_LINE = re.compile(r"^[\s>*_`]*####[ \t]*(?P<rest>.*)$")
# "The answer is 5." / "the final answer is: 5" up to the end of its sentence (a period followed by
# a space or the end, so that decimals such as 2.5 stay whole).
_ANSWER_IS = re.compile(
    r"\b(?:the\s+)?(?:final\s+)?answer\s+(?:is|would\s+be|will\s+be)\s*[:：]?\s*(?P<rest>(?:[^.!?\n]|\.(?=\S))*)",
    re.IGNORECASE,
)
# Sentence ends: . ! ? followed by whitespace or the end (not the point of a decimal).
_SENTENCE_END = re.compile(r"[.!?](?=\s|$)")
_SIGNED_NUMBER = re.compile(r"-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:\s*/\s*\d+)?")
_YES_NO = ("yes", "no")
SHORT_ANSWER_CHARS = 64  # a one-line answer this short, with no number in it, is read whole
_NUMBER = re.compile(r"\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+(?:\.\d+)?|\.\d+")
_LATEX_COMMAND = re.compile(r"\\[A-Za-z]+")
_TEXT_COMMAND = re.compile(r"\\(?:text|textbf|mathrm|mbox|operatorname)\s*\{([^{}]*)\}")
_WORD = re.compile(r"(?<![\\A-Za-z])[A-Za-z]{2,}")
_SPACING_ONLY = re.compile(r"(?:\s|~|\\[ ,;:!]|\\q?quad\b)*")
_NESTED_POWER = re.compile(r"\^\s*\{[^{}]*\^|\^\s*\(?[^\s{}()]*\^")
MAX_MATH_ANSWER_CHARS = 200
MATH_TIMEOUT_SECONDS = 2


def _boxed_contents(text: str) -> list[str]:
    """The contents of every `\\boxed{...}` (and `\\fbox{...}`), braces balanced, in order."""
    found = []
    for match in re.finditer(r"\\(?:boxed|fbox)\s*\{", text):
        depth, begin = 0, match.end()
        for position in range(begin, len(text)):
            if text[position] == "{":
                depth += 1
            elif text[position] == "}":
                if depth == 0:
                    found.append(text[begin:position])
                    break
                depth -= 1
    return found


def _clean(text: str) -> str:
    return text.strip().strip("*_`").strip()


def _last_nonempty_index(lines: list[str]) -> int:
    for index in range(len(lines) - 1, -1, -1):
        if lines[index].strip():
            return index
    return -1


def stated_answers(solution: str) -> list[str]:
    """Every final answer the solution states (boxes, `Answer:` and `####` lines, "the answer is"
    phrases), in order; [] if none."""
    answers: list[str] = []
    lines = solution.splitlines()
    last = _last_nonempty_index(lines)
    boxed_on_answer_lines: list[str] = []
    for index, line in enumerate(lines):
        match = _ANSWER_LINE.match(line) or _GSM8K_LINE.match(line)
        if not match and index == last:
            match = _ANSWER_IN_LINE.search(line)
        if not match:
            for phrase in _ANSWER_IS.finditer(line):
                rest = _clean(phrase.group("rest"))
                boxes = _boxed_contents(rest)
                boxed_on_answer_lines += boxes
                if rest:
                    answers.append(_clean(boxes[-1] if boxes else rest))
            continue
        rest = match.group("rest").strip()
        if not rest:  # "Answer:" with the value on the next non-empty line
            rest = next((later.strip() for later in lines[index + 1 :] if later.strip()), "")
        boxes = _boxed_contents(rest)
        boxed_on_answer_lines += boxes
        answers.append(_clean(boxes[-1] if boxes else rest))
    remaining_boxes = _boxed_contents(solution)
    for box in boxed_on_answer_lines:
        if box in remaining_boxes:
            remaining_boxes.remove(box)
    answers += [_clean(box) for box in remaining_boxes]
    return [answer for answer in answers if answer]


def extract_answer(solution: str) -> str:
    """The student's final answer: the last one it states (`stated_answers`), else its result in the
    last sentence with a number (`final_result`), else "" (no final answer)."""
    stated = stated_answers(solution)
    return stated[-1] if stated else final_result(solution)


def final_result(solution: str) -> str:
    """The answer of a solution that states none explicitly, or "" when there is none to read.

    The last sentence with a digit: the number after its last `=` (`3 + 5 = 8 marbles` -> `8`), or
    its only number (`Ana has 8 marbles now.` -> `8`); several numbers and no `=`: none. A short
    one-line solution with no digit at all is read whole (`abcdef.`, `Yes`, `x`).
    """
    text = solution.strip()
    short_line = text if "\n" not in text and len(text) <= SHORT_ANSWER_CHARS else ""
    line = next((line for line in reversed(text.splitlines()) if any(c.isdigit() for c in line)), None)
    if line is None:
        return short_line
    starts = [0] + [end.end() for end in _SENTENCE_END.finditer(line)]
    sentences = [line[a:b] for a, b in zip(starts, starts[1:] + [len(line)])]
    sentence = next(s for s in reversed(sentences) if any(c.isdigit() for c in s))
    if "=" in sentence:
        sentence = sentence.rsplit("=", 1)[1]
        if "\\" in sentence:  # a LaTeX result such as \\frac{3}{4}: compared as math
            return _clean(sentence).rstrip(".")
    numbers = _SIGNED_NUMBER.findall(sentence)
    if len(numbers) == 1:
        return numbers[0].replace(" ", "")
    # Several numbers and no `=` to say which is the result: a short one-line answer is read whole
    # (an expression such as x^2 + 2x + 1, or a hedge the comparison then refuses), else none.
    return short_line


def normalize_answer(text: str) -> str:
    """NFKC, casefold, drop `$`, collapse whitespace, no spaces around `=`, no trailing period."""
    text = " ".join(unicodedata.normalize("NFKC", text).replace("$", "").casefold().split())
    text = re.sub(r"\s*=\s*", "=", text)
    return text.rstrip(".").strip()


def _plain(text: str) -> str:
    """The answer as math text: NFKC, no `$`/`\\(`, `\\text{x}` -> x, no markdown or final period."""
    text = unicodedata.normalize("NFKC", text).replace("$", "").replace("\\(", "").replace("\\)", "")
    text = text.replace("\\[", "").replace("\\]", "").replace("\\!", "").replace("\\%", "%")
    text = _TEXT_COMMAND.sub(lambda m: f" {m.group(1)} ", text)
    return _clean(text).rstrip(".").strip()


def is_hedge(answer: str, label: str) -> bool:
    """Whether one stated answer offers several numbers where the label is one (see module doc)."""
    text = _plain(answer)
    lists_allowed = any(separator in label for separator in ",;")
    numbers = list(_NUMBER.finditer(text))
    for left, right in zip(numbers, numbers[1:]):
        if left.group(0) == right.group(0):
            continue  # the same number twice ("60, i.e. 60") offers no second candidate
        between = text[left.end() : right.start()]
        if _WORD.search(_LATEX_COMMAND.sub(" ", between)):
            return True
        if not lists_allowed and re.search(r"[,;]", between):
            return True
        if _SPACING_ONLY.fullmatch(between):
            return True
    return False


@functools.lru_cache(maxsize=1)
def _math_verify():
    try:
        import math_verify
    except ImportError:  # a declared dependency; the message says how to get it
        from slime_meta.errors import UserInputError

        raise UserInputError("the verifier needs math-verify for math labels: pip install math-verify") from None
    return math_verify


def _timeout() -> int | None:
    # math-verify times out with signal.alarm, which only the main thread may use.
    return MATH_TIMEOUT_SECONDS if threading.current_thread() is threading.main_thread() else None


@functools.lru_cache(maxsize=4096)
def _parse_math(text: str) -> tuple:
    """math-verify's reading of one LaTeX/plain math answer: () when it is not math."""
    if len(text) > MAX_MATH_ANSWER_CHARS or _NESTED_POWER.search(text) or not text:
        return ()
    mv = _math_verify()
    parsed = mv.parse(f"${text}$", extraction_config=[mv.LatexExtractionConfig()], parsing_timeout=_timeout())
    return tuple(parsed)


def is_math_label(label: str) -> bool:
    """A label math-verify should compare: digits or LaTeX, no words, and it parses as math."""
    text = _plain(label)
    if not (re.search(r"\d|\\[A-Za-z]|π", text)) or _WORD.search(_LATEX_COMMAND.sub(" ", text)):
        return False
    parsed = _parse_math(text)
    return bool(parsed) and not isinstance(parsed[0], str)


def _without_words(text: str) -> str:
    """`The answer is 60 dollars` -> `60`: words around a single number are not the answer."""
    return " ".join(_WORD.sub(" ", text).split())


def same_math_answer(label: str, answer: str) -> bool:
    """Whether `answer` states the math label `label` (math-verify; words around it ignored)."""
    gold = _parse_math(_plain(label))
    if not gold:
        return normalize_answer(label) == normalize_answer(answer)
    mv = _math_verify()
    text = _plain(answer)
    for candidate in dict.fromkeys((text, _without_words(text))):
        predicted = _parse_math(candidate)
        if predicted and mv.verify(list(gold), list(predicted), timeout_seconds=_timeout()):
            return True
    return normalize_answer(label) == normalize_answer(answer)


def same_answer(first: str, second: str) -> bool:
    """Two stated answers agree: equal as text, or as math when both are math."""
    if normalize_answer(first) == normalize_answer(second):
        return True
    return is_math_label(first) and is_math_label(second) and same_math_answer(first, second)


def yes_no_answer(answer: str) -> str | None:
    """`Yes, it does.` -> "yes"; `No.` -> "no"; None when it does not start with one, or says both."""
    words = re.findall(r"[a-z]+", normalize_answer(answer))
    if not words or words[0] not in _YES_NO or (set(_YES_NO) <= set(words)):
        return None
    return words[0]


def answer_matches_label(answer: str, label: str) -> bool:
    """The verifier's equivalence: math-verify for math labels (no hedges), yes/no labels by the
    answer's first word, else normalised text."""
    if is_math_label(label):
        return not is_hedge(answer, label) and same_math_answer(label, answer)
    if normalize_answer(label) in _YES_NO:
        return yes_no_answer(answer) == normalize_answer(label)
    return normalize_answer(answer) == normalize_answer(label)


def distinct_answers(answers: list[str]) -> list[str]:
    """The answers with repeats of the same answer (see `same_answer`) dropped, first kept."""
    kept: list[str] = []
    for answer in answers:
        if not any(same_answer(answer, earlier) for earlier in kept):
            kept.append(answer)
    return kept
