"""Minimal OpenAI-compatible endpoints for the embedded worker.

Only what a quick manual check or an OpenAI client library needs: non-streaming
`/v1/completions`, `/v1/chat/completions` and `/v1/models`, one choice per request, no
log-probs. Training code uses the SGLang-native `/generate`, which returns token ids.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from slime_meta_engine.protocol import (
    FinishedGeneration,
    GenerationSpec,
    RequestError,
    context_length_error,
    parse_sampling_params,
)

_OPENAI_TO_SAMPLING = {
    "max_tokens": "max_new_tokens",
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "stop": "stop",
}


@dataclass(frozen=True)
class OpenAIContext:
    model_name: str
    max_positions: int | None
    encode: Callable[[str, bool], list[int]]  # (text, add_special_tokens) -> ids
    render_chat: Callable[[list[dict[str, Any]]], str | None]  # None when there is no chat template
    run_spec: Callable[[GenerationSpec], Awaitable[FinishedGeneration]]


def _sampling_from_openai(body: dict[str, Any], default_max_tokens: int | None) -> Any:
    if body.get("stream"):
        raise RequestError("stream=true is not supported by this worker")
    if body.get("n", 1) != 1:
        raise RequestError("only n=1 is supported by this worker")
    if body.get("logprobs") not in (None, False):
        raise RequestError("logprobs are not supported on the OpenAI endpoints; use /generate")
    raw = {ours: body[theirs] for theirs, ours in _OPENAI_TO_SAMPLING.items() if body.get(theirs) is not None}
    if body.get("max_completion_tokens") is not None:
        raw["max_new_tokens"] = body["max_completion_tokens"]
    if "max_new_tokens" not in raw and default_max_tokens is not None:
        raw["max_new_tokens"] = default_max_tokens
    return parse_sampling_params(raw)


def _spec(context: OpenAIContext, input_ids: list[int], sampling: Any) -> GenerationSpec:
    if not input_ids:
        raise RequestError("the prompt is empty")
    length_error = context_length_error(len(input_ids), sampling.max_new_tokens, context.max_positions)
    if length_error is not None:  # SGLang's OpenAI routes pass the same check as its /generate
        raise RequestError(length_error)
    return GenerationSpec(rid=uuid.uuid4().hex, input_ids=tuple(input_ids), sampling=sampling)


def _finish_reason(result: FinishedGeneration) -> str:
    return {"stop": "stop", "length": "length"}.get(result.finish_reason.get("type"), "abort")


def _usage(results: list[FinishedGeneration]) -> dict[str, int]:
    prompt = sum(len(r.spec.input_ids) for r in results)
    completion = sum(len(r.output_ids) for r in results)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _response(
    context: OpenAIContext, id_prefix: str, object_name: str, choices: list[dict], results: list[FinishedGeneration]
) -> web.Response:
    """An OpenAI completion response: `choices` with a fresh id and the token usage of `results`."""
    return web.json_response(
        {
            "id": f"{id_prefix}-{uuid.uuid4().hex}",
            "object": object_name,
            "created": int(time.time()),
            "model": context.model_name,
            "choices": choices,
            "usage": _usage(results),
        }
    )


def _message_text(message: Any) -> str:
    if not isinstance(message, dict) or "role" not in message:
        raise RequestError("each message must be an object with 'role' and 'content'")
    content = message.get("content") or ""
    if isinstance(content, list):  # OpenAI content parts: keep the text ones
        content = "".join(part.get("text", "") for part in content if isinstance(part, dict))
    if not isinstance(content, str):
        raise RequestError("message content must be a string or a list of text parts")
    return content


def add_openai_routes(
    app: web.Application, context: OpenAIContext, read_json: Callable[[web.Request], Awaitable[Any]]
) -> None:
    async def completions(request: web.Request) -> web.Response:
        body = await read_json(request)
        if not isinstance(body, dict) or "prompt" not in body:
            raise RequestError("body must be an object with 'prompt'")
        sampling = _sampling_from_openai(body, default_max_tokens=16)  # OpenAI's default
        prompt = body["prompt"]
        if isinstance(prompt, str):
            prompts = [context.encode(prompt, True)]
        elif isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
            prompts = [context.encode(p, True) for p in prompt]
        elif isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            prompts = [list(prompt)]
        else:
            raise RequestError("'prompt' must be a string, a list of strings or a list of token ids")
        results = [await context.run_spec(_spec(context, ids, sampling)) for ids in prompts]
        choices = [
            {"index": i, "text": r.text, "logprobs": None, "finish_reason": _finish_reason(r)}
            for i, r in enumerate(results)
        ]
        return _response(context, "cmpl", "text_completion", choices, results)

    async def chat_completions(request: web.Request) -> web.Response:
        body = await read_json(request)
        messages = body.get("messages") if isinstance(body, dict) else None
        if not isinstance(messages, list) or not messages:
            raise RequestError("body must be an object with a non-empty 'messages' list")
        plain = [{"role": m["role"], "content": _message_text(m)} for m in messages]
        sampling = _sampling_from_openai(body, default_max_tokens=None)
        rendered = context.render_chat(plain)
        # A chat template writes its own special tokens; without one, contents joined by newlines.
        input_ids = (
            context.encode(rendered, False)
            if rendered is not None
            else context.encode("\n".join(m["content"] for m in plain), True)
        )
        result = await context.run_spec(_spec(context, input_ids, sampling))
        choice = {
            "index": 0,
            "message": {"role": "assistant", "content": result.text},
            "logprobs": None,
            "finish_reason": _finish_reason(result),
        }
        return _response(context, "chatcmpl", "chat.completion", [choice], [result])

    async def models(request: web.Request) -> web.Response:
        return web.json_response(
            {
                "object": "list",
                "data": [{"id": context.model_name, "object": "model", "created": 0, "owned_by": "slime-meta"}],
            }
        )

    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_get("/v1/models", models)
