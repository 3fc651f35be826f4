"""The worker's weight-update endpoints: from disk (SGLang's), and two same-host transfers of ours.

- `POST /update_weights_from_disk` {model_path, load_format?, weight_version?, abort_all_requests?}:
  SGLang's call; a `save_pretrained` directory inside `--weights-root`.
- `POST /update_weights_from_shared_memory` {buffer_name, tensors, weight_version?, abort_all_requests?}:
  a flat buffer under /dev/shm whose name starts with `--weight-buffer-prefix`; `tensors` is a list
  of {name, shape, dtype, offset} (offset in bytes).
- `POST /update_weights_from_cuda_ipc` {ipc_buffer, tensors, weight_version?, abort_all_requests?}:
  the same table over a CUDA allocation of the trainer on this worker's GPU (`ipc_buffer` holds
  the fields of torch's CUDA IPC export, byte strings in base64).
- `GET /weight_transfer_info`: device, dtype, GPU id and buffer prefix, for the trainer to pick a transfer.

All three updates read and check the tensors before generation is paused, then copy them into the
running parameters in place (CUDA graphs keep reading the same memory) between two batches. The
reply is SGLang's {success, message, num_paused_requests}; a refused update is HTTP 400.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import torch
from aiohttp import web

from slime_meta_engine.protocol import RequestError
from slime_meta_engine.weights import (
    SUPPORTED_LOAD_FORMATS,
    WeightUpdateError,
    copy_into_model,
    gpu_uuid,
    read_checkpoint,
    read_cuda_ipc,
    read_shared_memory,
    resolve_update_path,
)

logger = logging.getLogger("slime_meta.worker")


def _reply(success: bool, message: str, status: int = 200) -> web.Response:
    return web.json_response({"success": success, "message": message, "num_paused_requests": 0}, status=status)


def add_weight_routes(app: web.Application, context_key: web.AppKey, read_json: Callable) -> None:
    async def apply(request: web.Request, read: Callable[[dict], tuple[dict[str, torch.Tensor], str]]) -> web.Response:
        context = request.app[context_key]
        try:
            body = await read_json(request)
        except RequestError as error:
            return _reply(False, str(error), 400)
        if not isinstance(body, dict):
            return _reply(False, "body must be a JSON object", 400)
        requested_version = body.get("weight_version")
        async with context.update_lock:  # one update at a time; versions stay in order
            try:
                # Read and check the tensors before pausing generation, so the pause is only the copy.
                tensors, source = await asyncio.get_running_loop().run_in_executor(None, read, body)
            except WeightUpdateError as error:
                logger.warning("weight update refused: %s", error)
                return _reply(False, str(error), 400)
            if body.get("abort_all_requests", False):
                context.engine.abort_all("aborted for a weight update")
            new_version = str(requested_version) if requested_version is not None else str(context.weight_updates + 1)

            def swap() -> None:
                copy_into_model(context.model, tensors)
                context.engine.weight_version = new_version

            await asyncio.wrap_future(context.engine.run_between_batches(swap))
            context.weight_updates += 1
        logger.info("loaded weights from %s (weight_version %s)", source, new_version)
        return _reply(True, f"loaded weights from {source}; weight_version {new_version}")

    def from_disk(body: dict) -> tuple[dict[str, torch.Tensor], str]:
        context = app[context_key]
        model_path = body.get("model_path")
        if not isinstance(model_path, str) or not model_path:
            raise WeightUpdateError("body must be an object with a 'model_path' string")
        if body.get("load_format") not in SUPPORTED_LOAD_FORMATS:
            raise WeightUpdateError(f"load_format {body.get('load_format')!r} is not supported (safetensors only)")
        directory = resolve_update_path(model_path, context.weights_root)
        return read_checkpoint(directory, context.model), str(directory)

    def from_shared_memory(body: dict) -> tuple[dict[str, torch.Tensor], str]:
        context = app[context_key]
        name = body.get("buffer_name")
        tensors = read_shared_memory(name, body.get("tensors"), context.weight_buffer_prefix, context.model)
        return tensors, f"shared memory {name}"

    def from_cuda_ipc(body: dict) -> tuple[dict[str, torch.Tensor], str]:
        context = app[context_key]
        tensors = read_cuda_ipc(
            body.get("ipc_buffer"), body.get("tensors"), context.weight_buffer_prefix, context.model
        )
        return tensors, "a CUDA IPC buffer"

    # Handlers are cancelled when their client goes away (see serve); a weight update is not
    # stopped halfway for that: the version and the counters must describe the weights served.
    async def handle_disk(request: web.Request) -> web.Response:
        return await asyncio.shield(apply(request, from_disk))

    async def handle_shared_memory(request: web.Request) -> web.Response:
        return await asyncio.shield(apply(request, from_shared_memory))

    async def handle_cuda_ipc(request: web.Request) -> web.Response:
        return await asyncio.shield(apply(request, from_cuda_ipc))

    async def handle_info(request: web.Request) -> web.Response:
        context = request.app[context_key]
        return web.json_response(
            {
                "device": str(context.device),
                "dtype": str(context.dtype).removeprefix("torch."),
                "gpu_uuid": gpu_uuid(context.device),
                "buffer_prefix": context.weight_buffer_prefix,
            }
        )

    app.router.add_post("/update_weights_from_disk", handle_disk)
    app.router.add_post("/update_weights_from_shared_memory", handle_shared_memory)
    app.router.add_post("/update_weights_from_cuda_ipc", handle_cuda_ipc)
    app.router.add_get("/weight_transfer_info", handle_info)
