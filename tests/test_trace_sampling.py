"""Every step traces at least one teacher chain by default, so its infos are always there to read in
traces.jsonl; `--trace-sample-rate 0` still traces none."""

from __future__ import annotations

import random

from slime_meta.config.arguments import parse_config
from slime_meta.rollout.meta_rollout import trace_at_least_one
from slime_meta.types import Chain


def chains(count: int) -> list[Chain]:
    return [Chain(prompt_index=i // 4, sample_index=i % 4, problems=()) for i in range(count)]


def test_a_step_whose_draw_traced_no_chain_traces_one():
    rate = parse_config(["--prompt-data", "data/math_word_problems.jsonl"]).meta.trace_sample_rate
    rng = random.Random("1234:7")
    for step in range(200):  # 8 chains, as run_real.sh's CPU step: at 0.1 the draw often picks none
        step_chains = chains(8)
        for chain in step_chains:
            chain.traced = rng.random() < rate
        trace_at_least_one(step_chains, rate, rng)
        assert sum(chain.traced for chain in step_chains) >= 1, step


def test_the_draw_is_kept_where_it_traced_some_and_rate_zero_traces_none():
    drawn = chains(8)
    drawn[2].traced = drawn[5].traced = True
    trace_at_least_one(drawn, 0.1, random.Random(0))
    assert [c.traced for c in drawn] == [False, False, True, False, False, True, False, False]
    none = chains(8)
    trace_at_least_one(none, 0.0, random.Random(0))
    assert not any(c.traced for c in none)
