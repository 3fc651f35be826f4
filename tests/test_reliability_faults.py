"""Flaky servers: the inference client (`SGLangPool`) and the replay teachers against real local
HTTP servers that fail a fifth of their calls (429 with Retry-After, 500/503, a reply slower than
the client's timeout, a truncated body). Every call completes, each retry is counted, Retry-After
is honoured, retries are bounded and spread by a per-request jitter.

The grader's side of the same faults is proven in tests/test_grading.py (in-process, timeouts
included) and tests/test_reliability_runs.py (a whole run).
"""

from __future__ import annotations

import asyncio
import contextlib
import email.utils
import random
import threading
import time
from collections import Counter
from typing import Iterator

import pytest
from aiohttp import web
from openai_server import run_openai_server

from slime_meta.rollout.pools import (
    MAX_RETRY_AFTER_S,
    PoolProtocolError,
    PoolUnavailable,
    SGLangPool,
    retry_after_seconds,
)

FAULTS = ("rate_limit", "server_error", "unavailable", "slow", "malformed", "bad_request")


class FlakyInference:
    """What a router answers, with faults chosen per request (seeded) or scripted in order."""

    def __init__(self, *, script=(), seed=0, retry_after="0", slow_s=1.0, **fractions: float):
        self.script, self.retry_after, self.slow_s = list(script), retry_after, slow_s
        self.fractions = fractions
        self.rng = random.Random(seed)
        self.faults: Counter = Counter()
        self.requests = 0
        self.lock = threading.Lock()

    def choose(self) -> str | None:
        with self.lock:
            self.requests += 1
            if self.script:
                fault = self.script.pop(0)
            else:
                draw, threshold, fault = self.rng.random(), 0.0, None
                for kind in FAULTS:
                    threshold += self.fractions.get(kind, 0.0)
                    if draw < threshold:
                        fault = kind
                        break
            if fault:
                self.faults[fault] += 1
            return fault

    async def generate(self, request: web.Request) -> web.Response:
        body = await request.json()
        fault = self.choose()
        if fault == "rate_limit":
            return web.json_response({"error": "slow down"}, status=429, headers={"Retry-After": self.retry_after})
        if fault == "unavailable":
            return web.json_response({"error": "no workers"}, status=503, headers={"Retry-After": self.retry_after})
        if fault == "server_error":
            return web.json_response({"error": "boom"}, status=500)
        if fault == "bad_request":
            return web.json_response({"error": "bad"}, status=400)
        if fault == "malformed":
            return web.Response(text='{"text": "trunc', content_type="application/json")
        if fault == "slow":
            await asyncio.sleep(self.slow_s)
        text = body.get("text", "")
        return web.json_response(
            {
                "text": text[::-1],
                "output_ids": [1, 2],
                "meta_info": {"prompt_tokens": len(text), "completion_tokens": 2, "finish_reason": {"type": "length"}},
            }
        )

    @property
    def retryable(self) -> int:
        return sum(count for kind, count in self.faults.items() if kind != "bad_request")


@contextlib.contextmanager
def serve(server: FlakyInference) -> Iterator[str]:
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    app = web.Application()
    app.router.add_post("/generate", server.generate)
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)

    async def start() -> int:
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        return runner.addresses[0][1]

    try:
        port = asyncio.run_coroutine_threadsafe(start(), loop).result(timeout=10)
        yield f"http://127.0.0.1:{port}"
    finally:
        with contextlib.suppress(Exception):
            asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(timeout=10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=10)
        loop.close()


def pool_at(url: str, **overrides) -> SGLangPool:
    settings = dict(
        name="test",
        base_url=url,
        concurrency=16,
        timeout_s=0.4,
        max_retries=6,
        initial_backoff_s=0.01,
        max_backoff_s=0.05,
    )
    return SGLangPool(**{**settings, **overrides})


async def generate_all(pool: SGLangPool, count: int) -> list:
    try:
        return await asyncio.gather(
            *(pool.generate(text=f"prompt {i}", sampling_params={"max_new_tokens": 2}) for i in range(count))
        )
    finally:
        await pool.close()


def test_every_request_completes_when_a_fifth_of_the_calls_fail():
    server = FlakyInference(
        rate_limit=0.05, unavailable=0.03, server_error=0.04, slow=0.03, malformed=0.05, seed=4, slow_s=1.0
    )
    with serve(server) as url:
        pool = pool_at(url)
        completions = asyncio.run(generate_all(pool, 300))
    assert [c.text for c in completions] == [f"prompt {i}"[::-1] for i in range(300)]
    assert set(server.faults) == {"rate_limit", "unavailable", "server_error", "slow", "malformed"}
    assert server.retryable > 30  # about a fifth of ~330 calls
    # Each faulted call was retried once and counted once; none gave up.
    assert pool.stats.retries == server.retryable and pool.stats.failures == 0
    assert pool.stats.requests == 300 == server.requests - server.retryable
    print(f"\npool faults {dict(server.faults)}: {pool.stats.retries} retries, 0 failures")


@pytest.mark.parametrize("fault", ["rate_limit", "unavailable"])
def test_retry_after_is_honoured(fault):
    server = FlakyInference(script=[fault], retry_after="1")
    with serve(server) as url:
        pool = pool_at(url)  # own backoff: 10 ms
        started = time.monotonic()
        (completion,) = asyncio.run(generate_all(pool, 1))
        elapsed = time.monotonic() - started
    assert completion.text and pool.stats.retries == 1
    assert 1.0 <= elapsed < 1.0 * 1.1 + 0.5  # no earlier than asked; at most 10% spread


def test_retry_after_forms_and_limits():
    now = time.time()
    assert retry_after_seconds({"Retry-After": "2"}) == 2.0
    assert retry_after_seconds({"retry-after": "0.5"}) == 0.5
    assert retry_after_seconds({"retry-after-ms": "1500", "Retry-After": "9"}) == 1.5
    in_three = email.utils.formatdate(now + 3, usegmt=True)
    assert 1.5 < retry_after_seconds({"Retry-After": in_three}, now=now) <= 3.0
    assert retry_after_seconds({"Retry-After": email.utils.formatdate(now - 60, usegmt=True)}, now=now) == 0.0
    assert retry_after_seconds({"Retry-After": "86400"}) == MAX_RETRY_AFTER_S
    for unusable in ({}, None, {"Retry-After": "soon"}, {"Retry-After": "nan"}, {"X-Other": "1"}):
        assert retry_after_seconds(unusable) is None


def test_backoff_grows_is_capped_and_jittered_per_request():
    pool = SGLangPool(name="p", base_url="http://127.0.0.1:9", initial_backoff_s=0.2, max_backoff_s=5.0)
    for attempt, base in enumerate((0.2, 0.4, 0.8, 1.6, 3.2, 5.0, 5.0)):
        waits = [pool.backoff_s(attempt) for _ in range(200)]
        assert all(0.5 * base <= w < 1.5 * base for w in waits), attempt
        assert len(set(waits)) > 150  # requests that failed together come back apart
    assert all(3.0 <= pool.backoff_s(0, retry_after=3.0) <= 3.3 for _ in range(100))


def test_retries_are_bounded_and_refusals_are_not_retried():
    server = FlakyInference(server_error=1.0)
    with serve(server) as url:
        pool = pool_at(url, max_retries=3)
        with pytest.raises(PoolUnavailable, match="after 3 retries: HTTP 500"):
            asyncio.run(generate_all(pool, 1))
    assert server.requests == 4 and pool.stats.retries == 3 and pool.stats.failures == 1

    server = FlakyInference(bad_request=1.0)
    with serve(server) as url:
        pool = pool_at(url)
        with pytest.raises(PoolUnavailable, match="HTTP 400"):
            asyncio.run(generate_all(pool, 1))
    assert server.requests == 1 and pool.stats.retries == 0


def test_replay_teachers_answer_through_a_fifth_of_failed_calls(tmp_path, monkeypatch):
    replay = pytest.importorskip("slime_meta.replay.pairs")
    from slime_meta.replay.teachers import parse_replay_teachers

    monkeypatch.setenv("REPLAY_TEST_KEY", "sk-replay-test")
    faults = dict(rate_limit=0.05, server_error=0.05, slow=0.05, malformed=0.05, slow_seconds=3.0, seed=5)
    with run_openai_server(reply_fn=lambda messages: "Working.\nAnswer: 42", **faults) as (base_url, server):
        teachers = parse_replay_teachers([f"t{i}@{base_url}#REPLAY_TEST_KEY" for i in range(3)])
        pairer = replay.ReplayPairer(
            teachers,
            min_agree=2,
            cache_path=tmp_path / "replay.jsonl",
            request_timeout=1.5,  # under the slow fault's 3 s, well over a reply on a busy 2-core machine
            max_api_retries=5,
            initial_backoff=0.01,
            max_backoff=0.05,
        )
        requests = [replay.ReplayRequest.build(f"What is 6*7? ({i})", "Answer: 41", f"p{i}") for i in range(20)]
        pairs = pairer.pairs_for_sync(requests)
    # Every fault is retried; on a loaded machine a reply that is merely late times out and is retried
    # too (the server shares this process), so the retries may outnumber the faults, never the reverse.
    assert pairer.stats.api_retries >= server.retryable_faults > 0 and pairer.stats.api_failures == 0
    assert pairer.stats.calls <= len(server.requests) <= pairer.stats.calls + pairer.stats.api_retries
    assert len(pairs) == 20 and all(p.chosen_answer == "42" and p.rejected_answer == "41" for p in pairs)
    assert {r.authorization for r in server.requests} == {"Bearer sk-replay-test"}
    assert "sk-replay-test" not in (tmp_path / "replay.jsonl").read_text()


class LogprobReplies:
    """A server whose log-prob entries name the tokens given, whatever `output_ids` says."""

    def __init__(self, logprob_ids: list[int]):
        self.logprob_ids, self.requests = logprob_ids, 0

    async def generate(self, request: web.Request) -> web.Response:
        self.requests += 1
        entries = [[-0.5 - index, token_id, None] for index, token_id in enumerate(self.logprob_ids)]
        meta = {"output_token_logprobs": entries, "finish_reason": {"type": "length"}, "completion_tokens": 3}
        return web.json_response({"text": "abc", "output_ids": [5, 6, 7], "meta_info": meta})


async def generate_with_logprobs(pool: SGLangPool):
    try:
        return await pool.generate(input_ids=[1, 2], sampling_params={"max_new_tokens": 3}, return_logprob=True)
    finally:
        await pool.close()


@pytest.mark.parametrize(
    "logprob_ids, position",
    [([5, 7, 6], 1), ([6, 7, 8], 0), ([5, 6, None], 2)],  # swapped, shifted by one, id missing
)
def test_log_probs_of_other_tokens_are_a_protocol_error_and_not_retried(logprob_ids, position):
    server = LogprobReplies(logprob_ids)
    with serve(server) as url:
        pool = pool_at(url)
        with pytest.raises(PoolProtocolError, match=f"output position {position}, where output_ids has"):
            asyncio.run(generate_with_logprobs(pool))
    assert server.requests == 1 and pool.stats.retries == 0 and pool.stats.failures == 1
    assert issubclass(PoolProtocolError, PoolUnavailable)  # train.py ends the run with its one line


def test_log_probs_of_the_output_tokens_are_accepted():
    with serve(LogprobReplies([5, 6, 7])) as url:
        completion = asyncio.run(generate_with_logprobs(pool_at(url)))
    assert completion.output_ids == (5, 6, 7) and completion.output_logprobs == (-0.5, -1.5, -2.5)
