"""A synthetic task family on which a tiny model shows the whole meta-learning effect.

Why this task: the embedded default (one machine, no GPU, no model hub) needs a task where a hint
truly helps, a student small enough to train here can apply a hint, and a teacher can learn to
write one. A prototype of this task found the best such setting: every
problem of a *family* hides the same rule, a 2-letter suffix from the letters a-h; the problem is a
4-letter word and the answer is the word followed by the suffix. Without a hint the student can
only guess the suffix (1 in 64); with the family's suffix as `additional_info` it is exact; and the
grader's feedback on a few train problems reveals the suffix, so a teacher can infer it. The
family is the group key (`--group-key family`), so a batch's train and holdout problems share it.

Formats are character-level, one token a character in the tiny model; a student prompt has a
fixed length (7 characters, 9 with a 2-letter hint):
  student prompt   `S{hint}|{word}=`                        completion `{word}{hint}.` + EOS
  teacher prompt   `T{previous_info}#{word}:{attempt}!{expected};...>`  completion `{hint}.` + EOS

Generate the shipped data with:
  python -m slime_meta.data.tasks.synthetic --out data/synthetic_suffix.jsonl \
      --parquet data/synthetic_suffix.parquet --seed 0 --words-per-family 12
Select the templates with:
  --generator-template slime_meta.data.tasks.synthetic.SyntheticGeneratorTemplate
  --teacher-template slime_meta.data.tasks.synthetic.SyntheticTeacherTemplate
"""

from __future__ import annotations

import itertools
import random
import string
from pathlib import Path
from typing import Any, Callable, Sequence

from slime_meta.data.tasks import writer
from slime_meta.prompt_templates import GeneratorPromptTemplate, Message, TeacherPromptTemplate
from slime_meta.types import GradedAttempt, Problem

HINT_ALPHABET = "abcdefgh"  # small on purpose: the prototype's student could not learn 26 keys fast
SUFFIX_LENGTH = 2
WORD_LENGTH = 4
WORD_ALPHABET = string.ascii_lowercase
ALL_SUFFIXES: tuple[str, ...] = tuple("".join(p) for p in itertools.product(HINT_ALPHABET, repeat=SUFFIX_LENGTH))
RUBRIC = (
    "The answer is the word followed by the family's hidden two-letter suffix; full credit only for an exact match."
)
COLUMNS = ("uid", "family", "prompt", "label", "oracle_hint", "rubric")

ANSWER_END = "."  # the student ends its answer with it; the teacher ends its hint with it
MAX_ATTEMPT_CHARS = 8  # a runaway student answer cannot blow up the teacher's prompt
# 10 entries of at most 21 characters keep a teacher prompt (plus its hint) inside the tiny
# model's 256 positions; with the usual 3-4 train problems and 1-2 attempts each it never binds.
MAX_TEACHER_ENTRIES = 10

GENERATOR_TEXT = "S{additional_info}|{problem}="
TEACHER_TEXT = "T{previous_info}#{attempts_and_grades}>"


# ---------------------------------------------------------------------------- data generation


def generate_rows(seed: int = 0, words_per_family: int = 12) -> list[dict[str, str]]:
    """All rows of the task: one family per suffix (64), `words_per_family` distinct words each.

    Family names are opaque (`f00`..`f63`, suffixes shuffled by the seed) so the group key does not
    spell the hidden rule; `oracle_hint` holds it for evaluation and reading.
    """
    return generate_family_rows(
        ALL_SUFFIXES,
        lambda word, suffix: word + suffix,
        family_prefix="f",
        rubric=RUBRIC,
        seed=seed,
        words_per_family=words_per_family,
    )


def generate_family_rows(
    hints: Sequence[str],
    answer: Callable[[str, str], str],
    *,
    family_prefix: str,
    rubric: str,
    seed: int,
    words_per_family: int,
) -> list[dict[str, str]]:
    """One family per hidden hint (in an order shuffled by `seed`), `words_per_family` distinct
    random words each, the label `answer(word, hint)`: the data of every task built on this format."""
    if not 1 <= words_per_family <= len(WORD_ALPHABET) ** WORD_LENGTH:
        raise ValueError(f"words_per_family must be between 1 and {len(WORD_ALPHABET) ** WORD_LENGTH}")
    rng = random.Random(seed)
    shuffled = list(hints)
    rng.shuffle(shuffled)
    rows = []
    for family_index, hint in enumerate(shuffled):
        family = f"{family_prefix}{family_index:02d}"
        words: list[str] = []
        while len(words) < words_per_family:
            word = "".join(rng.choice(WORD_ALPHABET) for _ in range(WORD_LENGTH))
            if word not in words:  # distinct inside a family: a repeat would leak between train and holdout
                words.append(word)
        for word_index, word in enumerate(words):
            rows.append(
                {
                    "uid": f"{family}-{word_index:02d}",
                    "family": family,
                    "prompt": word,
                    "label": answer(word, hint),
                    "oracle_hint": hint,
                    "rubric": rubric,
                }
            )
    return rows


def jsonl_text(rows: Sequence[dict[str, Any]]) -> str:
    """The rows as JSON lines, with a fixed key order, so the same rows give the same bytes."""
    return writer.jsonl_text(rows, COLUMNS)


def write_jsonl(rows: Sequence[dict[str, Any]], path: str | Path) -> Path:
    return writer.write_jsonl(rows, path, COLUMNS)


# ---------------------------------------------------------------------------- evaluation helpers


def oracle_hint(problem: Problem) -> str:
    """The perfect hint for a problem of this task: its family's suffix.

    Read from the `oracle_hint` column when the loader kept it in metadata, else derived from the
    label (the label is the word followed by the suffix).
    """
    hint = problem.metadata.get("oracle_hint") if problem.metadata else None
    if isinstance(hint, str) and hint:
        return hint
    answer = problem.ground_truth
    return answer[len(problem.prompt) :] if answer.startswith(problem.prompt) else ""


def extract_answer(solution: str) -> str:
    """The student's answer: its completion up to the first `.`, without surrounding whitespace."""
    return solution.split(ANSWER_END, 1)[0].strip()


def per_character_score(solution: str, expected: str) -> float:
    """Partial credit: matching positions over the longer length, in [0, 1].

    Per-character rewards give RL a signal where exact match gives almost none
    (a wrong suffix still scores 4/6 for the copied word, one right letter 5/6).
    """
    answer = extract_answer(solution)
    longest = max(len(answer), len(expected))
    if longest == 0:
        return 1.0
    return sum(a == e for a, e in zip(answer, expected)) / longest


def exact_score(solution: str, expected: str) -> float:
    return float(extract_answer(solution) == expected)


def clean_hint(text: str) -> str:
    """A hint as the student was trained to read it: letters a-h only, at most two of them."""
    return "".join(ch for ch in text.split(ANSWER_END, 1)[0] if ch in HINT_ALPHABET)[:SUFFIX_LENGTH]


def clean_attempt(solution: str) -> str:
    """An attempt as the teacher reads it: the answer, lowercase letters only, bounded length.

    Dropping other characters keeps the teacher prompt's delimiters (`:`, `!`, `;`, `>`)
    unambiguous whatever the student wrote.
    """
    return "".join(ch for ch in extract_answer(solution) if ch in WORD_ALPHABET)[:MAX_ATTEMPT_CHARS]


# ---------------------------------------------------------------------------- prompt templates


class SyntheticGeneratorTemplate(GeneratorPromptTemplate):
    """The student's prompt `S{hint}|{word}=`; `S|{word}=` with no hint.

    The text needs no file: the default is built in, so `load_template` can instantiate the class
    with no arguments. A completion format: never wrapped in a chat template.
    """

    chat_format = False

    def __init__(self, text: str | None = None, *, source: str = "slime_meta.data.tasks.synthetic"):
        super().__init__(GENERATOR_TEXT if text is None else text, source=source)


class SyntheticTeacherTemplate(TeacherPromptTemplate):
    """The teacher's prompt `T{previous_info}#{word}:{attempt}!{expected};...>`.

    Each graded attempt shows the expected answer (`attempt.problem.ground_truth`): that is what
    the grader's feedback reveals on this task, and what lets the teacher infer the suffix.
    A completion format: never wrapped in a chat template.
    """

    chat_format = False

    def __init__(self, text: str | None = None, *, source: str = "slime_meta.data.tasks.synthetic"):
        super().__init__(TEACHER_TEXT if text is None else text, source=source)

    def format_attempt(self, number: int, attempt: GradedAttempt) -> str:
        del number  # entries are positional; a number would only lengthen the prompt
        problem = attempt.problem
        return f"{problem.prompt}:{clean_attempt(attempt.solution)}!{problem.ground_truth};"

    def format_attempts(self, problems: Sequence[Problem], attempts_K_M: Sequence[Sequence[GradedAttempt]]) -> str:
        entries = [self.format_attempt(n + 1, a) for attempts in attempts_K_M for n, a in enumerate(attempts)]
        return "".join(entries[:MAX_TEACHER_ENTRIES])

    def build(
        self,
        problems: Sequence[Problem],
        attempts_K_M: Sequence[Sequence[GradedAttempt]],
        previous_info: str,
    ) -> list[Message]:
        # previous_info went through parse_info already; cleaning again guards a caller that
        # passes raw text, which the model was never trained to read here.
        content = self.render(
            previous_info=clean_hint(previous_info),
            attempts_and_grades=self.format_attempts(problems, attempts_K_M),
        )
        return [{"role": "user", "content": content}]

    def parse_info(self, text: str) -> str:
        """The hint: text up to the first `.`, letters a-h only, at most two.

        The student was trained only on hints of that alphabet and length; anything else would be
        out of its distribution and would only add noise to the reward.
        """
        return clean_hint(text)


# ---------------------------------------------------------------------------- pretraining examples


class PretrainingSampler:
    """(prompt, completion) pairs for both roles of the tiny model; words are fresh, not the data's rows.

    `formats` renders them (slime_meta.models.tiny.build.Formats: this task's templates). The teacher's
    target is the family's suffix in `teacher_correct_fraction` of the examples, a random one
    otherwise (slime_meta/models/tiny/build.py says why). A task on the same format subclasses it and
    changes the rule (`hint`, `answer`) and the teacher's other targets (`other_teacher_target`).
    """

    empty_hint_fraction = 0.2

    def __init__(self, seed: int, teacher_correct_fraction: float, formats) -> None:
        self.rng = random.Random(seed)
        self.formats = formats
        self.teacher_correct_fraction = teacher_correct_fraction

    def word(self) -> str:
        return "".join(self.rng.choice(WORD_ALPHABET) for _ in range(WORD_LENGTH))

    def hint(self) -> str:
        """A family's hidden hint, drawn uniformly."""
        return self.rng.choice(ALL_SUFFIXES)

    def answer(self, word: str, hint: str) -> str:
        return word + hint

    def other_teacher_target(self, prompt: str) -> str:
        """The teacher's target when it is not the family's hint: a random hint."""
        return self.hint()

    def student(self) -> tuple[str, str]:
        word = self.word()
        if self.rng.random() < self.empty_hint_fraction:
            hint, rule = "", self.hint()  # no info: any hint is as likely, so it learns to guess
        else:
            hint = rule = self.hint()
        return self.formats.student_prompt(word, hint), self.answer(word, rule) + ANSWER_END

    def attempt(self, word: str, hint: str, previous_info: str) -> str:
        """What a student of unknown quality might have answered."""
        draw = self.rng.random()
        if draw < 0.4:
            return self.answer(word, self.hint())  # guessed without a (useful) hint
        if draw < 0.7 and previous_info:
            return self.answer(word, previous_info)  # applied the previous hint
        if draw < 0.9:
            return self.answer(word, hint)  # right
        length = self.rng.randint(0, MAX_ATTEMPT_CHARS)  # garbage
        return "".join(self.rng.choice(WORD_ALPHABET) for _ in range(length))

    def teacher(self, n_problems: int, n_attempts: int, previous_info: str) -> tuple[str, str]:
        hint = self.hint()
        words: list[str] = []
        while len(words) < n_problems:
            word = self.word()
            if word not in words:
                words.append(word)
        problems_K = [
            (w, self.answer(w, hint), [self.attempt(w, hint, previous_info) for _ in range(n_attempts)]) for w in words
        ]
        prompt = self.formats.teacher_prompt(previous_info, problems_K)
        correct = self.rng.random() < self.teacher_correct_fraction
        return prompt, (hint if correct else self.other_teacher_target(prompt)) + ANSWER_END

    def teacher_batch(self, size: int) -> list[tuple[str, str]]:
        # One shape per batch (problems, attempts each, previous info or not) keeps padding small;
        # up to 3 x 2 covers the prototype's 3 train problems with 1-2 student samples each (4
        # problems cost a fifth more time; copying the suffix from any entry generalises anyway).
        n_problems, n_attempts = self.rng.randint(1, 3), self.rng.randint(1, 2)
        with_previous = self.rng.random() < 0.5
        return [self.teacher(n_problems, n_attempts, self.hint() if with_previous else "") for _ in range(size)]


# ---------------------------------------------------------------------------- CLI


def family_task_main(
    argv: Sequence[str] | None, name: str, out: str, description: str, generate: Callable[..., list[dict[str, str]]]
) -> None:
    """The command line of a family task (this one, bracket.py): the rows of `generate(seed=, words_per_family=)`
    to `--out` (default `out`), and to parquet as well with `--parquet`."""
    parser = writer.task_parser(name, description, out=out, parquet=True)
    parser.add_argument("--words-per-family", type=int, default=12)
    writer.write_task(
        parser, argv, lambda args: generate(seed=args.seed, words_per_family=args.words_per_family), COLUMNS, "family"
    )


def main(argv: Sequence[str] | None = None) -> None:
    description = "Write the synthetic suffix task (deterministic for a seed)."
    family_task_main(argv, "synthetic", "data/synthetic_suffix.jsonl", description, generate_rows)


if __name__ == "__main__":
    main()
