"""The embedded inference worker's process: flags, loading the model and engine, serving, exiting.

Why it exists: slime-meta drives teachers and students through SGLang's HTTP API behind
sglang-router. On a laptop, in CI, or for tiny models there is no SGLang; this worker runs any
local Hugging Face causal LM behind the same endpoints (api/routes.py), so the rest of the program
(and the real router) cannot tell the difference for the calls it makes.

    python -m slime_meta_engine --model-path DIR --host 127.0.0.1 --port P \
        [--device auto|cpu|cuda] [--dtype auto|float32|bfloat16|float16] [--weights-root DIR] \
        [--weight-buffer-prefix NAME] \
        [--max-batch-size 64] [--max-prefill-tokens 16384] [--seed 0] \
        [--num-threads N] [--tokenizer-path DIR] [--weight-version default] [--log-level info] \
        [--cuda-graphs auto|on|off] [--kv-cache static|paged] [--page-size 16] [--max-total-tokens N] \
        [--static-cache-len 4096] [--mem-fraction-static F] [--chunked-prefill-size N] \
        [--prefill-window-ms 3] [--prefill-graph-tokens 4096]

`sampling_params.n = k` returns k completions of the prompt as a list (SGLang's shape); the k
rows share one prefill of the prompt (see engine.py).

The model runs in a single generation thread (see engine.py); the asyncio event loop
only parses, queues and answers. On CUDA, for Llama/Qwen2/Qwen3-family models, decoding runs
through a static or paged KV cache and CUDA graphs (`--cuda-graphs`, fast_path/static/batch.py);
`/get_server_info` says which path is active (`engine.decode_path`). The line
`worker ready on http://HOST:PORT` goes to stdout once the socket is listening; logs go to stderr.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
from typing import Any

import torch
from aiohttp import web

from slime_meta_engine import memory_snapshots
from slime_meta_engine.api.context import WorkerContext
from slime_meta_engine.api.routes import build_app
from slime_meta_engine.engine import GenerationEngine
from slime_meta_engine.fast_path.memory_budget import plan_for_device
from slime_meta_engine.fast_path.prefill_graphs import DEFAULT_MAX_TOKENS
from slime_meta_engine.fast_path.slot_batch import EAGER_PREFILL_COLUMNS, EAGER_PREFILL_ROWS_MODES
from slime_meta_engine.fast_path.static.batch import build_fast_path
from slime_meta_engine.launcher_watch import launcher_died, watch_launcher
from slime_meta_engine.protocol import RouterHttp2ProbeFilter
from slime_meta_engine.weights import release_cuda_ipc_buffers, remove_buffers

logger = logging.getLogger("slime_meta.worker")

# The admission window's default (engine.py), and the variable that sets it for workers a launcher
# starts without the flag. 3 ms: requests sent together (asyncio.gather behind the router) arrive
# within about a millisecond of each other, and a lone request (a client waiting for each answer)
# pays at most 3 ms more, about 1% of a 128-token answer at a few milliseconds a decode step.
PREFILL_WINDOW_ENV = "SLIME_META_PREFILL_WINDOW_MS"
DEFAULT_PREFILL_WINDOW_MS = 3.0
PREFILL_GRAPH_TOKENS_ENV = "SLIME_META_PREFILL_GRAPH_TOKENS"  # the default of --prefill-graph-tokens
EAGER_PREFILL_COLUMNS_ENV = "SLIME_META_EAGER_PREFILL_COLUMNS"  # the default of --eager-prefill-columns
EAGER_PREFILL_ROWS_ENV = "SLIME_META_EAGER_PREFILL_ROWS"  # the default of --eager-prefill-rows


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m slime_meta_engine",
        description="Serve a local Hugging Face causal LM with SGLang's /generate API.",
    )
    parser.add_argument("--model-path", required=True, help="local directory written by save_pretrained")
    parser.add_argument("--tokenizer-path", default=None, help="defaults to --model-path")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=30000, help="0 picks a free port (printed in the ready line)")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    parser.add_argument("--dtype", choices=("auto", "float32", "bfloat16", "float16"), default="auto")
    parser.add_argument("--weights-root", default=None, help="only load weight updates from inside this directory")
    parser.add_argument(
        "--weight-buffer-prefix",
        default=None,
        help="accept same-host weight transfers (/dev/shm buffers named with this prefix, CUDA IPC); "
        "the worker then stops, removing those buffers, when the process that started it is gone; "
        "default: refuse them",
    )
    parser.add_argument("--max-batch-size", type=int, default=64)
    parser.add_argument("--max-prefill-tokens", type=int, default=16384, help="padded prompt tokens per prefill")
    parser.add_argument(
        "--prefill-window-ms",
        "--batch-wait-ms",
        dest="prefill_window_ms",
        type=float,
        default=float(os.environ.get(PREFILL_WINDOW_ENV, DEFAULT_PREFILL_WINDOW_MS)),
        help="admission window: a request waits up to this long (or until the waiting requests fill the free rows "
        "or the prefill token budget) for others to share its prefill, since a prefill costs about the same for one "
        "prompt as for several; rows already decoding keep decoding meanwhile, so only the new request waits. "
        f"0: admit at once. Default: ${PREFILL_WINDOW_ENV}, else {DEFAULT_PREFILL_WINDOW_MS:g} (requests sent "
        "together arrive within it; it adds at most that much to a lone request)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--num-threads", type=int, default=None, help="torch CPU threads (default 1 on CPU)")
    parser.add_argument("--weight-version", default="default")
    parser.add_argument(
        "--cuda-graphs",
        choices=("auto", "on", "off"),
        default="auto",
        help="decode through a static KV cache and CUDA graphs (Llama/Qwen2 family); auto: when on CUDA and supported",
    )
    parser.add_argument(
        "--kv-cache",
        choices=("static", "paged"),
        default="paged",
        help="the fast path's KV cache: paged (default: one pool of pages shared by all requests, as many tokens as "
        "the static cache would hold, within --mem-fraction-static when given; any request the pool holds stays on "
        "the fast path, attention reads each row's own tokens, n samples share their prompt's pages) or static (a "
        "slot of --static-cache-len tokens per running request)",
    )
    parser.add_argument("--page-size", type=int, default=16, help="tokens per page of the paged KV cache (2^k <= 128)")
    parser.add_argument(
        "--max-total-tokens",
        type=int,
        default=None,
        help="paged KV cache with --mem-fraction-static: the most tokens its pool holds (SGLang's flag). Default: "
        "what the static cache would hold, --max-batch-size x --static-cache-len tokens; rows of any length share them",
    )
    parser.add_argument(
        "--static-cache-len",
        type=int,
        default=4096,
        help="tokens (prompt + new) one row may hold on the CUDA-graph path; longer requests take the generic path",
    )
    parser.add_argument(
        "--mem-fraction-static",
        type=float,
        default=None,
        help="CUDA: fraction of the GPU's total memory for model weights plus the static KV cache (SGLang's "
        "meaning); the cache's rows (running requests; more wait) and length, and the prefill token budget, are "
        "sized from what the weights leave of it. Default: no budget (up to --max-batch-size rows of "
        "--static-cache-len tokens, capped at 30%% of the memory free at start). Ignored on CPU.",
    )
    parser.add_argument(
        "--chunked-prefill-size",
        type=int,
        default=None,
        help="tokens per prefill forward (SGLang's name): admitted prompts are prefilled in windows of about "
        "this many tokens over all rows, same outputs, bounded activations. Default (or -1): whole prompts at once",
    )
    parser.add_argument(
        "--prefill-graph-tokens",
        type=int,
        default=os.environ.get(PREFILL_GRAPH_TOKENS_ENV)
        or None,  # argparse reads a string default with `type`: exit 2 if bad
        help="with CUDA graphs on: prefills of up to 8 prompts whose rows x length bucket (64, 128, ... tokens) is "
        "at most this many run as captured graphs, since a small prefill's time goes to launching its kernels "
        f"from Python. 0: every prefill eager. Default: ${PREFILL_GRAPH_TOKENS_ENV}, else {DEFAULT_MAX_TOKENS}",
    )
    parser.add_argument(
        "--eager-prefill-columns",
        type=int,
        default=os.environ.get(EAGER_PREFILL_COLUMNS_ENV)
        or None,  # argparse reads a string default with `type`: exit 2 if bad
        help="on a GPU: a prefill no graph holds (and a DynamicCache prefill: prompt scoring, rows beyond the fast "
        "path) pads its prompts to a multiple of this many columns, so its matmuls meet few token counts (each "
        "new one keeps about 20 KiB of host memory in CUDA's libraries for good). 1: exact widths. "
        f"Default: ${EAGER_PREFILL_COLUMNS_ENV}, else {EAGER_PREFILL_COLUMNS}",
    )
    parser.add_argument(
        "--eager-prefill-rows",
        choices=EAGER_PREFILL_ROWS_MODES,
        default=os.environ.get(EAGER_PREFILL_ROWS_ENV) or EAGER_PREFILL_ROWS_MODES[0],
        help="with CUDA graphs on: 'ladder' runs a prefill no graph holds on 1, 2, 3, 4, 6, 8, 12, 16, ... rows "
        "(padding rows of length 0; at most half again the prompts), since its matmuls' token count is rows x "
        f"width; 'exact': the prompts' own count. Default: ${EAGER_PREFILL_ROWS_ENV}, else ladder",
    )
    parser.add_argument("--log-level", choices=("debug", "info", "warning", "error"), default="info")
    args = parser.parse_args(argv)
    if args.prefill_window_ms < 0:
        parser.error(f"--prefill-window-ms {args.prefill_window_ms}: give milliseconds >= 0 (0: no window)")
    if args.eager_prefill_columns is not None and args.eager_prefill_columns < 1:
        parser.error(f"--eager-prefill-columns {args.eager_prefill_columns}: give columns >= 1 (1: exact widths)")
    if args.eager_prefill_rows not in EAGER_PREFILL_ROWS_MODES:  # argparse leaves a default unchecked
        parser.error(
            f"${EAGER_PREFILL_ROWS_ENV} {args.eager_prefill_rows!r}: give one of {', '.join(EAGER_PREFILL_ROWS_MODES)}"
        )
    if args.prefill_graph_tokens is not None and args.prefill_graph_tokens < 0:
        parser.error(f"--prefill-graph-tokens {args.prefill_graph_tokens}: give tokens >= 0 (0: no prefill graphs)")
    if args.max_batch_size < 1 or args.max_prefill_tokens < 1 or args.static_cache_len < 1:
        parser.error("--max-batch-size, --max-prefill-tokens and --static-cache-len must be >= 1")
    if args.max_total_tokens is not None and args.max_total_tokens < 1:
        parser.error(f"--max-total-tokens {args.max_total_tokens}: must be >= 1 (tokens in the page pool)")
    if args.mem_fraction_static is not None and not 0.0 < args.mem_fraction_static < 1.0:
        parser.error(f"--mem-fraction-static {args.mem_fraction_static}: give a fraction between 0 and 1, e.g. 0.3")
    if args.page_size < 1 or args.page_size > 128 or args.page_size & (args.page_size - 1):
        parser.error(f"--page-size {args.page_size}: give a power of two up to 128")
    if args.chunked_prefill_size == -1:
        args.chunked_prefill_size = None
    if args.chunked_prefill_size is not None and args.chunked_prefill_size < 1:
        parser.error(f"--chunked-prefill-size {args.chunked_prefill_size}: give a token count >= 1, or -1 for off")
    if not os.path.isdir(args.model_path):
        parser.error(f"--model-path {args.model_path} is not a local directory (this worker never downloads models)")
    return args


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise SystemExit("error: --device cuda but torch sees no CUDA device")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, name)


def _eos_token_ids(tokenizer: Any, model: torch.nn.Module) -> frozenset[int]:
    ids: set[int] = set()
    candidates = [tokenizer.eos_token_id, getattr(getattr(model, "generation_config", None), "eos_token_id", None)]
    for candidate in candidates:
        if isinstance(candidate, int):
            ids.add(candidate)
        elif isinstance(candidate, (list, tuple)):
            ids.update(i for i in candidate if isinstance(i, int))
    return frozenset(ids)


def build_context(args: argparse.Namespace) -> WorkerContext:
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()
    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    if device.type == "cpu":
        # Several workers usually share a few cores; one thread each avoids oversubscription.
        torch.set_num_threads(args.num_threads or 1)
    else:
        if args.num_threads:
            torch.set_num_threads(args.num_threads)
        # cuDNN's attention backend builds an execution plan for every new shape, and decoding
        # with a growing KV cache makes every step a new shape: measured on an H100, 60-190 ms
        # per decode step with it against about 3 ms without (tiny model).
        torch.backends.cuda.enable_cudnn_sdp(False)
    torch.manual_seed(args.seed)
    tokenizer_path = args.tokenizer_path or args.model_path
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
    model = AutoModelForCausalLM.from_pretrained(args.model_path, dtype=dtype).to(device).eval()
    model.requires_grad_(False)  # inference only; also lets weight updates copy in place freely
    pad_token_id = next(i for i in (tokenizer.pad_token_id, tokenizer.eos_token_id, 0) if i is not None)
    text_config = model.config.get_text_config()
    max_positions = getattr(text_config, "max_position_embeddings", None)
    plan = plan_for_device(
        args.mem_fraction_static,
        model,
        device,
        max_rows=args.max_batch_size,
        cache_len=args.static_cache_len,
        max_positions=max_positions,
        max_prefill_tokens=args.max_prefill_tokens,
        kv_cache=args.kv_cache,
        max_total_tokens=args.max_total_tokens,
    )
    max_batch_size, cache_len, max_prefill_tokens = args.max_batch_size, args.static_cache_len, args.max_prefill_tokens
    if plan is not None:
        logger.info("%s", plan.describe(args.chunked_prefill_size))
        max_batch_size, cache_len, max_prefill_tokens = plan.slots, plan.cache_len, plan.max_prefill_tokens
    engine = GenerationEngine(
        model,
        decode=lambda ids, skip_special: tokenizer.decode(list(ids), skip_special_tokens=skip_special),
        device=device,
        eos_token_ids=_eos_token_ids(tokenizer, model),
        pad_token_id=pad_token_id,
        max_batch_size=max_batch_size,
        max_prefill_tokens=max_prefill_tokens,
        prefill_window_s=args.prefill_window_ms / 1000.0,
        seed=args.seed,
        weight_version=args.weight_version,
        static_batch=build_fast_path(
            args.cuda_graphs,
            model,
            device,
            max_batch_size,
            cache_len,
            pad_token_id,
            chunk_tokens=args.chunked_prefill_size,
            budgeted=plan is not None,
            kv_cache=args.kv_cache,
            pool_tokens=plan.pool_tokens if plan is not None else None,
            page_size=args.page_size,
            prefill_graph_tokens=args.prefill_graph_tokens,
            eager_prefill_columns=args.eager_prefill_columns,
            eager_prefill_rows=args.eager_prefill_rows,
        ),
        chunked_prefill_size=args.chunked_prefill_size,
        prefill_width_multiple=args.eager_prefill_columns,
    )
    return WorkerContext(
        engine=engine,
        model=model,
        tokenizer=tokenizer,
        model_path=args.model_path,
        tokenizer_path=tokenizer_path,
        weights_root=args.weights_root,
        weight_buffer_prefix=args.weight_buffer_prefix,
        device=device,
        dtype=dtype,
        max_batch_size=max_batch_size,
        max_positions=max_positions,
        embedding_rows=model.get_input_embeddings().num_embeddings,
    )


async def serve(context: WorkerContext, host: str, port: int, access_log: bool) -> int:
    """Serve until SIGTERM or SIGINT; return the signal that stopped the server."""
    stop_requested = asyncio.Event()
    received: list[int] = []
    loop = asyncio.get_running_loop()

    def request_stop(signal_number: int) -> None:
        received.append(signal_number)
        stop_requested.set()

    for signal_number in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signal_number, request_stop, signal_number)
    # A short shutdown: requests still in flight belong to a client that is gone or stopping (a
    # trainer killed mid-step leaves the router's connections open; aiohttp would wait 60 s).
    # handler_cancellation: aiohttp (>= 3.7) no longer cancels a handler whose client went away.
    # A router that timed out and retried elsewhere, or a trainer that stopped, leaves such
    # requests behind; cancelling the handler is what frees their batch rows (run_spec).
    runner = web.AppRunner(
        build_app(context),
        access_log=logger if access_log else None,
        handle_signals=False,
        shutdown_timeout=2.0,
        handler_cancellation=True,
    )
    await runner.setup()
    site = web.TCPSite(runner, host, port, backlog=1024)
    await site.start()
    context.engine.start()
    bound_port = runner.addresses[0][1]
    print(f"worker ready on http://{host}:{bound_port}", flush=True)
    try:
        await stop_requested.wait()
        logger.info("shutting down")
    finally:
        context.engine.stop()
        try:
            await asyncio.wait_for(runner.cleanup(), timeout=5.0)
        except asyncio.TimeoutError:
            logger.warning("connections still open after 5 s; exiting anyway")
    return received[0]


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(
        stream=sys.stderr,
        level=args.log_level.upper(),
        format=f"%(asctime)s %(levelname)s worker:{args.port} %(name)s: %(message)s",
    )
    logging.getLogger("aiohttp.server").addFilter(RouterHttp2ProbeFilter())
    parent_pid = os.getppid()
    if args.weight_buffer_prefix:  # a launcher's worker: it goes when its launcher goes (launcher_watch.py)
        watch_launcher(parent_pid, args.weight_buffer_prefix)
    memory_snapshots.install(f"worker_{args.port}")  # only with SLIME_META_TRACEMALLOC set
    context = build_context(args)
    path = context.engine.decode_path
    logger.info("loaded %s on %s (%s), decode path %s", args.model_path, context.device, context.dtype, path)
    stopped_by = asyncio.run(serve(context, args.host, args.port, access_log=args.log_level == "debug"))
    release_cuda_ipc_buffers()
    if args.weight_buffer_prefix and launcher_died(parent_pid):
        # The launching process died without cleaning up (SIGKILL): its weight buffers go with it.
        remove_buffers(args.weight_buffer_prefix)
    # Everything is closed by now. Tearing down an interpreter with torch loaded takes about a
    # second, which every stop and restart of a pool would pay; skip it.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    # End by the signal that stopped us, as an unhandled one would: the supervisor reads "killed
    # by SIGINT" as Ctrl-C reaching the whole process group (no restart), where exit code 0
    # would look like a worker that quit on its own.
    signal.signal(stopped_by, signal.SIG_DFL)
    os.kill(os.getpid(), stopped_by)
    os._exit(128 + stopped_by)  # not reached: the default action of SIGTERM/SIGINT ends the process


if __name__ == "__main__":
    main()
