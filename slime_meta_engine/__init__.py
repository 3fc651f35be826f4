"""The embedded inference worker: any local Hugging Face causal LM behind SGLang's HTTP API.

`python -m slime_meta_engine --model-path DIR --port P` starts one worker (see `server.py`).
The training side never imports this package: it reaches workers over HTTP through the router,
as it would a real SGLang fleet. One module per concern:

- server.py         process entry point: flags, loading the model and engine, serving, exiting
- routes.py         the aiohttp app, SGLang's native routes, request handling
- weight_routes.py  weight updates from disk, shared memory and CUDA IPC
- context.py        what the handlers share; queueing a request's specs on the generation thread
- openai_routes.py  /v1/completions, /v1/chat/completions, /v1/models
- protocol.py       request parsing and response shapes of /generate
- engine.py         the generation thread: continuous batching, prefill, decode, finishing rows
- rows.py           one request's rows and their per-row decoding state
- sampling.py       temperature / top-p / top-k / min-p sampling and log-probs
- caches.py         DynamicCache row surgery (join, trim) for the batched path
- model_support.py  which models the fast path runs (Llama/Qwen2/Qwen3 family), their shapes
- family_forward.py the fast path's decoder layers, shared by both cache layouts
- fused_weights.py  q/k/v and gate/up as one weight each, the model's parameters views into them
- fused_ops.py      the layers' element-wise steps as Triton kernels (fused_kernels.py), torch elsewhere
- slot_batch.py     what the static and the paged batch share: rows in slots, logits in row order
- static_cache.py   the preallocated slot KV cache of the fast path
- static_model.py   the forward over the static cache
- static_batch.py   the fast path's batch: slots, prefill into slots, graph decode
- paged_cache.py    the paged KV cache: one pool of pages, its bookkeeping
- paged_model.py    the forward over the paged cache
- paged_batch.py    the paged batch: pages taken as tokens arrive, admission by pages
- cuda_graphs.py    captured decode graphs and their size buckets
- weights.py        reading checkpoints and copying them into the live model
"""
