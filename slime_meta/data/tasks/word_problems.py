"""Easy real-language word problems for a small instruct student (SmolLM2-135M-Instruct).

Why this task: the synthetic tasks measure the meta-learning loop with a tiny character-level
model; CHAMP (champ.py) is far beyond a 135M student (it solves essentially none of it). This family
sits in between: one- and two-step arithmetic stories in plain English that a 135M instruct model
solves some of the time without help, so a hint has room to help and room to hurt. Measured grades
per family, with no hint, with the hand-written `oracle_hint` and with the misleading `bad_hint`:
docs/tasks.md.

Each family is one kind of story (add, subtract, multiply, ...), the group key (`--group-key
category`) keeps a teacher prompt's train and holdout problems in one kind, labels are plain
integers, and the rubric says what a full-credit answer shows without giving the answer.

Generate the shipped data with:
  python -m slime_meta.data.tasks.word_problems --out data/easy_word_problems.jsonl --n 60 --seed 0
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Callable, Collection, Mapping, Protocol, Sequence

from slime_meta.data.tasks import writer
from slime_meta.errors import UserInputError

COLUMNS = ("id", "category", "prompt", "label", "rubric", "oracle_hint", "bad_hint")
# How the rubric of every whole-number task ends: the one answer form a grader gives credit for.
WHOLE_NUMBER_CREDIT = (
    "stated as one final whole number. No credit for a different number, for several different final numbers, "
    "or for no final number."
)

# (name, subject pronoun): the pronoun makes the second sentence of a story read naturally.
PEOPLE = (
    ("Ana", "She"),
    ("Ben", "He"),
    ("Cara", "She"),
    ("Dan", "He"),
    ("Eva", "She"),
    ("Finn", "He"),
    ("Gina", "She"),
    ("Hugo", "He"),
    ("Iris", "She"),
    ("Jack", "He"),
    ("Kate", "She"),
    ("Leo", "He"),
    ("Mia", "She"),
    ("Noah", "He"),
    ("Olga", "She"),
    ("Pablo", "He"),
    ("Rosa", "She"),
    ("Sam", "He"),
    ("Tara", "She"),
    ("Omar", "He"),
)
THINGS = (
    "marbles",
    "apples",
    "stickers",
    "cards",
    "books",
    "pencils",
    "cookies",
    "shells",
    "coins",
    "balloons",
    "stamps",
    "crayons",
    "oranges",
    "buttons",
    "toy cars",
    "flowers",
)


@dataclass(frozen=True)
class Story:
    """One drawn problem before it becomes a row."""

    prompt: str
    answer: int
    rubric: str | None = None  # this problem's own rubric (an answer key); None: its family's


@dataclass(frozen=True)
class Family:
    """One kind of story: how to draw it, and the hints and rubric that go with every problem of it."""

    name: str
    draw: Callable[[random.Random, int], Story]  # (stream, top): the largest number a story starts from
    rubric: str
    oracle_hint: str  # the best hint written by hand for the whole family (what a teacher could learn to write)
    bad_hint: str  # a plausible but wrong method: the grade it gives shows that the student follows hints
    top: int = 4  # the largest starting number: small on purpose (docs/tasks.md: the student cannot add 38 + 4)


def _person(rng: random.Random) -> tuple[str, str]:
    return rng.choice(PEOPLE)


def _two_people(rng: random.Random) -> tuple[tuple[str, str], tuple[str, str]]:
    first, second = rng.sample(PEOPLE, 2)
    return first, second


def _smaller_and_larger(rng: random.Random, low: int, top: int) -> tuple[int, int]:
    """A number from `low` to `top` and one 1 to `top` above it: a difference story never ends at 0 or below."""
    smaller = rng.randint(low, top)
    return smaller, smaller + rng.randint(1, top)


def _draw_add(rng: random.Random, top: int) -> Story:
    (name, pronoun), things = _person(rng), rng.choice(THINGS)
    first, more = rng.randint(2, top), rng.randint(1, top)  # from 2: "1 marbles" is not English
    prompt = rng.choice(
        (
            f"{name} has {first} {things}. {pronoun} gets {more} more. How many {things} does {name} have now?",
            f"{name} has {first} {things} and finds {more} more. How many {things} does {name} have now?",
            f"There are {first} {things} in a box. {name} puts {more} more {things} in the box. "
            f"How many {things} are in the box now?",
        )
    )
    return Story(prompt, first + more)


def _draw_subtract(rng: random.Random, top: int) -> Story:
    (name, pronoun), things = _person(rng), rng.choice(THINGS)
    taken, start = _smaller_and_larger(rng, 1, top)
    prompt = rng.choice(
        (
            f"{name} has {start} {things}. {pronoun} gives {taken} of them to a friend. "
            f"How many {things} does {name} have left?",
            f"{name} has {start} {things} and loses {taken} of them. How many {things} does {name} have left?",
            f"There are {start} {things} on a table. {name} takes {taken} of them away. "
            f"How many {things} are left on the table?",
        )
    )
    return Story(prompt, start - taken)


def _draw_multiply(rng: random.Random, top: int) -> Story:
    (name, _), things = _person(rng), rng.choice(THINGS)
    groups, each = rng.randint(2, top), rng.randint(2, top)
    prompt = rng.choice(
        (
            f"{name} has {groups} bags with {each} {things} in each bag. How many {things} does {name} have in all?",
            f"{name} buys {groups} boxes of {things}. Each box holds {each} {things}. "
            f"How many {things} does {name} buy in all?",
            f"There are {groups} rows of {things} with {each} {things} in each row. How many {things} are there in "
            "all?",
        )
    )
    return Story(prompt, groups * each)


def _draw_divide(rng: random.Random, top: int) -> Story:
    (name, _), things = _person(rng), rng.choice(THINGS)
    friends, each = rng.randint(2, top), rng.randint(2, top)
    total = friends * each
    prompt = rng.choice(
        (
            f"{name} shares {total} {things} equally among {friends} friends. How many {things} does each friend get?",
            f"{name} puts {total} {things} into {friends} bags with the same number in each bag. "
            f"How many {things} are in each bag?",
        )
    )
    return Story(prompt, each)


def _draw_compare(rng: random.Random, top: int) -> Story:
    (name, _), (other, _) = _two_people(rng)
    things = rng.choice(THINGS)
    fewer, more = _smaller_and_larger(rng, 2, top)
    prompt = rng.choice(
        (
            f"{name} has {more} {things} and {other} has {fewer} {things}. "
            f"How many more {things} does {name} have than {other}?",
            f"{other} has {fewer} {things}. {name} has {more} {things}. "
            f"How many fewer {things} does {other} have than {name}?",
        )
    )
    return Story(prompt, more - fewer)


def _draw_two_step(rng: random.Random, top: int) -> Story:
    (name, pronoun), things = _person(rng), rng.choice(THINGS)
    start, gained = rng.randint(2, top), rng.randint(1, top)
    given = rng.randint(1, start + gained - 1)
    prompt = rng.choice(
        (
            f"{name} has {start} {things}. {pronoun} gets {gained} more and then gives {given} away. "
            f"How many {things} does {name} have now?",
            f"{name} has {start} {things}, buys {gained} more, and then loses {given}. "
            f"How many {things} does {name} have now?",
        )
    )
    return Story(prompt, start + gained - given)


def _rubric(what: str) -> str:
    return f"Full credit: {what}, and the result is {WHOLE_NUMBER_CREDIT}"


def _oracle(rule: str, example: str) -> str:
    """A family's oracle hint: the rule in the story's words, the one line the verifier reads, a worked example.

    Chosen by measurement (docs/tasks.md): with the example the 135M student writes the `Answer:` line
    and the right operation far more often than with the rule alone or with a format instruction alone.
    """
    return f"{rule} Finish with one line: Answer: <number>.\nExample: {example}"


FAMILIES: dict[str, Family] = {
    family.name: family
    for family in (
        Family(
            "add",
            _draw_add,
            _rubric("the amount already there and the amount added are summed"),
            _oracle(
                "'More' means add. Add the two numbers in the story.",
                "Tom has 4 pens and gets 3 more. 4 + 3 = 7.\nAnswer: 7",
            ),
            "'More' is a trick here. Subtract the smaller number from the larger one.",
        ),
        Family(
            "subtract",
            _draw_subtract,
            _rubric("the amount given, lost or taken away is subtracted from the start"),
            _oracle(
                "Giving away, losing or taking away means subtract. Take the second number from the first.",
                "Tom has 9 pens and gives 3 away. 9 - 3 = 6.\nAnswer: 6",
            ),
            "Add the two numbers in the story.",
        ),
        Family(
            "multiply",
            _draw_multiply,
            _rubric("the number of groups is multiplied by the number in each group"),
            _oracle(
                "Equal groups mean multiply: number of groups times number in each group.",
                "Tom has 4 boxes with 3 pens in each box. 4 x 3 = 12.\nAnswer: 12",
            ),
            "Add the two numbers in the story.",
        ),
        Family(
            "divide",
            _draw_divide,
            _rubric("the total is divided by the number of equal shares"),
            _oracle(
                "Sharing equally means divide: the total divided by the number of shares.",
                "Tom shares 12 pens equally among 3 friends. 12 / 3 = 4.\nAnswer: 4",
            ),
            "Multiply the two numbers in the story.",
        ),
        Family(
            "compare",
            _draw_compare,
            _rubric("the smaller amount is subtracted from the larger one"),
            _oracle(
                "'How many more' or 'how many fewer' means the difference: larger minus smaller.",
                "Tom has 9 pens and Sue has 4 pens. Tom has 9 - 4 = 5 more.\nAnswer: 5",
            ),
            "Add the two numbers in the story.",
        ),
        # Not in the shipped file: no hint measured raised this student's grade on it (docs/tasks.md).
        Family(
            "two_step",
            _draw_two_step,
            _rubric("the amount gained is added and the amount given or lost is subtracted, in that order"),
            _oracle(
                "Two steps: first add the amount gained, then subtract the amount given away or lost.",
                "Tom has 5 pens, gets 4 more and gives 3 away. 5 + 4 = 9, then 9 - 3 = 6.\nAnswer: 6",
            ),
            "Add all three numbers in the story.",
        ),
    )
}
DEFAULT_FAMILIES = ("add", "subtract", "multiply", "divide", "compare")


# ---------------------------------------------------------------------------- data generation


class FamilyTexts(Protocol):
    """What every problem of a family shares in its row."""

    name: str
    rubric: str
    oracle_hint: str
    bad_hint: str


def choose_families(
    families: Sequence[str] | None, default: Sequence[str], known: Collection[str], n: int
) -> list[str]:
    """The families to write (`default` when none are named), checked with `n` as their flags are."""
    chosen = list(families) if families else list(default)
    unknown = [name for name in chosen if name not in known]
    if unknown:
        raise UserInputError(f"--families: unknown {', '.join(unknown)}; choose from {', '.join(known)}")
    if n < 1:
        raise UserInputError(f"--n {n}: give at least 1 problem per family")
    return chosen


def oracle_hint_with_example(rule: str, example: str) -> str:
    """A rule task's oracle hint: the rule, a worked example of another problem, then the answer format.

    The example states its result in a sentence, never as an `Answer:` line: a small student copies
    a final-answer line it has just read as its own.
    """
    return f"{rule} For example: {example} End your solution with one line: Answer: <number>."


def family_rows(
    family: FamilyTexts, n: int, stream: str, id_prefix: str, draw: Callable[[random.Random, int], Story]
) -> list[dict]:
    """The rows of `n` problems with distinct prompts, `draw(rng, i)` drawing the i-th from the seeded `stream`."""
    rng = random.Random(stream)
    seen: set[str] = set()
    rows = []
    for _ in range(100 * n):  # distinct prompts; the number space is far larger than any sensible n
        if len(seen) == n:
            break
        story = draw(rng, len(seen))
        if story.prompt in seen:
            continue
        seen.add(story.prompt)
        rows.append(
            {
                "id": f"{id_prefix}{len(seen) - 1:03d}",
                "category": family.name,
                "prompt": story.prompt,
                "label": story.answer,
                "rubric": family.rubric if story.rubric is None else story.rubric,
                "oracle_hint": family.oracle_hint,
                "bad_hint": family.bad_hint,
            }
        )
    if len(seen) < n:
        raise UserInputError(f"--n {n}: family {family.name} has fewer distinct problems; lower --n")
    return rows


def interleaved_family_rows(
    task: str,
    families: Mapping[str, FamilyTexts],
    chosen: Sequence[str],
    n: int,
    seed: int,
    draw: Callable[[random.Random, int, FamilyTexts], Story],
) -> list[dict]:
    """`n` rows of each chosen family, `draw(rng, i, family)` drawing the i-th from the family's own
    seeded stream (adding or dropping a family leaves the others' problems unchanged). The rows
    alternate between families, so any leading slice of the file holds every family."""
    rows_by_family = [
        family_rows(
            families[name],
            n,
            f"slime_meta.{task}/{seed}/{name}",
            f"{name}-s{seed}-",
            lambda rng, index, family=families[name]: draw(rng, index, family),
        )
        for name in chosen
    ]
    return [row for same_index in zip(*rows_by_family) for row in same_index]


def generate_rows(n: int, seed: int = 0, families: Sequence[str] | None = None, top: int | None = None) -> list[dict]:
    """`n` distinct problems of each family, family by family; the same seed gives the same rows.

    Each family draws from its own seeded stream, so adding or dropping a family leaves the others'
    problems unchanged.
    """
    chosen = choose_families(families, DEFAULT_FAMILIES, FAMILIES, n)
    if top is not None and top < 2:
        raise UserInputError(f"--top {top}: give 2 or more (a story starts from at least 2 things)")
    rows = []
    for name in chosen:
        family = FAMILIES[name]
        stream = f"slime_meta.word_problems/{seed}/{name}"
        rows += family_rows(family, n, stream, f"{name}-", lambda rng, _: family.draw(rng, top or family.top))
    return rows


def jsonl_text(rows: Sequence[dict]) -> str:
    """The rows as JSON lines with a fixed key order: the same rows give the same bytes."""
    return writer.jsonl_text(rows, COLUMNS)


def main(argv: Sequence[str] | None = None) -> None:
    description = "Write the easy word-problem task (deterministic for a seed)."
    parser = writer.task_parser("word_problems", description, out="data/easy_word_problems.jsonl")
    parser.add_argument("--n", type=int, default=60, help="problems per family")
    parser.add_argument(
        "--families",
        nargs="+",
        default=None,
        help=f"families to write (default: {' '.join(DEFAULT_FAMILIES)}); any of {' '.join(FAMILIES)}",
    )
    parser.add_argument("--top", type=int, default=None, help="largest starting number (default: each family's, 4)")
    writer.write_task(
        parser,
        argv,
        lambda args: generate_rows(args.n, seed=args.seed, families=args.families, top=args.top),
        COLUMNS,
        "category",
    )


if __name__ == "__main__":
    main()
