"""The worker's aiohttp application: SGLang's native routes, with the weight and OpenAI routes added.

Endpoints: GET /health, /health_generate, /get_model_info (/model_info), /get_server_info
(/server_info); POST /generate, /update_weights_from_disk, /abort_request; GET|POST /flush_cache;
POST /v1/completions, /v1/chat/completions, GET /v1/models. Same-host weight transfers of our
own (POST /update_weights_from_shared_memory, /update_weights_from_cuda_ipc, GET
/weight_transfer_info): see api/weight_routes.py.

Log-prob semantics (a contract with the trainer, which recomputes them for the PPO ratio):
- `output_token_logprobs[i]` = log_softmax(logits / temperature)[token], computed in float32
  from the distribution the token was sampled from *before* the top-p/top-k cut; greedy requests
  (temperature < 1e-6) use temperature 1. On-policy, the trainer's ratio is therefore exactly 1.
- `input_token_logprobs` cover positions `logprob_start_len ..` of the prompt at temperature 1;
  entry i is log p(ids[i] | ids[:i]) and position 0 is `[null, id, null]`. With the default
  `logprob_start_len=-1` they are empty (output tokens only).
- `max_new_tokens=0, logprob_start_len=0, return_logprob=true` is a scoring call: one forward,
  no sampling, every prompt position's log-prob.
`output_ids` are exactly the sampled ids (EOS included when it ended the generation); `text` is
their decoding without the matched stop token or stop string (unless `no_stop_trim`). Where a
stop token or string comes on the last allowed token, finish_reason is `stop` (SGLang says
`length`), so a complete answer is never taken for a truncated one. The third element of every
log-prob triple is null (`return_text_in_logprobs` is accepted but not honoured).

Handlers run on the asyncio event loop and only parse, queue and answer; the model runs on the
generation thread (engine.py), reached through the `WorkerContext` stored on the app.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
from typing import Any

from aiohttp import web

from slime_meta_engine.api.context import WorkerContext
from slime_meta_engine.api.openai_routes import OpenAIContext, add_openai_routes
from slime_meta_engine.api.weight_routes import add_weight_routes
from slime_meta_engine.protocol import (
    GenerationSpec,
    RequestError,
    SamplingParams,
    error_body,
    generate_response,
    parse_generate_request,
)

logger = logging.getLogger("slime_meta.worker")
_HEALTH_GENERATE_TIMEOUT_S = 60.0
_MAX_REQUEST_BYTES = 256 * 1024 * 1024  # batched input_ids can be large; aiohttp's default is 1 MiB


CONTEXT_KEY = web.AppKey("worker_context", WorkerContext)


async def read_json(request: web.Request) -> Any:
    try:
        return json.loads(await request.read())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise RequestError(f"request body is not valid JSON: {error}") from error


@web.middleware
async def error_middleware(request: web.Request, handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except RequestError as error:
        return web.json_response(error_body(str(error)), status=400)
    except web.HTTPException:
        raise
    except Exception as error:  # a bug or a failed batch: answer, keep serving
        logger.exception("error while handling %s %s", request.method, request.path)
        return web.json_response(error_body(f"{type(error).__name__}: {error}"), status=500)


async def handle_health(request: web.Request) -> web.Response:
    return web.Response(status=200)


async def handle_health_generate(request: web.Request) -> web.Response:
    context = request.app[CONTEXT_KEY]
    first_token = context.tokenizer.bos_token_id or context.tokenizer.pad_token_id or 0
    spec = GenerationSpec(
        rid=f"health-{os.urandom(4).hex()}",
        input_ids=(first_token,),
        sampling=SamplingParams(max_new_tokens=1, temperature=0.0),
    )
    try:
        await asyncio.wait_for(context.run_spec(spec), _HEALTH_GENERATE_TIMEOUT_S)
    except Exception as error:
        return web.json_response(error_body(f"health generation failed: {error!r}"), status=503)
    return web.Response(status=200)


async def handle_model_info(request: web.Request) -> web.Response:
    context = request.app[CONTEXT_KEY]
    return web.json_response(
        {
            "model_path": context.model_path,
            "tokenizer_path": context.tokenizer_path,
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": context.engine.weight_version,
        }
    )


async def handle_server_info(request: web.Request) -> web.Response:
    context = request.app[CONTEXT_KEY]
    return web.json_response(
        {
            "model_path": context.model_path,
            "tokenizer_path": context.tokenizer_path,
            "max_batch_size": context.max_batch_size,
            "device": str(context.device),
            "dtype": str(context.dtype).removeprefix("torch."),
            "context_length": context.max_positions,
            "weight_version": context.engine.weight_version,
            "num_generate_requests": context.generate_requests,
            "num_weight_updates": context.weight_updates,
            "queue_depth": context.engine.queue_depth(),
            "running_requests": context.engine.running_rows,
            "engine": {
                "decode_path": context.engine.decode_path,
                "fast_path": context.engine.fast_path_info,
                **context.engine.counters_now(),
                **context.engine.memory_now(),
            },
        }
    )


async def handle_generate(request: web.Request) -> web.Response:
    context = request.app[CONTEXT_KEY]
    body = await read_json(request)
    specs, is_batch = parse_generate_request(body, context.encode, context.embedding_rows, context.max_positions)
    context.generate_requests += 1
    results = await context.run_specs(specs)
    responses = [generate_response(result) for result in results]
    return web.json_response(responses if is_batch else responses[0])


async def handle_flush_cache(request: web.Request) -> web.Response:
    return web.Response(text="Cache flushed.\n")  # no prefix cache to flush


async def handle_abort_request(request: web.Request) -> web.Response:
    context = request.app[CONTEXT_KEY]
    body = await read_json(request)
    if not isinstance(body, dict):
        raise RequestError("body must be an object with 'rid' or 'abort_all'")
    if body.get("abort_all"):
        context.engine.abort_all()
    elif isinstance(body.get("rid"), str) and body["rid"] in context.in_flight:
        context.in_flight[body["rid"]].cancelled = True
    return web.Response(status=200)


def build_app(context: WorkerContext) -> web.Application:
    app = web.Application(middlewares=[error_middleware], client_max_size=_MAX_REQUEST_BYTES)
    app[CONTEXT_KEY] = context
    app.router.add_get("/health", handle_health)
    app.router.add_get("/health_generate", handle_health_generate)
    for path in ("/get_model_info", "/model_info"):
        app.router.add_get(path, handle_model_info)
    for path in ("/get_server_info", "/server_info"):
        app.router.add_get(path, handle_server_info)
    app.router.add_post("/generate", handle_generate)
    add_weight_routes(app, CONTEXT_KEY, read_json)
    app.router.add_route("*", "/flush_cache", handle_flush_cache)
    app.router.add_post("/abort_request", handle_abort_request)
    tokenizer = context.tokenizer
    add_openai_routes(
        app,
        OpenAIContext(
            model_name=context.model_path,
            max_positions=context.max_positions,
            encode=context.encode,
            render_chat=lambda messages: (
                tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
                if getattr(tokenizer, "chat_template", None)
                else None
            ),
            run_spec=context.run_spec,
        ),
        read_json,
    )
    return app
