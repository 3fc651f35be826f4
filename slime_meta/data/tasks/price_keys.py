"""Shop problems whose price the teacher must infer from answer keys: the rubric gives a result, never the rule.

Why this task: on price lists (price_lists.py) the family's rubric states the shop's price, so a
teacher that learns to pass that line on relays a rule it was handed, and the learning runs cannot
tell relaying from inferring. Here the shops, goods and prices are those of price lists, but each
problem's rubric is its own answer key: "Answer key for 6 mugs at Kim's stall: full credit for 42
dollars, ...". The price (7) is nowhere in it; a teacher finds it only by dividing a key by the
problem's quantity. The teacher reads the keys of its train problems; its reward is the student's
grade on holdout problems of the same shop with other quantities (`--group-key category`), so an
info that pastes a key ("the answer is 42") helps none of them and one that states the price helps
every one that does not state it.

Every third problem states the price ("Each costs 7 dollars."), so a student with no info solves
those and the no-info grade sits inside 0 to 1; the others name only the shop. Fewer than price
lists' one in two, so that more teacher prompts hold only problems whose price must be inferred.
A quantity never equals its shop's price, so the price's number is in no rubric and no problem
that does not state it. `oracle_hint` states the price with a worked example (price lists' hint),
`bad_hint` a wrong price. Labels are whole numbers (quantity x price); the rubric's key is the
label, and the grader gives credit for that one number stated as the one final answer.

Generate the shipped data (training pool, an evaluation set of the same shops, and one of shops,
goods, prices and wording no training file holds) with:
  python -m slime_meta.data.tasks.price_keys --out data/price_keys.jsonl --n 40 --seed 0
  python -m slime_meta.data.tasks.price_keys --out data/price_keys_eval.jsonl --n 12 --seed 1 \\
      --disjoint-from data/price_keys.jsonl
  python -m slime_meta.data.tasks.price_keys --out data/price_keys_eval_new_shops.jsonl --n 12 --seed 2 \\
      --held-out-shops
"""

from __future__ import annotations

import random
from typing import Collection, Sequence

from slime_meta.data.tasks.price_lists import MAX_DRAWS, Purchase, Shop, shop_table, write_shop_task
from slime_meta.data.tasks.word_problems import Story, choose_families, interleaved_family_rows
from slime_meta.errors import UserInputError

STATED_EVERY = 3  # the problem of index i states the price when i % STATED_EVERY == STATED_EVERY - 1


def states_price(index: int) -> bool:
    """Whether a shop's `index`-th problem states the price (in the file: every third row of the shop)."""
    return index % STATED_EVERY == STATED_EVERY - 1


def purchase_without_price(shop: Shop, rng: random.Random) -> Purchase:
    """A purchase whose quantity is not the shop's price: the price's number stays out of the key's rubric."""
    while True:
        purchase = shop.purchase(rng)
        if purchase.count != shop.price:
            return purchase


def draw(shop: Shop, rng: random.Random, price_stated: bool) -> Story:
    """One problem of `shop` with its answer key as its rubric."""
    purchase = purchase_without_price(shop, rng)
    return Story(shop.prompt(purchase, price_stated), purchase.count * shop.price, shop.key_rubric(purchase))


def generate_rows(
    n: int,
    seed: int = 0,
    families: Sequence[str] | None = None,
    avoid: Collection[str] = (),
    held_out_shops: bool = False,
) -> list[dict]:
    """`n` distinct problems of each shop, every third stating the price, each with its answer key as rubric.

    Each shop draws from its own seeded stream (adding or dropping one leaves the others'
    problems unchanged); rows alternate between shops, so any leading slice of the file holds all.
    Prompts in `avoid` are drawn again: an evaluation set never holds a training problem.
    `held_out_shops`: the shops no training file holds (price_lists.HELD_OUT_SHOPS), in their wording.
    """
    shops = shop_table(held_out_shops)
    chosen = choose_families(families, shops, shops, n)

    def draw_new(rng: random.Random, index: int, shop: Shop) -> Story:
        for _ in range(MAX_DRAWS):
            story = draw(shop, rng, price_stated=states_price(index))
            if story.prompt not in avoid:
                return story
        raise UserInputError(
            f"{shop.name}: no problem outside the {len(avoid)} prompts to avoid (--disjoint-from) in {MAX_DRAWS} "
            f"draws: that file holds (nearly) every problem this shop can pose; lower --n ({n}) or give a smaller file"
        )

    return interleaved_family_rows("price_keys", shops, chosen, n, seed, draw_new)


def main(argv: Sequence[str] | None = None) -> None:
    description = (
        "Write the price-keys task: shop problems whose rubric is each one's answer key, never the shop's price."
    )
    write_shop_task("price_keys", description, generate_rows, argv)


if __name__ == "__main__":
    main()
