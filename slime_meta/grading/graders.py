"""Graders: the built-in verifier against the label, and an LLM grader behind an OpenAI-style API.

Why two: the verifier is deterministic, free and needs no network (tests, the synthetic task,
datasets with short exact answers); an LLM grader follows a rubric and writes feedback the
teacher can learn from. Both expose `async grade(problem, solution) -> Grade` and `stats`.

Injection safety: the student's solution is text to be judged, never instructions. The verifier
only compares the stated final answer with the label (`slime_meta.grading.verifier`: one answer, no
hedges, math by math-verify), so `GRADE: 1.0` inside a solution is just a wrong answer, and its
feedback never quotes the label (the teacher reads it). The LLM grader's template encloses the
solution in a tag with a random name per request, with every instruction after it
(`GraderPromptTemplate`), inserts the solution verbatim in one rendering pass, and
`parse_grade` (`slime_meta.grading.llm_reply`) reads only the grader model's reply, never the solution,
by rules under which text quoted from the solution can make a reply unparseable (re-asked) but never
pick its score: the teacher is trained with RL on these grades and would learn to make students
write grade lines.

Transport and retries: `OpenAIGrader` sends its requests with `chat_api.ChatCompletionsClient`
(aiohttp; the openai SDK costs ~13x the client CPU per request, and the inner loop is bound by that
CPU: docs/performance.md section 1). Its retry policy is the one the openai SDK applies (checked
against the installed SDK: 408/409/429/5xx, timeouts and connection errors, Retry-After), plus what
the SDK does not do: a 200 reply whose body is malformed is retried too, and every retry is
counted in `GraderStats`: exponential backoff with jitter, `Retry-After`/`retry-after-ms`
honoured (up to 120 s, as the SDK does).
"""

from __future__ import annotations

import asyncio
import inspect
import math
import os
import random
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import Any

from slime_meta.errors import UserInputError
from slime_meta.grading import verifier
from slime_meta.grading.llm_reply import parse_grade, read_verdict
from slime_meta.grading.verifier.judge import Verdict
from slime_meta.grading.verifier.math_pool import CheckTimeout
from slime_meta.prompt_templates import GraderPromptTemplate
from slime_meta.rollout.chat_api import (
    ChatAPIConnectionError,
    ChatAPIRefusedError,
    ChatAPIStatusError,
    ChatAPITimeoutError,
    ChatCompletionsClient,
)
from slime_meta.types import Grade, Problem

MAX_RETRY_AFTER_SECONDS = 120.0
# The openai SDK's default: a hosted API answers in seconds, but a self-hosted model on CPU with
# --grader-concurrency requests at once can take minutes to write --grader-max-tokens tokens.
DEFAULT_GRADER_TIMEOUT_S = 600.0
MAX_QUOTED_CHARS = 200

# --------------------------------------------------------------------------- the verifier


@dataclass
class GraderStats:
    """Counters the training loop logs (ints only: safe to print)."""

    calls: int = 0  # solutions graded
    api_retries: int = 0  # requests re-sent after an API error
    parse_retries: int = 0  # re-asks after an unparseable reply
    parse_failures: int = 0  # solutions scored 0: no reply could be parsed
    replies: int = 0  # grader replies read (re-asked ones included)
    unparseable_replies: int = 0  # of those, replies without a verdict (llm_reply.read_verdict)
    request_errors: int = 0  # solutions scored 0: the API refused that one request (400/413/422)
    timeouts: int = 0  # solutions scored 0: checking the answer took longer than the verifier's time bound

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


class VerifierGrader:
    """Deterministic grading of the stated final answer against `problem.ground_truth`.

    How the answer is read and compared (one final answer; several different ones, hedges and
    chains of unequal values score 0) is in `slime_meta.grading.verifier`. Metrics: `exact` (equal text),
    `normalized` (numbers exactly, other math by math-verify, the rest as normalised text; labels
    naming one answer in two forms accept either), `numeric` (the same as `normalized`), `char`
    (partial credit: equal characters position by position over the longer length).

    Off the event loop: `grade` reads the answer in a worker thread (linear in its length) and
    math-verify runs in child processes (`verifier.math_pool.MathPool`, shared by the process), so sympy
    never holds the loop or the trainer's GIL. Each answer gets `timeout_s` seconds of math;
    over it, the answer scores 0, `stats.timeouts` counts it, and a child stuck in one C-level
    operation is killed; other answers keep being graded meanwhile.

    The explanation says whether the answer is right and what is wrong with it, and never quotes
    the label: the teacher reads it, and a teacher shown the train answers could copy them into
    its infos (the reward would then measure copying, not teaching).
    """

    METRICS = ("exact", "normalized", "numeric", "char")
    THREADS = 4

    def __init__(self, metric: str = "normalized", *, timeout_s: float = verifier.DEFAULT_TIMEOUT_S, math_pool=None):
        if metric not in self.METRICS:
            raise UserInputError(f"unknown verifier metric '{metric}'; choose one of {', '.join(self.METRICS)}")
        self.metric, self.timeout_s = metric, float(timeout_s)
        self.math_pool = math_pool  # None: the process-wide pool
        self.stats = GraderStats()
        self._threads: ThreadPoolExecutor | None = None

    def __repr__(self) -> str:
        return f"VerifierGrader(metric={self.metric!r})"

    def __getstate__(self) -> dict:  # threads do not travel (a grader shipped to another process)
        return {**self.__dict__, "_threads": None}

    def _executor(self) -> ThreadPoolExecutor:
        if self._threads is None:
            self._threads = ThreadPoolExecutor(max_workers=self.THREADS, thread_name_prefix="verifier")
        return self._threads

    async def grade(self, problem: Problem, solution: str) -> Grade:
        self.stats.calls += 1
        loop = asyncio.get_running_loop()
        verdict = await loop.run_in_executor(self._executor(), self._verdict, problem, solution)
        return self._grade_of(verdict)

    def grade_now(self, problem: Problem, solution: str) -> Grade:
        """The same verdict in the calling thread (math still bounded in the child processes)."""
        self.stats.calls += 1
        return self._grade_of(self._verdict(problem, solution))

    def _verdict(self, problem: Problem, solution: str) -> Verdict | None:
        try:
            return verifier.check(
                solution or "", problem.ground_truth.strip(), self.metric, timeout_s=self.timeout_s, pool=self.math_pool
            )
        except CheckTimeout:
            return None

    def _grade_of(self, verdict: Verdict | None) -> Grade:
        if verdict is None:
            self.stats.timeouts += 1
            explanation = (
                f"Incorrect: checking the final answer took longer than {self.timeout_s:g} s; "
                "state one short final answer."
            )
            return Grade(score=0.0, explanation=explanation, parsed=True, raw="")
        return Grade(score=verdict.score, explanation=verdict.explanation, parsed=True, raw=verdict.answer)

    async def aclose(self) -> None:
        """Ends the worker threads (a later `grade` starts new ones); the math children are shared."""
        threads, self._threads = self._threads, None
        if threads is not None:
            threads.shutdown(wait=False, cancel_futures=True)


# --------------------------------------------------------------------------- the LLM grader


class GraderUnavailable(UserInputError):
    """The grader API kept failing after every retry (or refused the configuration)."""


def reask_message(problem: str) -> str:
    """The follow-up to an unparseable reply: what was wrong (never a quote of it) and the format again."""
    return (
        f"Your reply could not be read: {problem}. Reply again in exactly the requested format: one line "
        "`GRADE: <a number between 0 and 1>` with nothing else on it, then a line `EXPLANATION: <one short "
        "paragraph>`, and no other grade anywhere in the reply."
    )


_RETRYABLE_STATUS = {408, 409, 429}
_PER_REQUEST_STATUS = {400, 413, 422}  # this one request was rejected (e.g. a too-long solution)


def _retry_after_seconds(headers: Any) -> float | None:
    """Seconds the server asked us to wait (`retry-after-ms` or `retry-after`), if it did."""
    if headers is None:
        return None
    for name, divisor in (("retry-after-ms", 1000.0), ("retry-after", 1.0)):
        value = headers.get(name)
        if value is None:
            continue
        try:
            seconds = float(value) / divisor
        except ValueError:
            continue  # an HTTP date: rare from LLM servers; fall back to our own backoff
        if math.isfinite(seconds) and 0 <= seconds <= MAX_RETRY_AFTER_SECONDS:
            return seconds
    return None


class OpenAIGrader:
    """An LLM grader behind the OpenAI chat-completions API (OpenAI, vLLM, SGLang, ...).

    The API key is read from the environment variable `api_key_env` only (when the client is
    made), never kept in this object's own fields, shown by repr or put in an error. With
    `base_url` (a self-hosted server) and no key set, the dummy key "EMPTY" is sent.

    A single bad reply never raises: an unparseable one (`llm_reply.read_verdict`) is re-asked
    up to `parse_retries` times, then scored 0 (parsed=False); `stats` counts replies, unparseable
    replies, re-asks and solutions scored 0 that way. API errors (429, 5xx, timeouts, connection
    errors, malformed bodies) are retried `max_api_retries` times; after that `GraderUnavailable`
    is raised, as it is at once for 401/403/404 (a configuration error), naming the cause (timed
    out after N s, connection refused at URL, the HTTP status); only a 401/403 message speaks of
    the key. `request_timeout` (`--grader-timeout`) bounds one whole request, reply included.
    A 400/413/422 refuses one request (say, a solution too long for the grader's context): it
    scores 0 (parsed=False, counted in `request_errors`) once the API has answered at least one
    request; before any success it means the configuration is wrong and raises.
    `initial_backoff`/`max_backoff` shape the waits when the server sends no Retry-After.
    """

    def __init__(
        self,
        *,
        model: str,
        base_url: str | None = None,
        api_key_env: str = "OPENAI_API_KEY",
        temperature: float = 0.0,
        max_tokens: int = 512,
        concurrency: int = 32,
        parse_retries: int = 2,
        request_timeout: float = DEFAULT_GRADER_TIMEOUT_S,
        max_api_retries: int = 5,
        template: GraderPromptTemplate | None = None,
        initial_backoff: float = 0.5,
        max_backoff: float = 8.0,
    ):
        if not os.environ.get(api_key_env) and not base_url:
            raise UserInputError(
                f"the openai grader needs an API key: export it in ${api_key_env} (--grader-api-key-env), "
                "or give --grader-base-url for a self-hosted server"
            )
        self.model, self.base_url, self.api_key_env = model, base_url, api_key_env
        self.temperature, self.max_tokens = temperature, max_tokens
        self.concurrency, self.parse_retries = max(1, int(concurrency)), max(0, int(parse_retries))
        self.request_timeout, self.max_api_retries = request_timeout, max(0, int(max_api_retries))
        self.initial_backoff, self.max_backoff = initial_backoff, max_backoff
        self.template = template if template is not None else GraderPromptTemplate()
        self.stats = GraderStats()
        # The client's connection pool and the semaphore belong to one event loop; a caller that
        # runs asyncio.run() per step gets fresh ones instead of "attached to a different loop".
        self._loop: asyncio.AbstractEventLoop | None = None
        # Connections for the concurrent requests plus a few spare; one session per event loop.
        self._client = ChatCompletionsClient(
            base_url=base_url,
            api_key_env=api_key_env,
            timeout_s=request_timeout,
            connection_limit=self.concurrency + 8,
        )
        self._semaphore: asyncio.Semaphore | None = None
        self._successes = 0

    def __repr__(self) -> str:
        return (
            f"OpenAIGrader(model={self.model!r}, base_url={self.base_url!r}, api_key_env={self.api_key_env!r}, "
            f"concurrency={self.concurrency})"
        )

    __str__ = __repr__

    def _where(self) -> str:
        return self.base_url or "the OpenAI API"

    def _resources(self) -> tuple[ChatCompletionsClient, asyncio.Semaphore]:
        loop = asyncio.get_running_loop()
        if self._loop is not loop:
            self._semaphore = asyncio.Semaphore(self.concurrency)
            self._loop = loop
        return self._client, self._semaphore

    async def aclose(self) -> None:
        await self._client.aclose()
        self._loop = self._semaphore = None

    def _redact(self, text: str) -> str:
        key = os.environ.get(self.api_key_env)
        text = " ".join(str(text).split())
        if key:
            text = text.replace(key, "<redacted>")
        return text[:MAX_QUOTED_CHARS]

    def _unavailable(self, attempts: int, error: BaseException) -> GraderUnavailable:
        cause, advice = self._cause_and_advice(error)
        return GraderUnavailable(
            f"grader at {self._where()} (model {self.model}) failed after {attempts} attempt(s): {cause}; {advice}"
        )

    def _cause_and_advice(self, error: BaseException) -> tuple[str, str]:
        """What went wrong, and what to check: the API key is named only when the server refused it."""
        url = self._client.url
        if isinstance(error, ChatAPITimeoutError):
            return (
                f"timed out after {error.timeout_s:g} s (--grader-timeout)",
                "a self-hosted model, on CPU above all, can need minutes to write --grader-max-tokens tokens for "
                "--grader-concurrency requests at once: raise --grader-timeout or lower those two",
            )
        if isinstance(error, ChatAPIRefusedError):
            return str(error), f"check that the grader server is running at --grader-base-url {self.base_url}"
        if not isinstance(error, ChatAPIStatusError):  # reset connections, replies that are not completions
            return self._redact(error), f"check that {self._where()} is up and serves the OpenAI chat-completions API"
        status, body = error.status_code, self._redact(error.body)
        if status in (401, 403):
            key = f"the key in ${self.api_key_env} was refused"
            if not os.environ.get(self.api_key_env):
                key = f"${self.api_key_env} is not set (the placeholder key EMPTY was sent)"
            return (
                f"HTTP {status} ({'unauthorized' if status == 401 else 'forbidden'}) from {url}: {body}",
                f"{key}; export a key this server accepts in ${self.api_key_env} (or name another variable "
                "with --grader-api-key-env)",
            )
        if status == 404:
            return (
                f"HTTP 404 (not found) from {url}: {body}",
                f"check --grader-base-url (a base URL usually ends in /v1) and --grader-model {self.model}",
            )
        if status == 429:
            return f"HTTP 429 (rate limited) from {url}: {body}", "lower --grader-concurrency or ask for a higher limit"
        if status >= 500:
            return f"HTTP {status} (server error) from {url}: {body}", "check the grader server's log"
        return f"HTTP {status} from {url}: {body}", "check --grader-model and --grader-max-tokens against the server"

    async def _complete(self, client: ChatCompletionsClient, messages: list[dict]) -> str | None:
        """One reply's text, retrying API errors. None: this one request was rejected."""
        payload = {
            "model": self.model,
            "messages": messages,
            "temperature": self.temperature,
            "max_tokens": self.max_tokens,
        }
        attempt = 0
        while True:
            try:
                reply = await client.create(payload)
                self._successes += 1
                return reply
            except ChatAPIStatusError as error:
                status = error.status_code
                if status in _PER_REQUEST_STATUS and self._successes > 0:
                    return None  # the API works, it refused this one request
                if status not in _RETRYABLE_STATUS and status < 500:
                    raise self._unavailable(attempt + 1, error) from None
                wait = _retry_after_seconds(error.headers)
                last_error: BaseException = error
            except ChatAPIConnectionError as error:  # timeouts, refused/reset connections, malformed 200s
                wait, last_error = None, error
            if attempt >= self.max_api_retries:
                raise self._unavailable(attempt + 1, last_error) from None
            if wait is None:
                wait = min(self.initial_backoff * 2.0**attempt, self.max_backoff) * (1.0 - 0.25 * random.random())
            attempt += 1
            self.stats.api_retries += 1
            await asyncio.sleep(wait)

    async def grade(self, problem: Problem, solution: str) -> Grade:
        client, semaphore = self._resources()
        messages = list(self.template.build(problem, solution))
        async with semaphore:
            self.stats.calls += 1
            for parse_attempt in range(self.parse_retries + 1):
                reply = await self._complete(client, messages)
                if reply is None:
                    self.stats.request_errors += 1
                    return Grade(score=0.0, explanation="the grader API rejected this request", parsed=False, raw="")
                self.stats.replies += 1
                grade = parse_grade(reply)  # the reply alone: the parser never reads the solution
                if grade.parsed:
                    return grade
                self.stats.unparseable_replies += 1
                if parse_attempt < self.parse_retries:
                    self.stats.parse_retries += 1
                    messages = messages + [
                        {"role": "assistant", "content": reply},
                        {"role": "user", "content": reask_message(read_verdict(reply).problem)},
                    ]
            self.stats.parse_failures += 1
            return grade


# --------------------------------------------------------------------------- choosing a grader

GRADERS: dict[str, type] = {"verifier": VerifierGrader, "openai": OpenAIGrader}


DEFAULT_GRADER_MODEL = "gpt-4"


def default_grader_kind(api_key_env: str, base_url: str | None) -> str:
    """The grader `--grader auto` picks when no model was named: "openai" with a server or a key, else "verifier"."""
    return "openai" if base_url or os.environ.get(api_key_env) else "verifier"


def choose_grader_kind(kind: str, *, model: str | None, api_key_env: str, base_url: str | None) -> str:
    """The grader that grades: "verifier" or "openai"; never the verifier in place of a named LLM grader.

    `--grader auto` picks the built-in verifier only when the user named no LLM grader (no
    `--grader-model`, no `--grader-base-url`, no key set). An LLM grader asked for (`--grader openai`
    or a `--grader-model`) without a key or a server raises `UserInputError` naming the variable.
    """
    named = kind == "openai" or (kind == "auto" and model is not None)
    if kind == "verifier" or (kind == "auto" and not named):
        return default_grader_kind(api_key_env, base_url) if kind == "auto" else "verifier"
    if not base_url and not os.environ.get(api_key_env):
        asked = "--grader openai" if kind == "openai" else f"--grader-model {model}"
        raise UserInputError(
            f"{asked} asks for an LLM grader but ${api_key_env} is not set: export the key in ${api_key_env} "
            "(or name another variable with --grader-api-key-env), give --grader-base-url for a self-hosted "
            "server, or use --grader verifier"
        )
    return "openai"


def grader_line(
    kind: str, *, model: str | None, base_url: str | None, api_key_env: str, metric: str, rubric_key: str
) -> str:
    """The one line printed at start: which grader grades, and whether it reads the rubrics."""
    if kind == "verifier":
        return (
            f"grader: the built-in verifier ({metric}) against the labels; it does not read rubrics "
            f"(column '{rubric_key}' is not used for grading; an LLM grader would use it)"
        )
    where = base_url or "the OpenAI API"
    return (
        f"grader: LLM grader {model or DEFAULT_GRADER_MODEL} at {where} (key from ${api_key_env}); "
        f"rubrics from column '{rubric_key}' go into its prompt"
    )


def build_grader(kind: str, **kwargs: Any) -> VerifierGrader | OpenAIGrader:
    """A grader by name ("verifier", "openai", or "auto").

    Only the keyword arguments the chosen class accepts are passed on, so one call site can hand
    over the whole grader configuration (a verifier ignores `model`, an LLM grader `metric`).
    """
    if kind == "auto":
        kind = default_grader_kind(kwargs.get("api_key_env", "OPENAI_API_KEY"), kwargs.get("base_url"))
    if kind not in GRADERS:
        raise UserInputError(f"--grader {kind}: unknown grader; choose one of auto, {', '.join(GRADERS)}")
    grader_class = GRADERS[kind]
    accepted = inspect.signature(grader_class.__init__).parameters
    return grader_class(**{name: value for name, value in kwargs.items() if name in accepted})
