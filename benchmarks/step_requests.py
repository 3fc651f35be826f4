"""The requests of one outer step, for benchmarks/step.py: read back from the run's traces, the
prompt tokens an unbounded prefix cache would skip, and their prefills replayed on a fresh worker.
"""

from __future__ import annotations

import argparse
import asyncio
import time


def step_requests(traces: list[dict], rollout_id: int, tokenizer) -> list[dict]:
    """Every generation request of one step, from its traces: prompt ids, `n`, and which role."""
    requests = []
    for record in traces:
        if record.get("type") != "chain" or record.get("rollout_id") != rollout_id:
            continue
        for step in record["steps"]:
            iteration = step.get("iteration", len(record["steps"]))  # the holdout record comes last
            for kind, entries in (("student_train", step.get("attempts")), ("student_holdout", step.get("holdout"))):
                counts: dict[str, int] = {}
                for entry in entries or ():
                    counts[entry["prompt"]] = counts.get(entry["prompt"], 0) + 1
                requests += [
                    {"kind": kind, "phase": (iteration, 0), "text": text, "n": n} for text, n in counts.items()
                ]
            if step.get("teacher_prompt"):
                requests.append({"kind": "teacher", "phase": (iteration, 1), "text": step["teacher_prompt"], "n": 1})
    for request in requests:
        request["ids"] = tokenizer(request["text"], add_special_tokens=False)["input_ids"]
    return requests


def prefix_sharing(requests: list[dict]) -> dict[str, float]:
    """Prompt tokens prefilled once per request, and those repeating a prefix already in the step:
    over the sorted prompts, each shares with its predecessor exactly its longest prefix in common
    with any prompt before it in that order, so the sum of neighbours' common prefixes is what an
    unbounded prefix cache would skip (independent of the order the requests came in)."""
    prompts = sorted(tuple(r["ids"]) for r in requests)
    repeated = sum(
        next((i for i, (a, b) in enumerate(zip(previous, current)) if a != b), min(len(previous), len(current)))
        for previous, current in zip(prompts, prompts[1:])
    )
    total = sum(len(p) for p in prompts)
    return {
        "requests": len(prompts),
        "prefilled_tokens": total,
        "repeated_prefix_tokens": repeated,
        "repeated_share": repeated / total if total else 0.0,
    }


async def replay(router_url: str, requests: list[dict], vocab: int, args: argparse.Namespace) -> dict[str, float]:
    """On a fresh worker: the step's prefills, and the served throughput as generation.py measures it.

    Prefill: every request of the step once with `max_new_tokens = 1` (the prefill and the token
    sampled from its logits; `0` computes nothing). Served tokens/s: `--served` requests of random
    ids (EOS ignored) through the project's pool client: generation.py's served measurement."""
    import torch

    from slime_meta.rollout.pools import SGLangPool

    prompt_len, new_tokens, in_flight, count = args.served
    pool = SGLangPool(name="replay", base_url=router_url, concurrency=max(len(requests), in_flight), timeout_s=600)
    first_token = {"max_new_tokens": 1, "temperature": 1.0, "ignore_eos": True}

    async def prefill() -> float:
        """Phase by phase as the step ran them (attempts of iteration 0, its teacher calls, ..., the
        holdout attempts), each phase's requests all at once: prompts of one kind batch together."""
        started = time.perf_counter()
        for phase in sorted({r["phase"] for r in requests}):
            await asyncio.gather(
                *[
                    pool.generate(input_ids=r["ids"], sampling_params=first_token)
                    for r in requests
                    if r["phase"] == phase
                ]
            )
        return time.perf_counter() - started

    try:
        await prefill()  # warm-up: the worker's first batches at these lengths
        prefill_s = min(await prefill(), await prefill())
        g = torch.Generator().manual_seed(1)
        batch = torch.randint(4, vocab, (count, prompt_len), generator=g).tolist()
        sampling = {"max_new_tokens": new_tokens, "temperature": 1.0, "top_k": -1, "top_p": 1.0, "ignore_eos": True}
        await asyncio.gather(
            *[pool.generate(input_ids=p, sampling_params=dict(sampling, max_new_tokens=4)) for p in batch[:8]]
        )
        gate = asyncio.Semaphore(in_flight)

        async def one(prompt: list[int]) -> int:
            async with gate:
                return len((await pool.generate(input_ids=prompt, sampling_params=sampling)).output_ids)

        started = time.perf_counter()
        generated = sum(await asyncio.gather(*[one(p) for p in batch]))
        served_s = time.perf_counter() - started
    finally:
        await pool.close()
    return {
        "prefill_only_s": prefill_s,
        "requests": len(requests),
        "served_s": served_s,
        "served_tokens": generated,
        "served_tokens_per_s": generated / served_s,
    }
