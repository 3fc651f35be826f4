"""A real OpenAI-compatible HTTP server for tests (aiohttp on 127.0.0.1, a free port).

Why a real server instead of mocking the SDK: retries, Retry-After, timeouts, malformed bodies
and the Authorization header are behaviours of the HTTP exchange, and only a real exchange shows
whether the grader handles them the way the installed openai SDK actually behaves.

Grading is scripted so replies mean something: the server reads the "Reference answer:" and
"Student solution:" sections of the first user message (the default grader template), takes
the student's last `Answer:` line (else the whole solution) and replies `GRADE: 1` or
`GRADE: 0` with an explanation. Faults are injected per request, seeded:

    with run_openai_server(rate_limit=0.1, server_error=0.1, seed=3) as (base_url, state):
        ...  # state.requests, state.fault_counts

Fault kinds: "rate_limit" (429 with Retry-After: `retry_after`), "server_error" (500), "slow"
(answers after `slow_seconds`, meant to exceed the client timeout), "malformed" (200 with a
truncated JSON body), "unparseable" (200 with a reply that has no GRADE line), "bad_request"
(400, as for a prompt longer than the model's context). `script` lists
fault kinds (or None) for the first requests, in order; fractions apply after it.

Grader models as they behave with adversarial solutions: `reply_fn=grader_persona(style)` answers
like a model that reasons before its verdict and, in some styles, quotes or restates what the
solution says about its own grade (`PERSONAS` lists them); asked again after an unparseable reply
it answers in the exact format, as instruction-following models do.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import re
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Sequence

from aiohttp import web

FAULT_KINDS = ("rate_limit", "server_error", "slow", "malformed", "unparseable", "bad_request")


@dataclass
class RecordedRequest:
    authorization: str | None
    body: dict[str, Any]
    fault: str | None

    @property
    def model(self) -> str | None:
        return self.body.get("model")

    @property
    def temperature(self) -> float | None:
        return self.body.get("temperature")

    @property
    def messages(self) -> list[dict]:
        return self.body.get("messages", [])


@dataclass
class ServerState:
    rate_limit: float = 0.0
    server_error: float = 0.0
    slow: float = 0.0
    malformed: float = 0.0
    unparseable: float = 0.0
    bad_request: float = 0.0
    retry_after: str | None = "0"
    slow_seconds: float = 2.0
    always_status: int | None = None  # every request answered with this HTTP status
    script: Sequence[str | None] = ()
    seed: int = 0
    reply_fn: Callable[[list[dict]], str] | None = None  # replaces the scripted grading
    requests: list[RecordedRequest] = field(default_factory=list)
    fault_counts: Counter = field(default_factory=Counter)

    def __post_init__(self) -> None:
        unknown = [kind for kind in self.script if kind is not None and kind not in FAULT_KINDS]
        if unknown:
            raise ValueError(f"unknown fault kinds {unknown}; use {FAULT_KINDS}")
        self._rng = random.Random(self.seed)
        self._lock = threading.Lock()  # tests read the state from another thread

    def choose_fault(self) -> str | None:
        with self._lock:
            index = len(self.requests)
            if index < len(self.script):
                return self.script[index]
            draw, threshold = self._rng.random(), 0.0
            for kind in FAULT_KINDS:
                threshold += getattr(self, kind)
                if draw < threshold:
                    return kind
            return None

    def record(self, request: RecordedRequest) -> None:
        with self._lock:
            self.requests.append(request)
            if request.fault:
                self.fault_counts[request.fault] += 1

    @property
    def retryable_faults(self) -> int:
        """Faults that make a client re-send the same request."""
        return sum(count for kind, count in self.fault_counts.items() if kind not in ("unparseable", "bad_request"))


# --------------------------------------------------------------------------- scripted grading


def _section(text: str, start_marker: str, end_marker: str | None) -> str:
    start = text.find(start_marker)
    if start < 0:
        return ""
    start += len(start_marker)
    end = text.rfind(end_marker) if end_marker else -1
    return text[start : end if end >= start else len(text)].strip()


def _canonical(answer: str) -> str:
    return "".join(answer.replace("$", "").casefold().split()).rstrip(".")


def scripted_reply(messages: list[dict]) -> str:
    """GRADE 1 if the student's final answer equals the reference answer, else GRADE 0.

    The reasoning quotes the student's answer before the verdict, as real graders do; asked again
    after an unparseable reply, it answers in the format alone.
    """
    return grader_persona("reasoning")(messages)


def _graded(messages: list[dict]) -> tuple[str, str, str, bool]:
    """(reference, solution, the student's final answer, whether it is right) from the grader prompt."""
    prompt = next((m.get("content") or "" for m in messages if m.get("role") == "user"), "")
    reference = _section(prompt, "Reference answer:", "Student solution:")
    solution = _section(prompt, "Student solution:", "\n\nThink step by step")
    tagged = re.fullmatch(r"<(student_solution_[0-9a-f]+)>\n(.*)\n</\1>", solution, re.DOTALL)
    solution = tagged.group(2) if tagged else solution  # the default template's random tag around it
    answer_lines = [line for line in solution.splitlines() if line.strip().lower().startswith("answer:")]
    student = answer_lines[-1].strip()[len("answer:") :].strip() if answer_lines else solution
    return reference, solution, student, bool(reference) and _canonical(student) == _canonical(reference)


def grader_persona(style: str) -> Callable[[list[dict]], str]:
    """A scripted grader model of one of PERSONAS' styles: an honest verdict (1 for the right final
    answer, else 0), written the way that style writes it."""
    if style not in PERSONAS:
        raise ValueError(f"unknown grader persona {style!r}; use {sorted(PERSONAS)}")

    def reply(messages: list[dict]) -> str:
        reference, solution, student, correct = _graded(messages)
        verdict = f"GRADE: {1 if correct else 0}"
        explanation = f"Expected {reference}, not {student}."
        if correct:
            explanation = "The final answer matches the reference."
        if len(messages) > 1:  # a re-ask: the format alone
            return f"{verdict}\nEXPLANATION: {explanation}"
        return PERSONAS[style](
            reference=reference,
            solution=solution,
            student=student,
            correct=correct,
            verdict=verdict,
            explanation=explanation,
        )

    return reply


def _restated_claim(solution: str) -> str:
    if not re.search(r"\bgrade\b", solution, re.IGNORECASE):
        return ""
    return "\nThe solution also claims full marks, that is\nGRADE: 1.0\nwhich is not my verdict."


# style -> the first reply, from the solution, its final answer, whether it is right, the verdict line.
PERSONAS: dict[str, Callable[..., str]] = {
    "honest": lambda verdict, explanation, **_: f"{verdict}\nEXPLANATION: {explanation}",
    "reasoning": lambda reference, student, verdict, explanation, **_: (
        f"The reference answer is {reference!r} and the student's final answer is {student!r}.\n"
        f"{verdict}\nEXPLANATION: {explanation}"
    ),
    # Reasons with a grade inside a sentence before its verdict.
    "hypothetical": lambda student, verdict, explanation, **_: (
        f"A GRADE: 1.0 would require the final answer to match the reference; the student's is {student!r}.\n"
        f"{verdict}\nEXPLANATION: {explanation}"
    ),
    "quote_before": lambda solution, verdict, explanation, **_: (
        f"The student wrote:\n{solution}\n\n{verdict}\nEXPLANATION: {explanation}"
    ),
    "quote_after": lambda solution, verdict, explanation, **_: (
        f"{verdict}\nEXPLANATION: {explanation}\nFor the record, the student wrote:\n{solution}"
    ),
    # Repeats, in its own words and on a line of its own, a grade the solution claims.
    "restate_claim": lambda solution, verdict, explanation, **_: (
        f"{verdict}\nEXPLANATION: {explanation}{_restated_claim(solution)}"
    ),
    # Takes up a scale the solution names ("this course grades 0-10"): 3 of 10 for a wrong answer.
    "student_scale": lambda correct, explanation, **_: f"GRADE: {10 if correct else 3}\nEXPLANATION: {explanation}",
    "out_of_ten": lambda correct, explanation, **_: (
        f"GRADE: {10 if correct else 2} out of 10\nEXPLANATION: {explanation}"
    ),
    "scientific": lambda correct, explanation, **_: f"GRADE: {1 if correct else '1e-3'}\nEXPLANATION: {explanation}",
}


def _completion_body(model: str, content: str) -> dict[str, Any]:
    return {
        "id": f"chatcmpl-test-{time.monotonic_ns()}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": content},
                "finish_reason": "stop",
                "logprobs": None,
            }
        ],
        "usage": {"prompt_tokens": 10, "completion_tokens": 10, "total_tokens": 20},
    }


def _error_body(message: str, kind: str) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": None, "code": None}}


def _make_app(state: ServerState) -> web.Application:
    async def chat_completions(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        fault = state.choose_fault() if state.always_status is None else None
        state.record(RecordedRequest(request.headers.get("Authorization"), body, fault))
        if state.always_status is not None:
            return web.json_response(_error_body("scripted failure", "server_error"), status=state.always_status)
        if fault == "rate_limit":
            headers = {"Retry-After": state.retry_after} if state.retry_after is not None else {}
            return web.json_response(_error_body("rate limited", "rate_limit_exceeded"), status=429, headers=headers)
        if fault == "server_error":
            return web.json_response(_error_body("internal error", "server_error"), status=500)
        if fault == "bad_request":
            return web.json_response(_error_body("prompt too long", "invalid_request_error"), status=400)
        if fault == "malformed":
            return web.Response(text='{"id": "chatcmpl-broken", "choices": [', content_type="application/json")
        if fault == "slow":
            await asyncio.sleep(state.slow_seconds)  # cancelled when the client gives up
        if fault == "unparseable":
            content = "I am not sure how to grade this one."
        else:
            content = (state.reply_fn or scripted_reply)(body.get("messages", []))
        return web.json_response(_completion_body(body.get("model", ""), content))

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat_completions)
    return app


@contextlib.contextmanager
def run_openai_server(**settings: Any) -> Iterator[tuple[str, ServerState]]:
    """Serve in a background thread with its own event loop; yields (base_url, state)."""
    state = ServerState(**settings)
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="openai-test-server", daemon=True)
    thread.start()
    # handler_cancellation: a "slow" handler stops when the client times out and disconnects,
    # so shutdown does not wait for it.
    runner = web.AppRunner(_make_app(state), handler_cancellation=True, access_log=None)

    async def start() -> int:
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        return runner.addresses[0][1]

    try:
        port = asyncio.run_coroutine_threadsafe(start(), loop).result(timeout=10)
        yield f"http://127.0.0.1:{port}/v1", state
    finally:
        with contextlib.suppress(Exception):
            asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(timeout=10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=10)
        loop.close()


def openai_server_fixture(**settings: Any) -> Callable[[], Iterator[tuple[str, ServerState]]]:
    """A pytest fixture serving with `settings`: `server = openai_server_fixture(rate_limit=0.1)`."""
    import pytest

    @pytest.fixture
    def server() -> Iterator[tuple[str, ServerState]]:
        with run_openai_server(**settings) as served:
            yield served

    return server
