"""Inference pools: a router URL that speaks SGLang's native `/generate` API.

The same client serves every mode: locally the pool is our embedded workers behind a real
sglang-router; on a cluster it is SGLang engines behind slime's router. One request per prompt
(the router rejects batched text lists). Concurrency is bounded per pool.

Retries: the router already re-sends a request whose worker failed to another worker; what
still reaches this client (5xx, 429, a dropped connection, a timeout, a truncated body) is
retried up to `max_retries` times. The wait before retry n is `initial_backoff_s * 2**n`, capped
at `max_backoff_s`, times a random factor in [0.5, 1.5) drawn per request, so that requests
that failed together do not come back together. A `Retry-After` header (seconds or an HTTP
date; also `retry-after-ms`) replaces that wait: the retry goes no earlier than asked (plus up
to 10% spread), capped at `MAX_RETRY_AFTER_S`. Other 4xx replies are not retried.
"""

from __future__ import annotations

import asyncio
import email.utils
import json
import math
import random
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import aiohttp

from slime_meta.errors import UserInputError
from slime_meta.types import Completion

_JSON_HEADERS = {"Content-Type": "application/json"}


def _text(body: bytes, limit: int) -> str:
    return body[:limit].decode("utf-8", "replace")


@dataclass
class PoolStats:
    requests: int = 0
    retries: int = 0
    failures: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0

    def snapshot_and_reset(self) -> dict[str, int]:
        values = dict(self.__dict__)
        for key in values:
            setattr(self, key, 0)
        return values


class PoolUnavailable(RuntimeError):
    """A pool kept failing after every retry."""


class PoolProtocolError(PoolUnavailable):
    """A pool answered 200 with a reply that breaks the /generate contract (not retried: a
    server that pairs log-probs with the wrong tokens does so again, and training on them is wrong)."""


MAX_RETRY_AFTER_S = 60.0


def retry_after_seconds(headers: Mapping[str, str] | None, now: float | None = None) -> float | None:
    """Seconds a server asked us to wait (`retry-after-ms`, or `Retry-After` in seconds or as an
    HTTP date), capped at `MAX_RETRY_AFTER_S`; None when it did not ask or the value is unusable."""
    if not headers:
        return None
    headers = {str(name).lower(): value for name, value in headers.items()}
    seconds = None
    milliseconds = headers.get("retry-after-ms")
    if milliseconds is not None:
        try:
            seconds = float(milliseconds) / 1000.0
        except ValueError:
            seconds = None
    value = headers.get("retry-after") if seconds is None else None
    if value is not None:
        try:
            seconds = float(value)
        except ValueError:
            try:
                when = email.utils.parsedate_to_datetime(value)
            except (TypeError, ValueError, IndexError):
                return None
            seconds = when.timestamp() - (time.time() if now is None else now)
    if seconds is None or not math.isfinite(seconds):
        return None
    return min(max(seconds, 0.0), MAX_RETRY_AFTER_S)


@dataclass
class SGLangPool:
    """Client of one pool. Create inside the event loop that uses it; `close()` at the end."""

    name: str
    base_url: str
    concurrency: int = 64
    timeout_s: float = 300.0
    max_retries: int = 3
    stats: PoolStats = field(default_factory=PoolStats)
    initial_backoff_s: float = 0.2
    max_backoff_s: float = 5.0

    def __post_init__(self):
        self.base_url = self.base_url.rstrip("/")
        self.max_retries = max(0, int(self.max_retries))  # -1 would mean "not even one attempt"
        self._semaphore = asyncio.Semaphore(self.concurrency)
        self._session: aiohttp.ClientSession | None = None

    async def _ensure_session(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            # The router holds connections open; a generous pool avoids head-of-line waits.
            connector = aiohttp.TCPConnector(limit=self.concurrency + 8)
            self._session = aiohttp.ClientSession(
                connector=connector,
                timeout=aiohttp.ClientTimeout(total=self.timeout_s),
                headers=_JSON_HEADERS,
                skip_auto_headers=("Accept-Encoding",),
                auto_decompress=False,
            )
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()

    def backoff_s(self, attempt: int, retry_after: float | None = None) -> float:
        """The wait before retry `attempt` (0-based): the server's Retry-After, else jittered backoff."""
        if retry_after is not None:
            return retry_after * (1.0 + 0.1 * random.random())
        return min(self.initial_backoff_s * 2.0**attempt, self.max_backoff_s) * (0.5 + random.random())

    async def post(self, path: str, payload: dict[str, Any]) -> Any:
        session = await self._ensure_session()
        body_bytes = json.dumps(payload).encode()  # once, not again on each retry
        async with self._semaphore:
            for attempt in range(self.max_retries + 1):
                retry_after = None
                try:
                    async with session.post(self.base_url + path, data=body_bytes) as response:
                        body = await response.read()
                        if response.status == 200:
                            reply = json.loads(body)  # a truncated body is retried, not counted as served
                            self.stats.requests += 1
                            return reply
                        if response.status < 500 and response.status not in (408, 429):
                            # A request the server refuses will be refused again: do not retry.
                            raise PoolUnavailable(
                                f"{self.name} pool {path}: HTTP {response.status}: {_text(body, 300)}"
                            )
                        error = f"HTTP {response.status}: {_text(body, 200)}"
                        retry_after = retry_after_seconds(response.headers)
                except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as exc:  # ValueError: a bad body
                    error = f"{type(exc).__name__}: {exc}"
                if attempt < self.max_retries:
                    self.stats.retries += 1
                    await asyncio.sleep(self.backoff_s(attempt, retry_after))
            self.stats.failures += 1
            raise PoolUnavailable(
                f"{self.name} pool at {self.base_url}{path} failed after {self.max_retries} retries: {error}"
            )

    def _check_logprob_tokens(self, output_ids: Sequence[int], entries: Sequence[Any]) -> None:
        """Each `[logprob, token_id, text]` entry must be the log-prob of the output token at its position.

        The trainer pairs `output_logprobs[i]` with `output_ids[i]` (the PPO ratio's denominator):
        log-probs of other tokens, or shifted by one, would train on wrong ratios without an error.
        """
        problem = None
        if len(entries) != len(output_ids):
            problem = f"returned {len(entries)} log-probs for {len(output_ids)} tokens"
        else:
            for position, (token_id, entry) in enumerate(zip(output_ids, entries)):
                if _logprob_token_id(entry) != token_id:
                    problem = (
                        f"returned output_token_logprobs for token {_logprob_token_id(entry)!r} at output position "
                        f"{position}, where output_ids has {token_id}: log-probs and tokens do not match"
                    )
                    break
        if problem is not None:
            self.stats.failures += 1
            raise PoolProtocolError(f"{self.name} pool at {self.base_url}/generate {problem}")

    async def generate(
        self,
        *,
        text: str | None = None,
        input_ids: Sequence[int] | None = None,
        sampling_params: dict[str, Any],
        return_logprob: bool = False,
    ) -> Completion:
        completions = await self.generate_n(
            text=text, input_ids=input_ids, sampling_params=sampling_params, return_logprob=return_logprob, n=1
        )
        return completions[0]

    async def generate_n(
        self,
        *,
        text: str | None = None,
        input_ids: Sequence[int] | None = None,
        sampling_params: dict[str, Any],
        return_logprob: bool = False,
        n: int,
    ) -> list[Completion]:
        """`n` completions of one prompt in one request (SGLang's `sampling_params.n`).

        The server shares the prompt's prefill among the n rows and answers with a list of n
        result objects; with n = 1 the request carries no `n` and the answer is one object.
        """
        payload: dict[str, Any] = {"sampling_params": sampling_params if n == 1 else {**sampling_params, "n": n}}
        if input_ids is not None:
            payload["input_ids"] = list(input_ids)
        else:
            payload["text"] = text
        if return_logprob:
            payload["return_logprob"] = True
        reply = await self.post("/generate", payload)
        results = reply if isinstance(reply, list) else [reply]
        if len(results) != n or not all(isinstance(result, dict) for result in results):
            self.stats.failures += 1
            raise PoolProtocolError(
                f"{self.name} pool at {self.base_url}/generate returned {len(results)} results for n={n}"
            )
        return [self._completion(result, input_ids, return_logprob) for result in results]

    def _completion(self, reply: dict[str, Any], input_ids: Sequence[int] | None, return_logprob: bool) -> Completion:
        meta = reply.get("meta_info", {})
        self.stats.prompt_tokens += int(meta.get("prompt_tokens", 0))
        self.stats.completion_tokens += int(meta.get("completion_tokens", 0))
        output_ids = tuple(reply.get("output_ids") or ())
        entries = meta.get("output_token_logprobs") or ()
        logprobs = tuple(float(entry[0]) for entry in entries)
        if return_logprob:
            self._check_logprob_tokens(output_ids, entries)
        finish = meta.get("finish_reason") or {}
        return Completion(
            text=reply.get("text", ""),
            prompt_ids=tuple(input_ids or ()),
            output_ids=output_ids,
            output_logprobs=logprobs,
            finish_reason=finish.get("type", "stop") if isinstance(finish, dict) else str(finish),
            weight_version=str(meta.get("weight_version")) if meta.get("weight_version") is not None else None,
        )


def _logprob_token_id(entry: Any) -> Any:
    return entry[1] if isinstance(entry, (list, tuple)) and len(entry) > 1 else None


def check_reachable(url: str, flag: str, timeout_s: float = 5.0) -> None:
    """Fail with one line naming the flag when a router given by the user does not answer."""
    for path in ("/readiness", "/health"):
        try:
            with urllib.request.urlopen(url.rstrip("/") + path, timeout=timeout_s) as response:
                if response.status == 200:
                    return
        except urllib.error.HTTPError as exc:
            if path == "/readiness" and exc.code == 404:
                continue  # a bare SGLang server has no /readiness; /health decides
            raise UserInputError(f"{flag}: {url}{path} answered HTTP {exc.code}; start the server or fix the address")
        except (urllib.error.URLError, OSError) as exc:
            raise UserInputError(
                f"{flag}: cannot reach {url} ({getattr(exc, 'reason', exc)}); start the router or fix the address"
            )
    raise UserInputError(f"{flag}: {url} is not ready; start the router or fix the address")


def post_json_sync(url: str, payload: dict[str, Any], timeout_s: float = 120.0) -> dict[str, Any]:
    """A blocking JSON POST, for control calls outside the event loop (weight updates)."""
    request = urllib.request.Request(
        url, data=json.dumps(payload).encode(), headers={"Content-Type": "application/json"}, method="POST"
    )
    with urllib.request.urlopen(request, timeout=timeout_s) as response:
        return json.loads(response.read().decode())
