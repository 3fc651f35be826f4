"""A minimal client for OpenAI-compatible `POST {base_url}/chat/completions`, over aiohttp.

Why not the openai SDK on the hot path: the inner loop sends thousands of grader requests per
outer step from one Python thread, and the SDK (httpx's connection pool, pydantic models per
request and reply) costs about 5.8 ms of client CPU per request against about 0.4 ms for the
same exchange here (`benchmarks/inner_loop.py`, docs/performance.md section 1). The step is bound
by that CPU, not by the servers. Retries are the caller's policy (see `grading.OpenAIGrader`);
this module only sends one request and classifies what came back.

The API key is read from the environment when a session is made and lives only in the session's
default headers: never in this object's fields, its repr, or an error message.
"""

from __future__ import annotations

import asyncio
import json
import os
from typing import Any

import aiohttp

DEFAULT_BASE_URL = "https://api.openai.com/v1"


class ChatAPIStatusError(Exception):
    """The server answered with an HTTP error status."""

    def __init__(self, status_code: int, headers: Any, body: str):
        super().__init__(f"HTTP {status_code}: {body}")
        self.status_code, self.headers = status_code, headers


class ChatAPIConnectionError(Exception):
    """No usable answer: connection refused or reset, timeout, or a 200 whose body is not a completion."""


class ChatCompletionsClient:
    """One aiohttp session per event loop (a caller may run `asyncio.run` once per step)."""

    def __init__(self, *, base_url: str | None, api_key_env: str, timeout_s: float, connection_limit: int):
        self.url = (base_url or DEFAULT_BASE_URL).rstrip("/") + "/chat/completions"
        self.api_key_env, self.timeout_s, self.connection_limit = api_key_env, timeout_s, connection_limit
        self._loop: asyncio.AbstractEventLoop | None = None
        self._session: aiohttp.ClientSession | None = None

    def __repr__(self) -> str:
        return f"ChatCompletionsClient(url={self.url!r}, api_key_env={self.api_key_env!r})"

    def _session_for_this_loop(self) -> aiohttp.ClientSession:
        loop = asyncio.get_running_loop()
        if self._loop is not loop or self._session is None or self._session.closed:
            # A session left by an earlier (closed) loop cannot be closed from this one; its
            # connections went with that loop.
            key = os.environ.get(self.api_key_env) or "EMPTY"  # a self-hosted server takes any key
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=self.connection_limit),
                timeout=aiohttp.ClientTimeout(total=self.timeout_s),
                headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"},
            )
            self._loop = loop
        return self._session

    async def create(self, payload: dict[str, Any]) -> str:
        """The first choice's message text. Raises ChatAPIStatusError or ChatAPIConnectionError."""
        session = self._session_for_this_loop()
        try:
            async with session.post(self.url, data=json.dumps(payload)) as response:
                body = await response.read()
                status, headers = response.status, response.headers
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as error:
            raise ChatAPIConnectionError(f"{type(error).__name__}: {error}") from None
        if status != 200:
            raise ChatAPIStatusError(status, headers, body[:500].decode("utf-8", "replace"))
        try:
            message = json.loads(body)["choices"][0]["message"]
            content = message.get("content")
        except (ValueError, KeyError, IndexError, TypeError, AttributeError):
            raise ChatAPIConnectionError(f"malformed reply body: {body[:200].decode('utf-8', 'replace')}") from None
        if content is not None and not isinstance(content, str):
            raise ChatAPIConnectionError("malformed reply: message content is not text")
        return content or ""

    async def aclose(self) -> None:
        if self._session is not None and self._loop is asyncio.get_running_loop():
            await self._session.close()
        self._session = self._loop = None
