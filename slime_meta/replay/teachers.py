"""The external teachers of trace replay: who they are (`--replay-teachers` specs) and how one is
asked (one OpenAI-compatible client and semaphore per teacher, retries, errors with keys redacted).

A call is retried like `grading.graders.OpenAIGrader` does (the SDK's own retries off; 408/409/429/5xx,
timeouts, connection errors and malformed 200 replies are retried with exponential backoff and jitter,
Retry-After honoured); one that still fails, or fails with another status, comes back as its error.
API keys are read from the environment by name when the clients are made and never kept here.
"""

from __future__ import annotations

import asyncio
import os
import random
import re
from dataclasses import dataclass
from typing import Any, Sequence
from urllib.parse import urlsplit

from slime_meta.errors import UserInputError
from slime_meta.grading.graders import _retry_after_seconds

DEFAULT_KEY_ENV = "OPENAI_API_KEY"
_RETRYABLE_STATUS = {408, 409, 429}  # and every 5xx, as in grading.OpenAIGrader
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_MAX_LOGGED_CHARS = 200


@dataclass(frozen=True)
class ReplayTeacher:
    """One teacher model behind an OpenAI-compatible API. `name` is the model name sent."""

    name: str
    base_url: str
    api_key_env: str = DEFAULT_KEY_ENV

    @property
    def label(self) -> str:
        """`name@base_url`: how the teacher is named in pairs, the cache and logs (no key)."""
        return f"{self.name}@{self.base_url}"


def parse_replay_teachers(specs: Sequence[str], flag: str = "--replay-teachers") -> list[ReplayTeacher]:
    """Teachers from `name@base_url` specs, optionally `name@base_url#ENV_VAR`.

    `ENV_VAR` names the environment variable holding that teacher's key (default
    `OPENAI_API_KEY`; a self-hosted server with no key set gets the dummy key "EMPTY"). The name is
    split at the first `@`, the env var at the last `#`. Raises `UserInputError` (one line naming
    the flag and the spec) for a malformed spec, a URL that is not http(s) or carries credentials
    or a query, a named env var that is not set, or the same teacher twice.
    """
    teachers: list[ReplayTeacher] = []
    for spec in specs:
        text = str(spec).strip()

        def bad(reason: str) -> UserInputError:
            return UserInputError(f"{flag} {text!r}: {reason}; expected name@base_url or name@base_url#ENV_VAR")

        name, at, rest = text.partition("@")
        if not at:
            raise bad("no '@' between the model name and the base URL")
        name = name.strip()
        if not name or any(ch.isspace() for ch in name):
            raise bad("the model name is empty or has spaces")
        base_url, hash_sign, env = rest.rpartition("#") if "#" in rest else (rest, "", "")
        base_url, env = base_url.strip().rstrip("/"), env.strip()
        if hash_sign and not _ENV_NAME.fullmatch(env):
            raise bad(f"'{env}' after '#' is not an environment variable name")
        try:
            parts = urlsplit(base_url)
            parts.port  # noqa: B018 - raises ValueError on a bad port
        except ValueError:
            raise bad("the base URL does not parse") from None
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise bad("the base URL must be http:// or https:// with a host")
        if parts.username is not None or parts.password is not None or parts.query:
            raise bad("the base URL must not carry credentials or a query; put the key in an env var (#ENV_VAR)")
        if hash_sign and not os.environ.get(env):
            raise bad(f"${env} is not set")
        teacher = ReplayTeacher(name=name, base_url=base_url, api_key_env=env or DEFAULT_KEY_ENV)
        if any(t.label == teacher.label for t in teachers):
            raise bad("this teacher is listed twice")
        teachers.append(teacher)
    return teachers


class TeacherClients:
    """The calls to the teachers, in the order of `teachers`. `concurrency` bounds the calls in flight
    per teacher (each teacher is its own server with its own limits); `initial_backoff`/`max_backoff`
    shape the retry waits when the server sends no Retry-After. Each call and each retry is counted
    in `stats` (`calls`, `api_retries`)."""

    def __init__(
        self,
        teachers: Sequence[ReplayTeacher],
        *,
        stats: Any,
        concurrency: int,
        temperature: float,
        max_tokens: int,
        request_timeout: float,
        max_api_retries: int,
        initial_backoff: float,
        max_backoff: float,
    ):
        self.teachers = tuple(teachers)
        self.stats = stats
        self.concurrency = concurrency
        self.temperature, self.max_tokens = temperature, max_tokens
        self.request_timeout, self.max_api_retries = request_timeout, max_api_retries
        self.initial_backoff, self.max_backoff = initial_backoff, max_backoff
        # Clients and semaphores belong to one event loop (see grading.OpenAIGrader._resources).
        self._loop: asyncio.AbstractEventLoop | None = None
        self._clients: list[Any] = []
        self._semaphores: list[asyncio.Semaphore] = []

    def _resources(self) -> tuple[list[Any], list[asyncio.Semaphore]]:
        loop = asyncio.get_running_loop()
        if self._loop is not loop:
            try:
                from openai import AsyncOpenAI  # lazy: the package imports without openai installed
            except ImportError:
                raise UserInputError("--replay-teachers needs the openai package: pip install 'slime-meta[api]'")
            self._clients = [
                AsyncOpenAI(
                    api_key=os.environ.get(teacher.api_key_env) or "EMPTY",
                    base_url=teacher.base_url,
                    timeout=self.request_timeout,
                    max_retries=0,
                )
                for teacher in self.teachers
            ]
            self._semaphores = [asyncio.Semaphore(self.concurrency) for _ in self.teachers]
            self._loop = loop
        return self._clients, self._semaphores

    async def aclose(self) -> None:
        if self._clients and self._loop is asyncio.get_running_loop():
            for client in self._clients:
                await client.close()
        self._clients, self._semaphores, self._loop = [], [], None

    def describe(self, teacher: ReplayTeacher, error: BaseException) -> str:
        """Type, status and a short message with the key (if the server echoed it) redacted."""
        status = getattr(error, "status_code", None)
        text = " ".join(str(error).split())
        key = os.environ.get(teacher.api_key_env)
        if key:
            text = text.replace(key, "<redacted>")
        return f"{type(error).__name__}" + (f" HTTP {status}" if status else "") + f": {text[:_MAX_LOGGED_CHARS]}"

    async def ask(self, index: int, prompt_text: str) -> tuple[str | None, BaseException | None]:
        """(reply text, None) or (None, the last error) once the retries are spent."""
        import openai

        teacher = self.teachers[index]
        clients, semaphores = self._resources()
        messages = [{"role": "user", "content": prompt_text}]
        async with semaphores[index]:
            self.stats.calls += 1
            attempt = 0
            while True:
                try:
                    response = await clients[index].chat.completions.create(
                        model=teacher.name, messages=messages, temperature=self.temperature, max_tokens=self.max_tokens
                    )
                    choices = getattr(response, "choices", None)
                    if not choices or choices[0].message is None:
                        raise ValueError("reply has no message")  # a malformed 200: retried like one
                    return choices[0].message.content or "", None
                except openai.APIStatusError as error:
                    if error.status_code not in _RETRYABLE_STATUS and error.status_code < 500:
                        return None, error  # 400/401/403/404/...: retrying will not help
                    wait, last_error = _retry_after_seconds(error.response.headers), error
                except (openai.APIConnectionError, openai.APIResponseValidationError, ValueError) as error:
                    wait, last_error = None, error  # timeouts, refused connections, bodies that do not parse
                if attempt >= self.max_api_retries:
                    return None, last_error
                if wait is None:
                    wait = min(self.initial_backoff * 2.0**attempt, self.max_backoff) * (1.0 - 0.25 * random.random())
                attempt += 1
                self.stats.api_retries += 1
                await asyncio.sleep(wait)
