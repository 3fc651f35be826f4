"""The LLM grader's request over one aiohttp session: a candidate for `slime_meta/grading.py`.

Not part of the package. `benchmarks/inner_loop.py` runs it beside the project's `OpenAIGrader`
(which goes through the openai SDK, httpx and pydantic) to measure what the SDK costs the inner
loop in client CPU. It sends the same request (`POST {base_url}/chat/completions` with the
template's messages), parses the reply with the project's `parse_grade`, and re-asks an
unparseable reply like `OpenAIGrader` does. API-error retries are left out: the benchmark's
workers never fail, so they would not change the measurement.
"""

from __future__ import annotations

import asyncio
import json
import os

import aiohttp

from slime_meta.grading import REASK_MESSAGE, GraderStats, parse_grade
from slime_meta.prompt_templates import GraderPromptTemplate
from slime_meta.types import Grade, Problem


class AiohttpChatGrader:
    def __init__(
        self,
        *,
        model: str,
        base_url: str,
        concurrency: int = 32,
        temperature: float = 0.0,
        max_tokens: int = 512,
        parse_retries: int = 2,
        api_key_env: str = "OPENAI_API_KEY",
        timeout_s: float = 60.0,
        template: GraderPromptTemplate | None = None,
    ):
        self.model, self.url = model, base_url.rstrip("/") + "/chat/completions"
        self.temperature, self.max_tokens, self.parse_retries = temperature, max_tokens, parse_retries
        self.concurrency, self.timeout_s, self.api_key_env = concurrency, timeout_s, api_key_env
        self.template = template or GraderPromptTemplate()
        self.stats = GraderStats()
        self._session: aiohttp.ClientSession | None = None
        self._semaphore: asyncio.Semaphore | None = None

    def _resources(self) -> tuple[aiohttp.ClientSession, asyncio.Semaphore]:
        if self._session is None or self._session.closed:
            key = os.environ.get(self.api_key_env) or "EMPTY"
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=self.concurrency + 8),
                timeout=aiohttp.ClientTimeout(total=self.timeout_s),
                headers={"Authorization": f"Bearer {key}"},
            )
            self._semaphore = asyncio.Semaphore(self.concurrency)
        return self._session, self._semaphore  # type: ignore[return-value]

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()

    async def _complete(self, session: aiohttp.ClientSession, messages: list[dict]) -> str:
        payload = {"model": self.model, "messages": messages, "temperature": self.temperature,
                   "max_tokens": self.max_tokens}  # fmt: skip
        async with session.post(self.url, json=payload) as response:
            body = await response.read()
            if response.status != 200:
                raise RuntimeError(f"grader HTTP {response.status}: {body[:200]!r}")
        return json.loads(body)["choices"][0]["message"]["content"] or ""

    async def grade(self, problem: Problem, solution: str) -> Grade:
        session, semaphore = self._resources()
        messages = list(self.template.build(problem, solution))
        async with semaphore:
            self.stats.calls += 1
            for attempt in range(self.parse_retries + 1):
                reply = await self._complete(session, messages)
                grade = parse_grade(reply, quoted=solution)
                if grade.parsed:
                    return grade
                if attempt < self.parse_retries:
                    self.stats.parse_retries += 1
                    messages = messages + [{"role": "assistant", "content": reply}, {"role": "user", "content": REASK_MESSAGE}]
            self.stats.parse_failures += 1
            return grade
