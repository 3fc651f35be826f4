"""The worker's HTTP side: the aiohttp app, its routes, and what a request becomes on the way in and out.

Modules, one concern each:
- `routes`: the aiohttp application, SGLang's native routes, request handling;
- `weight_routes`: weight updates from disk, shared memory and CUDA IPC;
- `openai_routes`: `/v1/completions`, `/v1/chat/completions`, `/v1/models`;
- `context`: what the handlers share, and queueing a request's specs on the generation thread.
Request parsing and the response shapes (`protocol.py`) sit one level up: the generation loop uses them too.
"""
