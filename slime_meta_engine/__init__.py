"""The embedded inference worker: any local Hugging Face causal LM behind SGLang's HTTP API.

`python -m slime_meta_engine --model-path DIR --port P` starts one worker (see `server.py`).
The training side reaches workers over HTTP through the router, as it would a real SGLang fleet;
it imports only weights.py's shared-memory buffer names and GPU id, for the local weight push.
One module per concern; the top level holds the process, the loop and what every path shares:

- server.py         process entry point: flags, loading the model and engine, serving, exiting
- engine.py         the generation thread: continuous batching, prefill, decode, finishing rows
- rows.py           one request's rows and their per-row decoding state
- prefill.py        the DynamicCache path's prefill and running batch
- sampling.py       temperature / top-p / top-k / min-p sampling and log-probs
- caches.py         DynamicCache row surgery (join, trim) for the batched path
- protocol.py       what a request is and what it returns: /generate's parsing and response shapes
- weights.py        reading checkpoints and copying them into the live model
- memory_snapshots.py  Python heap snapshots on SIGUSR2 when SLIME_META_TRACEMALLOC is set (the
                    trainer uses it too; benchmarks/soak.py --tracemalloc compares them)
- native_allocations.py  memray's record of native allocations between two of those snapshots
                    (with SLIME_META_MEMRAY=1; memray is optional)

and three subpackages, each listing its modules:

- api/              the HTTP side: the aiohttp app and SGLang's routes, weight and OpenAI routes,
                    what the handlers share
- fast_path/        the fast decode path: supported models, the family forward, fused weights,
                    slot batches, decode and prefill CUDA graphs, the GPU memory budget that sizes
                    its caches; static/ and paged/ (each a cache, its forward and its batch)
- kernels/          the Triton kernels (layer ops, sampling, paged attention), triton imported on
                    first use only
"""
