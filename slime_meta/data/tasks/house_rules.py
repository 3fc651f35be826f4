"""Shop and venue problems whose answer depends on a house rule the student is never told.

Why this task: a hint that only restates a method the student already knows (add, multiply) has
little to teach a 0.5B instruct model, which solves most easy word problems alone. Here each family
is one place with one house rule (a packing fee under a threshold, every fifth box free, a group
ticket free, a Monday discount, free short parking). The rule is written in the family's rubric,
which the grader and the teacher read, and in the hand-written `oracle_hint`; it is never in the
problem, so the student can only apply it when the teacher's info states it. About half of each
family's problems trigger the rule and half do not, so a student with no info still solves the
other half (the no-info grade sits well inside 0 to 1) and a hint that states the rule has clear
room to help. A rule learned on a family's train problems carries to its holdout problems, because
every problem of a family shares it (`--group-key category`).

Labels are whole numbers; the rubric says what a full-credit answer shows without giving the answer.

Generate the shipped data (training pool and a separate evaluation set) with:
  python -m slime_meta.data.tasks.house_rules --out data/house_rules.jsonl --n 40 --seed 0
  python -m slime_meta.data.tasks.house_rules --out data/house_rules_eval.jsonl --n 12 --seed 1
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Callable, Sequence

from slime_meta.data.tasks import writer
from slime_meta.data.tasks.word_problems import (
    COLUMNS,
    PEOPLE,
    WHOLE_NUMBER_CREDIT,
    Story,
    choose_families,
    interleaved_family_rows,
    oracle_hint_with_example,
)

GOODS = ("notebooks", "pens", "candles", "mugs", "socks", "soaps", "plates", "cups", "brushes", "tins")
FRUITS = ("apples", "pears", "melons", "lemons", "peaches", "mangoes")
DAYS = ("Tuesday", "Wednesday", "Thursday", "Friday", "Saturday")


@dataclass(frozen=True)
class HouseRule:
    """One place and its rule: how to draw a problem (triggering the rule or not) and the texts of the family."""

    name: str
    draw: Callable[[random.Random, bool], Story]  # (stream, the rule applies to this problem)
    rubric: str
    oracle_hint: str  # the rule and a worked example: what a teacher could learn to write
    bad_hint: str  # a plausible but wrong rule: shows that the student follows what it is told


def _draw_packing_fee(rng: random.Random, applies: bool) -> Story:
    """Nora's shop: an order under 20 dollars pays a 4-dollar packing fee."""
    name, _ = rng.choice(PEOPLE)
    goods = rng.choice(GOODS)
    while True:
        count, price = rng.randint(2, 6), rng.randint(2, 8)
        if (count * price < 20) == applies:
            break
    prompt = (
        f"{name} buys {count} {goods} at Nora's shop. Each costs {price} dollars. How many dollars does {name} pay?"
    )
    return Story(prompt, count * price + (4 if applies else 0))


def _draw_free_box(rng: random.Random, applies: bool) -> Story:
    """Lia's bakery: every fifth box is free."""
    name, _ = rng.choice(PEOPLE)
    boxes = rng.randint(5, 9) if applies else rng.randint(2, 4)
    price = rng.randint(2, 6)
    prompt = (
        f"{name} buys {boxes} boxes of muffins at Lia's bakery. A box costs {price} dollars. "
        f"How many dollars does {name} pay?"
    )
    return Story(prompt, (boxes - boxes // 5) * price)


def _draw_group_ticket(rng: random.Random, applies: bool) -> Story:
    """The Sunny cinema: a group of 5 or more people gets one ticket free."""
    people = rng.randint(5, 8) if applies else rng.randint(2, 4)
    price = rng.randint(3, 9)
    prompt = (
        f"{people} friends go to the Sunny cinema together. A ticket costs {price} dollars. "
        "How many dollars do they pay in all?"
    )
    return Story(prompt, (people - (1 if applies else 0)) * price)


def _draw_monday_market(rng: random.Random, applies: bool) -> Story:
    """Bo's market: on Mondays every item costs 1 dollar less."""
    name, _ = rng.choice(PEOPLE)
    fruit = rng.choice(FRUITS)
    day = "Monday" if applies else rng.choice(DAYS)
    count, price = rng.randint(2, 6), rng.randint(2, 6)
    prompt = (
        f"On {day}, {name} buys {count} {fruit} at Bo's market. Each costs {price} dollars. "
        f"How many dollars does {name} pay?"
    )
    return Story(prompt, count * (price - (1 if applies else 0)))


def _draw_free_parking(rng: random.Random, applies: bool) -> Story:
    """The Elm Street garage: a stay of 3 hours or less is free; a longer stay pays for every hour."""
    name, _ = rng.choice(PEOPLE)
    hours = rng.randint(1, 3) if applies else rng.randint(4, 8)
    price = rng.randint(2, 5)
    prompt = (
        f"{name} parks at the Elm Street garage for {hours} hours. Parking costs {price} dollars an hour. "
        f"How many dollars does {name} pay?"
    )
    return Story(prompt, 0 if applies else hours * price)


def _rubric(place: str, rule: str) -> str:
    return f"House rule of {place}: {rule} Full credit: the amount paid under this rule, {WHOLE_NUMBER_CREDIT}"


RULES: dict[str, HouseRule] = {
    rule.name: rule
    for rule in (
        HouseRule(
            "packing_fee",
            _draw_packing_fee,
            _rubric("Nora's shop", "an order under 20 dollars pays a 4-dollar packing fee; 20 or more pays none."),
            oracle_hint_with_example(
                "At Nora's shop an order under 20 dollars costs 4 dollars more (packing fee); 20 or more has no fee.",
                "3 cups at 5 dollars each cost 3 x 5 = 15 dollars, under 20, so the order costs 15 + 4 = 19 dollars.",
            ),
            "At Nora's shop every order gets 4 dollars off.",
        ),
        HouseRule(
            "free_box",
            _draw_free_box,
            _rubric("Lia's bakery", "every fifth box is free (5 to 9 boxes: one box free)."),
            oracle_hint_with_example(
                "At Lia's bakery every fifth box is free: pay for one box fewer when buying 5 to 9 boxes.",
                "for 6 boxes at 3 dollars a box one box is free, so the order costs 5 x 3 = 15 dollars.",
            ),
            "At Lia's bakery every box costs 1 dollar extra.",
        ),
        HouseRule(
            "group_ticket",
            _draw_group_ticket,
            _rubric("the Sunny cinema", "a group of 5 or more people gets one ticket free."),
            oracle_hint_with_example(
                "At the Sunny cinema a group of 5 or more people pays for one ticket fewer.",
                "6 friends with 4-dollar tickets pay for 6 - 1 = 5 tickets, so 5 x 4 = 20 dollars.",
            ),
            "At the Sunny cinema groups pay double.",
        ),
        HouseRule(
            "monday_market",
            _draw_monday_market,
            _rubric("Bo's market", "on Mondays every item costs 1 dollar less than its price."),
            oracle_hint_with_example(
                "At Bo's market every item costs 1 dollar less on Mondays; other days the price is as stated.",
                "on a Monday 3 pears priced 4 dollars cost 4 - 1 = 3 dollars each, so 3 x 3 = 9 dollars.",
            ),
            "At Bo's market every item costs 1 dollar more on Mondays.",
        ),
        HouseRule(
            "free_parking",
            _draw_free_parking,
            _rubric("the Elm Street garage", "a stay of 3 hours or less is free; a longer stay pays for every hour."),
            oracle_hint_with_example(
                "At the Elm Street garage 3 hours or less is free (0 dollars); a longer stay pays every hour.",
                "2 hours at 4 dollars an hour are free, so the stay costs 0 dollars.",
            ),
            "At the Elm Street garage the first hour costs double.",
        ),
    )
}


def generate_rows(n: int, seed: int = 0, families: Sequence[str] | None = None) -> list[dict]:
    """`n` distinct problems of each family, the rule applying to every other one; same seed, same rows.

    Each family draws from its own seeded stream, so adding or dropping a family leaves the others'
    problems unchanged. Rows alternate between families, so any leading slice of the file (a
    baseline measured on its first problems, say) holds every family.
    """
    chosen = choose_families(families, RULES, RULES, n)
    return interleaved_family_rows(
        "house_rules", RULES, chosen, n, seed, lambda rng, i, rule: rule.draw(rng, i % 2 == 0)
    )


def main(argv: Sequence[str] | None = None) -> None:
    description = "Write the house-rules task: problems whose answer needs a rule only the rubric and hint state."
    parser = writer.task_parser("house_rules", description)
    writer.add_family_flags(parser, RULES)
    writer.write_task(parser, argv, lambda args: generate_rows(args.n, args.seed, args.families), COLUMNS, "category")


if __name__ == "__main__":
    main()
