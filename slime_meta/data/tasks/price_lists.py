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

The evaluation set drawn with another seed holds the training pool's shops and prices: it measures
the teacher on the shops it was trained on. `--held-out-shops` writes problems of five other shops
(`HELD_OUT_SHOPS`): other names, goods and prices, and other wording of the problems, the rubric and
the hints (`HELD_OUT`), none of which the training pool holds; an info that relays a rule learnt by
heart cannot carry there, one that relays the rubric's rule can.

Generate the shipped data (training pool and two separate evaluation sets) with:
  python -m slime_meta.data.tasks.price_lists --out data/price_lists.jsonl --n 40 --seed 0
  python -m slime_meta.data.tasks.price_lists --out data/price_lists_eval.jsonl --n 12 --seed 1 \\
      --disjoint-from data/price_lists.jsonl
  python -m slime_meta.data.tasks.price_lists --out data/price_lists_eval_new_shops.jsonl --n 12 --seed 2 \\
      --held-out-shops
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Callable, Collection, Sequence

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
class Wording:
    """How a shop's problems, rubrics and hints are phrased (`str.format` slots in braces).

    The training shops share `TRAINING`; the held-out shops `HELD_OUT`, whose every sentence differs,
    so an evaluation set of held-out shops shares no phrasing with the training pool. `key` is the
    answer-key rubric of the price-keys task (price_keys.py), which names a problem's result and
    never the price.
    """

    purchase: str  # {name} {count} {goods} {place}
    stated: str  # {price}: the sentence of the problems that state the price
    question: str  # {name}
    price_list: str  # {place} {price}: the price-lists rubric, before `credit`
    key: str  # {count} {goods} {place} {total}: the price-keys rubric, before `credit`
    credit: str  # the one answer form that gets credit
    rule: str  # {place} {price}: the oracle hint's rule
    example: str  # {goods} {price} {total}: its worked example, of `example_count` items
    wrong: str  # {place} {price}: the bad hint, with the wrong price
    example_count: int = 2


TRAINING = Wording(
    purchase="{name} buys {count} {goods} at {place}.",
    stated=" Each costs {price} dollars.",
    question=" How many dollars does {name} pay?",
    price_list="Price list of {place}: every item costs {price} dollars. Full credit: the amount paid at this price, ",
    key="Answer key for {count} {goods} at {place}: full credit for {total} dollars, ",
    credit=WHOLE_NUMBER_CREDIT,
    rule="At {place} every item costs {price} dollars.",
    example="2 {goods} cost 2 x {price} = {total} dollars.",
    wrong="At {place} every item costs {price} dollars.",
)
HELD_OUT = Wording(
    purchase="At {place}, {name} picks up {count} {goods}.",
    stated=" One of them is priced at {price} dollars.",
    question=" What does {name} spend in total, in dollars?",
    price_list="Rate sheet for {place}: any single article is {price} dollars, and the total spent is the number of "
    "articles times that rate. ",
    key="Expected total for {count} {goods} from {place}: {total} dollars. ",
    credit=(
        "A correct solution states that total as one final whole number; a different number, more than one final "
        "number, or none earns nothing."
    ),
    rule="Any single article sold at {place} is priced at {price} dollars.",
    example="3 {goods} come to 3 x {price} = {total} dollars in all.",
    wrong="Any single article sold at {place} is priced at {price} dollars.",
    example_count=3,
)


@dataclass(frozen=True)
class Purchase:
    """One drawn problem of a shop: who buys how many of what."""

    name: str
    goods: str
    count: int


@dataclass(frozen=True)
class Shop:
    """One family: a shop whose every item costs `price` dollars."""

    name: str
    place: str  # as the problems name it
    goods: tuple[str, ...]
    price: int
    wrong_price: int  # the bad hint's price: shows that the student follows what it is told
    wording: Wording = TRAINING

    @property
    def rubric(self) -> str:
        return self.wording.price_list.format(place=self.place, price=self.price) + self.wording.credit

    def key_rubric(self, purchase: Purchase) -> str:
        """The price-keys rubric of one problem: its result, never the price."""
        total = purchase.count * self.price
        key = self.wording.key.format(count=purchase.count, goods=purchase.goods, place=self.place, total=total)
        return key + self.wording.credit

    @property
    def oracle_hint(self) -> str:
        return oracle_hint_with_example(
            self.wording.rule.format(place=self.place, price=self.price),
            self.wording.example.format(
                goods=self.goods[0], price=self.price, total=self.wording.example_count * self.price
            ),
        )

    @property
    def bad_hint(self) -> str:
        return self.wording.wrong.format(place=self.place, price=self.wrong_price)

    def purchase(self, rng: random.Random) -> Purchase:
        name, _ = rng.choice(PEOPLE)
        goods, count = rng.choice(self.goods), rng.randint(2, 9)
        return Purchase(name, goods, count)

    def prompt(self, purchase: Purchase, price_stated: bool) -> str:
        w = self.wording
        prompt = w.purchase.format(name=purchase.name, count=purchase.count, goods=purchase.goods, place=self.place)
        if price_stated:
            prompt += w.stated.format(price=self.price)
        return prompt + w.question.format(name=purchase.name)

    def draw(self, rng: random.Random, price_stated: bool) -> Story:
        purchase = self.purchase(rng)
        return Story(self.prompt(purchase, price_stated), purchase.count * self.price)


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
# Shops no training file holds: other names, goods and prices (the wrong ones too), worded by HELD_OUT.
HELD_OUT_SHOPS: dict[str, Shop] = {
    shop.name: shop
    for shop in (
        Shop("lantern_house", "the Lantern House", ("lamps", "lanterns", "lampshades", "bulbs"), 11, 13, HELD_OUT),
        Shop("ottos_hats", "Otto's hat corner", ("caps", "scarves", "berets", "headbands"), 12, 14, HELD_OUT),
        Shop("clock_works", "the Clock Works", ("watches", "clocks", "timers", "watch straps"), 15, 16, HELD_OUT),
        Shop(
            "spice_cart", "the Spice Cart", ("spice jars", "tea tins", "pepper mills", "salt boxes"), 20, 18, HELD_OUT
        ),
        Shop("bike_depot", "the Bike Depot", ("bells", "pumps", "helmets", "locks"), 25, 21, HELD_OUT),
    )
}


def shop_table(held_out: bool) -> dict[str, Shop]:
    return HELD_OUT_SHOPS if held_out else SHOPS


# Draws of one problem before a shop counts as exhausted by `avoid`: a shop poses about 1,300 distinct ones.
MAX_DRAWS = 10_000


def generate_rows(
    n: int,
    seed: int = 0,
    families: Sequence[str] | None = None,
    avoid: Collection[str] = (),
    held_out_shops: bool = False,
) -> list[dict]:
    """`n` distinct problems of each shop, every other one naming the shop without its price.

    Each shop draws from its own seeded stream, so adding or dropping one leaves the others'
    problems unchanged. Rows alternate between shops, so any leading slice of the file holds all.
    Prompts in `avoid` are drawn again: an evaluation set never holds a training problem.
    `held_out_shops`: the shops of `HELD_OUT_SHOPS` instead of the training ones.
    """
    shops = shop_table(held_out_shops)
    chosen = choose_families(families, shops, shops, n)

    def draw(rng: random.Random, index: int, shop: Shop) -> Story:
        for _ in range(MAX_DRAWS):
            story = shop.draw(rng, price_stated=index % 2 == 1)
            if story.prompt not in avoid:
                return story
        raise UserInputError(
            f"{shop.name}: no problem outside the {len(avoid)} prompts to avoid (--disjoint-from) in {MAX_DRAWS} "
            f"draws: that file holds (nearly) every problem this shop can pose; lower --n ({n}) or give a smaller file"
        )

    return interleaved_family_rows("price_lists", shops, chosen, n, seed, draw)


def add_shop_flags(parser) -> None:
    """The flags the shop tasks share: --n, --families, --disjoint-from, --held-out-shops."""
    writer.add_family_flags(parser, SHOPS, family="shop", families="shops")
    parser.add_argument(
        "--disjoint-from",
        default=None,
        metavar="JSONL",
        help="a task file (the training pool) whose prompts this one must not hold: for an evaluation set",
    )
    parser.add_argument(
        "--held-out-shops",
        action="store_true",
        help=f"the shops no training file holds (default all: {', '.join(HELD_OUT_SHOPS)}; --families picks among "
        "them), in wording of their own: for an evaluation set of new shops",
    )


def write_shop_task(name: str, description: str, generate: Callable[..., list[dict]], argv) -> None:
    """The command line of a shop task (price lists, price keys): its flags, its rows, its file."""
    parser = writer.task_parser(name, description)
    add_shop_flags(parser)

    def rows(args) -> list[dict]:  # inside write_task: a bad --disjoint-from file is one error line
        avoid = writer.prompts_of(args.disjoint_from) if args.disjoint_from else set()
        return generate(args.n, args.seed, args.families, avoid, args.held_out_shops)

    writer.write_task(parser, argv, rows, COLUMNS, "category")


def main(argv: Sequence[str] | None = None) -> None:
    description = "Write the price-lists task: shop problems whose price only the rubric and the hint state."
    write_shop_task("price_lists", description, generate_rows, argv)


if __name__ == "__main__":
    main()
