"""What the built-in verifier costs per answer, and on 100,000-character adversarial answers.

    python benchmarks/verifier_cost.py            # 300 answers per kind
    python benchmarks/verifier_cost.py --n 2000

Why: the inner loop grades thousands of answers per step in the trainer's process. Numbers are
compared exactly (microseconds); other math goes to math-verify in the verifier's child processes
(milliseconds, bounded). Prints ms per answer through `grade_now` and through `grade` (gathered on
one event loop, as the inner loop does), then the seconds each adversarial answer takes.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from slime_meta.grading.graders import VerifierGrader  # noqa: E402
from slime_meta.types import Problem  # noqa: E402


def answers(count: int, seed: int, needs_sympy: bool) -> list[tuple[Problem, str]]:
    """Right answers in the forms models write: numbers, or forms only math-verify can compare."""
    rng, out = random.Random(seed), []
    for index in range(count):
        a, b = rng.randint(1, 999), rng.randint(1, 999)
        if needs_sympy:
            label, solution = [
                (f"x = {a}", f"So x = {a}.0\nAnswer: x = {a}.0"),
                (f"\\sqrt{{{a}}}", f"Answer: \\sqrt{{{a}}}"),
                (f"{a}n/{b}", f"Answer: \\frac{{{a}n}}{{{b}}}"),
            ][index % 3]
        else:
            label, solution = (
                str(a + b),
                [
                    f"Ana has {a} and gets {b} more.\nAnswer: {a + b}",
                    f"She has {a} + {b} = {a + b} marbles.",
                    f"The total is \\boxed{{{a + b}}}.",
                    f"So {a} + {b} = {a + b}. The answer is {a + b}.",
                    f"Answer: {a + b}.0",
                ][index % 5],
            )
        out.append((Problem(uid=f"u{index}", prompt="?", label=label), solution))
    return out


def adversarial(length: int = 100_000) -> dict[str, str]:
    def repeat(unit: str) -> str:
        return (unit * (length // len(unit) + 1))[:length]

    return {
        "Answer lines": "".join(f"Answer: {i}\n" for i in range(length // 5))[:length],
        "unclosed boxes": repeat("\\boxed{"),
        "distinct boxes": "".join(f"\\boxed{{{i}}}" for i in range(length // 5))[:length],
        "answer phrases": repeat("the answer is 7 "),
        "one space run": "Answer:" + " " * length,
        "one = chain": "Answer: " + repeat("1 = "),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=300, help="answers per kind")
    n = parser.parse_args().n
    grader = VerifierGrader()
    for needs_sympy in (False, True):
        kind = "needs sympy" if needs_sympy else "numbers"
        grader.grade_now(*answers(1, 0, needs_sympy)[0])  # the math child is started before timing
        batch = answers(n, 1, needs_sympy)
        started = time.perf_counter()
        mean = sum(grader.grade_now(p, s).score for p, s in batch) / n
        per_answer_ms = (time.perf_counter() - started) / n * 1e3
        print(f"{kind:12s} grade_now: {per_answer_ms:7.3f} ms/answer (mean grade {mean:.2f})")
        batch = answers(n, 2, needs_sympy)

        async def gathered():
            return await asyncio.gather(*(grader.grade(p, s) for p, s in batch))

        started = time.perf_counter()
        mean = sum(g.score for g in asyncio.run(gathered())) / n
        per_answer_ms = (time.perf_counter() - started) / n * 1e3
        print(f"{kind:12s} grade:     {per_answer_ms:7.3f} ms/answer (mean grade {mean:.2f})")
    label = Problem(uid="a", prompt="?", label="60")
    for name, text in adversarial().items():
        started = time.perf_counter()
        score = grader.grade_now(label, text).score
        print(f"100k characters, {name:15s} {time.perf_counter() - started:.3f} s (grade {score})")


if __name__ == "__main__":
    main()
