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
        self.status_code, self.headers, self.body = status_code, headers, body


class ChatAPIConnectionError(Exception):
    """No usable answer: connection refused or reset, timeout, or a 200 whose body is not a completion.

    The message names the cause and the URL; it never holds a header (the key is in one).
    """


class ChatAPITimeoutError(ChatAPIConnectionError):
    """No whole reply within the client's timeout (`timeout_s`, the time for the whole exchange)."""

    def __init__(self, url: str, timeout_s: float):
        super().__init__(f"timed out after {timeout_s:g} s waiting for {url}")
        self.timeout_s = timeout_s


class ChatAPIRefusedError(ChatAPIConnectionError):
    """Nothing listens at the URL's host and port (or a firewall said so)."""


def _connection_failure(url: str, error: BaseException) -> ChatAPIConnectionError:
    """The error that names what went wrong with one exchange, in words a user can act on (timeouts aside)."""
    if isinstance(error, aiohttp.ClientConnectorError):
        cause = error.os_error
        if isinstance(cause, ConnectionRefusedError):
            return ChatAPIRefusedError(f"connection refused at {url}")
        if isinstance(error, getattr(aiohttp, "ClientConnectorDNSError", ())):
            return ChatAPIConnectionError(f"cannot resolve the host of {url}")
        return ChatAPIConnectionError(f"cannot connect to {url}: {cause.strerror or cause}")
    if isinstance(error, aiohttp.ServerDisconnectedError):
        return ChatAPIConnectionError(f"the server at {url} closed the connection before replying")
    return ChatAPIConnectionError(f"request to {url} failed: {type(error).__name__}: {error}")


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
        except asyncio.TimeoutError:  # aiohttp's ServerTimeoutError is one too
            raise ChatAPITimeoutError(self.url, self.timeout_s) from None
        except (aiohttp.ClientError, OSError) as error:
            raise _connection_failure(self.url, error) from None
        if status != 200:
            raise ChatAPIStatusError(status, headers, body[:500].decode("utf-8", "replace"))
        try:
            message = json.loads(body)["choices"][0]["message"]
            content = message.get("content")
        except (ValueError, KeyError, IndexError, TypeError, AttributeError):
            shown = body[:200].decode("utf-8", "replace")
            raise ChatAPIConnectionError(f"a reply from {self.url} that is not a chat completion: {shown}") from None
        if content is not None and not isinstance(content, str):
            raise ChatAPIConnectionError(f"a reply from {self.url} whose message content is not text")
        return content or ""

    async def aclose(self) -> None:
        if self._session is not None and self._loop is asyncio.get_running_loop():
            await self._session.close()
        self._session = self._loop = None
