"""Shop problems whose price only the hint can give: the student must be told the fact, then multiply.

Why this task: on the house-rules task a 0.5B instruct student did not apply a stated rule (its
grade with the hand-written hint was below its grade without), so no teacher could be measured
there. Here the knowledge a hint must carry is one fact a small model can copy: the one price every
item of a shop costs. Each family is one shop with one price, written in the family's rubric (which
the grader and the teacher read) and in the hand-written `oracle_hint`. Every other problem states
the price, so a student with no info solves those and the no-info grade sits inside 0 to 1; the
others name only the shop, so their answer needs the price that only an info can give. The price
is shared by every problem of the family, so a price relayed for the train problems carries to the
holdout problems (`--group-key category`).

Labels are whole numbers; the rubric says what a full-credit answer shows without giving the answer.

Generate the shipped data (training pool and a separate evaluation set) with:
  python -m slime_meta.data.tasks.price_lists --out data/price_lists.jsonl --n 40 --seed 0
  python -m slime_meta.data.tasks.price_lists --out data/price_lists_eval.jsonl --n 12 --seed 1 \\
      --disjoint-from data/price_lists.jsonl
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Collection, Sequence

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
from slime_meta.errors import UserInputError


@dataclass(frozen=True)
class Shop:
    """One family: a shop whose every item costs `price` dollars."""

    name: str
    place: str  # as the problems name it
    goods: tuple[str, ...]
    price: int
    wrong_price: int  # the bad hint's price: shows that the student follows what it is told

    @property
    def rubric(self) -> str:
        return (
            f"Price list of {self.place}: every item costs {self.price} dollars. Full credit: the amount paid at "
            f"this price, {WHOLE_NUMBER_CREDIT}"
        )

    @property
    def oracle_hint(self) -> str:
        return oracle_hint_with_example(
            f"At {self.place} every item costs {self.price} dollars.",
            f"2 {self.goods[0]} cost 2 x {self.price} = {2 * self.price} dollars.",
        )

    @property
    def bad_hint(self) -> str:
        return f"At {self.place} every item costs {self.wrong_price} dollars."

    def draw(self, rng: random.Random, price_stated: bool) -> Story:
        name, _ = rng.choice(PEOPLE)
        goods, count = rng.choice(self.goods), rng.randint(2, 9)
        prompt = f"{name} buys {count} {goods} at {self.place}."
        if price_stated:
            prompt += f" Each costs {self.price} dollars."
        return Story(f"{prompt} How many dollars does {name} pay?", count * self.price)


SHOPS: dict[str, Shop] = {
    shop.name: shop
    for shop in (
        Shop("kims_stall", "Kim's stall", ("mugs", "bowls", "plates", "cups"), 7, 5),
        Shop("corner_books", "the Corner bookshop", ("notebooks", "comics", "maps", "diaries"), 4, 6),
        Shop("toy_barn", "the Toy Barn", ("yo-yos", "kites", "puzzles", "balls"), 9, 3),
        Shop("garden_hut", "the Garden Hut", ("seed packs", "pots", "gloves", "trowels"), 6, 8),
        Shop("sea_market", "the Sea Market", ("shells", "postcards", "magnets", "candles"), 8, 4),
    )
}


# Draws of one problem before a shop counts as exhausted by `avoid`: a shop poses about 1,300 distinct ones.
MAX_DRAWS = 10_000


def generate_rows(
    n: int, seed: int = 0, families: Sequence[str] | None = None, avoid: Collection[str] = ()
) -> list[dict]:
    """`n` distinct problems of each shop, every other one naming the shop without its price.

    Each shop draws from its own seeded stream, so adding or dropping one leaves the others'
    problems unchanged. Rows alternate between shops, so any leading slice of the file holds all.
    Prompts in `avoid` are drawn again: an evaluation set never holds a training problem.
    """
    chosen = choose_families(families, SHOPS, SHOPS, n)

    def draw(rng: random.Random, index: int, shop: Shop) -> Story:
        for _ in range(MAX_DRAWS):
            story = shop.draw(rng, price_stated=index % 2 == 1)
            if story.prompt not in avoid:
                return story
        raise UserInputError(
            f"{shop.name}: no problem outside the {len(avoid)} prompts to avoid (--disjoint-from) in {MAX_DRAWS} "
            f"draws: that file holds (nearly) every problem this shop can pose; lower --n ({n}) or give a smaller file"
        )

    return interleaved_family_rows("price_lists", SHOPS, chosen, n, seed, draw)


def main(argv: Sequence[str] | None = None) -> None:
    description = "Write the price-lists task: shop problems whose price only the rubric and the hint state."
    parser = writer.task_parser("price_lists", description)
    writer.add_family_flags(parser, SHOPS, family="shop", families="shops")
    parser.add_argument(
        "--disjoint-from",
        default=None,
        metavar="JSONL",
        help="a task file (the training pool) whose prompts this one must not hold: for an evaluation set",
    )

    def rows(args) -> list[dict]:  # inside write_task: a bad --disjoint-from file is one error line
        avoid = writer.prompts_of(args.disjoint_from) if args.disjoint_from else set()
        return generate_rows(args.n, args.seed, args.families, avoid)

    writer.write_task(parser, argv, rows, COLUMNS, "category")


if __name__ == "__main__":
    main()
