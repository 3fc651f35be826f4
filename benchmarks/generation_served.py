"""benchmarks/generation.py's served measurement: requests through the router to the workers,
timed, with the workers' own engine counters split into prefill, decode and idle."""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
import urllib.request
from typing import Sequence

from generation_inputs import prompts


async def timed_batch(pool, prompts_: list[list[int]], sampling: dict) -> tuple[float, list[int]]:
    t0 = time.perf_counter()
    results = await asyncio.gather(*[pool.generate(input_ids=p, sampling_params=sampling) for p in prompts_])
    return time.perf_counter() - t0, [len(r.output_ids) for r in results]


ENGINE_TIME_KEYS = ("prefill_s", "fast_decode_s", "dynamic_decode_s", "idle_s", "prefill_batches", "decode_steps")


def engine_totals(worker_urls: Sequence[str]) -> dict[str, float]:
    """The workers' engine counters summed (seconds by phase, prefill batches, decode steps). A
    blocking HTTP call: made only between timed phases, with nothing in flight."""
    engines = worker_engines(worker_urls)
    return {key: sum(float(engine.get(key, 0)) for engine in engines) for key in ENGINE_TIME_KEYS}


def engine_split(before: dict[str, float], after: dict[str, float], wall_s: float, workers: int) -> dict[str, float]:
    """Where a timed phase's wall time went inside the workers' engines: each counter's change,
    and the share of the workers' wall time each phase took (idle: waiting for requests)."""
    delta = {key: after[key] - before[key] for key in ENGINE_TIME_KEYS}
    for key in ("prefill_s", "fast_decode_s", "dynamic_decode_s", "idle_s"):
        delta[key.removesuffix("_s") + "_share"] = delta[key] / (wall_s * workers)
    if delta["prefill_batches"]:
        delta["prefill_ms_per_batch"] = 1e3 * delta["prefill_s"] / delta["prefill_batches"]
    if delta["decode_steps"]:
        delta["decode_us_per_step"] = 1e6 * (delta["fast_decode_s"] + delta["dynamic_decode_s"]) / delta["decode_steps"]
    return delta


async def served(
    router_url: str,
    args: argparse.Namespace,
    vocab: int,
    greedy_reference: list[list[int]],
    check: list[list[int]],
    worker_urls: Sequence[str],
) -> dict:
    from slime_meta.rollout.pools import SGLangPool

    more = {}
    for in_flight in args.also_concurrency:
        more_pool = SGLangPool(name="bench", base_url=router_url, concurrency=in_flight, timeout_s=600)
        batch = prompts(in_flight * 3, args.prompt_len, vocab, seed=2)
        sampling = {
            "max_new_tokens": args.new_tokens,
            "temperature": 1.0,
            "top_k": -1,
            "top_p": 1.0,
            "ignore_eos": True,
        }
        await timed_batch(more_pool, batch[:in_flight], dict(sampling, max_new_tokens=4))  # warm-up
        before = engine_totals(worker_urls)
        wall, lengths = await timed_batch(more_pool, batch, sampling)
        split = engine_split(before, engine_totals(worker_urls), wall, len(worker_urls))
        await more_pool.close()
        more[str(in_flight)] = {
            "tokens_per_s": sum(lengths) / wall,
            "wall_s": wall,
            "requests": len(batch),
            "in_flight": in_flight,
            "all_lengths_right": all(n == args.new_tokens for n in lengths),
            "engine_split": split,
        }
    pool = SGLangPool(name="bench", base_url=router_url, concurrency=args.concurrency, timeout_s=600)
    sampling = {"max_new_tokens": args.new_tokens, "temperature": 1.0, "top_k": -1, "top_p": 1.0, "ignore_eos": True}
    batch = prompts(max(args.requests, args.concurrency), args.prompt_len, vocab, seed=1)
    # correctness: greedy through the served path equals in-process greedy (to EOS for a real checkpoint)
    greedy_params = {"max_new_tokens": args.check_tokens, "temperature": 0.0, "ignore_eos": not args.model_path}
    served_greedy = [(await pool.generate(input_ids=p, sampling_params=greedy_params)).output_ids for p in check]
    matches = [sum(a == b for a, b in zip(s, r)) / max(1, len(r)) for s, r in zip(served_greedy, greedy_reference)]
    # behaviour log-probs, checked later against a full forward
    sampled = [await pool.generate(input_ids=p, sampling_params=sampling, return_logprob=True) for p in check]
    await asyncio.gather(
        *[pool.generate(input_ids=p, sampling_params=dict(sampling, max_new_tokens=4)) for p in batch[:8]]
    )
    before = engine_totals(worker_urls)
    t0 = time.perf_counter()
    results = await asyncio.gather(
        *[pool.generate(input_ids=p, sampling_params=sampling) for p in batch[: args.requests]]
    )
    wall = time.perf_counter() - t0
    split = engine_split(before, engine_totals(worker_urls), wall, len(worker_urls))
    lengths = [len(r.output_ids) for r in results]
    singles = []
    for p in batch[: args.one_at_a_time]:
        t1 = time.perf_counter()
        r = await pool.generate(input_ids=p, sampling_params=sampling)
        singles.append(time.perf_counter() - t1)
        lengths.append(len(r.output_ids))
    await pool.close()
    return {
        "concurrent": {
            "tokens_per_s": sum(lengths[: args.requests]) / wall,
            "wall_s": wall,
            "requests": args.requests,
            "in_flight": args.concurrency,
            "engine_split": split,
        },
        "one_at_a_time": {"tokens_per_s": args.new_tokens / statistics.median(singles), "request_s": singles},
        "more_in_flight": more,
        "all_lengths_right": all(n == args.new_tokens for n in lengths)
        and all(m["all_lengths_right"] for m in more.values()),
        "greedy_token_match": matches,
        "greedy_served": [list(ids) for ids in served_greedy],
        "sampled_check": [
            {"prompt": p, "output_ids": list(c.output_ids), "output_logprobs": list(c.output_logprobs)}
            for p, c in zip(check, sampled)
        ],
    }


def worker_engines(worker_urls: Sequence[str]) -> list[dict]:
    """Each worker's decode path and counters, from its /get_server_info."""
    engines = []
    for url in worker_urls:
        with urllib.request.urlopen(f"{url}/get_server_info", timeout=30) as response:
            engines.append(json.loads(response.read())["engine"])
    return engines
