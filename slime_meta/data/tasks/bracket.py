"""A second synthetic task family, on which the starting teacher has never written a useful hint.

Why a second task: on the suffix task (synthetic.py) the small model's teacher is pretrained to
write the family's suffix half of the time, so most of the measured gain is the pretraining's, not
RL's. Here the teacher is pretrained on the family's problems and answers and on hint-shaped text,
but never on the rule that makes a hint useful: only RL can find it.

The rule: every problem of a family hides two letters from a-h, an opening and a closing one; the
problem is a 4-letter word and the answer is the word between them (`kqpd` -> `dkqpdf` for the
key `df`). The oracle hint is the key itself; a student applies it exactly (first letter in front,
second at the end) and without it can only guess both letters (1 in 64; per character it still
copies the word, 4 of 6). The grader's feedback on the train problems shows the expected answers,
so the key is readable from them: the first and the last letter of any expected answer. That is
what the teacher must learn to copy, and it is never shown doing it in pretraining.

Formats are character level, one token a character in the tiny model, and those of synthetic.py:
  student prompt   `S{hint}|{word}=`                        completion `{h0}{word}{h1}.` + EOS
  teacher prompt   `T{previous_info}#{word}:{attempt}!{expected};...>`  completion `{hint}.` + EOS

The teacher's pretraining prior (slime_meta/models/tiny/build.py builds it): its target is two letters
drawn uniformly from the hint letters (a-h) that occur anywhere in its own prompt, never the rule's
choice. The key's letters are always in the prompt, so that prior writes the correct key only by
chance (about 1 in 38 for 3 train problems), but it teaches the teacher to read its prompt and
copy from it; a teacher pretrained on prompt-blind random hints learns to ignore its input, and RL
has to build the reading from nothing (measured: flat for 200 steps instead of rising from the
start; docs/tasks.md).

Generate the shipped data with:
  python -m slime_meta.data.tasks.bracket --out data/bracket.jsonl --parquet data/bracket.parquet
Select the templates with:
  --generator-template slime_meta.data.tasks.bracket.BracketGeneratorTemplate
  --teacher-template slime_meta.data.tasks.bracket.BracketTeacherTemplate
"""

from __future__ import annotations

import random
from typing import Sequence

from slime_meta.data.tasks import synthetic
from slime_meta.data.tasks.synthetic import HINT_ALPHABET, WORD_LENGTH
from slime_meta.types import Problem

NAME = "bracket"
HINT_LENGTH = 2
ANSWER_LENGTH = WORD_LENGTH + HINT_LENGTH
ALL_HINTS: tuple[str, ...] = synthetic.ALL_SUFFIXES  # every ordered pair of a-h letters
RUBRIC = "The answer is the word between the family's two hidden letters; full credit only for an exact match."


# The suffix task's serialisation and scoring serve this task unchanged (same columns, same grader).
jsonl_text = synthetic.jsonl_text
per_character_score = synthetic.per_character_score
exact_score = synthetic.exact_score


def apply_hint(word: str, hint: str) -> str:
    """The answer the rule gives for a word under a key: `df`, `kqpd` -> `dkqpdf`."""
    return hint[:1] + word + hint[1:2]


# ---------------------------------------------------------------------------- data generation


def generate_rows(seed: int = 0, words_per_family: int = 12) -> list[dict[str, str]]:
    """All rows: one family per key (64), `words_per_family` distinct words each.

    Family names are opaque (`b00`..`b63`, keys shuffled by the seed) so the group key does not
    spell the hidden rule; `oracle_hint` holds it for evaluation and reading.
    """
    return synthetic.generate_family_rows(
        ALL_HINTS, apply_hint, family_prefix="b", rubric=RUBRIC, seed=seed, words_per_family=words_per_family
    )


def oracle_hint(problem: Problem) -> str:
    """The perfect hint: the `oracle_hint` column, else the label's first and last letter."""
    hint = problem.metadata.get("oracle_hint") if problem.metadata else None
    if isinstance(hint, str) and hint:
        return hint
    answer = problem.ground_truth
    return answer[0] + answer[-1] if len(answer) == ANSWER_LENGTH else ""


# ---------------------------------------------------------------------------- prompt templates


class BracketGeneratorTemplate(synthetic.SyntheticGeneratorTemplate):
    """The student's prompt `S{hint}|{word}=`, as in the suffix task (the model is built per task)."""

    def __init__(self, text: str | None = None, *, source: str = "slime_meta.data.tasks.bracket"):
        super().__init__(text, source=source)


class BracketTeacherTemplate(synthetic.SyntheticTeacherTemplate):
    """The teacher's prompt `T{previous_info}#{word}:{attempt}!{expected};...>`; hints a-h, two letters.

    The expected answers are what the grader's feedback reveals: the key is their first and last
    letter.
    """

    def __init__(self, text: str | None = None, *, source: str = "slime_meta.data.tasks.bracket"):
        super().__init__(text, source=source)


# ---------------------------------------------------------------------------- pretraining examples


def prompt_hint_letters(text: str) -> list[str]:
    """The hint letters that occur in a text, each once, in a fixed order."""
    return sorted(set(text) & set(HINT_ALPHABET))


class PretrainingSampler(synthetic.PretrainingSampler):
    """(prompt, completion) pairs for both roles of the tiny model; words are fresh, not the data's.

    Student: the rule applied to a random key (20% with no hint, answering a random key). Teacher:
    a prompt of a random family with the usual mix of attempts, and a target of two letters drawn
    uniformly from the a-h letters of that prompt: hint-shaped, read from the input, never the key
    by design (only by chance). `teacher_correct_fraction` (default 0 for this task) replaces that
    target with the key in that share of examples, for measurements only.
    """

    def hint(self) -> str:
        return self.rng.choice(ALL_HINTS)

    def answer(self, word: str, hint: str) -> str:
        return apply_hint(word, hint)

    def other_teacher_target(self, prompt: str) -> str:
        letters = prompt_hint_letters(prompt)  # never empty: the expected answers hold the key
        return "".join(self.rng.choice(letters) for _ in range(HINT_LENGTH))


def no_hint_attempt(word: str, rng: random.Random) -> str:
    """A student's answer without a hint, for the teacher's evaluation prompts: a guessed key."""
    return apply_hint(word, rng.choice(ALL_HINTS))


# ---------------------------------------------------------------------------- CLI


def main(argv: Sequence[str] | None = None) -> None:
    description = "Write the bracket task (deterministic for a seed)."
    synthetic.family_task_main(argv, NAME, "data/bracket.jsonl", description, generate_rows)


if __name__ == "__main__":
    main()
