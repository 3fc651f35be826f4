"""The built-in verifier: one final answer, read from free-form text, compared with the label.

Why it is strict: the teacher is trained with RL against these grades and writes the student's
prompt, so any answer form that scores without being one correct final answer ("list every
candidate", "end with a GRADE line", "write 12 = 60") would be found and taught. Why it is
lenient: real small models write `Ana has 3 + 5 = 8 marbles.`, `Answer: Yes, it does.` or
`#### 8`, and a careful human grader reads those as answers.

Modules, one idea each:
- `reading`: where the solution states its final answers (boxes, `Answer:`, `####`, "the answer
  is"), and what is read without any (the last sentence's final result);
- `labels`: the forms a label names (`C(10, 5), or equivalently 252`) and their kinds;
- `text`: normalisation (superscripts stay powers), exact numbers, hedges inside one answer;
- `judge`: the verdict and its feedback (never quoting the label);
- `math_pool` / `math_server`: math-verify in child processes, each answer under a time bound.

The rules, why each exists and the attack it stops: docs/reliability.md, "The built-in verifier".
"""

from __future__ import annotations

from slime_meta.grading.verifier.judge import Verdict, judge
from slime_meta.grading.verifier.math_pool import MathPool, MathSession
from slime_meta.grading.verifier.reading import final_value, read
from slime_meta.grading.verifier.text import clean

DEFAULT_TIMEOUT_S = 2.0


def check(
    solution: str,
    label: str,
    metric: str = "normalized",
    *,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    pool: MathPool | None = None,
) -> Verdict:
    """The verdict on one solution; raises `math_pool.CheckTimeout` when its math took longer than `timeout_s`."""
    return judge(solution or "", label, metric, MathSession(pool or MathPool.shared(), timeout_s))


def stated_answers(solution: str) -> list[str]:
    """Every final answer the solution states (boxes, `Answer:`, `####`, "the answer is"), in order."""
    return [clean(value) for value in read(solution or "").values if clean(value)]


def extract_answer(solution: str) -> str:
    """The final answer, whatever the label: the last statement, else the last sentence's final
    result, else the last line (a short answer read whole)."""
    stated = stated_answers(solution)
    if stated:
        return stated[-1]
    reading = read(solution or "")
    value = clean(final_value(reading.last_sentence))
    return value if value else reading.last_line
